"""torch-dp (nn.DataParallel) on a CPU-only machine: it claims one device and says so once, and
its step is the SGD step written out from its definition. Kill-and-resume and a crash in the
loop: tests/trainers/test_contract.py."""

from __future__ import annotations

import os

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.config import preset
from common.datasets import load_for
from common.pipeline import TrainLoader
from common.schedule import lr_table_for
from frameworks.torch_models import create_model
from frameworks.torch_support import device_plan, initialize
from tests.conftest import SMOKE, ok, read_json, relative_update_difference, run_trainer


def run(framework: str, *args: str, env: dict[str, str] | None = None):
    return run_trainer(framework, *SMOKE, *args, env=env)


def test_cpu_run_records_one_device_and_one_thread_per_core_it_may_use(tmp_path):
    """On a CPU-only machine torch-dp uses one device and says so once; on the one core its
    affinity allows (taskset, Slurm, a pinned test worker), it sets one thread."""
    cores = sorted(os.sched_getaffinity(0))
    out = tmp_path / "dp.json"
    args = ("--gpus", "2", "--epochs", "1", "--max-steps-per-epoch", "1", "--output", str(out))
    os.sched_setaffinity(0, cores[:1])  # this test's process: the trainer inherits it
    try:
        proc = run("torch-dp", *args)
    finally:
        os.sched_setaffinity(0, cores)
    ok(proc)
    rec = read_json(out)
    assert rec["devices"] == 1 and rec["device_kind"] == "cpu"
    assert rec["framework"] == "torch-dp" and rec["test_examples"] == 10
    notes = [ln for ln in proc.stdout.splitlines() if "DataParallel" in ln]
    assert len(notes) == 1, proc.stdout
    assert notes[0].startswith("note: no CUDA device") and "used 1 device" in notes[0]
    assert "--gpus 2" in notes[0]
    assert proc.stderr == "", proc.stderr  # stderr keeps the one line of an error
    threads = rec["threads"]
    assert (threads["total"], threads["per_device"], threads["cores"]) == (1, None, 1)


def reference_step(cfg) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """(initial, after one step) of an SGD step written out here from its definition, on the
    trainers' first global batch: the shared initial weights, the mean label-smoothed loss over
    the global batch, buf = grad + wd * w on conv/linear weights only (torch's first momentum
    step), w -= lr[0] * buf; BN running statistics from the training-mode forward."""
    ds = load_for(cfg)
    model = create_model(cfg.model, ds.channels, ds.num_classes, cfg.width)
    initialize(cfg, model)
    initial = {k: v.detach().clone().numpy() for k, v in model.state_dict().items()}
    loader = TrainLoader(ds, cfg.batch_size, cfg.seed, 0, 1, layout="NCHW", prefetch=0)
    x, y = next(iter(loader.epoch(0)))
    model.train()
    logits = model(torch.from_numpy(x))
    loss = F.cross_entropy(logits, torch.from_numpy(y).long(),
                           label_smoothing=cfg.label_smoothing).mean()  # fmt: skip
    loss.backward()
    lr = float(lr_table_for(cfg, 1)[0])
    decayed = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    with torch.no_grad():
        for p in model.parameters():
            wd = cfg.weight_decay if id(p) in decayed else 0.0
            p -= lr * (p.grad + wd * p)
    return initial, {k: v.detach().numpy() for k, v in model.state_dict().items()}


def test_step_equals_the_sgd_step_written_out(tmp_path):
    """torch-dp's first step (the LR table built for 2 steps: cosine 0.05 -> 0.025; checkpoint
    after step 1, then killed) equals the step written out in reference_step, and the check
    sees an off-by-one LR index injected into torch-dp (it then takes the second step's LR)."""
    flags = ("--epochs", "2", "--max-steps-per-epoch", "1", "--lr-schedule", "cosine")
    flags += ("--warmup-epochs", "0", "--weight-decay", "0.05", "--label-smoothing", "0.1")
    cfg = preset("smoke", epochs=2, max_steps_per_epoch=1, lr_schedule="cosine", warmup_epochs=0,
                 weight_decay=0.05, label_smoothing=0.1, framework="torch-dp")  # fmt: skip
    initial, want = reference_step(cfg)

    def first_step(name: str, inject: str = "") -> dict[str, np.ndarray]:
        env = {"DPBENCH_FAIL": "torch-dp@1"}  # killed after epoch 1's checkpoint: one step
        if inject:
            env["DPBENCH_INJECT"] = inject
        run("torch-dp", *flags, "--checkpoint-dir", str(tmp_path / name), env=env)
        ckpt = torch.load(tmp_path / name / "torch-dp.pt", weights_only=True)
        assert ckpt["step"] == 1
        return {k: v.numpy() for k, v in ckpt["model"].items()}

    params = [k for k in want if not k.endswith(("running_mean", "running_var", "tracked"))]
    stats = [k for k in want if k.endswith("running_mean")]

    def diff(got: dict[str, np.ndarray], keys: list[str]) -> float:
        return relative_update_difference({k: initial[k] for k in keys}, got, want)

    got = first_step("ok")
    assert diff(got, params) < 1e-5 and diff(got, stats) < 1e-5
    shifted = first_step("shifted", inject="lr-shift@torch-dp")
    assert diff(shifted, params) > 0.1  # the second step's LR is half the first's


def one_step(channels_last: bool, wrong_layout: bool = False) -> tuple[dict, dict]:
    """(initial, after) of one torch-dp step on a batch of random images, in either layout."""
    from frameworks import torch_dp
    from frameworks.torch_support import to_device

    cfg = preset("smoke", channels_last=channels_last, framework="torch-dp")
    torch.manual_seed(0)
    model = torch_dp.build_model(cfg, 3, 10)
    state = torch_dp.create_train_state(cfg, model, [], 1, device_plan(cfg, "cpu"))
    initial = {k: v.detach().clone().numpy() for k, v in state.module.state_dict().items()}
    rng = np.random.default_rng(0)
    x = rng.standard_normal((24, 3, 16, 16)).astype(np.float32)  # no ties: random values
    y = rng.integers(0, 10, 24).astype(np.int64)
    batch = to_device((x, y), state)
    assert batch[0].is_contiguous(memory_format=torch.channels_last) == channels_last
    if wrong_layout:  # the bug the check guards against: NHWC bytes read as NCHW
        batch = (torch.from_numpy(x).permute(0, 2, 3, 1).reshape(x.shape), batch[1])
    torch_dp.train_step(state, batch)
    return initial, {k: v.detach().numpy() for k, v in state.module.state_dict().items()}


def test_channels_last_step_equals_the_nchw_step():
    """The CPU fast path (channels-last convolutions in oneDNN) changes no value: the same step
    to float rounding (measured 9e-7 of the update), while a layout slip changes it by O(1)."""
    initial, nchw = one_step(channels_last=False)
    keys = [k for k in initial if not k.endswith("num_batches_tracked")]
    before = {k: initial[k] for k in keys}
    _, cl = one_step(channels_last=True)
    assert relative_update_difference(before, cl, nchw) < 1e-4
    _, slipped = one_step(channels_last=True, wrong_layout=True)
    assert relative_update_difference(before, slipped, nchw) > 0.1
