"""What the MXNet trainer builds on: Gluon (MXNet 1.9.1) models, optimisers, the loss, the train
state and checkpoint I/O (the same roles as torch_models.py and jax_models.py).

ResNet-18 (CIFAR variant) and the WideResNet of the NVIDIA data-parallel course, as HybridBlocks
with torch's submodule names: `_collect_params_with_prefix()` yields `layer1.0.downsample.0.weight`
exactly where torch's state dict has it. Only the leaf names of BatchNorm differ (Gluon `gamma`,
`beta` = torch `weight`, `bias`); `torch_key` / `load_torch_state` map them. Conv kernels are OIHW
and linear weights (out, in) in both frameworks, so a ported array needs no transpose.

Every default is spelled out (Gluon's differ from torch's):
- BatchNorm: momentum 0.9 in Gluon's convention (running = 0.9 * running + 0.1 * batch = torch's
  momentum 0.1), epsilon 1e-5, gamma 1, beta 0, running mean 0 / var 1.
- Conv kernels: He-normal on fan_out = k*k*out_channels, untruncated (torchvision's
  kaiming_normal_(mode="fan_out", nonlinearity="relu")) = MSRAPrelu(factor_type="out", slope=0).
  Gluon's default is Uniform(0.07).
- Linear: weight AND bias uniform in +-1/sqrt(fan_in) (torch's nn.Linear). Gluon's default bias
  is zero.
- Weight decay only on conv and linear weights: `wd_mult = 0` on BN gamma/beta and on biases
  (Gluon applies the optimiser's wd to every parameter by default).

Known, unavoidable differences from torch: MXNet's BatchNorm updates running_var with the biased
batch variance (torch the unbiased one, n/(n-1) larger), and it updates the running statistics in
the backward pass (a forward under autograd.record() alone leaves them unchanged); dropout masks
come from MXNet's generator, not torch's.

Optimisers: `TorchSGD` follows torch's update rule (buf = m*buf + (g + wd*w); w -= lr*buf).
MXNet's built-in "sgd" keeps lr inside the momentum buffer (mom = m*mom - lr*(g + wd*w);
w += mom), which equals torch's form only while the LR is constant: under warm-up or a cosine
schedule the old buffer is applied at the old LR (six steps of a changing LR leave the two more
than 0.1 apart in the tests). `TorchSGD` drives the same fused kernel with the buffer rescaled to
each new LR.
MXNet 1.9.1 has no NovoGrad (its registry holds sgd, nag, signum, lamb, lars, adam, ...);
`NovoGrad` here is the layer-wise form of torch_models.NovoGrad (the NVIDIA course; Ginsburg et
al. 2019), written as NDArray ops.

This module imports mxnet at the top: the trainer imports it only after `main()` has set the
OpenMP thread count, which MXNet reads once, when it is loaded.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet.gluon import nn

from common.config import Config, ConfigError
from common.devices import need_gpus
from common.init import initial_state
from common.pipeline import TrainLoader
from common.results import RunRecorder, write_json_atomic
from common.runtime import atomic_write_with
from common.timing import PhaseTimer
from common.trainer import checkpoint_meta, reading_checkpoint, restore_meta

# Gluon's momentum is the weight of the OLD running value: 1 - torch's momentum.
BN_MOMENTUM = 0.9
BN_EPS = 1e-5

Norm = Callable[[int], gluon.HybridBlock]


def channels(base: int, width: float) -> int:
    """`base` channels times the width multiplier, rounded, at least 1 (same rule everywhere)."""
    return max(1, int(round(base * width)))


def batch_norm(momentum: float = BN_MOMENTUM, eps: float = BN_EPS, sync_devices: int = 0) -> Norm:
    """A factory of BatchNorm layers over axis 1 (NCHW). `sync_devices` > 0: Gluon's contrib
    SyncBatchNorm, whose statistics cover the global batch over that many GPUs (CUDA only)."""

    def make(c: int) -> gluon.HybridBlock:
        if sync_devices:
            return gluon.contrib.nn.SyncBatchNorm(
                in_channels=c,
                num_devices=sync_devices,
                momentum=momentum,
                epsilon=eps,
                gamma_initializer="ones",
                beta_initializer="zeros",
                running_mean_initializer="zeros",
                running_variance_initializer="ones",
            )
        return nn.BatchNorm(
            axis=1,
            momentum=momentum,
            epsilon=eps,
            center=True,
            scale=True,
            use_global_stats=False,
            in_channels=c,
            gamma_initializer="ones",
            beta_initializer="zeros",
            running_mean_initializer="zeros",
            running_variance_initializer="ones",
        )

    return make


def conv(in_c: int, out_c: int, kernel: int, stride: int = 1) -> nn.Conv2D:
    """Bias-free conv, padding k//2 (1 for 3x3, 0 for 1x1), He-normal on fan_out."""
    return nn.Conv2D(
        out_c,
        kernel_size=kernel,
        strides=stride,
        padding=kernel // 2,
        use_bias=False,
        layout="NCHW",
        in_channels=in_c,
        # Xavier with factor_type "out": std = sqrt(2 / (k*k*out_channels)), gaussian.
        weight_initializer=mx.init.MSRAPrelu(factor_type="out", slope=0.0),
    )


