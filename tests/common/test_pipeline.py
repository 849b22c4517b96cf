"""Sharding, augmentation and evaluation invariants of the shared data pipeline."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import ConfigError, per_device
from common.datasets import make_synthetic
from common.pipeline import (
    EvalLoader,
    TrainLoader,
    augmentation_params,
    crop_and_flip,
    epoch_permutation,
)


@pytest.fixture(scope="module")
def ds():
    return make_synthetic(100, 10, 8, 3, 10, seed=0)


def test_permutation_depends_on_seed_and_epoch_only() -> None:
    a, b = epoch_permutation(0, 1, 50), epoch_permutation(0, 1, 50)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(a, epoch_permutation(0, 2, 50))
    assert not np.array_equal(a, epoch_permutation(1, 1, 50))
    assert sorted(a) == list(range(50))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_k_device_shards_are_disjoint_cover_and_equal_the_1_device_batches(ds, world) -> None:
    gb = 16
    one = TrainLoader(ds, gb, seed=3, augment=False, prefetch=0)
    shards = [TrainLoader(ds, gb, 3, r, world, augment=False, prefetch=0) for r in range(world)]
    assert len(one) == 100 // gb
    seen = []
    for step in range(len(one)):
        parts = [s.indices(2, step) for s in shards]
        assert all(len(p) == gb // world for p in parts)
        joined = np.concatenate(parts)
        np.testing.assert_array_equal(joined, one.indices(2, step))  # same global batch
        assert len(set(joined.tolist())) == gb  # disjoint
        seen.extend(joined.tolist())
    assert len(set(seen)) == len(one) * gb  # no image twice in an epoch
    # The same holds for the data itself, augmentation included.
    aug_one = TrainLoader(ds, gb, seed=3, prefetch=0)
    aug_k = [TrainLoader(ds, gb, seed=3, rank=r, world=world, prefetch=0) for r in range(world)]
    x1, y1 = next(iter(aug_one.epoch(1)))
    xk = np.concatenate([next(iter(s.epoch(1)))[0] for s in aug_k])
    np.testing.assert_array_equal(x1, xk)


def test_per_device_split_error_names_the_fix() -> None:
    assert per_device(12, 3) == 4
    with pytest.raises(ConfigError, match="does not divide over 5 devices; use --batch-size 10"):
        per_device(12, 5)


def test_augmentation_is_deterministic_and_crops_within_padding(ds) -> None:
    dy, dx, fl = augmentation_params(0, 0, 100, 2, True)
    dy2, _, fl2 = augmentation_params(0, 0, 100, 2, True)
    np.testing.assert_array_equal(dy, dy2)
    np.testing.assert_array_equal(fl, fl2)
    assert dy.min() >= 0 and dy.max() <= 4 and 0 < fl.mean() < 1
    img = ds.train_x[:3]
    centred = crop_and_flip(img, 2, np.full(3, 2), np.full(3, 2), np.zeros(3, bool))
    np.testing.assert_array_equal(centred, img)  # offset = pad reproduces the original
    flipped = crop_and_flip(img, 2, np.full(3, 2), np.full(3, 2), np.ones(3, bool))
    np.testing.assert_array_equal(flipped, img[:, :, ::-1])
    shifted = crop_and_flip(img, 2, np.full(3, 0), np.full(3, 2), np.zeros(3, bool))
    np.testing.assert_array_equal(shifted[:, 2:], img[:, :-2])
    assert (shifted[:, :2] == 0).all()  # zero padding came in from the top


def test_layouts_and_normalisation(ds) -> None:
    x_nhwc, x_nchw = (
        next(iter(TrainLoader(ds, 10, 0, augment=False, layout=layout, prefetch=0).epoch(0)))[0]
        for layout in ("NHWC", "NCHW")
    )
    assert x_nhwc.shape == (10, 8, 8, 3) and x_nchw.shape == (10, 3, 8, 8)
    np.testing.assert_allclose(x_nhwc.transpose(0, 3, 1, 2), x_nchw)
    assert x_nhwc.dtype == np.float32 and abs(float(x_nhwc.mean())) < 0.3


@pytest.mark.parametrize(
    "n,world,batch,pad", [(10, 3, 4, 0), (10, 3, 4, 3), (10, 1, 4, 3), (7, 2, 8, 2), (3, 4, 2, 0)]
)
def test_eval_visits_every_test_image_exactly_once(n, world, batch, pad) -> None:
    small = make_synthetic(4, n, 4, 1, 10, seed=1)
    labels, weights = [], 0.0
    for rank in range(world):
        for x, y, w in EvalLoader(small, batch, rank, world, pad_to=pad):
            if pad:
                assert len(x) % pad == 0
            labels.extend(y[w > 0].tolist())
            weights += float(w.sum())
    assert weights == n
    assert sorted(labels) == sorted(small.test_y.tolist())
