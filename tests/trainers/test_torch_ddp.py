"""torch-ddp on CPU (gloo): evaluation at an uneven process count (torch-fsdp's too), --bn
local's per-rank BN statistics. Launch: tests/trainers/test_launch.py; steps and resume:
test_contract.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from common.config import preset
from common.runtime import free_port
from tests.conftest import ROOT, read_json


def _eval_worker(rank: int, world: int, port: int, out: str, trainer: str) -> None:
    from importlib import import_module

    from common.datasets import load_for
    from common.pipeline import EvalLoader
    from frameworks.torch_support import device_plan, evaluate

    module = import_module(f"frameworks.{trainer}")

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    cfg = eval_config()
    ds = load_for(cfg)
    torch.manual_seed(0)
    model = module.build_model(cfg, ds.channels, ds.num_classes)
    plan = device_plan(cfg, "cpu")
    state = module.create_train_state(cfg, model, torch.device("cpu"), 1, plan)
    # as many batches on every rank (torch-fsdp's forward is a collective): 18, 18 and 17 here
    steps = max(len(EvalLoader(ds, 7, r, world)) for r in range(world))
    loader = EvalLoader(ds, 7, rank, world, layout="NCHW")
    sums = evaluate(module.eval_step, state, loader, steps)
    total = torch.stack([sums["correct"], sums["count"], sums["loss_sum"]]).double()
    torch.distributed.all_reduce(total)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(total.tolist(), f)
    torch.distributed.barrier()
    # Exit without running gloo's C++ destructors: at 3 CPU processes one of them intermittently
    # aborted at teardown ("terminate called without an active exception") after the work was done.
    os._exit(0)


def eval_config():
    # 359 test images (prime: no process count divides it), eval batches of 7 per rank
    return preset("smoke", dataset="digits", image_size=16, test_limit=359)


@pytest.mark.parametrize("trainer", ["torch_ddp", "torch_fsdp"])
def test_evaluation_at_3_processes_equals_the_whole_test_set_at_once(tmp_path, trainer):
    """359 test images do not divide over 3 processes: every image counted once, and the sums
    those of the whole set at once."""
    from common.datasets import load_for
    from common.pipeline import Normalizer
    from frameworks.torch_ddp import build_model
    from frameworks.torch_support import initialize

    cfg = eval_config()
    ds = load_for(cfg)
    torch.manual_seed(0)
    model = build_model(cfg, ds.channels, ds.num_classes).eval()
    initialize(cfg, model)  # what create_train_state does (--init shared)
    with torch.no_grad():  # the whole test set at once, no sharding: the reference
        logits = model(torch.from_numpy(Normalizer(ds.mean, ds.std, "NCHW")(ds.test_x)))
    ref_correct = int((logits.argmax(1).numpy() == ds.test_y).sum())
    out = tmp_path / "3.json"
    torch.multiprocessing.start_processes(
        _eval_worker, args=(3, free_port(), str(out), trainer), nprocs=3, start_method="spawn"
    )
    correct, count, loss_sum = read_json(out)
    assert count == 359 and correct == ref_correct  # every test image exactly once
    labels = torch.from_numpy(ds.test_y).long()
    want = torch.nn.functional.cross_entropy(logits, labels, reduction="sum").item()
    assert loss_sum == pytest.approx(want, rel=1e-5)


LOCAL_BN_SCRIPT = """
import os, sys, torch, torch.distributed as dist, torch.multiprocessing as mp
from common.config import preset
from frameworks import torch_ddp
from frameworks.torch_support import device_plan

def rank_main(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    torch.set_num_threads(1)
    cfg = preset("smoke", bn="local")
    model = torch_ddp.build_model(cfg, 3, 10)
    plan = device_plan(cfg, "cpu")
    state = torch_ddp.create_train_state(cfg, model, torch.device("cpu"), 2, plan)
    state.lr[:] = 0.0  # the weights stay put, so the same batch gives the same statistics
    bn = state.module.bn1
    g = torch.Generator().manual_seed(rank)  # each rank its own shard
    batch = (torch.randn(8, 3, 16, 16, generator=g), torch.randint(0, 10, (8,), generator=g))
    before = bn.running_mean.clone()
    torch_ddp.train_step(state, batch)
    first = bn.running_mean.clone()
    torch_ddp.train_step(state, batch)
    second = bn.running_mean.clone()
    torch.save({"before": before, "first": first, "second": second}, f"{out}{rank}.pt")
    dist.destroy_process_group()

if __name__ == "__main__":
    mp.spawn(rank_main, args=(sys.argv[1], sys.argv[2]), nprocs=2)
"""


@pytest.mark.parametrize("inject", [False, True])
def test_local_bn_keeps_each_ranks_running_statistics(tmp_path, inject):
    """--bn local: DDP must not overwrite a rank's BN running statistics with rank 0's at every
    forward (torch's default), or the epoch-end average would average rank 0's history. Two
    steps of one batch at LR 0 on each of 2 ranks: second = (1 - m) * first + (first - (1 - m) *
    before). Shown to fail with the per-forward sync put back (inject)."""
    script = tmp_path / "local_bn.py"
    source = LOCAL_BN_SCRIPT
    if inject:
        source = source.replace(
            "import os,",
            "import frameworks.torch_support as tm\n"
            "on = {k: True for k in tm.no_forward_buffer_sync()}  # this torch's keyword\n"
            "tm.no_forward_buffer_sync = lambda: on\nimport os,",
        ).replace("from frameworks import torch_ddp", "from frameworks import torch_ddp\n"
                  "torch_ddp.no_forward_buffer_sync = tm.no_forward_buffer_sync")  # fmt: skip
    script.write_text(source)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, str(script), str(free_port()), str(tmp_path / "rank")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    m = preset("smoke").bn_momentum
    own = []
    for rank in (0, 1):
        s = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        expected = (1 - m) * s["first"] + (s["first"] - (1 - m) * s["before"])
        own.append(torch.allclose(s["second"], expected, rtol=1e-5, atol=1e-6))
    # rank 0's statistics are its own either way; rank 1's only without the per-forward sync
    assert own == ([True, False] if inject else [True, True])
