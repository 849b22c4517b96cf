"""`--pipeline device`: the batches gathered on the devices from the indices and crops
`common.pipeline` draws equal the host pipeline's exactly: numpy's `gather_crops` specification,
torch's `train_put` (NCHW and channels-last), jax-pmap's and jax-shard's on 2 simulated devices.
Each check is shown to fail on the bugs it guards against. End to end: test_contract.py."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from common.config import ConfigError
from common.datasets import make_synthetic
from common.pipeline import (
    DEVICE_DATA_LIMIT,
    TrainLoader,
    crops_on_device,
    gather_crops,
    pipeline_record,
)
from common.runtime import simulate_host_devices

simulate_host_devices(4)  # before the first device query (as tests/trainers/test_jax_pmap.py)

GLOBAL_BATCH = 8


@pytest.fixture(scope="module")
def ds():
    # 8x8 RGB images (pad 1) with flips: every crop offset and both flip states occur.
    return make_synthetic(64, 8, 8, 3, 10, seed=0)


def loaders(ds, augment: bool = True, rank: int = 0, world: int = 1) -> tuple:
    kw = dict(seed=5, rank=rank, world=world, augment=augment, prefetch=0)
    host = TrainLoader(ds, GLOBAL_BATCH, layout="NHWC", **kw)
    device = TrainLoader(ds, GLOBAL_BATCH, layout="NHWC", on_device=True, **kw)
    return host, device


def spec_batch(loader: TrainLoader, batch: tuple[np.ndarray, ...]) -> np.ndarray:
    idx, rows, cols, _ = batch
    return loader.norm(gather_crops(loader.ds.train_x, idx, rows, cols))


# The bugs a device pipeline could have, as edits of one step's (idx, rows, cols, y).
BUGS = {
    "crop one pixel lower": lambda idx, rows, cols, y: (idx, rows + 1, cols, y),
    "no flip": lambda idx, rows, cols, y: (idx, rows, np.sort(cols, axis=1), y),
    "another image": lambda idx, rows, cols, y: (np.roll(idx, 1), rows, cols, y),
}


def test_indices_follow_the_host_draws_exactly_and_the_check_can_fail(ds) -> None:
    for augment, world in itertools.product((True, False), (1, 2)):
        for rank in range(world):
            host, device = loaders(ds, augment, rank, world)
            for (x, y), batch in zip(host.epoch(2), device.epoch(2), strict=True):
                np.testing.assert_array_equal(spec_batch(device, batch), x)
                np.testing.assert_array_equal(batch[3], y)
                assert all(a.dtype == np.int32 for a in batch)
    host, device = loaders(ds)
    batches = list(zip(host.epoch(2), device.epoch(2), strict=True))
    for name, bug in BUGS.items():
        differs = [
            not np.array_equal(spec_batch(device, bug(*batch)), x) for (x, _), batch in batches
        ]
        assert any(differs), name
    # Padding not zeroed (the edge pixel repeated instead): gather without the mask.
    (x, _), (idx, rows, cols, _) = batches[0]
    h, w = ds.train_x.shape[1:3]
    clamped = ds.train_x[
        idx[:, None, None], np.clip(rows, 0, h - 1)[:, :, None], np.clip(cols, 0, w - 1)[:, None, :]
    ]
    assert (rows < 0).any() or (rows >= h).any() or (cols < 0).any() or (cols >= w).any()
    assert not np.array_equal(device.norm(clamped), x)


def test_auto_is_device_on_gpus_when_the_training_set_fits() -> None:
    small, large = 150 * 2**20, DEVICE_DATA_LIMIT + 1  # CIFAR-10's 0.15 GB; over the limit
    assert crops_on_device("auto", True, small) and not crops_on_device("auto", False, small)
    assert crops_on_device("device", False, small) and not crops_on_device("host", True, small)
    assert not crops_on_device("auto", True, large)  # falls back to the host pipeline
    with pytest.raises(ConfigError, match=r"--pipeline device keeps .* use --pipeline host"):
        crops_on_device("device", True, large)  # asked for: refused with the fix (exit 2)
    assert pipeline_record(True).startswith("device") and pipeline_record(False).startswith("host")


# ---- torch ----------------------------------------------------------------------------------


@pytest.mark.parametrize("channels_last", [False, True])
def test_torch_train_put_equals_the_host_batches(ds, channels_last: bool) -> None:
    torch = pytest.importorskip("torch")
    from common.config import Config
    from frameworks.torch_support import device_plan, to_device, train_put

    cfg = Config(channels_last=channels_last)
    plan = device_plan(cfg, "cpu")  # channels-last as the config says
    state = type("State", (), {"device": torch.device("cpu"), "cfg": cfg, "plan": plan})()
    host = TrainLoader(ds, GLOBAL_BATCH, seed=5, layout="NCHW", prefetch=0)
    device = TrainLoader(ds, GLOBAL_BATCH, seed=5, layout="NCHW", prefetch=0, on_device=True)
    put_host, put_device = train_put(host, state), train_put(device, state)
    assert put_host.__name__ == "<lambda>"  # the host path is to_device itself
    for hb, db in zip(host.epoch(2), device.epoch(2), strict=True):
        xh, yh = to_device(hb, state)
        xd, yd = put_device(db)
        assert xd.shape == xh.shape and xd.dtype == xh.dtype == torch.float32
        assert xd.is_contiguous(memory_format=torch.channels_last) == channels_last
        assert torch.equal(xd, xh) and torch.equal(yd, yh) and yd.dtype == torch.int64
    # The same comparison fails on an injected bug.
    db = list(device.epoch(2))[0]
    xd, _ = put_device(BUGS["no flip"](*db))
    assert not torch.equal(xd, to_device(list(host.epoch(2))[0], state)[0])


# ---- JAX ------------------------------------------------------------------------------------


def test_normaliser_table_is_bitwise_the_normaliser(ds) -> None:
    norm = TrainLoader(ds, GLOBAL_BATCH, seed=5).norm
    table = norm.table()
    pixels = np.random.default_rng(0).integers(0, 256, (50, 4, 4, 3), dtype=np.uint8)
    looked_up = table[pixels.astype(np.int64), np.arange(3)]
    np.testing.assert_array_equal(looked_up, norm(pixels))
    # What the lookup replaces: x * scale + shift rounded once (a fused multiply-add, as XLA
    # emits it) differs from numpy's two roundings; the comparisons here would catch it.
    fused = (pixels.astype(np.float64) * norm.scale + norm.shift).astype(np.float32)
    assert not np.array_equal(fused, norm(pixels))


@pytest.mark.parametrize("trainer", ["jax_pmap", "jax_shard"])
def test_jax_train_put_equals_the_host_batches_on_two_devices(ds, trainer: str) -> None:
    jax = pytest.importorskip("jax")
    import importlib

    from jax.sharding import Mesh

    from frameworks.jax_support import train_put

    mod = importlib.import_module(f"frameworks.{trainer}")
    devices = jax.devices()[:2]
    assert len(devices) == 2, "2 simulated CPU devices (XLA_FLAGS set before JAX started)"
    mesh = Mesh(np.array(devices), (mod.AXIS,))
    put = lambda batch: mod.to_device(batch, mesh)  # noqa: E731  (as the trainers)
    host, device = loaders(ds)
    put_device = train_put(
        device, put, lambda a: mod.replicate(a, mesh), lambda f: mod.parallel_batches(f, mesh)
    )
    assert train_put(host, put, None, None) is put  # the host path is the trainer's put

    def on_devices(arrays: tuple) -> list[list[np.ndarray]]:
        """Each array's per-device pieces, in device order: (device, rows) as the step sees."""
        return [
            [np.asarray(s.data) for s in sorted(a.addressable_shards, key=lambda s: s.device.id)]
            for a in arrays
        ]

    for hb, db in zip(host.epoch(2), device.epoch(2), strict=True):
        expect, got = on_devices(put(hb)), on_devices(put_device(db))
        for e, g in zip(expect, got, strict=True):  # images, then labels
            assert [p.shape for p in g] == [p.shape for p in e]
            for pe, pg in zip(e, g, strict=True):
                assert pg.dtype == pe.dtype
                np.testing.assert_array_equal(pg, pe)
    # The same comparison fails on an injected bug.
    db, (xh, _) = list(device.epoch(2))[0], list(host.epoch(2))[0]
    xd = put_device(BUGS["crop one pixel lower"](*db))[0]
    assert not np.array_equal(np.asarray(xd).reshape(xh.shape), xh)
