"""jax-shard on simulated CPU devices: the jit step with global-batch BN equals jax-pmap's sync-BN
step, per-device BN through shard_map equals jax-pmap's local BN (which
catches a doubled gradient reduction) (evaluation at 1, 2 and 3 devices: test_jax_pmap.py; the
record's BN mode and learning real digits: tests/test_trainer_contract.py).

Shares the compiled steps of test_jax_pmap.py (one pytest process, 4 simulated host devices).
"""

from __future__ import annotations

from pathlib import Path

from flax.traverse_util import flatten_dict

from common.results import RunRecorder
from frameworks.jax_support import load_checkpoint, save_checkpoint
from tests.conftest import relative_update_difference
from tests.test_jax_pmap import CFG, UPDATE_RTOL, compiled, max_diff, stepped


def test_global_bn_step_equals_jax_pmap_sync_bn_step() -> None:
    # The same model and update as jax-pmap's (sync BN over the pmap axis = global-batch BN).
    # Two programs: one step, compared on the update. (The N-device step = 1-device step of
    # each: tests/test_trainer_contract.py.)
    shard, ms = stepped("jax-shard", 2, "sync")
    pmap, mp = stepped("jax-pmap", 2, "sync")
    _, _, initial, _, _ = compiled("jax-shard", 2, "sync")
    for group in ("params", "batch_stats"):
        diff = relative_update_difference(
            flatten_dict(getattr(initial, group)),
            flatten_dict(getattr(shard, group)),
            flatten_dict(getattr(pmap, group)),
        )
        assert diff <= UPDATE_RTOL, (group, diff)
    assert ms[0]["count"] == CFG.batch_size and ms[0]["correct"] == mp[0]["correct"]
    assert abs(ms[0]["loss_sum"] - mp[0]["loss_sum"]) <= 1e-4


def test_per_device_bn_through_shard_map_equals_pmap_local_bn() -> None:
    # jax-pmap: local loss mean + pmean(grads). jax-shard: shard_map forward, global loss,
    # gradient through the shard_map (check_vma=True sums it over devices). A second reduction
    # (the pmap idiom inside shard_map) would scale the update by 2 and fail here.
    # Two programs: one step, compared on the update (as the test above).
    shard, ms = stepped("jax-shard", 2, "local")
    pmap, mp = stepped("jax-pmap", 2, "local")
    _, _, initial, _, _ = compiled("jax-shard", 2, "local")

    def diff(a, b, group: str) -> float:
        return relative_update_difference(
            flatten_dict(getattr(initial, group)),
            flatten_dict(getattr(a, group)),
            flatten_dict(getattr(b, group)),
        )

    assert diff(shard, pmap, "params") <= UPDATE_RTOL
    assert abs(ms[0]["loss_sum"] - mp[0]["loss_sum"]) <= 1e-4
    # jax-shard pmeans the running statistics every step; jax-pmap at the epoch's end (done by
    # stepped() too): the running average is linear, so the two agree.
    assert diff(shard, pmap, "batch_stats") <= UPDATE_RTOL
    # ... and it differs from global-batch BN: the statistics really are per device.
    glob, _ = stepped("jax-shard", 2, "sync")
    assert diff(shard, glob, "params") > 100 * UPDATE_RTOL


def test_checkpoint_round_trip_restores_the_state(tmp_path: Path) -> None:
    # jax-pmap's crash-and-resume test covers the loop; this covers jax-shard's own
    # (un)replication around the same msgpack format.
    state, _ = stepped("jax-shard", 2, "local", steps=1)
    _, _, _, mesh, mod = compiled("jax-shard", 2, "local")
    cfg = CFG.replace(gpus=2, bn="local", framework="jax-shard", checkpoint_dir=str(tmp_path))
    recorder = RunRecorder(cfg, devices=2, device_kind="cpu-simulated", params=0, is_main=True)
    recorder.end_epoch(0, 1.0, 24, 2.5, 1, 10, 23.0)
    # What train() does: unreplicate -> save; load into a host template -> replicate.
    save_checkpoint(cfg, mod.unreplicate(mod.replicate(state, mesh)), recorder, 0)
    fresh = RunRecorder(cfg, devices=2, device_kind="cpu-simulated", params=0, is_main=True)
    _, _, initial, _, _ = compiled("jax-shard", 2, "local")
    host, epoch = load_checkpoint(cfg, initial, fresh)
    restored = mod.replicate(host, mesh)
    assert epoch == 1 and fresh.epochs == recorder.epochs
    assert restored.params["fc"]["kernel"].sharding.is_fully_replicated
    assert max_diff(mod.unreplicate(restored), state) == 0.0
    assert int(mod.unreplicate(restored).step) == 1
