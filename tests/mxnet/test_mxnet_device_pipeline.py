"""`--pipeline device` in MXNet: each context's crops, gathered from its resident copy of the
training set, equal its split_and_load slice of the host pipeline's batch, exactly (the other
checks: tests/trainers/test_device_pipeline.py)."""

from __future__ import annotations

import mxnet as mx
import numpy as np

from common.config import Config
from common.datasets import make_synthetic
from common.pipeline import TrainLoader
from frameworks.mxnet_gluon import to_device, train_put


class State:  # what to_device and train_put read of a TrainState
    def __init__(self, n: int):
        self.ctx = [mx.cpu(i) for i in range(n)]
        self.host = mx.cpu()
        self.cfg = Config()


def test_contexts_get_the_host_batches_slices_exactly() -> None:
    ds = make_synthetic(64, 8, 8, 3, 10, seed=0)  # 8x8, pad 1, flips: every offset occurs
    state = State(2)
    kw = dict(seed=5, layout="NCHW", prefetch=0)
    host, device = TrainLoader(ds, 8, **kw), TrainLoader(ds, 8, on_device=True, **kw)
    put = train_put(device, state)
    for hb, db in zip(host.epoch(2), device.epoch(2), strict=True):
        expect, got = to_device(hb, state), put(db)
        for e_parts, g_parts in zip(expect, got, strict=True):  # images, then labels
            for e, g, c in zip(e_parts, g_parts, state.ctx, strict=True):
                assert g.context == c and g.dtype == e.dtype == np.float32
                np.testing.assert_array_equal(g.asnumpy(), e.asnumpy())
    # The same comparison fails on an injected bug: a crop one pixel lower.
    idx, rows, cols, y = next(iter(device.epoch(2)))
    wrong = put((idx, rows + 1, cols, y))[0][0].asnumpy()
    assert not np.array_equal(wrong, to_device(next(iter(host.epoch(2))), state)[0][0].asnumpy())
