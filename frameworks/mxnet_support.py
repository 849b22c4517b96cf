"""What the MXNet trainer builds on besides the models (frameworks/mxnet_models.py): the loss,
the optimisers, the device pipeline, the train state and checkpoint I/O (the same roles as
torch_support.py and jax_support.py).

Optimisers: `TorchSGD` follows torch's update rule (buf = m*buf + (g + wd*w); w -= lr*buf).
MXNet's built-in "sgd" keeps lr inside the momentum buffer (mom = m*mom - lr*(g + wd*w);
w += mom), which equals torch's form only while the LR is constant: under warm-up or a cosine
schedule the old buffer is applied at the old LR (six steps of a changing LR leave the two more
than 0.1 apart in the tests). `TorchSGD` drives the same fused kernel with the buffer rescaled to
each new LR.
MXNet 1.9.1 has no NovoGrad (its registry holds sgd, nag, signum, lamb, lars, adam, ...);
`NovoGrad` here is the layer-wise form of torch_support.NovoGrad (the NVIDIA course; Ginsburg et
al. 2019), written as NDArray ops.

This module imports mxnet at the top: the trainer imports it only after `main()` has set the
OpenMP thread count, which MXNet reads once, when it is loaded.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import gluon

from common.checkpoints import (
    Checkpoints,
    check_digest,
    check_resume,
    checkpoint_meta,
    read_index,
    reading_checkpoint,
    restore_meta,
    sha256_hex,
    write_index,
    writing_checkpoint,
)
from common.config import Config, ConfigError
from common.datasets import check_available
from common.devices import need_gpus
from common.footprint import state_record
from common.pipeline import TrainLoader
from common.results import RunRecorder
from common.run import Run
from common.runtime import atomic_write_with, threads_record
from common.timing import PhaseTimer
from frameworks.mxnet_models import count_params, structural_params, torch_key


class SoftmaxCrossEntropy(gluon.HybridBlock):
    """Per-example softmax cross-entropy with torch's label smoothing (Gluon's
    SoftmaxCrossEntropyLoss has none): (1 - s) * nll + s * mean_k(-log p_k)."""

    def __init__(self, smoothing: float = 0.0):
        super().__init__()
        self.smoothing = smoothing

    def hybrid_forward(self, F, logits, label):  # noqa: N803  (N, K), (N,) float -> (N,)
        logp = F.log_softmax(logits, axis=1)
        nll = -F.pick(logp, label, axis=1)
        if not self.smoothing:
            return nll
        return (1.0 - self.smoothing) * nll - self.smoothing * F.mean(logp, axis=1)


@mx.optimizer.register
class TorchSGD(mx.optimizer.Optimizer):
    """SGD with momentum in torch's form (dampening 0), g = rescale_grad * grad + wd * w:
        buf = momentum * buf + g;  w -= lr * buf        (Nesterov: w -= lr * (g + momentum * buf))

    MXNet's fused kernel (`sgd_mom_update`, the built-in "sgd") keeps the LR inside the buffer,
    mom = momentum * mom - lr * g; w += mom, i.e. mom = -lr * buf only while the LR is constant.
    Here the kernel's momentum is momentum * lr / lr_prev, which rescales the stored buffer to the
    new LR before adding the new gradient: mom = -lr * buf after every step, so the update equals
    torch's under any schedule (warm-up, cosine) up to float rounding, at the fused kernel's
    speed (the plain NDArray version of this rule took 3-4x longer on ResNet-18). An LR of exactly
    0 would zero the buffer; no schedule in common/ produces one. Nesterov uses NDArray ops
    (the 1.9.1 NAG kernel keeps the LR inside its buffer too, and treats wd differently)."""

    def __init__(self, momentum: float = 0.0, nesterov: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.momentum = momentum
        self.nesterov = nesterov

    def create_state(self, index, weight):
        if self.momentum == 0.0:
            return None
        # [buffer, the LR it is scaled by]: -lr * buf for the fused kernel; buf for Nesterov.
        return [mx.nd.zeros(weight.shape, weight.context, dtype=weight.dtype), 0.0]

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        # rescale_grad = 1/global_batch (set by Trainer.step): grad holds the SUM over contexts
        # and examples, so g is the gradient of the mean loss over the global batch.
        kwargs = dict(lr=lr, wd=wd, rescale_grad=self.rescale_grad)
        if state is None:  # w -= lr * g
            mx.nd.sgd_update(weight, grad, out=weight, **kwargs)
        elif not self.nesterov:
            mom, lr_prev = state
            ratio = lr / lr_prev if lr_prev else 1.0  # the first step: mom is 0 anyway
            mx.nd.sgd_mom_update(
                weight, grad, mom, out=weight, momentum=self.momentum * ratio, **kwargs
            )
            state[1] = lr
        else:
            buf = state[0]
            g = grad * self.rescale_grad + wd * weight
            buf[:] = self.momentum * buf + g
            weight[:] -= lr * (g + self.momentum * buf)


@mx.optimizer.register
class NovoGrad(mx.optimizer.Optimizer):
    """NovoGrad (Ginsburg et al. 2019; the NVIDIA course; Optax's `novograd`), layer-wise:
    v = ||g||^2 at the first step, then v = b2 * v + (1 - b2) * ||g||^2 (one scalar per tensor);
    m = b1 * m + (g / (sqrt(v) + eps) + wd * w);  w -= lr * m."""

    def __init__(self, beta1: float = 0.95, beta2: float = 0.98, epsilon: float = 1e-8, **kwargs):
        super().__init__(**kwargs)
        self.beta1, self.beta2, self.epsilon = beta1, beta2, epsilon

    def create_state(self, index, weight):
        # (m, v, started): `started` is 0 until the first update, so v starts at ||g||^2.
        ctx = weight.context
        return (
            mx.nd.zeros(weight.shape, ctx, dtype=weight.dtype),
            mx.nd.zeros((1,), ctx),
            mx.nd.zeros((1,), ctx),
        )

    def update(self, index, weight, grad, state):
        self._update_count(index)
        lr, wd = self._get_lr(index), self._get_wd(index)
        m, v, started = state
        g = grad * self.rescale_grad
        sq = mx.nd.sum(mx.nd.square(g)).reshape((1,))  # on the device: no host sync
        b2 = started * self.beta2  # 0 at the first step: v = ||g||^2
        v[:] = b2 * v + (1.0 - b2) * sq
        started[:] = 1.0
        g = mx.nd.broadcast_div(g, mx.nd.sqrt(v) + self.epsilon)
        if wd:
            g = g + wd * weight
        m[:] = self.beta1 * m + g
        weight[:] -= lr * m


# ---- the device pipeline ------------------------------------------------------------------


# MXNet 1.9.1's wheels are built without large-tensor support (INT64_TENSOR_SIZE off): an
# NDArray holds at most 2^31 - 1 elements, so a resident uint8 training set at most this many bytes.
MAX_ELEMENTS = 2**31 - 1


def make_batch(images: Any, idx: Any, rows: Any, cols: Any, scale: Any, shift: Any) -> Any:
    """--pipeline device: common.pipeline.gather_crops in mx.nd ops on one context, then the
    host Normalizer's (x * scale + shift): the resident uint8 images (N, H, W, C) -> float32
    (B, C, H, W)."""
    (b, h), w = rows.shape, images.shape[2]
    inside = mx.nd.broadcast_mul(
        ((rows >= 0) * (rows < h)).reshape((b, h, 1)), ((cols >= 0) * (cols < w)).reshape((b, 1, w))
    )
    where = [
        idx.reshape((b, 1, 1)).broadcast_to((b, h, w)),
        mx.nd.clip(rows, 0, h - 1).reshape((b, h, 1)).broadcast_to((b, h, w)),
        mx.nd.clip(cols, 0, w - 1).reshape((b, 1, w)).broadcast_to((b, h, w)),
    ]
    crops = mx.nd.gather_nd(images, mx.nd.stack(*where)).astype("float32")  # (B, H, W, C)
    crops = mx.nd.broadcast_mul(crops, inside.astype("float32").expand_dims(3))  # zero padding
    x = mx.nd.broadcast_add(mx.nd.broadcast_mul(crops, scale), shift)
    return x.transpose((0, 3, 1, 2))


def resident_put(loader: TrainLoader, state: TrainState) -> Callable[..., tuple[list[Any], ...]]:
    """--pipeline device: the uint8 training set is copied to every context once, here, and
    each step copies only each context's slice of the indices and gathers its crops there
    (`make_batch`): what split_and_load would have given it."""

    def on(c: Any) -> tuple[Any, ...]:
        norm = loader.norm
        return (
            mx.nd.array(loader.ds.train_x, ctx=c, dtype="uint8"),
            mx.nd.array(norm.scale.reshape(1, 1, 1, -1), ctx=c, dtype="float32"),
            mx.nd.array(norm.shift.reshape(1, 1, 1, -1), ctx=c, dtype="float32"),
        )

    resident = [on(c) for c in state.ctx]

    def put(batch: tuple[np.ndarray, ...]) -> tuple[list[Any], ...]:
        idx, rows, cols, y = batch
        b = len(idx) // len(state.ctx)  # even split, as split_and_load(even_split=True)
        xs, ys = [], []
        for i, (c, (images, scale, shift)) in enumerate(zip(state.ctx, resident)):
            part = slice(i * b, (i + 1) * b)
            args = [mx.nd.array(a[part], ctx=c, dtype="int32") for a in (idx, rows, cols)]
            xs.append(make_batch(images, *args, scale, shift))
            ys.append(mx.nd.array(y[part], ctx=c, dtype="float32"))
        return xs, ys

    return put


# ---- the train state, checkpoints ---------------------------------------------------------


@dataclass
class TrainState:
    """Everything a step changes or reads. Gluon updates in place; the step returns it anyway."""

    model: Any  # gluon.HybridBlock, parameters replicated on every context
    trainer: Any  # gluon.Trainer: the kvstore, and one optimiser state per context
    loss: Any  # per-example softmax cross-entropy with label smoothing (a HybridBlock)
    lr: np.ndarray  # LR of every step (common.schedule)
    step: int
    cfg: Config
    ctx: list[Any]  # the devices
    host: Any  # where a batch is staged for split_and_load: pinned memory on GPUs
    phases: PhaseTimer = field(default_factory=lambda: PhaseTimer(sync, False))  # run.phases


def check_inputs(cfg: Config) -> None:
    """MXNet's checks before training starts (ConfigError / DatasetError): `--devices cuda` on
    an MXNet without a GPU (a CPU build; on Hopper there is no other: scripts/setup_plan.py),
    the dataset, --resume's checkpoint."""
    cuda = mx.runtime.Features().is_enabled("CUDA")
    visible = mx.context.num_gpus() if cuda else 0
    build = "a CUDA build" if cuda else "a CPU build"
    why = need_gpus(cfg.devices, visible, cfg.framework, f"mxnet {mx.__version__}, {build}")
    if why:
        raise ConfigError(why)
    check_available(cfg)
    check_resume(cfg, CHECKPOINTS)


def start_run(run: Run, state: TrainState, kind: str) -> tuple[TrainState, int]:
    """What the trainer does between building the state and the epoch loop: the run record
    (`kind` of device, OMP_NUM_THREADS per context, the execution mode, float32 precision and
    what the network computes in), --compile's note, --resume, the run's phase timer. Returns
    the state and the first epoch to train."""
    cfg, gpu = run.cfg, state.ctx[0].device_type == "gpu"
    omp = int(os.environ.get("OMP_NUM_THREADS", "0") or 0)
    threads = threads_record(
        omp * len(state.ctx), omp, "OMP_NUM_THREADS per context (each engine worker's OpenMP team)"
    )
    threads["omp_wait_policy"] = os.environ.get("OMP_WAIT_POLICY", "")
    tf32 = "tf32" if cfg.tf32 else "fp32 (TF32 off)"
    run.record(
        devices=len(state.ctx),
        kind=kind,
        params=count_params(state.model),
        threads=threads,
        execution="hybridized (static_alloc, static_shape)",
        precision=tf32 if gpu else "fp32 (CPU)",
        ran=what_ran(state.model),
        state_bytes=state_bytes(state),
    )
    if not gpu and cfg.compile:
        run.log("note: --compile applies to torch only; this run is hybridized")
    state, start = run.resume(state, CHECKPOINTS)
    state.phases = run.phases
    return state, start


def state_bytes(state: TrainState) -> dict[str, int]:
    """What one context keeps between steps (common.footprint.state_record): every context
    holds a full copy of the params, their grads (allocated with them) and the BN statistics,
    and with update_on_kvstore=False the Trainer keeps one updater per context, whose optimiser
    state lives on that context (read: context 0's). The states appear at the first update:
    before it, the optimiser's own `create_state` of each param says their size. Not counted:
    kvstore "device"'s merge buffers (on the context that owns each key)."""
    ctx = state.ctx[0]

    def nbytes(arrays: Any) -> int:
        if isinstance(arrays, mx.nd.NDArray):
            return int(arrays.size) * np.dtype(arrays.dtype).itemsize
        return sum(nbytes(a) for a in arrays) if isinstance(arrays, list | tuple) else 0

    params = list(state.model.collect_params().values())
    trainable = [p for p in params if p.grad_req != "null"]
    kept = state.trainer._updaters[0].states  # {index: state} of context 0's updater
    opt = state.trainer._optimizer
    return state_record(
        params=nbytes([p.data(ctx) for p in trainable]),
        grads=nbytes([p.grad(ctx) for p in trainable]),
        optimizer=nbytes(list(kept.values()))
        or nbytes([opt.create_state(i, p.data(ctx)) for i, p in enumerate(trainable)]),
        buffers=nbytes([p.data(ctx) for p in params if p.grad_req == "null"]),
    )


def what_ran(model: gluon.Block) -> dict[str, str]:
    """The record's `ran`: the dtype the hybridized network computes in (its parameters'; MXNet
    1.9 runs a network in its parameters' dtype), the input's memory format, the mode."""
    dtypes = sorted({np.dtype(p.dtype).name for p in model.collect_params().values()})
    return {
        "activation_dtype": "+".join(dtypes),
        "input_memory_format": "NCHW",
        "mode": "hybridized (static graph)",
    }


def sync() -> None:
    """Wait for all queued MXNet work: the engine runs every operation asynchronously."""
    mx.nd.waitall()


def seed_for(seed: int, epoch: int) -> int:
    """mx.random seed (dropout) of an epoch: reproducible after --resume."""
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0] % 2**31)


