"""tutorials.flax_imagenet (the Flax ImageNet example's pmap loop): its step does the same
arithmetic as jax-pmap's, a 2-device run counts the images the example's loaders yield and
learns real digits, and flags the example has no equivalent exit 2 with one line."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import jax_utils
from jax.sharding import Mesh

from common.config import preset
from common.datasets import load_for
from common.pipeline import TrainLoader
from frameworks import jax_pmap
from tests.conftest import run_recorded
from tutorials import flax_imagenet as tut

MODULE = "tutorials.flax_imagenet"
# The driver's forced settings (the example has no augmentation, warm-up or LR schedule).
FORCED = ("--no-augment", "--lr-schedule", "constant", "--warmup-epochs", "0")
DIGITS = ("--preset", "digits", "--width", "0.125", *FORCED)  # 1437 train, 360 test, batch 64
# The step comparison's bound on ||dW_a - dW_b|| / ||dW_b|| (dW = after - before, all leaves):
# 60x the rounding measured (1.6e-6), 5000x below the injected slips (0.52 and 8).
TOL = 1e-4


def test_step_matches_jax_pmap() -> None:
    """One step of the example's step (L2 penalty in the loss, pmean'd metrics) moves the
    weights and BN statistics as jax-pmap's does, up to rounding; an injected slip moves them
    far apart. One step only: a second starts from weights that differ by rounding, and a ReLU
    input within rounding of 0 then flips (~1e-3 of the update). The rounding stand-in below
    perturbs only the last layer, never the forward's ReLU inputs."""
    # A weight decay large enough that a wrong decay (or mask) moves the update by >> TOL.
    cfg = preset("smoke", augment=False, weight_decay=0.05, batch_size=96, gpus=1)
    cfg = cfg.replace(framework="jax-pmap")
    ds = load_for(cfg)
    devices = jax.devices()[:1]
    (x, y), *rest = TrainLoader(ds, cfg.batch_size, cfg.seed, augment=False, prefetch=0).epoch(0)
    assert not rest and x.shape == (96, 16, 16, 3)
    model = jax_pmap.build_model(cfg, ds.channels, ds.num_classes, jnp.float32)
    lr_fn = optax.constant_schedule(cfg.lr)

    def theirs_step(model: Any = model, weight_decay: float = cfg.weight_decay) -> Any:
        step = functools.partial(tut.train_step, learning_rate_fn=lr_fn, weight_decay=weight_decay)
        p_step = jax.pmap(step, tut.AXIS, devices=devices)
        return lambda state: p_step(state.replace(apply_fn=model.apply), batch)

    batch = {"image": x[None], "label": y[None]}  # a leading device axis of 1
    theirs0 = tut.create_train_state(cfg, model, ds.image_shape, lr_fn)
    theirs0 = jax_utils.replicate(theirs0, devices)
    step = theirs_step()  # compiled once: the perturbed run below reuses it
    theirs, metrics = step(theirs0)
    mesh = Mesh(np.array(devices), (jax_pmap.AXIS,))
    ours0 = jax_pmap.create_train_state(cfg, model, ds.image_shape, mesh, steps_per_epoch=1)
    ours, ours_metrics = jax.pmap(jax_pmap.train_step, jax_pmap.AXIS, devices=devices)(
        ours0, (x[None], y[None])
    )
    initial = host(theirs0)
    assert np.array_equal(flat(host(ours0).params), flat(initial.params))  # the same start
    # The step did move the weights (measured: ||dW|| = 0.15, ||W|| = 40).
    assert update_norm(host(theirs).params, initial.params) > 0.01

    def params_diff(a: Any, a0: Any = initial) -> float:
        return update_difference(host(a).params, a0.params, host(theirs).params, initial.params)

    def stats_diff(a: Any) -> float:
        return update_difference(
            host(a).batch_stats, initial.batch_stats, host(theirs).batch_stats, initial.batch_stats
        )

    # Measured on a 2-core Intel Xeon: 1.6e-6 (weights), 0 (statistics).
    assert params_diff(ours) < TOL
    assert stats_diff(ours) < TOL
    # The example's metrics: the mean loss of the batch (penalty excluded) and the LR.
    ours_loss = host(ours_metrics)["loss_sum"] / host(ours_metrics)["count"]
    assert host(metrics)["loss"] == pytest.approx(ours_loss, abs=1e-5)
    assert host(metrics)["learning_rate"] == pytest.approx(cfg.lr)

    # Rounding stand-in: the last layer's weights perturbed by 1e-6 (relative) change the
    # backward signal by about that, as a different CPU's rounding does. Measured: 3e-6.
    rng = np.random.default_rng(0)
    noisy = initial.replace(
        params={
            **initial.params,
            "fc": jax.tree.map(
                lambda a: (a * (1 + 1e-6 * rng.standard_normal(a.shape))).astype(a.dtype),
                initial.params["fc"],
            ),
        }
    )
    perturbed, _ = step(jax_utils.replicate(noisy, devices))
    assert params_diff(perturbed, noisy) < TOL / 10

    # Two slips in one program (one compile), each seen in its own metric: the L2 penalty
    # without its 1/2 moves the weights (0.52), Flax's BN momentum (0.9) passed as torch's
    # moves the running statistics (8.0; a training step never reads them).
    flax_momentum = jax_pmap.build_model(
        cfg.replace(bn_momentum=0.9), ds.channels, ds.num_classes, jnp.float32
    )
    slipped, _ = theirs_step(flax_momentum, weight_decay=2 * cfg.weight_decay)(theirs0)
    assert params_diff(slipped) > 1000 * TOL
    assert stats_diff(slipped) > 1000 * TOL


