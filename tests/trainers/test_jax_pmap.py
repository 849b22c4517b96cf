"""jax-pmap on simulated CPU devices: evaluation counts every test image once on an uneven
device count, per-device BN statistics are reconciled, too many devices is one clear error, a
second run loads its programs from the compile cache. Steps, learning, kill/resume:
test_contract.py. `stepped()` and `evaluated()` (shared with test_jax_shard.py and
test_jax_shardmap.py) cache their compiled steps: XLA's CPU compiles are the cost here."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict
from jax.sharding import Mesh

from common.config import ConfigError, preset
from common.datasets import load_for
from common.pipeline import EvalLoader, TrainLoader
from common.runtime import simulate_host_devices
from frameworks import jax_fsdp, jax_pmap, jax_shard, jax_shardmap
from frameworks.jax_support import device_plan, evaluate
from tests.conftest import read_json, relative_update_difference, run_trainer

simulate_host_devices(4)  # before the first device query (see the module docstring)

MODULES = {"jax-pmap": jax_pmap, "jax-shard": jax_shard, "jax-shardmap": jax_shardmap,
           "jax-fsdp": jax_fsdp}  # fmt: skip
CFG = preset("smoke", eval_batch_size=4)  # ResNet-18 x 0.125 on 16x16 synthetic images
# One step of two different programs on the same weights: in float64 the updates agree to
# 5e-15 of the update (a real difference, per-device BN statistics or a doubled reduction,
# moves it by 1e-1 to 1); in float32, N devices against 1: about 1e-5 measured.
UPDATE_RTOL = 1e-3
F64_RTOL = 1e-9
# float32: within this factor times the reference program's own float32 rounding on this batch
# (its float32 step against its float64 step), as this CPU rounds it: BN's variance over a
# near-constant channel cancels, so --bn sync at 2 devices rounds 2e-6 on an AVX-512 Xeon and
# 1.1e-2 on an AVX2-only EPYC.
F32_ROUNDING_FACTOR = 10.0


def host_devices(n: int) -> list[jax.Device]:
    devices = jax.devices()
    assert len(devices) >= n, (
        f"JAX's CPU backend started with {len(devices)} devices before this module set "
        "XLA_FLAGS; run these tests in a fresh pytest process"
    )
    return devices[:n]


def as_float64(tree: Any) -> Any:
    """Every floating-point leaf as float64 (host numpy), the rest as is."""
    return jax.tree.map(
        lambda a: np.asarray(a, np.float64) if np.issubdtype(np.asarray(a).dtype, np.floating)
        else np.asarray(a),
        tree,
    )  # fmt: skip


def compiled(framework: str, n: int, bn: str, x64: bool = False) -> tuple[Any, Any, Any, Mesh, Any]:
    """(train step, eval step, initial host state, mesh, module) for `n` devices, through the
    trainer's own `parallelize`, one XLA compile per combination. `x64`: the same model in
    float64 from the same weights (call its steps under jax.enable_x64)."""
    return _compiled(framework, n, bn, x64)  # one cache entry however the caller spells it


@functools.cache
def _compiled(framework: str, n: int, bn: str, x64: bool) -> tuple[Any, Any, Any, Mesh, Any]:
    mod = MODULES[framework]
    mesh = Mesh(np.array(host_devices(n)), ("batch",))
    cfg = CFG.replace(bn=bn, gpus=n)
    ds = load_for(cfg)
    with jax.enable_x64(x64):
        dtype = jnp.float64 if x64 else jnp.float32
        model = mod.build_model(cfg, ds.channels, ds.num_classes, dtype)
        state = mod.create_train_state(cfg, model, ds.image_shape, mesh, steps_per_epoch=4)
        initial = mod.unreplicate(state)
        train, evaluate = mod.parallelize(device_plan(cfg, "cpu"), mesh)
    return train, evaluate, as_float64(initial) if x64 else initial, mesh, mod


@functools.lru_cache(maxsize=1)
def train_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """The first two global batches (24 augmented images each) of epoch 0."""
    loader = TrainLoader(load_for(CFG), CFG.batch_size, CFG.seed, prefetch=0)
    return list(loader.epoch(0))[:2]


def stepped(
    framework: str, n: int, bn: str, steps: int = 1, x64: bool = False
) -> tuple[Any, list[dict]]:
    """Host state and per-step metrics after `steps` steps from the seed's initial state
    (jax-pmap --bn local: with the replicas' running statistics averaged, as train() does);
    `x64`: in float64 (see `compiled`)."""
    train, _, initial, mesh, mod = compiled(framework, n, bn, x64)
    metrics = []
    with jax.enable_x64(x64):
        state = mod.replicate(initial, mesh)  # a fresh copy (the steps donate theirs on GPUs)
        for x, y in train_batches()[:steps]:
            batch = (x.astype(np.float64) if x64 else x, y)
            state, m = train(state, mod.to_device(batch, mesh))
            metrics.append(mod.unreplicate(m))
        if mod is jax_pmap and bn == "local":  # what train() does at the end of every epoch
            state = jax_pmap.sync_batch_stats(state, jax_pmap.cross_replica_mean(mesh))
        return mod.unreplicate(state), metrics


def update_difference(start: Any, a: Any, b: Any, group: str = "params") -> float:
    """conftest.relative_update_difference of two host states' `group` from `start`."""
    return relative_update_difference(flatten_dict(getattr(start, group)),
                                      flatten_dict(getattr(a, group)),
                                      flatten_dict(getattr(b, group)))  # fmt: skip


def step_differences(
    framework: str, reference: str, n: int, bn: str, reference_bn: str | None = None
) -> dict[str, float]:
    """How far `framework`'s first step is from `reference`'s, relative to the update, per
    state group: "f64:<group>" both in float64, "f32:<group>" in float32, "f32_tolerance:<group>"
    F32_ROUNDING_FACTOR times the reference's own float32 rounding on this batch."""
    ref_bn = reference_bn or bn
    a32, _ = stepped(framework, n, bn)
    b32, _ = stepped(reference, n, ref_bn)
    a64, _ = stepped(framework, n, bn, x64=True)
    b64, _ = stepped(reference, n, ref_bn, x64=True)
    initial = compiled(reference, n, ref_bn)[2]
    initial64 = compiled(reference, n, ref_bn, True)[2]
    got: dict[str, float] = {}
    for group in ("params", "batch_stats"):
        diff = functools.partial(update_difference, group=group)
        got[f"f64:{group}"] = diff(initial64, a64, b64)
        got[f"f32:{group}"] = diff(initial, a32, b32)
        rounding = diff(initial64, as_float64(b32), b64)
        got[f"f32_tolerance:{group}"] = F32_ROUNDING_FACTOR * max(rounding, 1e-7)
    return got


def same_step(framework: str, reference: str, n: int, bn: str) -> dict[str, float]:
    """Assert that two programs take the same step (`step_differences`): in float64 within
    F64_RTOL (meaning), in float32 within the reference's own rounding times
    F32_ROUNDING_FACTOR. Returns the differences."""
    got = step_differences(framework, reference, n, bn)
    for group in ("params", "batch_stats"):
        assert got[f"f64:{group}"] <= F64_RTOL, (framework, reference, n, bn, got)
        assert got[f"f32:{group}"] <= got[f"f32_tolerance:{group}"], (
            framework, reference, n, bn, got
        )  # fmt: skip
    return got


def evaluated(framework: str, n: int) -> dict[str, float]:
    """Test sums of the initial state over the 10 synthetic test images, batches of 4."""
    _, eval_fn, initial, mesh, mod = compiled(framework, n, "sync")
    loader = EvalLoader(load_for(CFG), CFG.eval_batch_size, pad_to=n)
    put = lambda batch: mod.to_device(batch, mesh)  # noqa: E731
    state = mod.replicate(initial, mesh)
    return evaluate(eval_fn, state, loader, len(loader), put, mod.unreplicate)


def max_diff(a: Any, b: Any) -> float:
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, b)))