def checkpoint_path(cfg: Config) -> Path:
    """The checkpoint's index; it names the weights and optimiser files it belongs with."""
    return Path(cfg.checkpoint_dir) / f"{cfg.framework}.json"


def save_checkpoint(cfg: Config, state: TrainState, recorder: RunRecorder, epoch: int) -> None:
    """Write the state after `epoch` (0-based): weights and optimiser states, each to a temp file
    renamed into place, then the index (atomic JSON) that names them; older files go last. A
    write that fails (a full disk) removes this epoch's files, so that none is left that no
    index names, and is one line (`writing_checkpoint`). Both files are MXNet's NDArray
    format (`mx.nd.save`), never a pickle: `--resume` reads nothing that can run code. The
    index holds the sha256 of each file and of its own fields (common/checkpoints.py)."""
    index = checkpoint_path(cfg)
    tag = f"{cfg.framework}-epoch{epoch + 1}"
    # Context 0's copy of the (identical) replicas, in save_parameters' format. Gluon's own
    # save_parameters averages the replicas, and (a + a + a) / 3 can differ from a in the last
    # bit, which would break an exact resume at 3 devices.
    params = {
        name: p.data(state.ctx[0]).as_in_context(mx.cpu())
        for name, p in state.model._collect_params_with_prefix().items()
    }
    # context 0's optimiser state (all are identical)
    states = optimizer_arrays(state.trainer, state.model)
    meta = checkpoint_meta(cfg, recorder, epoch, state.step)
    files = [index.with_name(f"{tag}.{kind}") for kind in ("params", "states")]
    new = [f for f in files if not f.exists()]  # what a failed write must not leave behind
    try:
        with writing_checkpoint(index, (OSError, mx.base.MXNetError)):  # a full disk: one line
            index.parent.mkdir(parents=True, exist_ok=True)
            for f, arrays in zip(files, (params, states)):
                atomic_write_with(f, lambda tmp, a=arrays: mx.nd.save(tmp, a))  # type: ignore[misc]
            named = {key: f.name for key, f in zip(("params", "states"), files)}
            digests = {f"{key}_sha256": sha256_hex(f.read_bytes()) for key, f in zip(named, files)}
            write_index(index, {**named, **digests, **meta})
    except BaseException:  # the index still names the last complete checkpoint's files
        for f in new:
            f.unlink(missing_ok=True)
        raise
    for old in index.parent.glob(f"{cfg.framework}-epoch*"):
        if not old.name.startswith(f"{tag}."):
            old.unlink(missing_ok=True)