def linear(in_f: int, out_f: int) -> nn.Dense:
    """torch's nn.Linear: weight and bias uniform in +-1/sqrt(fan_in)."""
    bound = 1.0 / math.sqrt(in_f)
    return nn.Dense(
        out_f,
        use_bias=True,
        flatten=True,
        in_units=in_f,
        weight_initializer=mx.init.Uniform(bound),
        bias_initializer=mx.init.Uniform(bound),
    )


class BasicBlock(gluon.HybridBlock):
    """conv1 3x3/s -> bn1 -> ReLU -> conv2 3x3 -> bn2, + shortcut (downsample where the shape
    changes), ReLU."""

    def __init__(self, in_c: int, out_c: int, stride: int, norm: Norm):
        super().__init__()
        self.conv1 = conv(in_c, out_c, 3, stride)
        self.bn1 = norm(out_c)
        self.conv2 = conv(out_c, out_c, 3)
        self.bn2 = norm(out_c)
        self.downsample = None
        if stride != 1 or in_c != out_c:
            # Children of a HybridSequential are named "0", "1": torch's downsample.0 / .1.
            self.downsample = nn.HybridSequential()
            self.downsample.add(conv(in_c, out_c, 1, stride), norm(out_c))

    def hybrid_forward(self, F, x):  # noqa: N803 (Gluon's signature)
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        shortcut = x if self.downsample is None else self.downsample(x)
        return F.relu(out + shortcut)


class ResNet18(gluon.HybridBlock):
    """ResNet-18, CIFAR variant: 3x3 stride-1 stem, no max-pool, global average pool, fc."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: float = 1.0,
        norm: Norm | None = None,
    ):
        super().__init__()
        norm = norm or batch_norm()
        widths = [channels(c, width) for c in (64, 128, 256, 512)]
        self.conv1 = conv(in_channels, widths[0], 3)
        self.bn1 = norm(widths[0])
        in_c = widths[0]
        for i, out_c in enumerate(widths):
            layer = nn.HybridSequential()
            for j in range(2):
                stride = 2 if i > 0 and j == 0 else 1
                layer.add(BasicBlock(in_c, out_c, stride, norm))
                in_c = out_c
            setattr(self, f"layer{i + 1}", layer)
        self.fc = linear(in_c, num_classes)

    def hybrid_forward(self, F, x):  # noqa: N803  x: (N, C, H, W) -> logits (N, classes)
        x = F.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(F.mean(x, axis=(2, 3)))  # global average pool over all pixels


class WideBlock(gluon.HybridBlock):
    """conv1 3x3 -> bn1 -> ReLU -> Dropout -> conv2 3x3 -> bn2 -> ReLU, + shortcut (1x1 conv where
    the width changes, identity otherwise); no ReLU after the add."""

    def __init__(self, in_c: int, out_c: int, dropout: float, norm: Norm):
        super().__init__()
        self.conv1 = conv(in_c, out_c, 3)
        self.bn1 = norm(out_c)
        self.dropout = nn.Dropout(dropout)  # active only under autograd.record(train_mode=True)
        self.conv2 = conv(out_c, out_c, 3)
        self.bn2 = norm(out_c)
        self.shortcut = conv(in_c, out_c, 1) if in_c != out_c else None

    def hybrid_forward(self, F, x):  # noqa: N803
        out = self.dropout(F.relu(self.bn1(self.conv1(x))))
        out = F.relu(self.bn2(self.conv2(out)))
        return out + (x if self.shortcut is None else self.shortcut(x))


class WideResNet(gluon.HybridBlock):
    """The NVIDIA course's WideResNet: stem 16, blocks 160,160,320,320,640,640 (x width), 2x2
    max-pool after blocks 2 and 4, global average pool over ALL pixels, fc."""

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: float = 1.0,
        dropout: float = 0.01,
        norm: Norm | None = None,
    ):
        super().__init__()
        norm = norm or batch_norm()
        stem = channels(16, width)
        self.conv1 = conv(in_channels, stem, 3)
        self.bn1 = norm(stem)
        in_c = stem
        for i, base in enumerate((160, 160, 320, 320, 640, 640)):
            out_c = channels(base, width)
            setattr(self, f"layer{i + 1}", WideBlock(in_c, out_c, dropout, norm))
            in_c = out_c
        self.fc = linear(in_c, num_classes)

    def hybrid_forward(self, F, x):  # noqa: N803  x: (N, C, H, W) -> logits (N, classes)
        def pool(t):  # floor mode, like torch's MaxPool2d(2)
            return F.Pooling(t, kernel=(2, 2), stride=(2, 2), pool_type="max")

        x = F.relu(self.bn1(self.conv1(x)))
        x = pool(self.layer2(self.layer1(x)))
        x = pool(self.layer4(self.layer3(x)))
        x = self.layer6(self.layer5(x))
        return self.fc(F.mean(x, axis=(2, 3)))  # all pixels (the course's AvgPool2d(7) drops some)


def create_model(
    model: str,
    in_channels: int,
    num_classes: int,
    width: float = 1.0,
    dropout: float = 0.01,
    bn_momentum: float = 0.1,
    bn_eps: float = BN_EPS,
    sync_devices: int = 0,
) -> gluon.HybridBlock:
    """Build `model` ("resnet18" / "wideresnet"); `bn_momentum` in torch's convention."""
    norm = batch_norm(1.0 - bn_momentum, bn_eps, sync_devices)
    if model == "resnet18":
        net = ResNet18(in_channels, num_classes, width, norm)
    elif model == "wideresnet":
        net = WideResNet(in_channels, num_classes, width, dropout, norm)
    else:
        raise ValueError(f"unknown model {model!r}; choose resnet18 or wideresnet")
    no_decay(net)
    return net


