"""jax-shard on simulated CPU devices: the jit step with global-batch BN equals jax-pmap's
sync-BN step, per-device BN through shard_map equals jax-pmap's local BN (which catches a
doubled gradient reduction). Shares test_jax_pmap.py's compiled steps (evaluation there;
learning: tests/trainers/test_contract.py)."""

from __future__ import annotations

from pathlib import Path

from common.results import RunRecorder
from frameworks.jax_support import load_checkpoint, save_checkpoint
from tests.trainers.test_jax_pmap import (
    CFG,
    F64_RTOL,
    compiled,
    max_diff,
    same_step,
    step_differences,
    stepped,
)


def test_global_bn_step_equals_jax_pmap_sync_bn_step() -> None:
    # The same model and update as jax-pmap's (sync BN over the pmap axis = global-batch BN).
    # Two programs: one step, compared on the update, in float64 (meaning) and in float32
    # (within the reference's own rounding on this CPU; test_jax_pmap.same_step). (The N-device
    # step = 1-device step of each: tests/trainers/test_contract.py.)
    same_step("jax-shard", "jax-pmap", 2, "sync")  # 1 device: the same finding
    _, ms = stepped("jax-shard", 2, "sync")
    _, mp = stepped("jax-pmap", 2, "sync")
    assert ms[0]["count"] == CFG.batch_size and ms[0]["correct"] == mp[0]["correct"]
    assert abs(ms[0]["loss_sum"] - mp[0]["loss_sum"]) <= 1e-4


def test_per_device_bn_through_shard_map_equals_pmap_local_bn() -> None:
    # jax-pmap: local loss mean + pmean(grads). jax-shard: shard_map forward, global loss,
    # gradient through the shard_map (check_vma=True sums it over devices). A second reduction
    # (the pmap idiom inside shard_map) would scale the update by 2 and fail here. jax-shard
    # pmeans the running statistics every step; jax-pmap at the epoch's end (done by stepped()
    # too): the running average is linear, so the two agree.
    same_step("jax-shard", "jax-pmap", 2, "local")
    _, ms = stepped("jax-shard", 2, "local")
    _, mp = stepped("jax-pmap", 2, "local")
    assert abs(ms[0]["loss_sum"] - mp[0]["loss_sum"]) <= 1e-4


def test_the_step_comparison_sees_a_difference_of_meaning() -> None:
    # Per-device BN statistics against global-batch ones (jax-pmap --bn local as the reference
    # of jax-shard --bn sync): a real difference, which both checks of same_step must see.
    got = step_differences("jax-shard", "jax-pmap", 2, "sync", reference_bn="local")
    assert got["f64:params"] > 1e6 * F64_RTOL, got
    assert got["f32:params"] > got["f32_tolerance:params"], got


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
