"""One typed, frozen run configuration with named presets.

`Config` is resolved once (preset, then command-line overrides, then derived values such as the
global batch of a per-device preset) and saved with every result. Nothing here parses arguments
at import time; `common.cli.parse_args` is the only parser.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

FRAMEWORKS = ("torch-dp", "torch-ddp", "jax-pmap", "jax-shard", "mxnet-gluon")
MODELS = ("resnet18", "wideresnet")
DATASETS = ("cifar10", "cifar100", "fashion-mnist", "digits", "synthetic")
LR_SCALINGS = ("none", "linear", "sqrt")
LR_SCHEDULES = ("constant", "step", "cosine")
OPTIMIZERS = ("sgd", "novograd")
BN_MODES = ("local", "sync")
PRECISIONS = ("fp32", "bf16", "fp16")


class ConfigError(ValueError):
    """A configuration value is invalid; the message names the problem and the fix."""


@dataclass(frozen=True)
class Config:
    """Everything that determines a run. Field names match the command-line flags."""

    preset: str = "digits"
    framework: str = ""
    # Model. `width` multiplies every channel count (1.0 = the published architecture); tests use
    # narrow models. `dropout` applies to the WideResNet only (0.01 in the NVIDIA course).
    model: str = "resnet18"
    width: float = 1.0
    dropout: float = 0.01
    # Data. `image_size` 0 keeps the dataset's native size. `train_limit`/`test_limit` 0 = all.
    dataset: str = "digits"
    data_dir: str = "data"
    download: bool = True
    image_size: int = 0
    augment: bool = True
    train_limit: int = 0
    test_limit: int = 0
    synthetic_train: int = 50_000
    synthetic_test: int = 10_000
    synthetic_classes: int = 10
    synthetic_channels: int = 3
    # Devices: GPUs where present, otherwise N simulated CPU devices.
    gpus: int = 1
    # Optimisation. `batch_size` is the GLOBAL batch; a preset may instead fix the per-device
    # batch (`batch_per_device` > 0), and the global batch then grows with the device count.
    epochs: int = 10
    batch_size: int = 128
    batch_per_device: int = 0
    eval_batch_size: int = 256
    lr: float = 0.1
    lr_base_batch: int = 128
    lr_scaling: str = "none"
    lr_schedule: str = "cosine"
    lr_step_epochs: tuple[int, ...] = ()
    lr_step_factor: float = 0.1
    warmup_epochs: float = 0.0
    # Warm-up starts at lr * warmup_start_factor; None = the unscaled (1-device) LR, i.e. 1/N of a
    # linearly scaled LR (Goyal et al., the NVIDIA course).
    warmup_start_factor: float | None = 0.0
    optimizer: str = "sgd"
    momentum: float = 0.9
    nesterov: bool = False
    weight_decay: float = 5e-4
    # Weight decay applies to conv and linear weights only, never to BN scales/offsets or biases.
    label_smoothing: float = 0.0
    novograd_betas: tuple[float, float] = (0.95, 0.98)
    # BatchNorm, in torch's convention: running = (1 - momentum) * running + momentum * batch.
    # (Flax and Gluon call 1 - momentum "momentum": 0.9.)
    bn: str = "local"
    bn_momentum: float = 0.1
    bn_eps: float = 1e-5
    # Run control.
    seed: int = 0
    target_accuracy: float = 0.0
    patience: int = 1
    max_steps_per_epoch: int = 0
    output: str = ""
    checkpoint_dir: str = ""
    resume: bool = False
    log_every: int = 0
    phase_timing: bool = False
    prefetch: int = 2
    # CUDA fast paths (ignored on CPU): mixed precision, channels-last, torch.compile.
    precision: str = "fp32"
    channels_last: bool = True
    compile: bool = False

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def global_batch(self) -> int:
        return self.batch_size


PRESETS: dict[str, dict[str, Any]] = {
    # Tiny and fast, for tests: a narrow ResNet-18 on a few synthetic 16x16 images.
    "smoke": dict(
        model="resnet18",
        width=0.125,
        dataset="synthetic",
        image_size=16,
        synthetic_train=96,
        synthetic_test=10,
        epochs=2,
        batch_size=24,
        eval_batch_size=8,
        lr=0.05,
        lr_base_batch=24,
        lr_schedule="constant",
        weight_decay=5e-4,
        augment=True,
    ),
    # The offline default: real handwritten digits (scikit-learn), 16x16, ResNet-18.
    # ResNet-18 at a quarter of its width (0.7M parameters): the full width (11.2M) costs ~7 TFLOP
    # per run, over a minute per run even on an idle 2-core CPU, too slow for the 5-minute
    # default sweep of 9 runs; `--width 1` restores it.
    "digits": dict(
        model="resnet18",
        width=0.25,
        dataset="digits",
        image_size=16,
        epochs=5,
        batch_size=64,
        eval_batch_size=256,
        lr=0.1,
        lr_base_batch=64,
        lr_schedule="cosine",
        warmup_epochs=1,
        weight_decay=5e-4,
    ),
    # d2l "Multiple GPUs, concise": ResNet-18 on Fashion-MNIST, batch 256, lr 0.1 on 1 device,
    # scaled linearly with the device count, 10 epochs, no augmentation.
    "fashion-mnist-d2l": dict(
        model="resnet18",
        dataset="fashion-mnist",
        epochs=10,
        batch_size=256,
        lr=0.1,
        lr_base_batch=256,
        lr_scaling="linear",
        lr_schedule="constant",
        momentum=0.0,
        weight_decay=0.0,
        augment=False,
        eval_batch_size=512,
    ),
    # NVIDIA DLI "Data parallelism" course: WideResNet on CIFAR-10, 256 images per device,
    # SGD momentum 0.9, LR scaled linearly, warmed up over 5 epochs starting from the
    # 1-device LR (1/N of the scaled LR), stop at 85% test accuracy held for 2 epochs.
    "cifar10-wrn-nvidia": dict(
        model="wideresnet",
        dataset="cifar10",
        epochs=40,
        batch_size=256,
        batch_per_device=256,
        lr=0.01,
        lr_base_batch=256,
        lr_scaling="linear",
        lr_schedule="constant",
        warmup_epochs=5,
        warmup_start_factor=None,
        momentum=0.9,
        weight_decay=5e-4,
        target_accuracy=0.85,
        patience=2,
        eval_batch_size=512,
    ),
    # ResNet-18 on CIFAR-10 aimed at >= 94% test accuracy: SGD+Nesterov, cosine, label smoothing.
    "cifar10-resnet18": dict(
        model="resnet18",
        dataset="cifar10",
        epochs=40,
        batch_size=512,
        lr=0.4,
        lr_base_batch=512,
        lr_scaling="none",
        lr_schedule="cosine",
        warmup_epochs=2,
        momentum=0.9,
        nesterov=True,
        weight_decay=5e-4,
        label_smoothing=0.1,
        eval_batch_size=1000,
        target_accuracy=0.94,
    ),
    # Throughput: synthetic CIFAR-shaped data, ResNet-18, no evaluation to speak of.
    "throughput": dict(
        model="resnet18",
        dataset="synthetic",
        image_size=32,
        synthetic_train=8192,
        synthetic_test=256,
        epochs=3,
        batch_size=256,
        lr=0.1,
        lr_base_batch=256,
        lr_schedule="constant",
        augment=False,
    ),
}


def preset(name: str, **overrides: Any) -> Config:
    """Return the named preset with `overrides` applied and derived values resolved."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; choose one of: {', '.join(PRESETS)}")
    values = dict(PRESETS[name])
    values.update(overrides)
    return resolve(Config(preset=name, **values))