def state_names(trainer: gluon.Trainer, model: gluon.Block) -> list[str]:
    """The structural name ("layer1.0.conv1.weight") of each of the Trainer's parameters, in
    its index order: Gluon's own names carry a per-instance counter (resnet180_conv3_weight)
    and the Trainer orders its parameters by them, so an index alone names nothing stable."""
    by_id = {id(p): name for name, p in model._collect_params_with_prefix().items()}
    return [by_id[id(p)] for p in trainer._params]


def optimizer_arrays(trainer: gluon.Trainer, model: gluon.Block) -> dict[str, mx.nd.NDArray]:
    """Context 0's optimiser states as named NDArrays (Gluon's `save_states` pickles them):
    a parameter's state is "<name>" (one array) or "<name>#j" (the j-th item of a list or
    tuple; a Python number, such as TorchSGD's previous LR, as a float64 scalar, exactly)."""
    names = state_names(trainer, model)
    out: dict[str, mx.nd.NDArray] = {}
    for i, st in trainer._updaters[0].states.items():
        items = st if isinstance(st, (list, tuple)) else [st]
        for j, item in enumerate(items):
            key = f"{names[i]}#{j}" if isinstance(st, (list, tuple)) else names[i]
            if isinstance(item, mx.nd.NDArray):
                out[key] = item.as_in_context(mx.cpu())
            elif item is not None:
                out[key] = mx.nd.array([float(item)], dtype="float64")
    return out