def no_decay(net: gluon.Block) -> None:
    """Weight decay on conv and linear weights only: wd_mult 0 on BN gamma/beta and biases."""
    for name, p in net._collect_params_with_prefix().items():
        if not name.endswith(".weight"):
            p.wd_mult = 0.0


def structural_params(net: gluon.Block) -> dict[str, gluon.Parameter]:
    """Parameters by structural name, e.g. `layer1.0.downsample.1.gamma` (torch's layout)."""
    return net._collect_params_with_prefix()


def count_params(net: gluon.Block) -> int:
    """Trainable parameters (running statistics excluded), as torch counts them."""
    return sum(
        int(np.prod(p.shape)) for p in structural_params(net).values() if p.grad_req != "null"
    )


# Gluon leaf name -> torch leaf name (everything else is identical).
_TORCH_LEAF = {"gamma": "weight", "beta": "bias"}
# torch state-dict entries with no Gluon counterpart (BN's step counter, unused by momentum BN).
_TORCH_ONLY = ("num_batches_tracked",)


def torch_key(name: str) -> str:
    """The torch state-dict key of Gluon structural name `name`: BN gamma/beta -> weight/bias."""
    head, _, leaf = name.rpartition(".")
    return f"{head}.{_TORCH_LEAF.get(leaf, leaf)}" if head else _TORCH_LEAF.get(leaf, leaf)


def load_torch_state(net: gluon.Block, flat: Mapping[str, np.ndarray]) -> None:
    """Copy a torch state dict (flat numpy arrays keyed by torch names, e.g. from an .npz) into
    `net` on every context it lives on. Conv OIHW and linear (out, in) are Gluon's layouts too,
    so arrays go in unchanged; BN weight/bias land in gamma/beta. Keys starting with "__" (test
    metadata) and torch's num_batches_tracked are ignored; anything else must match exactly."""
    params = structural_params(net)
    wanted = {torch_key(name): name for name in params}
    given = {k for k in flat if not k.startswith("__") and not k.endswith(_TORCH_ONLY)}
    missing, extra = sorted(set(wanted) - given), sorted(given - set(wanted))
    if missing or extra:
        raise ValueError(
            f"torch state does not match the Gluon model: missing {missing[:5]}, "
            f"unexpected {extra[:5]}; build the same model, width and classes"
        )
    for key, name in wanted.items():
        p, value = params[name], np.asarray(flat[key], dtype=np.float32)
        if tuple(value.shape) != tuple(p.shape):
            raise ValueError(f"{key}: torch shape {value.shape} != Gluon shape {p.shape}")
        p.set_data(mx.nd.array(value, dtype="float32"))


