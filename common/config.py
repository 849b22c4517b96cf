"""One typed, frozen run configuration with named presets.

`Config` is resolved once (preset, then command-line overrides, then derived values such as the
global batch of a per-device preset) and saved with every result. Nothing here parses arguments
at import time; `common.cli.parse_args` is the only parser.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from common.devices import CHOICES as DEVICE_CHOICES
from common.errors import ConfigError

FRAMEWORKS = ("torch-dp", "torch-ddp", "torch-fsdp", "jax-pmap", "jax-shard", "jax-shardmap",
              "jax-fsdp", "mxnet-gluon")  # fmt: skip
MODELS = ("resnet18", "wideresnet")
DATASETS = ("cifar10", "cifar100", "fashion-mnist", "digits", "synthetic")
LR_SCALINGS = ("none", "linear", "sqrt")
LR_SCHEDULES = ("constant", "step", "cosine")
OPTIMIZERS = ("sgd", "novograd")
BN_MODES = ("local", "sync")
PRECISIONS = ("fp32", "bf16", "fp16")
# torch.compile's modes. reduce-overhead and max-autotune add CUDA graphs: the compiled
# forward and backward each replayed in one launch, not one launch per kernel.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
CUDA_GRAPH_MODES = ("reduce-overhead", "max-autotune")
INIT_MODES = ("shared", "native")


def float_or_none(text: str) -> float | None:
    """Parse a float, or 'none' for None."""
    return None if text.lower() == "none" else float(text)


def int_tuple(text: str) -> tuple[int, ...]:
    """Parse a comma-separated list of ints ('' = empty)."""
    return tuple(int(t) for t in text.split(",") if t.strip())


def opt(
    default: Any,
    help: str,
    *,
    choices: tuple[str, ...] | None = None,
    parse: Callable[[str], Any] | None = None,
    hidden: bool = False,
    switch: bool = False,
) -> Any:
    """A Config field with its command-line documentation beside it; `common.cli` builds the flag.

    `help` is the flag's help text; `choices` the allowed values (also checked by `validate`);
    `parse` turns the flag's text into the value where the default's type cannot (int, float,
    str and bool are derived); `hidden` fields have no flag (set by presets, trainers or tests);
    `switch`: --name / --no-name for a field whose default is None (decided later: "auto").
    """
    meta = {"help": help, "choices": choices, "parse": parse, "hidden": hidden, "switch": switch}
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class Config:
    """Everything that determines a run. Field names match the command-line flags."""

    preset: str = opt("digits", "named preset", hidden=True)  # `--preset`, chosen first
    framework: str = opt("", "the trainer that runs this config (set by it)", hidden=True)
    # Model. `width` multiplies every channel count (1.0 = the published architecture); tests use
    # narrow models. `dropout` applies to the WideResNet only (0.01 in the NVIDIA course).
    model: str = opt("resnet18", "model architecture", choices=MODELS)
    width: float = opt(1.0, "channel-width multiplier (1.0 = the published model)")
    dropout: float = opt(0.01, "dropout between the two units of a WideResNet block")
    # Data. `image_size` 0 keeps the dataset's native size. `train_limit`/`test_limit` 0 = all.
    dataset: str = opt("digits", "dataset name", choices=DATASETS)
    data_dir: str = opt("data", "directory holding (or receiving) the dataset files")
    download: bool = opt(True, "download missing dataset files (verified by checksum) when online")
    verify: bool = opt(
        True,
        "check dataset files on disk against the published MD5 checksums (each hashed once, then "
        "remembered until the file changes); --no-verify skips it with a warning",
    )
    image_size: int = opt(0, "resize images to this side (0 = native size)")
    augment: bool = opt(True, "random pad-and-crop (+ horizontal flip where it makes sense)")
    train_limit: int = opt(0, "use only the first N training images (0 = all)")
    test_limit: int = opt(0, "use only the first N test images (0 = all)")
    synthetic_train: int = opt(50_000, "synthetic training images", hidden=True)
    synthetic_test: int = opt(10_000, "synthetic test images", hidden=True)
    synthetic_classes: int = opt(10, "synthetic classes", hidden=True)
    synthetic_channels: int = opt(3, "synthetic image channels", hidden=True)
    # Devices: GPUs where present, otherwise N simulated CPU devices.
    gpus: int = opt(1, "number of devices: GPUs where present, otherwise N simulated CPU devices")
    devices: str = opt(
        "auto",
        "where the devices are: auto (the GPUs where this framework sees them, else simulated CPU "
        "devices), cpu (simulated CPU devices, also on a GPU machine), cuda (GPUs; refused when "
        "the framework sees none). Default: $DPBENCH_DEVICES, else auto",
        choices=DEVICE_CHOICES,
    )
    # Optimisation. `batch_size` is the GLOBAL batch; a preset may instead fix the per-device
    # batch (`batch_per_device` > 0), and the global batch then grows with the device count.
    epochs: int = opt(10, "number of epochs")
    batch_size: int = opt(128, "GLOBAL batch size (split evenly over the devices)")
    batch_per_device: int = opt(
        0, "fix the per-device batch instead (global = this x devices; 0 = off)"
    )
    eval_batch_size: int = opt(256, "global batch size for evaluation")
    lr: float = opt(0.1, "learning rate at --lr-base-batch images per step")
    lr_base_batch: int = opt(128, "global batch at which --lr is given (for --lr-scaling)")
    lr_scaling: str = opt(
        "none", "scale the LR with global batch / base batch", choices=LR_SCALINGS
    )
    lr_schedule: str = opt("cosine", "LR schedule after warm-up", choices=LR_SCHEDULES)
    lr_step_epochs: tuple[int, ...] = opt(
        (),
        "comma-separated epochs at which the step schedule multiplies the LR by --lr-step-factor",
        parse=int_tuple,
    )
    lr_step_factor: float = opt(0.1, "LR multiplier at each of --lr-step-epochs")
    warmup_epochs: float = opt(0.0, "linear LR warm-up length in epochs")
    # Warm-up starts at lr * warmup_start_factor; None = the unscaled (1-device) LR, i.e. 1/N of a
    # linearly scaled LR (Goyal et al., the NVIDIA course).
    warmup_start_factor: float | None = opt(
        0.0, "warm-up starts at LR x this ('none' = the unscaled 1-device LR)", parse=float_or_none
    )
    optimizer: str = opt("sgd", "optimiser", choices=OPTIMIZERS)
    momentum: float = opt(0.9, "SGD momentum (0 = plain SGD)")
    nesterov: bool = opt(False, "Nesterov momentum for SGD (needs --momentum > 0)")
    weight_decay: float = opt(5e-4, "weight decay (conv and linear weights only)")
    # Weight decay applies to conv and linear weights only, never to BN scales/offsets or biases.
    label_smoothing: float = opt(0.0, "label smoothing of the cross-entropy loss (0 = off)")
    novograd_betas: tuple[float, float] = opt((0.95, 0.98), "NovoGrad (beta1, beta2)", hidden=True)
    # BatchNorm, in torch's convention: running = (1 - momentum) * running + momentum * batch.
    # (Flax and Gluon call 1 - momentum "momentum": 0.9.)
    bn: str = opt(
        "local",
        "BatchNorm statistics: per device (local) or over the global batch (sync)",
        choices=BN_MODES,
    )
    bn_momentum: float = opt(0.1, "BatchNorm running-average momentum in torch's convention")
    bn_eps: float = opt(1e-5, "BatchNorm epsilon added to the variance")
    # Run control.
    seed: int = opt(0, "random seed (weights, data order, augmentation)")
    # Initial weights: `shared` = drawn once with numpy (common/init.py) and loaded by every
    # framework, so every framework starts from the same point; `native` = the framework's own
    # generator (different weights for the same seed).
    init: str = opt(
        "shared",
        "initial weights: the same arrays in every framework (shared) or the framework's own "
        "generator (native)",
        choices=INIT_MODES,
    )
    target_accuracy: float = opt(
        0.0, "stop once test accuracy reaches this for --patience epochs (0 = off)"
    )
    patience: int = opt(1, "epochs --target-accuracy must hold before the run stops")
    max_steps_per_epoch: int = opt(0, "cap the training steps per epoch (0 = the whole epoch)")
    output: str = opt("", "write the run-result JSON here")
    tensorboard: str = opt(
        "",
        "write TensorBoard event files here (process 0, once per epoch: losses, accuracy, "
        "images/s, epoch time, LR; the config and environment as text)",
    )
    checkpoint_dir: str = opt("", "save a checkpoint here after every epoch")
    save_state: str = opt(
        "",
        "write the final parameters and BN running statistics here (.npz in torch's names and "
        "layouts, the same in every framework; benchmarks.parity compares them)",
    )
    resume: bool = opt(False, "continue from the latest checkpoint in --checkpoint-dir")
    log_every: int = opt(0, "print training metrics every N steps (0 = per epoch only)")
    phase_timing: bool = opt(
        False, "measure data / transfer / compute / communication / update time per phase"
    )
    profile: int = opt(
        0,
        "record STEPS training steps of the first epoch (after 3 warm-up steps) with the "
        "framework's own profiler; the trace's path and the step's breakdown (compute, "
        "communication, exposed communication, input wait, host gaps) go into the record "
        "(0 = off; docs/profiling.md)",
    )
    profile_dir: str = opt(
        "",
        "where --profile writes its traces (default: beside the run's record, <name>.profile/, "
        "else ./profile/<framework>-<gpus>gpu/)",
    )
    prefetch: int = opt(2, "batches prepared ahead by the background loader")
    pipeline: str = opt(
        "auto",
        "where training batches are made: host (numpy crops and flips on a prefetch thread, "
        "copied to the devices every step), device (the uint8 training set copied to every "
        "device once; each step's crops gathered there from the same host-drawn order and "
        "crops; at most 4 GiB of images), auto (device on GPUs when the training set fits, "
        "host otherwise and on CPUs)",
        choices=("auto", "host", "device"),
    )
    collective_timeout: float = opt(
        300.0,
        "seconds a process waits for the others (rendezvous, all-reduce) before the run fails "
        "naming the rank that did not answer (torch-ddp, multi-process JAX)",
    )
    compile_cache: bool = opt(
        True,
        "JAX: keep compiled XLA programs in --cache-dir, so that a second run of the same "
        "configuration does not compile again (safe for concurrent runs)",
    )
    cache_dir: str = opt(
        "~/.cache/dp-bench",
        "where the JAX compilation cache lives: <cache-dir>/jax (JAX_COMPILATION_CACHE_DIR, if "
        "set, wins)",
    )
    # Fast paths: mixed precision, torch.compile and TF32 (CUDA), channels-last (torch, CUDA and
    # CPU), XLA:CPU's YNNPACK kernels (JAX on CPU). Every record's `execution` names the path.
    precision: str = opt("fp32", "CUDA: fp32, or mixed precision bf16 / fp16", choices=PRECISIONS)
    channels_last: bool | None = opt(
        None,
        "channels-last (NHWC) memory format for torch's images and conv weights, or NCHW "
        "(--no-channels-last). Same values. Default: on CUDA (cuDNN's fast path), NCHW on a CPU "
        "(oneDNN's channels-last crashed torch 2.11 on a Xeon with 'double free or corruption', "
        "docs/results/h200-20261128; it gained 0.96-1.17x where it ran)",
        switch=True,
    )
    compile: bool = opt(False, "CUDA: torch.compile the model (torch)")
    compile_mode: str = opt(
        "default",
        "with --compile: torch.compile's mode; reduce-overhead replays the compiled forward and "
        "backward as CUDA graphs (1.5x the default mode's loop on one H100 at bf16; measured on "
        "one GPU only, docs/performance.md)",
        choices=COMPILE_MODES,
    )
    xla_cpu_ynn: bool | None = opt(
        None,
        "JAX on CPU: XLA's YNNPACK kernels for its dot, elementwise and reduction fusions, or "
        "XLA's own code (--no-xla-cpu-ynn). Same values to rounding. Default: YNNPACK, except "
        "for images under 32x32 on several simulated devices, where XLA's own code measured "
        "faster (docs/performance.md)",
        switch=True,
    )
    reshard_after_forward: bool = opt(
        True,
        "torch-fsdp: free each block's gathered parameters after its forward and all-gather them "
        "again for its backward (ZeRO-3), or keep them until then (--no-reshard-after-forward: "
        "ZeRO-2's traffic, more memory)",
    )
    tf32: bool = opt(
        False,
        "CUDA: TF32 for float32 matmuls and convolutions in every framework alike (default off: "
        "full fp32 everywhere)",
    )

    def replace(self, **changes: Any) -> Config:
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


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
    for f in dataclasses.fields(cfg):
        if f.metadata.get("choices"):
            choice(f.name.replace("_", "-"), getattr(cfg, f.name), f.metadata["choices"])
    _check_ranges(cfg)
    per_device(cfg.batch_size, cfg.gpus)
    if cfg.resume and not cfg.checkpoint_dir:
        raise ConfigError("--resume needs --checkpoint-dir DIR (where the checkpoints are)")
    if cfg.compile_mode != "default" and not cfg.compile:
        raise ConfigError(f"--compile-mode {cfg.compile_mode} needs --compile")
    if cfg.profile and cfg.phase_timing:
        raise ConfigError(
            "--profile and --phase-timing contradict each other: phase timing syncs the device "
            "at every phase, so the trace would show a serialised step; give only one"
        )
    if cfg.nesterov and cfg.momentum <= 0 and cfg.optimizer == "sgd":
        raise ConfigError("--nesterov needs --momentum > 0")
    if not (math.isfinite(cfg.collective_timeout) and 1 <= cfg.collective_timeout <= 86400):
        raise ConfigError(
            f"--collective-timeout must be between 1 and 86400 seconds (got "
            f"{cfg.collective_timeout}); the default is 300"
        )
    _check_sizes(cfg)


# Hard caps, far above any sensible run and low enough that a typo fails at once rather than in
# a MemoryError (or 1000 started processes) minutes later.
MAX_DEVICES = 64
MAX_PROFILE = 1000  # profiled steps: a trace of more is too big to read
MAX_WIDTH = 8.0  # ResNet-18 at width 8: 0.7G parameters
MAX_IMAGE_SIZE = 512
MAX_EPOCHS = 100_000
MAX_SEED = 2**32 - 1  # numpy's and JAX's seeds are 32-bit
# (test images, native side, channels) of each dataset, for the size checks before any run.
DATA_SHAPES = {
    "cifar10": (10_000, 32, 3),
    "cifar100": (10_000, 32, 3),
    "fashion-mnist": (10_000, 28, 1),
    "digits": (360, 8, 1),
}
# Training-set sizes (before --train-limit), known without reading a file: a runner rejects a
# global batch larger than the training set before it starts any run.
TRAIN_SIZES = {"cifar10": 50_000, "cifar100": 50_000, "fashion-mnist": 60_000,
               "digits": 1797 - DATA_SHAPES["digits"][0]}  # fmt: skip


def train_size(cfg: Config) -> int:
    """Training images a run of `cfg` sees per epoch (synthetic: --synthetic-train)."""
    n = cfg.synthetic_train if cfg.dataset == "synthetic" else TRAIN_SIZES[cfg.dataset]
    return min(n, cfg.train_limit or n)


def _check_ranges(cfg: Config) -> None:
    """Every number in range: one line naming the flag, the range and the value."""

    def finite(x: Any) -> bool:
        return isinstance(x, (int, float)) and math.isfinite(x)

    def unit(x: Any) -> bool:  # in [0, 1)
        return finite(x) and 0 <= x < 1

    wsf = cfg.warmup_start_factor
    checks = [  # (field, in range, the range), the first that fails is named
        ("gpus", cfg.gpus >= 1, ">= 1; use --gpus 1 for one device"),
        ("gpus", cfg.gpus <= MAX_DEVICES, f"<= {MAX_DEVICES}"),
        ("profile", 0 <= cfg.profile <= MAX_PROFILE, f"in [0, {MAX_PROFILE}] steps"),
        ("epochs", 1 <= cfg.epochs <= MAX_EPOCHS, f"in [1, {MAX_EPOCHS}]"),
        ("batch_size", cfg.batch_size >= 1, ">= 1"),
        ("eval_batch_size", cfg.eval_batch_size >= 1, ">= 1"),
        ("batch_per_device", cfg.batch_per_device >= 0, ">= 0 (0 = off)"),
        ("lr", finite(cfg.lr) and cfg.lr > 0, "a positive number"),
        ("lr_base_batch", cfg.lr_base_batch >= 1, ">= 1"),
        ("lr_step_factor", finite(cfg.lr_step_factor) and cfg.lr_step_factor > 0,
         "a positive number"),
        ("lr_step_epochs", all(e >= 1 for e in cfg.lr_step_epochs), "epochs >= 1"),
        ("warmup_epochs", finite(cfg.warmup_epochs) and 0 <= cfg.warmup_epochs <= MAX_EPOCHS,
         f"in [0, {MAX_EPOCHS}]"),
        ("warmup_start_factor", wsf is None or (finite(wsf) and wsf >= 0),
         "a number >= 0 or 'none'"),
        ("momentum", unit(cfg.momentum), "in [0, 1)"),
        ("weight_decay", unit(cfg.weight_decay), "in [0, 1)"),
        ("label_smoothing", unit(cfg.label_smoothing), "in [0, 1)"),
        ("novograd_betas", all(unit(b) for b in cfg.novograd_betas), "in [0, 1)"),
        ("bn_momentum", finite(cfg.bn_momentum) and 0 <= cfg.bn_momentum <= 1, "in [0, 1]"),
        ("bn_eps", finite(cfg.bn_eps) and 0 < cfg.bn_eps < 1, "in (0, 1)"),
        ("width", finite(cfg.width) and 0 < cfg.width <= MAX_WIDTH,
         f"in (0, {MAX_WIDTH:g}] (1 = the published model)"),
        ("dropout", unit(cfg.dropout), "in [0, 1)"),
        ("target_accuracy", finite(cfg.target_accuracy) and 0 <= cfg.target_accuracy <= 1,
         "in [0, 1]"),
        ("patience", cfg.patience >= 1, ">= 1"),
        ("seed", 0 <= cfg.seed <= MAX_SEED, f"in [0, {MAX_SEED}]"),
        ("image_size", cfg.image_size == 0 or 8 <= cfg.image_size <= MAX_IMAGE_SIZE,
         f"0 (native) or in [8, {MAX_IMAGE_SIZE}]"),
        *((n, getattr(cfg, n) >= 0, ">= 0 (0 = off)")
          for n in ("train_limit", "test_limit", "max_steps_per_epoch", "log_every")),
        ("prefetch", 0 <= cfg.prefetch <= 64, "in [0, 64]"),
        *((n, getattr(cfg, n) >= 1, ">= 1")
          for n in ("synthetic_train", "synthetic_test", "synthetic_channels")),
        ("synthetic_classes", cfg.synthetic_classes >= 2, ">= 2"),
    ]  # fmt: skip
    for name, ok, rule in checks:
        if not ok:
            value = getattr(cfg, name)
            if name == "lr_step_epochs":
                value = ",".join(map(str, value))
            raise ConfigError(f"--{name.replace('_', '-')} must be {rule} (got {value})")


def data_dims(cfg: Config) -> tuple[int, int]:
    """(channels, classes) of `cfg`'s dataset, known before any file is read."""
    if cfg.dataset not in DATA_SHAPES:
        return cfg.synthetic_channels, cfg.synthetic_classes
    return DATA_SHAPES[cfg.dataset][2], 100 if cfg.dataset == "cifar100" else 10