def resolve(cfg: Config) -> Config:
    """Validate `cfg` and fill derived values (global batch of per-device presets)."""
    if cfg.batch_per_device > 0:
        cfg = cfg.replace(batch_size=cfg.batch_per_device * cfg.gpus)
    validate(cfg)
    return cfg


def validate(cfg: Config) -> None:
    """Raise ConfigError naming the first invalid value and how to fix it."""

    def choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
        if value not in allowed:
            raise ConfigError(f"unknown {name} {value!r}; choose one of: {', '.join(allowed)}")

    if cfg.framework:
        choice("framework", cfg.framework, FRAMEWORKS)
    choice("model", cfg.model, MODELS)
    choice("dataset", cfg.dataset, DATASETS)
    choice("lr-scaling", cfg.lr_scaling, LR_SCALINGS)
    choice("lr-schedule", cfg.lr_schedule, LR_SCHEDULES)
    choice("optimizer", cfg.optimizer, OPTIMIZERS)
    choice("bn", cfg.bn, BN_MODES)
    choice("precision", cfg.precision, PRECISIONS)
    if cfg.gpus < 1:
        raise ConfigError(f"--gpus must be >= 1 (got {cfg.gpus}); use --gpus 1 for one device")
    if cfg.epochs < 1:
        raise ConfigError(f"--epochs must be >= 1 (got {cfg.epochs})")
    if cfg.batch_size < 1 or cfg.eval_batch_size < 1:
        raise ConfigError("--batch-size and --eval-batch-size must be >= 1")
    per_device(cfg.batch_size, cfg.gpus)
    if not (cfg.lr > 0 and math.isfinite(cfg.lr)):
        raise ConfigError(f"--lr must be a positive number (got {cfg.lr})")
    if cfg.warmup_epochs < 0:
        raise ConfigError(f"--warmup-epochs must be >= 0 (got {cfg.warmup_epochs})")
    if cfg.width <= 0:
        raise ConfigError(f"--width must be > 0 (got {cfg.width})")
    if not 0 <= cfg.dropout < 1:
        raise ConfigError(f"--dropout must be in [0, 1) (got {cfg.dropout})")
    if not 0 <= cfg.target_accuracy <= 1:
        raise ConfigError(f"--target-accuracy must be in [0, 1] (got {cfg.target_accuracy})")
    if cfg.patience < 1:
        raise ConfigError(f"--patience must be >= 1 (got {cfg.patience})")
    if cfg.image_size < 0 or (cfg.image_size and cfg.image_size < 8):
        raise ConfigError(f"--image-size must be 0 (native) or >= 8 (got {cfg.image_size})")
    if cfg.resume and not cfg.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")


