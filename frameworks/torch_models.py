"""The torch models, shared by torch-dp, torch-ddp and torch-fsdp: the CIFAR ResNet-18 and the
NVIDIA course's WideResNet, with the submodule names every framework uses (`conv1`, `bn1`,
`layer1.0`, `fc`), and the CPU SyncBatchNorm. The rest the torch trainers share (optimiser, loss,
train state, device I/O, evaluation, checkpoints) is in frameworks/torch_support.py.

Every default that differs between frameworks is spelled out here rather than inherited:
- BatchNorm: momentum 0.1 in torch's convention (running = 0.9 * running + 0.1 * batch; Flax and
  Gluon call this 0.9), epsilon 1e-5, scale 1 and offset 0 at init. torch updates running_var
  with the UNBIASED batch variance (n / (n - 1)); Flax uses the biased one.
- Convolutions: no bias, padding 1 for 3x3 and 0 for 1x1, He-normal init (untruncated normal,
  std = sqrt(2 / fan_out), fan_out = k * k * out_channels: torchvision's
  kaiming_normal_(mode="fan_out", nonlinearity="relu")).
- Linear: weight and bias uniform in +-1/sqrt(fan_in) (torch's nn.Linear default, written out).
- Weight decay: conv and linear weights only, never BN scales/offsets or biases
  (`decay_parameters`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn

NormLayer = Callable[[int], nn.Module]


def scaled(channels: int, width: float) -> int:
    """`channels` x width multiplier, rounded, at least 1."""
    return max(1, int(round(channels * width)))


def batch_norm(momentum: float = 0.1, eps: float = 1e-5) -> NormLayer:
    """BatchNorm2d factory with explicit momentum (torch convention) and epsilon."""
    return lambda channels: nn.BatchNorm2d(channels, eps=eps, momentum=momentum)


def conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


def conv1x1(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 1, stride=stride, padding=0, bias=False)


class BasicBlock(nn.Module):
    """ResNet basic block (torchvision naming): conv-bn-relu-conv-bn + shortcut, relu."""

    def __init__(self, in_ch: int, out_ch: int, stride: int, norm: NormLayer):
        super().__init__()
        self.conv1 = conv3x3(in_ch, out_ch, stride)
        self.bn1 = norm(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = conv3x3(out_ch, out_ch)
        self.bn2 = norm(out_ch)
        # 1x1 projection only where the shape changes (None keeps torchvision's state-dict keys).
        self.downsample = (
            nn.Sequential(conv1x1(in_ch, out_ch, stride), norm(out_ch))
            if stride != 1 or in_ch != out_ch
            else None
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18, CIFAR variant: 3x3 stride-1 stem, no max-pool, BasicBlocks 64/128/256/512 x 2.

    11,173,962 parameters at width 1, 3 input channels, 10 classes.
    """

    layer1: nn.Sequential  # set by name in __init__ (layer1 .. layer4)
    layer2: nn.Sequential
    layer3: nn.Sequential
    layer4: nn.Sequential

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: float = 1.0,
        norm: NormLayer | None = None,
    ):
        super().__init__()
        norm = norm or batch_norm()
        widths = [scaled(c, width) for c in (64, 128, 256, 512)]
        self.conv1 = conv3x3(in_channels, widths[0])
        self.bn1 = norm(widths[0])
        self.relu = nn.ReLU(inplace=True)
        in_ch = widths[0]
        for i, out_ch in enumerate(widths):
            stride = 1 if i == 0 else 2
            layer = nn.Sequential(
                BasicBlock(in_ch, out_ch, stride, norm), BasicBlock(out_ch, out_ch, 1, norm)
            )
            setattr(self, f"layer{i + 1}", layer)
            in_ch = out_ch
        self.fc = nn.Linear(in_ch, num_classes)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, C, H, W)
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        x = torch.flatten(x.mean(dim=(2, 3)), 1)  # global average pool -> (N, 512w)
        return self.fc(x)


class WideBlock(nn.Module):
    """NVIDIA course residual block: conv-bn-relu, dropout, conv-bn-relu; + shortcut (no relu
    after the add). The shortcut is a 1x1 conv (no BN) where the width changes."""

    def __init__(self, in_ch: int, out_ch: int, dropout: float, norm: NormLayer):
        super().__init__()
        self.conv1 = conv3x3(in_ch, out_ch)
        self.bn1 = norm(out_ch)
        self.relu = nn.ReLU(inplace=True)
        self.dropout = nn.Dropout(p=dropout)
        self.conv2 = conv3x3(out_ch, out_ch)
        self.bn2 = norm(out_ch)
        self.shortcut = conv1x1(in_ch, out_ch) if in_ch != out_ch else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.dropout(self.relu(self.bn1(self.conv1(x))))
        out = self.relu(self.bn2(self.conv2(out)))
        return out + self.shortcut(x)


