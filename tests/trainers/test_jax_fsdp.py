"""jax-fsdp on simulated CPU devices: its first update equals jax-shard's (the same step with the
state sharded) for both models at 1, 2 and 4 devices, and the comparison fails when the gradients
are summed over the devices instead of averaged; between steps each device holds 1/N of every
parameter and optimiser state array a dimension of which N divides, the rest replicated; the
compiled step all-gathers the parameters. Shares test_jax_pmap.py's compiled steps (evaluation
there; learning, resume and the N-device step = 1-device step: tests/trainers/test_contract.py)."""

from __future__ import annotations

import re
from typing import Any

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import Mesh

from common.datasets import load_for
from frameworks import jax_fsdp, jax_shard
from frameworks.jax_support import device_plan
from tests.trainers.test_jax_pmap import (
    CFG,
    MODULES,
    compiled,
    host_devices,
    train_batches,
    update_difference,
)

RTOL = 1e-4  # of the update: the two programs sum the same gradients in another order


def one_step(framework: str, n: int, cfg: Any = None) -> tuple[Any, Any, Any, Any]:
    """(initial host state, the state on the devices after one step on the first smoke batch,
    the step, the batch) with the trainer's own state and parallel transform on `n` devices;
    without `cfg`, the smoke ResNet-18's of test_jax_pmap.py, compiled once per process."""
    if cfg is None:
        train, _, initial, mesh, mod = compiled(framework, n, "sync")
    else:
        mod, mesh = MODULES[framework], Mesh(np.array(host_devices(n)), ("batch",))
        cfg, ds = cfg.replace(gpus=n), load_for(cfg)
        model = mod.build_model(cfg, ds.channels, ds.num_classes, np.float32)
        state = mod.create_train_state(cfg, model, ds.image_shape, mesh, steps_per_epoch=4)
        initial, (train, _) = mod.unreplicate(state), mod.parallelize(device_plan(cfg, "cpu"), mesh)
    state, batch = mod.replicate(initial, mesh), mod.to_device(train_batches()[0], mesh)
    return initial, train(state, batch)[0], train, (state, batch)


def differences(n: int, cfg: Any = None) -> dict[str, float]:
    start, shard, _, _ = one_step("jax-shard", n, cfg)
    _, fsdp, _, _ = one_step("jax-fsdp", n, cfg)
    shard, fsdp = jax_shard.unreplicate(shard), jax_fsdp.unreplicate(fsdp)
    return {g: update_difference(start, fsdp, shard, g) for g in ("params", "batch_stats")}


@pytest.mark.parametrize(("model", "n"), [("resnet18", 1), ("resnet18", 2), ("resnet18", 4),
                                          ("wideresnet", 4)])  # fmt: skip
def test_first_update_equals_jax_shards(model: str, n: int) -> None:
    # WideResNet as test_contract.py's resume runs it (dropout: the same masks on any sharding)
    cfg = None if model == "resnet18" else CFG.replace(model=model, width=0.05, dropout=0.3)
    got = differences(n, cfg)
    assert max(got.values()) <= RTOL, got


def test_the_comparison_fails_when_gradients_are_summed_over_the_devices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The bug: the 2 devices' mean losses summed (twice the global mean) instead of averaged,
    # as a reduce-scatter that summed instead of averaging would leave the gradient.
    cross_entropy = jax_fsdp.cross_entropy
    monkeypatch.setattr(jax_fsdp, "cross_entropy", lambda *a: 2 * cross_entropy(*a))
    start, shard, _, _ = one_step("jax-shard", 2)
    _, fsdp, _, _ = one_step("jax-fsdp", 2, CFG)  # built afresh: with the bug
    got = update_difference(start, jax_fsdp.unreplicate(fsdp), jax_shard.unreplicate(shard))
    assert got > 100 * RTOL, got


@pytest.mark.parametrize("n", [2, 4])
def test_each_device_holds_1_over_n_of_the_state_between_steps(n: int) -> None:
    _, state, _, _ = one_step("jax-fsdp", n)
    kernel = state.params["layer1_0"]["conv1"]["kernel"]  # (3, 3, 8, 8): split along C_in
    assert [s.data.shape for s in kernel.addressable_shards] == [(3, 3, 8 // n, 8)] * n
    momentum = flatten_dict(state.opt_state[1][0].trace)[("layer1_0", "conv1", "kernel")]
    assert momentum.addressable_shards[0].data.shape == (3, 3, 8 // n, 8)
    bias = state.params["fc"]["bias"]  # (10,): 2 divides it, 4 does not
    assert bias.addressable_shards[0].data.shape == ((5,) if n == 2 else (10,))
    assert bias.sharding.is_fully_replicated == (n == 4)
    leaves = jax.tree.leaves((state.params, state.opt_state))
    whole = sum(a.nbytes for a in leaves)
    held = sum(a.addressable_shards[0].data.nbytes for a in leaves)
    assert held <= 1.01 * whole / n, (held, whole)  # the replicated ones: biases of 10, counts


def test_the_compiled_step_all_gathers_the_parameters() -> None:
    # XLA:CPU as pinned: every sharded parameter all-gathered for the step, and the gradients
    # summed by all-reduces with each device then slicing its shard (no reduce-scatter op on
    # this backend; GPUs' XLA turns all-reduce + slice into a reduce-scatter). jax-shard's step:
    # all-reduces only.
    def collectives(text: str) -> dict[str, int]:
        ops = ("all-gather", "all-reduce", "reduce-scatter", "dynamic-slice")
        return {op: len(re.findall(rf" {op}(?:-start)?\(", text)) for op in ops}

    _, state, fsdp_step, args = one_step("jax-fsdp", 2)
    _, _, shard_step, shard_args = one_step("jax-shard", 2)
    fsdp = collectives(fsdp_step.lower(*args).compile().as_text())
    shard = collectives(shard_step.lower(*shard_args).compile().as_text())
    sharded = [a for a in jax.tree.leaves(state.params) if not a.sharding.is_fully_replicated]
    assert fsdp["all-gather"] >= len(sharded) == len(jax.tree.leaves(state.params)), fsdp
    assert fsdp["all-reduce"] >= 1 and fsdp["dynamic-slice"] >= len(sharded), fsdp
    assert fsdp["reduce-scatter"] == 0, fsdp
    assert shard["all-gather"] == shard["reduce-scatter"] == 0 and shard["all-reduce"] >= 1, shard