@pytest.mark.parametrize("framework", sorted(MODULES))
def test_evaluation_counts_every_test_image_once(framework: str) -> None:
    """On 3 devices, which 10 images in batches of 4 do not divide (2 devices: the digits runs
    of test_contract.py)."""
    got = evaluated(framework, 3)  # jax-shard, jax-shardmap: their own transforms and meshes
    want = evaluated("jax-pmap", 1)
    assert got["count"] == 10  # 4 + 4 + 2 images, padded to 6 rows each: padding weighs 0
    assert got["correct"] == want["correct"]
    assert abs(got["loss_sum"] - want["loss_sum"]) <= 1e-4


def test_local_bn_statistics_are_per_device_then_averaged() -> None:
    train, _, initial, mesh, mod = compiled("jax-pmap", 2, "local")
    state, _ = train(mod.replicate(initial, mesh), mod.to_device(train_batches()[0], mesh))
    per_device = [np.asarray(s.data) for s in state.batch_stats["bn1"]["mean"].addressable_shards]
    assert np.abs(per_device[0] - per_device[1]).max() > 1e-4  # each device saw its own half
    params = [np.asarray(s.data) for s in state.params["fc"]["kernel"].addressable_shards]
    np.testing.assert_array_equal(params[0], params[1])  # but the update is the same
    synced = jax_pmap.sync_batch_stats(state, jax_pmap.cross_replica_mean(mesh))
    synced = synced.batch_stats["bn1"]["mean"]
    for shard in synced.addressable_shards:
        np.testing.assert_allclose(
            np.asarray(shard.data)[0], np.mean(per_device, axis=0)[0], rtol=1e-6, atol=1e-7
        )