def load_optimizer_arrays(
    trainer: gluon.Trainer, model: gluon.Block, arrays: Mapping[str, mx.nd.NDArray]
) -> None:
    """The inverse of `optimizer_arrays`, into every context's updater: each state is built by
    the optimiser's own `create_state` (so its structure, shapes and dtypes come from this
    model, not from the file) and then filled; a missing, extra or misshapen array raises
    ValueError."""
    if not trainer._kv_initialized:  # Gluon sets the kvstore up lazily (as load_states does)
        trainer._init_kvstore()
    if trainer._params_to_init:
        trainer._init_params()
    names = state_names(trainer, model)
    used: set[str] = set()

    def fill(template: Any, key: str) -> Any:
        if template is None:
            return None
        if key not in arrays:
            raise ValueError(f"no optimiser state {key!r}")
        used.add(key)
        a = arrays[key]
        if not isinstance(template, mx.nd.NDArray):
            if a.shape != (1,):
                raise ValueError(f"optimiser state {key!r} has shape {a.shape}, not (1,)")
            return type(template)(a.asnumpy()[0])
        if a.shape != template.shape or a.dtype != template.dtype:
            raise ValueError(
                f"optimiser state {key!r} is {a.dtype.__name__}{a.shape}, this model's "
                f"{template.dtype.__name__}{template.shape}"
            )
        return a.copyto(template.context)

    for k, updater in enumerate(trainer._updaters):
        states = {}
        for i, param in enumerate(trainer._params):
            template = updater.optimizer.create_state_multi_precision(i, param.list_data()[k])
            if isinstance(template, (list, tuple)):
                states[i] = type(template)(
                    fill(t, f"{names[i]}#{j}") for j, t in enumerate(template)
                )
            else:
                states[i] = fill(template, names[i])
        updater.states = states
        updater.states_synced = dict.fromkeys(states, True)  # built on this context already
    extra = sorted(set(arrays) - used)
    if extra:
        raise ValueError(f"optimiser states of another model ({', '.join(extra[:3])}, ...)")


