"""mxnet-gluon checkpoints hold no pickle: the optimiser states are named
NDArrays in MXNet's own format, restored bit-exactly into every context's updater; a pickle
planted as the states file is refused with one line and never runs. Kill-and-resume of the
whole trainer: tests/trainers/test_contract.py."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest

from common.config import ConfigError, preset
from common.results import RunRecorder
from frameworks import mxnet_gluon as G
from frameworks.mxnet_support import checkpoint_path, load_checkpoint, save_checkpoint, state_names


def make_state(cfg, n: int) -> G.TrainState:
    model = G.build_model(cfg, 3, 10)
    return G.create_train_state(cfg, model, [mx.cpu(i) for i in range(n)], steps_per_epoch=4)


def recorder(cfg, steps: tuple[int, ...] = ()) -> RunRecorder:
    """A recorder with one row per epoch of `steps` (that epoch's steps): what a checkpoint
    after those epochs holds, counters included (common.trainer.check_meta)."""
    rec = RunRecorder(cfg, devices=cfg.gpus, device_kind="cpu", params=0, is_main=False)
    for epoch, n in enumerate(steps):
        rec.end_epoch(epoch, 1.0, n * cfg.batch_size, 2.3, 1, 10, 23.0)
    return rec


def batch(seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((24, 3, 16, 16)).astype(np.float32)
    return x, rng.integers(0, 10, 24).astype(np.int32)


def weights(state: G.TrainState, ctx: int) -> dict[str, np.ndarray]:
    params = state.model._collect_params_with_prefix()  # names without the instance counter
    return {k: p.data(state.ctx[ctx]).asnumpy() for k, p in params.items()}


@pytest.mark.parametrize(
    "optimizer,n", [("sgd", 2), ("novograd", 1)], ids=["sgd-momentum-2ctx", "novograd"]
)
def test_states_round_trip_bit_exactly_without_pickle(tmp_path: Path, optimizer: str, n: int):
    cfg = preset(
        "smoke", gpus=n, optimizer=optimizer, momentum=0.9, checkpoint_dir=str(tmp_path)
    ).replace(framework="mxnet-gluon")
    a = make_state(cfg, n)
    for seed in (1, 2):  # momentum buffers and TorchSGD's previous LR are now non-trivial
        a, _ = G.train_step(a, G.to_device(batch(seed), a))
    G.sync_batch_stats(a)  # as the trainer does at the end of an epoch, before its checkpoint
    save_checkpoint(cfg, a, recorder(cfg, (2,)), epoch=0)
    index = checkpoint_path(cfg)
    states_file = next(index.parent.glob("*.states"))
    assert not states_file.read_bytes().startswith(b"\x80")  # not a pickle (protocol 2+)
    assert sorted(p.name for p in tmp_path.iterdir() if ".tmp" in p.name) == []

    b = make_state(cfg, n)
    b, epoch = load_checkpoint(cfg, b, recorder(cfg))
    assert epoch == 1 and b.step == a.step
    # By structural name: two models in one process order their Trainer's parameters by
    # Gluon's instance-numbered names, so index i is not the same parameter in a and b.
    names_a, names_b = state_names(a.trainer, a.model), state_names(b.trainer, b.model)
    for upd_a, upd_b in zip(a.trainer._updaters, b.trainer._updaters, strict=True):
        by_name = {names_b[i]: st for i, st in upd_b.states.items()}
        assert sorted(by_name) == sorted(names_a[i] for i in upd_a.states)
        for i, sa in upd_a.states.items():
            sb = by_name[names_a[i]]
            for x, y in zip(sa, sb, strict=True):
                if isinstance(x, mx.nd.NDArray):
                    assert y.context == x.context
                    np.testing.assert_array_equal(x.asnumpy(), y.asnumpy())
                else:
                    assert type(x) is type(y) and x == y  # the previous LR, exactly
    a, _ = G.train_step(a, G.to_device(batch(3), a))  # the next step is the same step
    b, _ = G.train_step(b, G.to_device(batch(3), b))
    for ctx in range(n):
        wa, wb = weights(a, ctx), weights(b, ctx)
        for k in wa:
            np.testing.assert_array_equal(wa[k], wb[k], err_msg=k)


class Payload:
    """What a hostile .states file runs when unpickled (MXNet's load_states did unpickle it)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_planted_pickle_is_refused_and_never_runs(tmp_path: Path) -> None:
    cfg = preset("smoke", gpus=1, checkpoint_dir=str(tmp_path / "ckpt")).replace(
        framework="mxnet-gluon"
    )
    state = make_state(cfg, 1)
    state, _ = G.train_step(state, G.to_device(batch(1), state))
    save_checkpoint(cfg, state, recorder(cfg, (0, 1)), epoch=1)
    states_file = next(checkpoint_path(cfg).parent.glob("*.states"))
    marker = tmp_path / "pwned"
    states_file.write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(ConfigError) as refused:
        load_checkpoint(cfg, make_state(cfg, 1), recorder(cfg))
    message = str(refused.value)
    assert "cannot read checkpoint" in message and "\n" not in message
    assert not marker.exists()
    pickle.loads(states_file.read_bytes())  # the file is live: unpickling it does run it
    assert marker.exists()


@pytest.mark.parametrize("optimizer", ["sgd", "novograd"])
def test_state_bytes_before_the_first_step_are_those_after_it(optimizer: str) -> None:
    """The optimiser state appears at the first update; counted before it by the optimiser's
    own create_state, it is what the updater of each context then holds (the record's
    state_bytes_per_device)."""
    from frameworks.mxnet_support import state_bytes

    state = make_state(preset("smoke", optimizer=optimizer, momentum=0.9, gpus=2), 2)
    before = state_bytes(state)
    state, _ = G.train_step(state, G.to_device(batch(1), state))
    assert state.trainer._updaters[1].states  # one updater per context, each with its state
    assert state_bytes(state) == before and before["optimizer"] >= before["params"] > 0