class WideResNet(nn.Module):
    """WideResNet of the NVIDIA data-parallel course: stem to 16, six blocks of widths
    160,160,320,320,640,640, 2x2 max-pool after blocks 2 and 4, global average pool, linear.

    The average pool covers every pixel (the course's fixed AvgPool2d(7) drops pixels at 32x32).
    """

    layer1: nn.Module  # set by name in __init__ (layer1 .. layer6)
    layer2: nn.Module
    layer3: nn.Module
    layer4: nn.Module
    layer5: nn.Module
    layer6: nn.Module

    def __init__(
        self,
        in_channels: int = 3,
        num_classes: int = 10,
        width: float = 1.0,
        dropout: float = 0.01,
        norm: NormLayer | None = None,
    ):
        super().__init__()
        norm = norm or batch_norm()
        stem = scaled(16, width)
        widths = [scaled(c, width) for c in (160, 160, 320, 320, 640, 640)]
        self.conv1 = conv3x3(in_channels, stem)
        self.bn1 = norm(stem)
        self.relu = nn.ReLU(inplace=True)
        in_ch = stem
        for i, out_ch in enumerate(widths):
            setattr(self, f"layer{i + 1}", WideBlock(in_ch, out_ch, dropout, norm))
            in_ch = out_ch
        self.pool = nn.MaxPool2d(2, stride=2)
        self.fc = nn.Linear(in_ch, num_classes)
        init_weights(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, C, H, W)
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.pool(self.layer2(self.layer1(x)))  # (N, 160w, H/2, W/2)
        x = self.pool(self.layer4(self.layer3(x)))  # (N, 320w, H/4, W/4)
        x = self.layer6(self.layer5(x))
        x = torch.flatten(x.mean(dim=(2, 3)), 1)  # every pixel: (N, 640w)
        return self.fc(x)


class AllReduceSum(torch.autograd.Function):
    """Differentiable all-reduce (sum): the gradient of a global sum with respect to each rank's
    part is the global sum of the gradients (what the deprecated torch.distributed.nn does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm over the global batch for CPU tensors (torch's SyncBatchNorm is CUDA-only).

    One differentiable all-reduce of (sum, sum of squares, count) per layer: its backward
    all-reduces the gradient of the statistics, so every rank's input gets its share of the
    global-batch gradient, as in SyncBatchNorm. Plain BatchNorm2d in eval mode or alone.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, C, H, W), this rank's shard
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        c = x.shape[1]
        local = torch.cat(
            [x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), x.new_full((1,), x.numel() / c)]
        )
        stats = AllReduceSum.apply(local)  # (2C + 1,) summed over ranks; a sync point
        n = stats[-1]
        mean = stats[:c] / n
        var = (stats[c : 2 * c] / n - mean * mean).clamp_min(0)  # biased: normalises the batch
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None and self.momentum is not None
        with torch.no_grad():  # running = (1 - momentum) * running + momentum * batch (unbiased)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
            self.num_batches_tracked.add_(1)
        scale = self.weight * torch.rsqrt(var + self.eps)
        return x * scale[None, :, None, None] + (self.bias - mean * scale)[None, :, None, None]


def init_weights(model: nn.Module) -> None:
    """The initialisers every framework uses (see the module docstring)."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, nn.modules.batchnorm._BatchNorm):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)
        elif isinstance(m, nn.Linear):
            bound = 1.0 / math.sqrt(m.in_features)
            nn.init.uniform_(m.weight, -bound, bound)
            nn.init.uniform_(m.bias, -bound, bound)


def create_model(
    name: str,
    in_channels: int,
    num_classes: int,
    width: float = 1.0,
    dropout: float = 0.01,
    bn_momentum: float = 0.1,
    bn_eps: float = 1e-5,
    norm: NormLayer | None = None,
) -> nn.Module:
    """Model `name` ("resnet18" or "wideresnet"); `norm` overrides the BatchNorm factory."""
    norm = norm or batch_norm(bn_momentum, bn_eps)
    if name == "resnet18":
        return ResNet18(in_channels, num_classes, width, norm)
    if name == "wideresnet":
        return WideResNet(in_channels, num_classes, width, dropout, norm)
    raise ValueError(f"unknown model {name!r}; choose resnet18 or wideresnet")


def decay_parameters(model: nn.Module) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(conv and linear weights, everything else): weight decay applies to the first list only."""
    decay_ids = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Conv2d, nn.Linear))}
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for p in model.parameters():
        (decay if id(p) in decay_ids else no_decay).append(p)
    return decay, no_decay


def count_params(model: nn.Module) -> int:
    """Number of trainable parameters."""
    return sum(p.numel() for p in model.parameters() if p.requires_grad)