def image_side(cfg: Config) -> int:
    """The side of the images a run trains on: --image-size, else the dataset's own."""
    return cfg.image_size or DATA_SHAPES.get(cfg.dataset, (0, 32, 0))[1]


def _check_sizes(cfg: Config) -> None:
    """What the dataset can hold, known before any file is read: a global batch no larger than
    the training set. (What the machine can hold: common/memory.py's check_machine.)"""
    n_train = train_size(cfg)
    if cfg.batch_size > n_train:
        most = max(cfg.gpus, n_train // cfg.gpus * cfg.gpus)
        raise ConfigError(
            f"global batch {cfg.batch_size} is larger than the {cfg.dataset} training set "
            f"({n_train} images), so no step could run; use --batch-size {most} or less"
        )


def per_device(global_batch: int, devices: int) -> int:
    """Split the global batch evenly over `devices`; one clear error when it does not divide."""
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
    clean: dict[str, Any] = {}
    for key, value in values.items():
        if key in known:
            clean[key] = tuple(value) if isinstance(value, list) else value
    return Config(**clean)


# Settings that make a checkpoint belong to a run: resuming with any of them changed is refused
# (the trainer, the model, the data and its order, the devices, every hyper-parameter of the
# update and of the LR schedule, the test set, and every setting that changes how fast a step
# runs: a resumed run must be the run it continues, and its record says so; the devices' kind,
# the library versions and the execution mode are checked at load time, common/trainer.py).
# --epochs may grow, except under the cosine schedule, which spans --epochs. Where results go,
# when to log or stop, and the caches (the first epoch of every process is untimed) may change.
RESUME_KEYS = tuple(
    "framework model width dropout dataset image_size augment train_limit test_limit "
    "synthetic_train synthetic_test synthetic_classes synthetic_channels gpus batch_size "
    "eval_batch_size max_steps_per_epoch seed init optimizer lr lr_base_batch lr_scaling "
    "lr_schedule lr_step_epochs lr_step_factor warmup_epochs warmup_start_factor momentum "
    "nesterov weight_decay label_smoothing novograd_betas bn bn_momentum bn_eps precision tf32 "
    "channels_last compile compile_mode xla_cpu_ynn reshard_after_forward pipeline prefetch "
    "phase_timing".split()
)


def check_same_run(saved: dict[str, Any], cfg: Config, path: str) -> None:
    """Raise ConfigError if checkpoint `path` (its saved config `saved`) is from another run,
    naming every setting that differs (a setting it lacks differs too)."""

    def same(value: Any, now: Any) -> bool:  # JSON keeps tuples as lists
        return (tuple(value) if isinstance(value, list) else value) == now

    keys = list(RESUME_KEYS)
    if cfg.lr_schedule == "cosine":
        keys.append("epochs")
    missing = object()
    diff = [
        f"--{k.replace('_', '-')} {saved.get(k, 'unset')!r} (now {getattr(cfg, k)!r})"
        for k in keys
        if saved.get(k, missing) is missing or not same(saved[k], getattr(cfg, k))
    ]
    if diff:
        raise ConfigError(
            f"checkpoint {path} is from another run: {', '.join(diff)}; "
            "resume with the same settings or use a new --checkpoint-dir"
        )
