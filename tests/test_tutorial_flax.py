"""benchmarks.tutorials.flax_imagenet (the Flax ImageNet example's pmap loop): its step does
the same arithmetic as jax-pmap's, runs at 1 and 2 simulated devices count the images the
example's loaders yield (full training batches; full test batches of the TRAINING batch size),
the loop learns real digits, and flags the example has no equivalent for exit 2 with one line.

Each end-to-end run is its own process (XLA_FLAGS must be set before JAX's CPU backend starts);
the step comparison runs in this process on its first device.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np
import optax
import pytest
from flax import jax_utils
from jax.sharding import Mesh

from benchmarks.tutorials import flax_imagenet as tut
from common.config import preset
from common.datasets import load_for
from common.pipeline import TrainLoader
from frameworks import jax_pmap
from tests.conftest import read_json, run_module

MODULE = "benchmarks.tutorials.flax_imagenet"
# The driver's forced settings (the example has no augmentation, warm-up or LR schedule).
FORCED = ("--no-augment", "--lr-schedule", "constant", "--warmup-epochs", "0")
DIGITS = ("--preset", "digits", "--width", "0.125", *FORCED)  # 1437 train, 360 test, batch 64


def test_step_matches_jax_pmap() -> None:
    """Two steps of the example's step (L2 penalty in the loss, pmean'd metrics) give
    jax-pmap's weights (decay on the same kernels through optax, same optax.sgd)."""
    # A weight decay large enough that a wrong decay (or mask) moves weights by >> 1e-5.
    cfg = preset("smoke", augment=False, weight_decay=0.05, gpus=1, framework="jax-pmap")
    ds = load_for(cfg)
    devices = jax.devices()[:1]
    loader = TrainLoader(ds, cfg.batch_size, cfg.seed, augment=False, prefetch=0)
    batches = list(loader.epoch(0))[:2]  # two global batches of 24: (24, 16, 16, 3), (24,)
    model = jax_pmap.build_model(cfg, ds.channels, ds.num_classes)

    lr_fn = optax.constant_schedule(cfg.lr)
    theirs = jax_utils.replicate(tut.create_train_state(cfg, model, ds.image_shape, lr_fn), devices)
    initial = host(theirs.params)
    theirs_step = jax.pmap(
        functools.partial(tut.train_step, learning_rate_fn=lr_fn, weight_decay=cfg.weight_decay),
        tut.AXIS,
        devices=devices,
    )
    mesh = Mesh(np.array(devices), (jax_pmap.AXIS,))
    ours = jax_pmap.create_train_state(cfg, model, ds.image_shape, mesh, steps_per_epoch=4)
    ours_step = jax.pmap(jax_pmap.train_step, jax_pmap.AXIS, devices=devices)
    for x, y in batches:  # a leading device axis of 1
        theirs, metrics = theirs_step(theirs, {"image": x[None], "label": y[None]})
        ours, ours_metrics = ours_step(ours, (x[None], y[None]))

    def max_diff(a: Any, b: Any) -> float:
        return max(jax.tree.leaves(jax.tree.map(lambda u, v: float(np.max(np.abs(u - v))), a, b)))

    assert max_diff(host(theirs.params), initial) > 1e-3  # the steps did move the weights
    assert max_diff(host(theirs.params), host(ours.params)) < 1e-5
    assert max_diff(host(theirs.batch_stats), host(ours.batch_stats)) < 1e-5
    # The example's metrics: the mean loss of the last batch (penalty excluded) and the LR.
    ours_loss = host(ours_metrics)["loss_sum"] / host(ours_metrics)["count"]
    assert host(metrics)["loss"] == pytest.approx(ours_loss, abs=1e-5)
    assert host(metrics)["learning_rate"] == pytest.approx(cfg.lr)


def host(tree: Any) -> Any:
    """The first device's copy of every leaf, as numpy."""
    return jax.tree.map(lambda a: np.asarray(a)[0], tree)


def run(tmp_path: Path, *flags: str) -> tuple[dict, str]:
    out = tmp_path / "record.json"
    proc = run_module(MODULE, *flags, "--output", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_json(out), proc.stdout


@pytest.mark.slow
def test_one_device_digits_learns(tmp_path: Path) -> None:
    epochs = 3
    record, stdout = run(tmp_path, *DIGITS, "--epochs", str(epochs), "--gpus", "1")
    assert record["status"] == "ok" and record["error"] == ""
    assert record["tutorial"] == "flax-imagenet" and record["compared_with"] == "jax-pmap"
    assert record["devices"] == 1 and record["device_kind"] == "cpu-simulated"
    assert record["deviations"] == list(tut.DEVIATIONS)
    assert [e["epoch"] for e in record["epochs"]] == list(range(1, epochs + 1))
    # Full training batches only: 1437 // 64 = 22 steps of 64 images.
    assert all(e["images"] == 22 * 64 for e in record["epochs"])
    # The example's eval: 360 // 64 = 5 full batches of the training batch; 40 images never seen.
    assert record["test_examples"] == 5 * 64 and record["test_set_size"] == 360
    assert record["timed_epochs"] == epochs - 1 and record["images_per_sec"] > 0
    # Measured 0.96 after 3 epochs (0.57 after the first); chance is 0.1.
    assert record["test_accuracy"] > 0.6, stdout
    assert stdout.count("epoch ") == epochs


@pytest.mark.slow
def test_two_devices_same_counts(tmp_path: Path) -> None:
    record, stdout = run(tmp_path, *DIGITS, "--epochs", "2", "--gpus", "2", "--bn", "sync")
    assert record["status"] == "ok", record["error"]
    assert record["devices"] == 2 and record["device_kind"] == "cpu-simulated"
    assert len(record["epochs"]) == 2
    # Same global batch: the same images per epoch and the same evaluated test images.
    assert all(e["images"] == 22 * 64 for e in record["epochs"])
    assert record["test_examples"] == 5 * 64
    assert record["test_accuracy"] > 0.4, stdout


@pytest.mark.parametrize(
    "flags, named",
    [
        (("--precision", "bf16"), "--precision bf16"),
        (("--augment",), "--augment"),
        (("--test-limit", "50"), "50 test images < --batch-size 64"),
    ],
)
def test_bad_input_exits_2_with_one_line(
    tmp_path: Path, flags: tuple[str, ...], named: str
) -> None:
    out = tmp_path / "record.json"
    proc = run_module(MODULE, *DIGITS, *flags, "--output", str(out), timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0].startswith(f"python -m {MODULE}: error: ") and named in lines[0]
    assert not out.exists()
