"""The Gluon (MXNet 1.9.1) models of the MXNet trainer: the CIFAR ResNet-18 and the NVIDIA
course's WideResNet, their initialisation and the torch weight port. The loss, optimisers,
device pipeline, train state and checkpoint I/O are in frameworks/mxnet_support.py (the same
split as torch_models.py / torch_support.py and jax_models.py / jax_support.py).

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

This module imports mxnet at the top: the trainer imports it only after `main()` has set the
OpenMP thread count, which MXNet reads once, when it is loaded.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping

import mxnet as mx
import numpy as np
from mxnet import gluon
from mxnet.gluon import nn

from common.config import Config
from common.init import initial_state

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