def update_norm(after: Any, before: Any) -> float:
    return float(np.linalg.norm(flat(after) - flat(before)))


def update_difference(a: Any, a0: Any, b: Any, b0: Any) -> float:
    """||dW_a - dW_b|| / ||dW_b|| over every leaf, dW = after - before (float64)."""
    da, db = flat(a) - flat(a0), flat(b) - flat(b0)
    return float(np.linalg.norm(da - db) / np.linalg.norm(db))


def flat(tree: Any) -> np.ndarray:
    return np.concatenate([np.ravel(leaf).astype(np.float64) for leaf in jax.tree.leaves(tree)])


def host(tree: Any) -> Any:
    """The first device's copy of every leaf, as numpy."""
    return jax.tree.map(lambda a: np.asarray(a)[0], tree)


def run(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    return run_recorded(MODULE, tmp_path, *flags)


@pytest.mark.slow
def test_two_devices_digits_learns_and_counts_every_batch(tmp_path: Path) -> None:
    """2 simulated devices with sync BN: the images per epoch and test images of the example's
    loaders (the same at any device count), and the loop learns."""
    epochs = 3
    record, stdout = run(tmp_path, *DIGITS, "--epochs", str(epochs), "--gpus", "2", "--bn", "sync")
    assert record["status"] == "ok" and record["error"] == ""
    assert record["tutorial"] == "flax-imagenet" and record["compared_with"] == "jax-pmap"
    assert record["devices"] == 2 and record["device_kind"] == "cpu-simulated"
    assert record["deviations"] == list(tut.DEVIATIONS)
    assert [e["epoch"] for e in record["epochs"]] == list(range(1, epochs + 1))
    # Full training batches only: 1437 // 64 = 22 steps of 64 images.
    assert all(e["images"] == 22 * 64 for e in record["epochs"])
    # The example's eval: 360 // 64 = 5 full batches of the training batch; 40 images never seen.
    assert record["test_examples"] == 5 * 64 and record["test_set_size"] == 360
    assert record["timed_epochs"] == epochs - 1 and record["images_per_sec"] > 0
    # Measured 0.96 after 3 epochs at 1 device (0.57 after the first); chance is 0.1.
    assert record["test_accuracy"] > 0.6, stdout
    assert stdout.count("epoch ") == epochs


@pytest.mark.parametrize("flags, named", [
    (("--precision", "bf16"), "--precision bf16"), (("--augment",), "--augment"),
    (("--test-limit", "50"), "50 test images < --batch-size 64"),
])  # fmt: skip
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    flags: tuple[str, ...],
    named: str,
) -> None:
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))  # main() sets it
    out = tmp_path / "record.json"
    assert tut.main([*DIGITS, *flags, "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"python -m {MODULE}: error: "), err
    assert named in err and not out.exists()