def per_device(global_batch: int, devices: int) -> int:
    """Split the global batch evenly over `devices`; one clear error when it does not divide."""
    if devices < 1:
        raise ConfigError(f"device count must be >= 1 (got {devices})")
    if global_batch % devices:
        lo = global_batch // devices * devices
        hi = lo + devices
        raise ConfigError(
            f"global batch {global_batch} does not divide over {devices} devices; "
            f"use --batch-size {lo or hi} or {hi}"
        )
    return global_batch // devices


def config_from_dict(values: dict[str, Any]) -> Config:
    """Rebuild a Config saved with `to_dict` (JSON turns tuples into lists)."""
    known = {f.name: f for f in dataclasses.fields(Config)}
    clean = {}
    for key, value in values.items():
        if key in known:
            clean[key] = tuple(value) if isinstance(value, list) else value
    return Config(**clean)


__all__ = [
    "BN_MODES",
    "DATASETS",
    "FRAMEWORKS",
    "LR_SCALINGS",
    "LR_SCHEDULES",
    "MODELS",
    "OPTIMIZERS",
    "PRECISIONS",
    "PRESETS",
    "Config",
    "ConfigError",
    "config_from_dict",
    "per_device",
    "preset",
    "resolve",
    "validate",
    "field",
]


# Settings that make a checkpoint belong to a run: resuming with any of them changed is refused.
RESUME_KEYS = (
    "model",
    "width",
    "dataset",
    "image_size",
    "synthetic_classes",
    "batch_size",
    "seed",
    "optimizer",
    "bn",
)


def check_same_run(saved: dict[str, Any], cfg: Config, path: str) -> None:
    """Raise ConfigError if checkpoint `path` (its saved config `saved`) is from another run."""
    diff = [
        f"--{k.replace('_', '-')} {saved.get(k)!r} (now {getattr(cfg, k)!r})"
        for k in RESUME_KEYS
        if saved.get(k) != getattr(cfg, k)
    ]
    if diff:
        raise ConfigError(
            f"checkpoint {path} is from another run: {', '.join(diff)}; "
            "resume with the same settings or use a new --checkpoint-dir"
        )
