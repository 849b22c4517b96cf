"""The one command line shared by every `python -m frameworks.<name>` (and passed through by the
benchmark runner). Parsing happens only when `parse_args` is called, never at import time.

Bad values give one line, `<prog>: error: <problem and fix>`, and exit code 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Collection, Sequence
from typing import Any, NoReturn

from common.config import (
    BN_MODES,
    DATASETS,
    LR_SCALINGS,
    LR_SCHEDULES,
    MODELS,
    OPTIMIZERS,
    PRECISIONS,
    PRESETS,
    Config,
    ConfigError,
    preset,
)

HELP: dict[str, str] = {
    "model": "model architecture",
    "width": "channel-width multiplier (1.0 = the published model)",
    "dropout": "dropout between the two units of a WideResNet block",
    "dataset": "dataset name",
    "data_dir": "directory holding (or receiving) the dataset files",
    "download": "download missing dataset files (verified by checksum) when online",
    "image_size": "resize images to this side (0 = native size)",
    "augment": "random pad-and-crop (+ horizontal flip where it makes sense)",
    "train_limit": "use only the first N training images (0 = all)",
    "test_limit": "use only the first N test images (0 = all)",
    "gpus": "number of devices: GPUs where present, otherwise N simulated CPU devices",
    "epochs": "number of epochs",
    "batch_size": "GLOBAL batch size (split evenly over the devices)",
    "batch_per_device": "fix the per-device batch instead (global = this x devices; 0 = off)",
    "eval_batch_size": "global batch size for evaluation",
    "lr": "learning rate at --lr-base-batch images per step",
    "lr_base_batch": "global batch at which --lr is given (for --lr-scaling)",
    "lr_scaling": "scale the LR with global batch / base batch",
    "lr_schedule": "LR schedule after warm-up",
    "lr_step_epochs": "epochs at which the step schedule multiplies the LR by --lr-step-factor",
    "warmup_epochs": "linear LR warm-up length in epochs",
    "warmup_start_factor": "warm-up starts at LR x this ('none' = the unscaled 1-device LR)",
    "optimizer": "optimiser",
    "bn": "BatchNorm statistics: per device (local) or over the global batch (sync)",
    "bn_momentum": "BatchNorm running-average momentum in torch's convention",
    "seed": "random seed (weights, data order, augmentation)",
    "target_accuracy": "stop once test accuracy reaches this for --patience epochs (0 = off)",
    "max_steps_per_epoch": "cap the training steps per epoch (0 = the whole epoch)",
    "output": "write the run-result JSON here",
    "checkpoint_dir": "save a checkpoint here after every epoch",
    "resume": "continue from the latest checkpoint in --checkpoint-dir",
    "log_every": "print training metrics every N steps (0 = per epoch only)",
    "phase_timing": "measure data / transfer / compute / communication / update time per phase",
    "prefetch": "batches prepared ahead by the background loader",
    "precision": "CUDA: fp32, or mixed precision bf16 / fp16",
    "channels_last": "CUDA: channels-last memory format (torch)",
    "compile": "CUDA: torch.compile the model (torch)",
}
CHOICES: dict[str, tuple[str, ...]] = {
    "model": MODELS,
    "dataset": DATASETS,
    "lr_scaling": LR_SCALINGS,
    "lr_schedule": LR_SCHEDULES,
    "optimizer": OPTIMIZERS,
    "bn": BN_MODES,
    "precision": PRECISIONS,
}
HIDDEN = {
    "preset",
    "framework",
    "synthetic_train",
    "synthetic_test",
    "synthetic_classes",
    "synthetic_channels",
    "novograd_betas",
}


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, exit 2
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def _float_or_none(text: str) -> float | None:
    return None if text.lower() == "none" else float(text)


def _int_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(t) for t in text.split(",") if t.strip())


def build_parser(prog: str, exclude: Collection[str] = ()) -> argparse.ArgumentParser:
    """The shared flags; `exclude` leaves out fields a caller sets itself (the benchmark runner
    owns --gpus and --output)."""
    parser = _Parser(prog=prog, description="Train an image classifier with data parallelism.")
    parser.add_argument("--preset", default="digits", help=f"named preset: {', '.join(PRESETS)}")
    for f in dataclasses.fields(Config):
        if f.name in HIDDEN or f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        kwargs: dict[str, Any] = dict(default=argparse.SUPPRESS, help=HELP.get(f.name, f.name))
        if f.type in ("bool",):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "warmup_start_factor":
            kwargs["type"] = _float_or_none
        elif f.name == "lr_step_epochs":
            kwargs["type"] = _int_tuple
        elif f.type == "int":
            kwargs["type"] = int
        elif f.type == "float":
            kwargs["type"] = float
        if f.name in CHOICES:
            kwargs["choices"] = CHOICES[f.name]
        parser.add_argument(flag, dest=f.name, **kwargs)
    return parser


def parse_args(argv: Sequence[str] | None, framework: str, prog: str | None = None) -> Config:
    """Parse the shared command line into a resolved Config (exit 2 with one line on bad input)."""
    prog = prog or f"python -m frameworks.{framework.replace('-', '_')}"
    parser = build_parser(prog)
    ns = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    overrides = {k: v for k, v in vars(ns).items() if k != "preset"}  # only flags given
    if "batch_size" in overrides:  # an explicit global batch wins over a per-device preset
        overrides.setdefault("batch_per_device", 0)
    try:
        return preset(ns.preset, framework=framework, **overrides)
    except ConfigError as exc:
        parser.error(str(exc))