def load_checkpoint(
    cfg: Config, state: TrainState, recorder: RunRecorder
) -> tuple[TrainState, int]:
    """Restore the latest checkpoint into every context; return the state and the epoch to
    continue from. Every file is checked against its sha256 before MXNet opens it; another
    run's metadata, and weights of other shapes (Gluon's load_parameters refuses them), are
    one line (exit 2)."""
    index = checkpoint_path(cfg)
    with reading_checkpoint(index):
        ckpt = checkpoint_meta_of(index)
        epoch, state.step = restore_meta(ckpt, recorder, index)
        state.model.load_parameters(str(index.with_name(ckpt["params"])), ctx=state.ctx)
        states = mx.nd.load(str(index.with_name(ckpt["states"])))
        load_optimizer_arrays(state.trainer, state.model, states)
    return state, epoch


def canonical_state(state: TrainState) -> dict[str, np.ndarray]:
    """Parameters and BN statistics (context 0's copy) in torch's names and layouts
    (--save-state): Gluon's layouts are torch's, only BN gamma/beta are renamed."""
    params = structural_params(state.model)
    return {torch_key(n): p.data(state.ctx[0]).asnumpy() for n, p in params.items()}


def checkpoint_meta_of(path: Path) -> dict[str, Any]:
    """The metadata saved in a checkpoint's index: config, epoch ... (for check_resume), once
    the index and the weights and optimiser files it names match their sha256."""
    ckpt = read_index(path)
    for key in ("params", "states"):
        check_digest(path.with_name(ckpt[key]), ckpt[f"{key}_sha256"])
    return ckpt


CHECKPOINTS = Checkpoints(checkpoint_path, save_checkpoint, load_checkpoint, checkpoint_meta_of)
