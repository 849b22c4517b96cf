"""tutorials.d2l_jax (d2l 13.6's JAX loop): its step does the same arithmetic as jax-pmap's on
every device (gradients averaged, per-device BN statistics kept apart), a run counts the images
d2l's loop sees and learns real digits, and options d2l has no equivalent for exit 2 with one
line. The step comparison runs in this process over 2 of 4 simulated host devices."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import Mesh

from common.config import preset
from common.datasets import load_for
from common.pipeline import TrainLoader
from common.runtime import simulate_host_devices
from frameworks import jax_pmap
from tests.conftest import relative_update_difference, run_recorded
from tutorials import d2l_jax as tut

simulate_host_devices(4)  # before the first device query (as tests/trainers/test_jax_pmap.py)

MODULE = "tutorials.d2l_jax"
FORCED = ("--no-augment", "--lr-schedule", "constant", "--warmup-epochs", "0")
DIGITS = ("--preset", "digits", "--width", "0.125", *FORCED)  # 1437 train, 360 test, batch 64
# ||dW_d2l - dW_ours|| / ||dW_ours|| after one step: the two programs compute the same loss,
# gradient, pmean and optimiser update, so only XLA's fusion choices may differ (measured:
# 0 on an Intel Xeon, every leaf bitwise equal); the injected slips move it by > 0.1.
TOL = 1e-4


def one_step(step_fns: list[Any], devices: list[jax.Device]) -> tuple[Any, Any, list[Any]]:
    """(ours_before, ours_after, [d2l_after per step_fn]) after one step of jax-pmap's and of
    each `step_fn` (a d2l-style step) on the same global batch and initial weights, per device,
    as numpy. jax-pmap's step is made and compiled once, whatever the number of d2l steps."""
    cfg = preset("smoke", augment=False, weight_decay=0.05, batch_size=96, gpus=len(devices))
    cfg = cfg.replace(framework="jax-pmap")
    ds = load_for(cfg)
    n = len(devices)
    (x, y), *rest = TrainLoader(ds, cfg.batch_size, cfg.seed, augment=False, prefetch=0).epoch(0)
    assert not rest and x.shape == (96, 16, 16, 3)
    model = jax_pmap.build_model(cfg, ds.channels, ds.num_classes, jnp.float32)
    mesh = Mesh(np.array(devices), (jax_pmap.AXIS,))
    ours0 = jax_pmap.create_train_state(cfg, model, ds.image_shape, mesh, steps_per_epoch=1)
    p_step = jax.pmap(jax_pmap.train_step, jax_pmap.AXIS, devices=devices)
    ours, _ = p_step(ours0, jax_pmap.to_device((x, y), mesh))
    X, Y = tut.reshape_batch(np.array(x), np.array(y), n)  # d2l's per-batch host reshape
    theirs = []
    for step_fn in step_fns:
        theirs0 = tut.replicate(tut.create_train_state(cfg, model, ds.image_shape), n)
        after, loss = jax.pmap(step_fn, axis_name=tut.AXIS, devices=devices)(theirs0, X, Y)
        assert loss.shape == (n,)  # the per-device loss d2l returns (and never reads)
        theirs.append(host(after))
    return host(ours0), host(ours), theirs


def host(state: Any) -> dict[str, np.ndarray]:
    """{"params": (devices, P), "batch_stats": (devices, S)}: every device's copy, flattened."""
    return {
        part: np.stack(
            [
                np.concatenate([np.ravel(np.asarray(leaf)[d]) for leaf in jax.tree.leaves(tree)])
                for d in range(np.asarray(jax.tree.leaves(tree)[0]).shape[0])
            ]
        )
        for part, tree in (("params", state.params), ("batch_stats", state.batch_stats))
    }


def diffs(before: Any, ours: Any, theirs: Any, part: str) -> list[float]:
    """Per device, relative difference of the two updates of `part` from the same start."""
    return [
        relative_update_difference(
            {"a": before[part][d]}, {"a": theirs[part][d]}, {"a": ours[part][d]}
        )
        for d in range(before[part].shape[0])
    ]


def test_step_matches_jax_pmap_on_every_device() -> None:
    """One d2l step over 2 devices moves every device's weights as jax-pmap's step does and
    every device's BN statistics from its own shard (d2l never averages them); the d2l step
    without its pmean (an injected slip) moves them far apart."""
    devices = jax.devices()[:2]

    def no_pmean_step(state: Any, images: Any, labels: Any) -> Any:
        """The slip: d2l's step with the gradient average left out."""
        pmean = lax.pmean
        try:
            lax.pmean = lambda x, axis_name: x  # type: ignore[assignment]
            return tut.train_step(state, images, labels)
        finally:
            lax.pmean = pmean

    before, ours, (theirs, slipped) = one_step([tut.train_step, no_pmean_step], devices)
    moved = np.linalg.norm(ours["params"][0] - before["params"][0])
    assert moved > 0.01  # the step did move the weights
    assert np.array_equal(ours["params"][0], ours["params"][1])  # replicas stay equal
    # The two shards' statistics differ (per-device BN), and d2l's follow each shard.
    assert not np.allclose(ours["batch_stats"][0], ours["batch_stats"][1])
    assert max(diffs(before, ours, theirs, "params")) < TOL
    assert max(diffs(before, ours, theirs, "batch_stats")) < TOL
    assert min(diffs(before, ours, slipped, "params")) > 1000 * TOL


def run(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    return run_recorded(MODULE, tmp_path, *flags)


@pytest.mark.slow
def test_two_devices_digits_learns(tmp_path: Path) -> None:
    epochs = 3
    record, stdout = run(tmp_path, *DIGITS, "--epochs", str(epochs), "--gpus", "2")
    assert record["status"] == "ok" and record["error"] == ""
    assert record["tutorial"] == "d2l-jax" and record["compared_with"] == "jax-pmap"
    assert record["devices"] == 2 and record["device_kind"] == "cpu-simulated"
    assert record["deviations"] == list(tut.DEVIATIONS)
    # Full training batches of the trainers' order: 1437 // 64 = 22 steps of 64 images.
    assert all(e["images"] == 22 * 64 for e in record["epochs"])
    # Every test image: 5 batches of 64 and one of 40 (even: no row dropped at 2 devices).
    assert record["test_examples"] == 360 == record["test_set_size"]
    assert record["timed_epochs"] == epochs - 1 and record["images_per_sec"] > 0
    # Measured 0.96 after 3 epochs; chance is 0.1.
    assert record["test_accuracy"] > 0.6, stdout


def test_label_smoothing_exits_2_with_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() sets it
    out = tmp_path / "record.json"
    assert tut.main([*DIGITS, "--label-smoothing", "0.1", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"python -m {MODULE}: error: --label-smoothing")
    assert not out.exists()
