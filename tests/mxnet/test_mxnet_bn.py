"""mxnet-gluon at 2 contexts with --bn local: after one step each context's BN running mean is
0.9 * initial + 0.1 * the batch mean of its OWN shard (Gluon's Trainer used to overwrite that
first update when it set its kvstore up lazily at the first step)."""

from __future__ import annotations

import mxnet as mx
import numpy as np
from mxnet import gluon

from common.config import preset
from common.datasets import load_for
from common.pipeline import TrainLoader
from frameworks import mxnet_gluon as G
from frameworks.mxnet_models import structural_params
from frameworks.mxnet_support import TorchSGD


def first_step_running_means(buggy: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """(each context's bn1 running mean after step 1, what it should be)."""
    cfg = preset("smoke", gpus=2)
    ctx = [mx.cpu(0), mx.cpu(1)]
    ds = load_for(cfg)
    state = G.create_train_state(cfg, G.build_model(cfg, ds.channels, ds.num_classes), ctx, 4)
    if buggy:  # the Trainer over every parameter, BN running statistics included
        state.trainer = gluon.Trainer(
            state.model.collect_params(),
            TorchSGD(momentum=cfg.momentum, wd=cfg.weight_decay, learning_rate=cfg.lr),
            kvstore="device",
            update_on_kvstore=False,
        )
    loader = TrainLoader(ds, cfg.batch_size, cfg.seed, 0, 1, layout="NCHW", prefetch=0)
    xs, ys = G.to_device(next(iter(loader.epoch(0)))[:2], state)
    bn1 = structural_params(state.model)["bn1.running_mean"]
    initial = [d.asnumpy() for d in bn1.list_data()]
    # bn1 normalises conv1's output; its batch mean per channel, on each context's own shard.
    shard_means = [state.model.conv1(x).mean(axis=(0, 2, 3)).asnumpy() for x in xs]
    G.train_step(state, (xs, ys))
    mx.nd.waitall()
    got = [d.asnumpy() for d in bn1.list_data()]
    want = [0.9 * i + 0.1 * m for i, m in zip(initial, shard_means)]
    return got, want


def test_each_context_keeps_its_first_running_mean_update() -> None:
    got, want = first_step_running_means(buggy=False)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6)
    assert np.abs(want[0] - want[1]).max() > 1e-4  # the two shards' statistics differ


def test_the_check_sees_the_lost_update() -> None:
    got, want = first_step_running_means(buggy=True)
    assert max(np.abs(g - w).max() for g, w in zip(got, want)) > 1e-3
