"""torch-fsdp on CPU (gloo): its first update equals torch-ddp's at 1, 2 and 4 processes on both
models, and the comparison fails when the gradients are summed over the shards, not averaged;
each rank holds 1/N of a parameter. Kill/resume, N-device steps, digits: test_contract.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from common.config import preset
from common.init import initial_state
from common.runtime import free_port
from tests.conftest import CONDITIONED_SEED, relative_update_difference

MODELS = ("resnet18", "wideresnet")
BATCH = 8  # the global batch: 8, 4 or 2 images per rank
# Two programs (DDP's all-reduce, FSDP's reduce-scatter) from the same weights on the same batch:
# float32 rounding only. A sum over 2 ranks instead of the mean moves the update by about 1.
RTOL = 1e-4


def config(model: str):  # the narrowest models the other tests train
    width = 0.125 if model == "resnet18" else 0.05
    return preset("smoke", seed=CONDITIONED_SEED, model=model, width=width, dropout=0.0)


def _step_worker(rank: int, world: int, port: int, out: str) -> None:
    """One step of torch-ddp and of torch-fsdp (and, at 2 processes, of torch-fsdp with the
    gradients summed) on the same global batch, for both models; rank 0 saves the states."""
    from torch.distributed.fsdp import FSDPModule

    from frameworks import torch_ddp, torch_fsdp
    from frameworks.torch_support import canonical_state, device_plan

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(BATCH, 3, 16, 16, generator=g), torch.randint(0, 10, (BATCH,), generator=g)
    part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)  # this rank's shard
    states, shards = {}, {}
    runs = [("torch-ddp", torch_ddp), ("torch-fsdp", torch_fsdp)]
    runs += [("summed", torch_fsdp)] if world == 2 else []
    for model_name in MODELS:
        cfg = config(model_name)
        for name, trainer in runs:
            torch.manual_seed(0)
            model = trainer.build_model(cfg, 3, 10)
            plan = device_plan(cfg, "cpu")
            state = trainer.create_train_state(cfg, model, torch.device("cpu"), 1, plan)
            if name == "summed":  # the bug the comparison must catch: no division by N
                for m in state.module.modules():
                    if isinstance(m, FSDPModule):
                        m.set_gradient_divide_factor(1.0)
                        m.set_force_sum_reduction_for_comms(True)  # gloo: no PREMUL_SUM
            if name == "torch-fsdp":
                shards[model_name] = list(state.module.get_parameter("fc.weight").to_local().shape)
            trainer.train_step(state, (x[part], y[part]))
            full = canonical_state(state)  # FSDP: a collective, the full state on rank 0
            states.update({f"{name}/{model_name}/{k}": v for k, v in full.items()})
    with open(f"{out}.{rank}.json", "w") as f:
        json.dump(shards, f)
    if rank == 0:
        np.savez(out, **states)
    torch.distributed.barrier()
    os._exit(0)  # no gloo teardown (see test_torch_ddp.py)


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory):
    """world -> (the states of every run by "<run>/<model>/<name>", each rank's shards)."""
    made = {}
    for world in (1, 2, 4):
        out = str(tmp_path_factory.mktemp(f"fsdp{world}") / "states.npz")
        torch.multiprocessing.start_processes(
            _step_worker, args=(world, free_port(), out), nprocs=world, start_method="spawn"
        )
        with np.load(out) as f:
            arrays = {k: f[k] for k in f.files}
        shards = [json.loads(Path(f"{out}.{r}.json").read_text()) for r in range(world)]
        made[world] = arrays, shards
    return made


def update_difference(arrays, model: str, run: str) -> float:
    before, _ = initial_state(config(model), 3, 10)
    pick = lambda name: {k.split("/", 2)[2]: v for k, v in arrays.items() if k.startswith(name)}
    return relative_update_difference(before, pick(f"{run}/{model}/"), pick(f"torch-ddp/{model}/"))


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("model", MODELS)
def test_the_first_update_equals_torch_ddps(steps, world: int, model: str) -> None:
    arrays, _ = steps[world]
    diff = update_difference(arrays, model, "torch-fsdp")
    print(f"{model} at {world}: {diff:.2e}")  # the report's numbers (pytest -s)
    assert diff <= RTOL, diff


@pytest.mark.parametrize("model", MODELS)
def test_the_comparison_fails_on_gradients_summed_over_the_shards(steps, model: str) -> None:
    arrays, _ = steps[2]
    diff = update_difference(arrays, model, "summed")
    print(f"{model} summed at 2: {diff:.2e}")
    assert diff > 100 * RTOL, diff


def test_each_rank_holds_half_of_a_parameter_at_2_processes(steps) -> None:
    arrays, shards = steps[2]
    for model in MODELS:  # fc.weight (10 classes, C): sharded on its first dim
        out, *rest = arrays[f"torch-fsdp/{model}/fc.weight"].shape
        assert out % 2 == 0 and [s[model] for s in shards] == [[out // 2, *rest]] * 2