def test_too_many_devices_is_one_clear_error() -> None:
    host_devices(4)
    with pytest.raises(ConfigError, match="--gpus 9: only 4 devices"):
        jax_pmap.train(CFG.replace(gpus=9))


def test_a_second_run_loads_its_programs_from_the_compile_cache(tmp_path: Path) -> None:
    """--compile-cache (the default): the first run compiles and stores every program, a
    second run of the same configuration loads them all (no miss) and spends less time on
    them; the record says both. --no-compile-cache stores and loads nothing. All three train
    to the same final state, bit for bit."""
    args = ("--preset", "smoke", "--epochs", "2", "--cache-dir", str(tmp_path / "cache"))
    env = {"JAX_COMPILATION_CACHE_DIR": ""}  # the flag decides, not the caller's environment
    records, states = [], []
    for name, extra in (("cold", ()), ("warm", ()), ("off", ("--no-compile-cache",))):
        out, state = tmp_path / f"{name}.json", tmp_path / f"{name}.npz"
        extra += ("--output", str(out), "--save-state", str(state))
        proc = run_trainer("jax-pmap", *args, *extra, env=env)
        assert proc.returncode == 0, proc.stderr[-2000:]
        records.append(read_json(out))
        states.append(dict(np.load(state)))
    cold, warm, off = (r["compile_cache"] for r in records)
    assert cold["dir"] == str(tmp_path / "cache" / "jax") and cold["misses"] > 0
    assert warm["hits"] >= cold["misses"] and warm["misses"] == 0
    assert records[1]["compile_sec"] < records[0]["compile_sec"]
    assert off["dir"] is None and off["hits"] == off["misses"] == 0
    assert records[2]["compile_sec"] > 0
    for other in states[1:]:
        assert other.keys() == states[0].keys()
        for k in states[0]:
            np.testing.assert_array_equal(other[k], states[0][k], err_msg=k)