def initialize(cfg: Config, net: gluon.Block) -> None:
    """--init shared: load the arrays every framework starts from (common/init.py, by torch
    name; Gluon's layouts are torch's) into every context. --init native keeps what mx.random
    drew at `net.initialize`."""
    if cfg.init == "shared":
        params = structural_params(net)
        in_channels, num_classes = params["conv1.weight"].shape[1], params["fc.weight"].shape[0]
        arrays, _ = initial_state(cfg, in_channels, num_classes)
        load_torch_state(net, arrays)


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


__all__ = [
    "BN_EPS",
    "BN_MOMENTUM",
    "BasicBlock",
    "NovoGrad",
    "ResNet18",
    "SoftmaxCrossEntropy",
    "TorchSGD",
    "WideBlock",
    "WideResNet",
    "batch_norm",
    "channels",
    "count_params",
    "create_model",
    "initialize",
    "load_torch_state",
    "no_decay",
    "structural_params",
    "torch_key",
]


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
    phases: PhaseTimer


def check_devices(cfg: Config) -> None:
    """`--devices cuda` on an MXNet without a GPU (a CPU build; on Hopper there is no other:
    scripts/setup_plan.py) is one ConfigError before any work."""
    cuda = mx.runtime.Features().is_enabled("CUDA")
    visible = mx.context.num_gpus() if cuda else 0
    build = "a CUDA build" if cuda else "a CPU build"
    why = need_gpus(cfg.devices, visible, cfg.framework, f"mxnet {mx.__version__}, {build}")
    if why:
        raise ConfigError(why)


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
    renamed into place (removed if the write fails), then the index (atomic JSON) that names
    them; older files go last. Both files are MXNet's NDArray format (`mx.nd.save`), never a
    pickle: `--resume` reads nothing that can run code."""
    index = checkpoint_path(cfg)
    index.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{cfg.framework}-epoch{epoch + 1}"
    # Context 0's copy of the (identical) replicas, in save_parameters' format. Gluon's own
    # save_parameters averages the replicas, and (a + a + a) / 3 can differ from a in the last
    # bit, which would break an exact resume at 3 devices.
    params = {
        name: p.data(state.ctx[0]).as_in_context(mx.cpu())
        for name, p in state.model._collect_params_with_prefix().items()
    }
    atomic_write_with(index.with_name(f"{tag}.params"), lambda tmp: mx.nd.save(tmp, params))
    # context 0's optimiser state (all are identical)
    states = optimizer_arrays(state.trainer, state.model)
    atomic_write_with(index.with_name(f"{tag}.states"), lambda tmp: mx.nd.save(tmp, states))
    meta = checkpoint_meta(cfg, recorder, epoch, state.step)
    write_json_atomic(index, {"params": f"{tag}.params", "states": f"{tag}.states", **meta})
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
    continue from. A corrupt or foreign file is bad input (one line, exit 2)."""
    index = checkpoint_path(cfg)
    with reading_checkpoint(index):
        ckpt = json.loads(index.read_text())
        state.model.load_parameters(str(index.with_name(ckpt["params"])), ctx=state.ctx)
        states = mx.nd.load(str(index.with_name(ckpt["states"])))
        if not isinstance(states, dict):
            raise ValueError("the optimiser states are not named arrays")
        load_optimizer_arrays(state.trainer, state.model, states)
        epoch, state.step = restore_meta(ckpt, recorder)
    return state, epoch


def canonical_state(state: TrainState) -> dict[str, np.ndarray]:
    """Parameters and BN statistics (context 0's copy) in torch's names and layouts
    (--save-state): Gluon's layouts are torch's, only BN gamma/beta are renamed."""
    params = structural_params(state.model)
    return {torch_key(n): p.data(state.ctx[0]).asnumpy() for n, p in params.items()}


def checkpoint_meta_of(path: Path) -> dict[str, Any]:
    """The metadata saved in a checkpoint: config, epoch ... (for common.trainer.check_resume);
    the weights and optimiser files it names must parse too, so that a corrupt one is refused
    before the run."""
    ckpt = json.loads(path.read_text())
    for key in ("params", "states"):
        name = Path(str(ckpt[key]))
        if name.name != str(name):
            raise ValueError(f"{key} file {name} is not beside the index")
        mx.nd.load(str(path.with_name(name.name)))
    return ckpt
