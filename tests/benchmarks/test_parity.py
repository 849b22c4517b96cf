"""benchmarks.parity: the cross-framework one-step check passes on a reduced grid, fails on an
injected off-by-one LR index, stays far below its tolerance under rounding-level noise, and
refuses bad input in one line."""

from __future__ import annotations

import numpy as np
import pytest

from benchmarks import parity
from tests.conftest import MAIN_PYTHON, MXNET_PYTHON, ok, read_json, run_module


def run_parity(tmp_path, *args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    out = tmp_path / "parity"
    proc = run_module("benchmarks.parity", "--out", str(out), *args, python=MAIN_PYTHON, env=env)
    return proc, out


def test_reduced_grid_agrees(tmp_path):
    """Per-device BN at 2 devices (a collective in every row), one framework per family; each
    framework's sync-BN and 1-device steps equal each other in tests/trainers/test_contract.py."""
    frameworks = "torch-ddp,jax-pmap" + (",mxnet-gluon" if MXNET_PYTHON.exists() else "")
    proc, out = run_parity(tmp_path, "--models", "resnet18", "--frameworks", frameworks,
                           "--bn", "local", "--gpus", "2,")  # fmt: skip
    ok(proc)
    rows = read_json(out / "parity.json")
    assert {r["framework"] for r in rows} == set(frameworks.split(","))
    assert {r["reference"] for r in rows} == {"torch-ddp 2 devices local"}
    for r in rows:
        assert r["ok"], r
        assert r["update_rel_diff"] < parity.TOLERANCE / 10, r  # measured <= 4e-6
        assert r["running_mean_rel_diff"] < parity.MEAN_TOLERANCE / 10, r
        lo, hi = r["running_var_factor"]
        # torch's unbiased batch variance against the biased one: n/(n-1), at most ~1.02 here
        assert 0.9999 < lo <= hi < 1.05, r
    assert "| framework |" in (out / "parity.md").read_text()


def test_lr_off_by_one_fails(tmp_path):
    """The LR table shifted by one step in jax-pmap only: its rows differ, the others do not.
    Three steps: at K=1 the table has one entry and a shift changes nothing."""
    proc, out = run_parity(tmp_path, "--models", "resnet18", "--frameworks", "torch-ddp,jax-pmap",
                           "--bn", "local", "--gpus", "1", "--steps", "3",
                           env={"DPBENCH_INJECT": "lr-shift@jax-pmap"})  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    rows = {r["framework"]: r for r in read_json(out / "parity.json")}
    bad = rows["jax-pmap"]
    assert bad["ok"] is False and bad["status"] == "DIFFERS"
    # measured 0.89: the warm-up's first LR is half the peak, shifted it is the peak
    assert bad["update_rel_diff"] > 10 * parity.TOLERANCE_MULTI_STEP, bad
    assert rows["torch-ddp"]["ok"] is True


def torch_update(cfg, ds, images: np.ndarray, labels: np.ndarray, devices: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """One SGD step of `cfg` in torch from the shared initial state; the update of every
    parameter, flattened. `devices` > 1: per-device BN (each shard normalised on its own) and
    the gradients averaged over the shards, as data parallelism does."""
    import torch

    from common.schedule import lr_table_for
    from frameworks.torch_models import create_model
    from frameworks.torch_support import initialize, loss_fn, make_optimizer

    net = create_model(cfg.model, ds.channels, ds.num_classes, cfg.width, cfg.dropout,
                       cfg.bn_momentum, cfg.bn_eps)  # fmt: skip
    initialize(cfg, net)
    before = [p.detach().clone() for p in net.parameters()]
    opt = make_optimizer(cfg, net)
    for group in opt.param_groups:
        group["lr"] = float(lr_table_for(cfg, 1)[0])
    net.train()
    xs = torch.from_numpy(images).chunk(devices)
    ys = torch.from_numpy(labels).long().chunk(devices)
    loss = sum(loss_fn(cfg, net(a), b).mean() for a, b in zip(xs, ys)) / devices
    loss.backward()
    opt.step()
    moved = [(p.detach() - b).ravel() for p, b in zip(net.parameters(), before)]
    return torch.cat(moved).double().numpy()


def test_rounding_noise_stays_far_below_tolerance():
    """One torch step of the tool's configuration (1 and 2 devices): the batch times
    1 + 3e-7 N(0, 1), a few float32 ulps, moves the update by <= 2.2e-6 (measured), far below
    the tolerance (parity.SEED keeps every ReLU input >= 2e-6 from 0)."""
    torch = pytest.importorskip("torch")
    from common.config import preset
    from common.datasets import load_for
    from common.pipeline import TrainLoader

    ns = parity.build_parser().parse_args([])
    torch.set_num_threads(2)
    worst = 0.0
    for model in ("resnet18", "wideresnet"):
        cfg = preset(parity.BASE, **parity.workload(ns, model, "local", 1), framework="torch-ddp")
        ds = load_for(cfg)
        loader = TrainLoader(ds, cfg.batch_size, cfg.seed, layout="NCHW", max_steps=1, prefetch=0)
        x, y = next(iter(loader.epoch(0)))
        for devices in (1, 2):
            ref = torch_update(cfg, ds, x, y, devices)
            noise = np.random.default_rng(devices).standard_normal(x.shape)
            noisy = (x * (1 + 3e-7 * noise)).astype(np.float32)
            moved = torch_update(cfg, ds, noisy, y, devices)
            worst = max(worst, np.linalg.norm(moved - ref) / np.linalg.norm(ref))
    print(f"rounding-level noise: update_rel_diff <= {worst:.1e}")
    assert worst < parity.TOLERANCE / 10


@pytest.mark.parametrize("args, fragment", [
    (["--frameworks", "tensorflow"], "unknown framework"), (["--models", "vgg"], "--models"),
    (["--steps", "0"], "--steps must be >= 1"), (["--bn", "global"], "--bn"),
    (["--batch-size", "7", "--gpus", "2"], "divide"), (["--tolerance", "-1"], "--tolerance"),
    (["--steps", "1000"], "synthetic training images"),
])  # fmt: skip
def test_bad_input_is_one_line(tmp_path, capsys, args, fragment):
    try:
        code = parity.main(["--out", str(tmp_path / "p"), *args])
    except SystemExit as exc:  # refused by the flag parser
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and err.startswith("parity: error:"), err
    assert fragment in err and not (tmp_path / "p").exists()


def test_reference_per_row():
    assert parity.reference_of("local", 1) == ("local", 1)
    assert parity.reference_of("sync", 2) == ("local", 1)
    assert parity.reference_of("local", 2) == ("local", 2)
