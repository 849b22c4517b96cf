"""jax-shardmap on simulated CPU devices: its shard_map + pmean step equals jax-pmap's for both
BN modes at 2 devices (its 1-device step equals its 2-device one: test_contract.py); under
shard_map's default check_vma=True the update would scale by the device count; --bn local keeps
the state replicated. Shares test_jax_pmap.py's compiled steps."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import PartitionSpec as P

from frameworks import jax_shardmap
from tests.conftest import relative_update_difference
from tests.trainers.test_jax_pmap import CFG, compiled, stepped, train_batches

# The same per-device program as jax-pmap's, under another transform: the update agrees to
# float32 rounding (1e-6 of the update).
PMAP_RTOL = 1e-6


def update_diff(a, b, initial, group: str = "params") -> float:
    return relative_update_difference(flatten_dict(getattr(initial, group)),
                                      flatten_dict(getattr(a, group)),
                                      flatten_dict(getattr(b, group)))  # fmt: skip


@pytest.mark.parametrize("bn", ["local", "sync"])
def test_step_equals_jax_pmap_step(bn: str) -> None:
    n = 2
    shardmap, ms = stepped("jax-shardmap", n, bn, steps=2)
    pmap, mp = stepped("jax-pmap", n, bn, steps=2)  # --bn local: its epoch-end average too
    _, _, initial, _, _ = compiled("jax-shardmap", n, bn)
    assert update_diff(shardmap, pmap, initial) <= PMAP_RTOL
    assert update_diff(shardmap, pmap, initial, "batch_stats") <= PMAP_RTOL
    assert [m["count"] for m in ms] == [m["count"] for m in mp] == [CFG.batch_size] * 2
    for a, b in zip(ms, mp):
        assert abs(a["loss_sum"] - b["loss_sum"]) <= 1e-5 * abs(b["loss_sum"])


def test_check_vma_true_would_scale_the_update_by_the_device_count() -> None:
    # The bug the trainer's check_vma=False avoids: with JAX's default, the gradient of the
    # replicated parameters is already summed over the devices inside shard_map, and the pmap
    # idiom's pmean leaves twice the gradient at 2 devices. SGD's first step is linear in the
    # gradient (momentum starts at 0), so the update doubles.
    _, _, initial, mesh, mod = compiled("jax-shardmap", 2, "sync")
    wrong = jax.jit(
        jax.shard_map(
            jax_shardmap.train_step, mesh=mesh, in_specs=(P(), P("batch")), out_specs=(P(), P())
        )
    )
    batch = mod.to_device(train_batches()[0], mesh)
    bad, _ = wrong(mod.replicate(initial, mesh), batch)
    good, _ = stepped("jax-shardmap", 2, "sync")
    before = flatten_dict(initial.params)
    ratios = [
        float(np.linalg.norm(np.asarray(b) - before[k]) / np.linalg.norm(good_v - before[k]))
        for k, (b, good_v) in zip(
            before,
            zip(
                flatten_dict(mod.unreplicate(bad.params)).values(),
                flatten_dict(good.params).values(),
            ),  # fmt: skip
        )
        if k[-1] == "kernel" and np.linalg.norm(good_v - before[k]) > 0
    ]
    assert ratios and 1.8 < float(np.median(ratios)) < 2.2, ratios
    assert update_diff(mod.unreplicate(bad), good, initial) > 100 * PMAP_RTOL


def test_local_bn_keeps_the_state_replicated() -> None:
    train, _, initial, mesh, mod = compiled("jax-shardmap", 2, "local")
    state, _ = train(mod.replicate(initial, mesh), mod.to_device(train_batches()[0], mesh))
    means = [np.asarray(s.data) for s in state.batch_stats["bn1"]["mean"].addressable_shards]
    np.testing.assert_array_equal(means[0], means[1])  # pmean'd inside the step
    start = np.asarray(initial.batch_stats["bn1"]["mean"])
    assert np.abs(means[0] - start).max() > 1e-4  # and really updated
