"""The Flax models, shared by jax-pmap and jax-shard: the CIFAR ResNet-18 and the NVIDIA
course's WideResNet, with the submodule names every framework uses (`conv1`, `bn1`, `layer1_0`,
`fc`; torch's `layer1.0.downsample.0` is Flax's `layer1_0/downsample_0`), their initial
variables and the torch weight port. The rest the two trainers share (train state, optimiser,
loss, device I/O, evaluation, checkpoints, caches) is in frameworks/jax_support.py.

Flax linen, not NNX. NNX is Flax's recommendation for new code, but its modules are mutable
Python objects: under `jax.pmap` / `jax.jit` they have to be split into a graph definition and
a state pytree (`nnx.split` / `nnx.merge`, or the lifted `nnx.pmap` / `nnx.jit`) and merged back,
which is linen's functional style with extra ceremony. Linen keeps the contract's pure
`train_step(state, batch) -> (state, metrics)` exactly as the Flax ImageNet example (the pmap
pattern readers know) writes it; its variables are a plain nested dict whose paths are the torch
names, so the weight port and msgpack checkpoints need no adapters. Linen remains supported in
Flax 0.12.

Every default that differs between frameworks is spelled out here rather than inherited:
- BatchNorm: Flax momentum 0.9 = torch momentum 0.1 (running = 0.9 * running + 0.1 * batch),
  epsilon 1e-5, scale 1 and offset 0 at init; the variance is E[x^2] - E[x]^2 in one pass
  (`use_fast_variance=True`, Flax's default: one collective per layer with sync BN).
  Unavoidable difference: Flax updates the running variance with the BIASED batch variance,
  torch with the unbiased one (n / (n - 1)); training-mode outputs are identical, running_var
  drifts apart by that factor (0.2% at 512 values per channel).
- Convolutions: no bias, padding 1 for 3x3 and 0 for 1x1 (explicit, not "SAME", which pads
  asymmetrically at stride 2), He-normal init (untruncated normal, std = sqrt(2 / fan_out),
  fan_out = k * k * out_channels: torchvision's kaiming_normal_(mode="fan_out")).
- Linear: weight and bias uniform in +-1/sqrt(fan_in) (torch's nn.Linear default; Flax's own
  default is LeCun-normal weights and zero bias).
- Weight decay: conv and linear kernels only, never BN scales/offsets or biases (`decay_mask`).
- Layouts: images NHWC, conv kernels HWIO, linear kernels (in, out) (`from_torch_state`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.export
import jax.numpy as jnp
import numpy as np
from flax import struct, traverse_util

from common.config import Config, ConfigError
from common.init import initial_state

# torchvision's kaiming_normal_(mode="fan_out", nonlinearity="relu"): jax's variance_scaling
# computes fan_out = prod(kernel_shape[:-2]) * out_channels for an HWIO kernel, "normal" is the
# untruncated normal.
he_normal = nn.initializers.variance_scaling(2.0, "fan_out", "normal")


def scaled(channels: int, width: float) -> int:
    """`channels` x width multiplier, rounded, at least 1."""
    return max(1, int(round(channels * width)))


def torch_linear_init(fan_in: int) -> Callable[..., jax.Array]:
    """Uniform in +-1/sqrt(fan_in), for nn.Linear's weight AND bias (torch's default)."""
    bound = 1.0 / np.sqrt(fan_in)

    def init(key: jax.Array, shape: Sequence[int], dtype: Any = jnp.float32) -> jax.Array:
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


def conv3x3(features: int, stride: int, name: str, dtype: Any) -> nn.Conv:
    return nn.Conv(
        features,
        (3, 3),
        strides=stride,
        padding=((1, 1), (1, 1)),
        use_bias=False,
        kernel_init=he_normal,
        dtype=dtype,
        name=name,
    )


def conv1x1(features: int, stride: int, name: str, dtype: Any) -> nn.Conv:
    return nn.Conv(
        features,
        (1, 1),
        strides=stride,
        padding=((0, 0), (0, 0)),
        use_bias=False,
        kernel_init=he_normal,
        dtype=dtype,
        name=name,
    )


class Norm(struct.PyTreeNode):
    """BatchNorm settings shared by every layer of a model (torch's convention for momentum).

    `axis_name` None: statistics over the batch this program sees (per device under pmap or
    shard_map, the global batch under jit over a mesh); "batch": pmean'd over that pmap axis.
    """

    momentum: float = struct.field(pytree_node=False, default=0.1)
    eps: float = struct.field(pytree_node=False, default=1e-5)
    axis_name: str | None = struct.field(pytree_node=False, default=None)

    def __call__(self, train: bool, name: str, dtype: Any) -> nn.BatchNorm:
        return nn.BatchNorm(
            use_running_average=not train,
            momentum=1.0 - self.momentum,
            epsilon=self.eps,
            axis_name=self.axis_name,
            use_fast_variance=True,
            scale_init=nn.initializers.ones,
            bias_init=nn.initializers.zeros,
            dtype=dtype,
            name=name,
        )


class BasicBlock(nn.Module):
    """ResNet basic block (torchvision naming): conv-bn-relu-conv-bn + shortcut, relu."""

    features: int
    stride: int
    norm: Norm
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        identity = x
        if self.stride != 1 or x.shape[-1] != self.features:  # 1x1 projection where shape changes
            identity = conv1x1(self.features, self.stride, "downsample_0", self.dtype)(x)
            identity = self.norm(train, "downsample_1", self.dtype)(identity)
        out = conv3x3(self.features, self.stride, "conv1", self.dtype)(x)
        out = nn.relu(self.norm(train, "bn1", self.dtype)(out))
        out = conv3x3(self.features, 1, "conv2", self.dtype)(out)
        out = self.norm(train, "bn2", self.dtype)(out)
        return nn.relu(out + identity)


class ResNet18(nn.Module):
    """ResNet-18, CIFAR variant: 3x3 stride-1 stem, no max-pool, BasicBlocks 64/128/256/512 x 2.

    11,173,962 parameters at width 1, 3 input channels, 10 classes.
    """

    num_classes: int = 10
    width: float = 1.0
    norm: Norm = Norm()
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:  # x: (N, H, W, C)
        widths = [scaled(c, self.width) for c in (64, 128, 256, 512)]
        x = conv3x3(widths[0], 1, "conv1", self.dtype)(x)
        x = nn.relu(self.norm(train, "bn1", self.dtype)(x))
        for i, features in enumerate(widths):
            for j in range(2):
                stride = 2 if i > 0 and j == 0 else 1
                x = BasicBlock(features, stride, self.norm, self.dtype, name=f"layer{i + 1}_{j}")(
                    x, train
                )
        x = jnp.mean(x, axis=(1, 2))  # global average pool -> (N, 512w)
        return nn.Dense(
            self.num_classes,
            kernel_init=torch_linear_init(x.shape[-1]),
            bias_init=torch_linear_init(x.shape[-1]),
            dtype=self.dtype,
            name="fc",
        )(x).astype(jnp.float32)


class WideBlock(nn.Module):
    """NVIDIA course residual block: conv-bn-relu, dropout, conv-bn-relu; + shortcut (no relu
    after the add). The shortcut is a 1x1 conv (no BN) where the width changes."""

    features: int
    dropout: float
    norm: Norm
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool) -> jax.Array:
        out = conv3x3(self.features, 1, "conv1", self.dtype)(x)
        out = nn.relu(self.norm(train, "bn1", self.dtype)(out))
        out = nn.Dropout(self.dropout, deterministic=not train, name="dropout")(out)
        out = conv3x3(self.features, 1, "conv2", self.dtype)(out)
        out = nn.relu(self.norm(train, "bn2", self.dtype)(out))
        shortcut = x
        if x.shape[-1] != self.features:
            shortcut = conv1x1(self.features, 1, "shortcut", self.dtype)(x)
        return out + shortcut


class WideResNet(nn.Module):
    """WideResNet of the NVIDIA data-parallel course: stem to 16, six blocks of widths
    160,160,320,320,640,640, 2x2 max-pool after blocks 2 and 4, global average pool, linear.

    The average pool covers every pixel (the course's fixed AvgPool2d(7) drops pixels at 32x32).
    """

    num_classes: int = 10
    width: float = 1.0
    dropout: float = 0.01
    norm: Norm = Norm()
    dtype: Any = jnp.float32

    @nn.compact
    def __call__(self, x: jax.Array, train: bool = False) -> jax.Array:  # x: (N, H, W, C)
        stem = scaled(16, self.width)
        widths = [scaled(c, self.width) for c in (160, 160, 320, 320, 640, 640)]
        x = conv3x3(stem, 1, "conv1", self.dtype)(x)
        x = nn.relu(self.norm(train, "bn1", self.dtype)(x))
        for i, features in enumerate(widths):
            x = WideBlock(features, self.dropout, self.norm, self.dtype, name=f"layer{i + 1}")(
                x, train
            )
            if i in (1, 3):  # after layer2: (N, H/2, W/2, 160w); after layer4: (N, H/4, W/4, 320w)
                x = nn.max_pool(x, (2, 2), strides=(2, 2), padding="VALID")
        x = jnp.mean(x, axis=(1, 2))  # every pixel: (N, 640w)
        return nn.Dense(
            self.num_classes,
            kernel_init=torch_linear_init(x.shape[-1]),
            bias_init=torch_linear_init(x.shape[-1]),
            dtype=self.dtype,
            name="fc",
        )(x).astype(jnp.float32)


def create_model(
    name: str,
    num_classes: int,
    width: float = 1.0,
    dropout: float = 0.01,
    bn_momentum: float = 0.1,
    bn_eps: float = 1e-5,
    bn_axis_name: str | None = None,
    dtype: Any = jnp.float32,
) -> nn.Module:
    """Model `name` ("resnet18" or "wideresnet"); `bn_axis_name` syncs BN over that pmap axis.
    (Flax infers the input channels at `init`, so unlike torch they are not a constructor
    argument.)"""
    norm = Norm(bn_momentum, bn_eps, bn_axis_name)
    if name == "resnet18":
        return ResNet18(num_classes, width, norm, dtype)
    if name == "wideresnet":
        return WideResNet(num_classes, width, dropout, norm, dtype)
    raise ValueError(f"unknown model {name!r}; choose resnet18 or wideresnet")


def compute_dtype(cfg: Config) -> Any:
    """The activations' dtype (parameters stay float32): float32, or bfloat16 for --precision
    bf16 on every platform (a CPU runs the path a GPU runs: slower there, for checking). Used
    by jax_support.device_plan only: the one place a run's precision is decided."""
    if cfg.precision == "fp32":
        return jnp.float32
    if cfg.precision == "bf16":
        return jnp.bfloat16
    raise ConfigError(
        "--precision fp16 needs loss scaling, which the JAX trainers do not "
        "implement; use --precision bf16 (same speed on recent GPUs) or fp32"
    )


def init_variables(model: nn.Module, seed: int, image_shape: Sequence[int]) -> Any:
    """{"params", "batch_stats"} of `model` for (H, W, C) images, on the default device.

    The initialisers draw from an "rbg" key (XLA's RngBitGenerator): on CPU its init program
    compiles about 4x faster than with the default threefry key (6 s instead of 24 s for
    ResNet-18 on a busy 2-core host). The same seed gives the same weights at any device count;
    the stream may differ between backends (CPU, GPU)."""
    key = jax.random.key(seed, impl="rbg")
    return jax.jit(model.init, static_argnames="train")(
        key, jnp.zeros((1, *image_shape), jnp.float32), train=False
    )


def initial_variables(cfg: Config, model: nn.Module, image_shape: Sequence[int]) -> Any:
    """{"params", "batch_stats"} the run starts from: --init shared loads the arrays every
    framework starts from (common/init.py, ported by name and layout with from_torch_state);
    --init native draws them with JAX's generator (init_variables)."""
    if cfg.init == "native":
        return init_variables(model, cfg.seed, image_shape)
    arrays, _ = initial_state(cfg, image_shape[-1], model.num_classes)
    return from_torch_state(arrays)


def count_params(params: Any) -> int:
    """Number of trainable parameters."""
    return int(sum(np.prod(p.shape) for p in jax.tree.leaves(params)))


def decay_mask(params: Any) -> Any:
    """True for conv and linear kernels (weight decay applies), False for BN scale/bias and
    linear biases: the same split as torch_models.decay_parameters."""
    flat = traverse_util.flatten_dict(params)
    return traverse_util.unflatten_dict({k: k[-1] == "kernel" for k in flat})


# -- torch weight port --------------------------------------------------------------------------


def from_torch_state(flat: dict[str, np.ndarray]) -> dict[str, Any]:
    """Flax variables {"params", "batch_stats"} from a torch state dict (numpy, torch keys).

    - Names: `layer1.0.downsample.0.weight` -> `layer1_0/downsample_0/...` (an index joins the
      name before it with "_"); `__*__` entries (test inputs/outputs) are skipped.
    - Conv weight (O, I, kH, kW) -> kernel (kH, kW, I, O); linear weight (out, in) -> kernel
      (in, out); linear bias -> bias.
    - BN weight -> scale, bias -> bias (params); running_mean -> mean, running_var -> var
      (batch_stats). A 1-D `weight` is a BN scale: conv and linear weights are 4-D and 2-D.
    """
    params: dict[tuple[str, ...], np.ndarray] = {}
    stats: dict[tuple[str, ...], np.ndarray] = {}
    for key, value in flat.items():
        if key.startswith("__") or key.endswith("num_batches_tracked"):
            continue
        parts: list[str] = []
        for part in key.split("."):
            if part.isdigit() and parts:
                parts[-1] = f"{parts[-1]}_{part}"
            else:
                parts.append(part)
        path, leaf = tuple(parts[:-1]), parts[-1]
        v = np.asarray(value, np.float32)
        if leaf == "weight" and v.ndim == 4:
            params[(*path, "kernel")] = v.transpose(2, 3, 1, 0)
        elif leaf == "weight" and v.ndim == 2:
            params[(*path, "kernel")] = v.T
        elif leaf == "weight" and v.ndim == 1:
            params[(*path, "scale")] = v
        elif leaf == "bias":
            params[(*path, "bias")] = v
        elif leaf == "running_mean":
            stats[(*path, "mean")] = v
        elif leaf == "running_var":
            stats[(*path, "var")] = v
        else:
            raise ValueError(f"unexpected torch state-dict entry {key!r} with shape {v.shape}")
    return {
        "params": traverse_util.unflatten_dict(params),
        "batch_stats": traverse_util.unflatten_dict(stats),
    }
