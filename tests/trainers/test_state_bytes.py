"""What one device keeps, read from each framework's own arrays (the record's
`state_bytes_per_device`; the collectives from it: tests/common/test_footprint.py): a torch
DTensor counts its local shard, a lazily made optimiser state is counted as it will be, a JAX
array sharded over 2 devices counts half on each."""

from __future__ import annotations

from types import SimpleNamespace

import jax
import numpy as np
import pytest
import torch
import torch.distributed as dist
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from torch import nn

from frameworks import jax_support, torch_support
from tests.trainers.test_jax_pmap import host_devices  # 4 simulated host devices


@pytest.mark.parametrize("optimizer", ["sgd", "novograd"])
def test_torch_optimizer_state_counted_before_the_first_step_as_it_is_after(optimizer) -> None:
    model = nn.Sequential(nn.Linear(6, 4), nn.BatchNorm1d(4))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if optimizer == "sgd"
           else torch_support.NovoGrad(model.parameters()))  # fmt: skip
    before = torch_support.state_bytes(model, opt)
    model(torch.randn(5, 6)).sum().backward()
    opt.step()
    assert torch_support.state_bytes(model, opt) == before
    params = (6 * 4 + 4 + 4 + 4) * 4  # Linear, BN's weight and bias: float32
    assert before["params"] == before["grads"] == params
    assert before["optimizer"] == params + (0 if optimizer == "sgd" else 4 * 4)  # v: 4 scalars
    assert before["buffers"] == (4 + 4) * 4 + 8  # running mean and var, num_batches_tracked


def test_torch_dtensor_counts_its_local_shard() -> None:
    from torch.distributed.tensor import DTensor, Shard, init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = nn.Linear(3, 8, bias=False)  # weight (8, 3): this device's half of (16, 3)
        local = model.weight.detach()
        shard = DTensor.from_local(local, mesh, [Shard(0)], run_check=False,
                                   shape=torch.Size((16, 3)), stride=(3, 1))  # fmt: skip
        model.weight = nn.Parameter(shard)
        assert model.weight.numel() == 48
        got = torch_support.state_bytes(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert got["params"] == got["grads"] == 24 * 4 and got["optimizer"] == 0  # no momentum
    finally:
        dist.destroy_process_group()


def test_jax_array_sharded_over_2_devices_counts_half_on_each() -> None:
    mesh = Mesh(np.array(host_devices(2)), ("batch",))
    put = lambda spec: jax.device_put(np.ones((8, 4), np.float32),  # noqa: E731
                                      NamedSharding(mesh, PartitionSpec(*spec)))  # fmt: skip
    sharded, replicated = put(("batch",)), put(())
    assert jax_support.device_bytes({"w": sharded}) == 64
    assert jax_support.device_bytes({"w": replicated, "n": 3}) == 128  # a Python int: no bytes
    state = SimpleNamespace(params={"w": sharded}, opt_state=({"m": sharded},),
                            batch_stats={"mean": replicated})  # fmt: skip
    got = jax_support.state_bytes(state)  # type: ignore[arg-type]
    assert (got["params"], got["grads"], got["optimizer"], got["buffers"]) == (64, 64, 64, 128)
    assert got["total"] == 320
