"""What every tutorial loop shares besides its loop: its run record and its option check.

The record is `common.results.RunRecorder`'s, so its timing definitions are the trainers' (the
first epoch, with compilation and warm-up, is not timed) and `benchmarks.tutorial_loops`
compares like with like. Training seconds end at the framework's own sync (a tutorial that
stops its clock before queued work finishes would otherwise look faster than it is); evaluation
is timed separately.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any, NamedTuple

from common.config import Config, ConfigError
from common.datasets import Dataset, check_available
from common.init import init_record
from common.pipeline import steps_per_epoch
from common.results import RunRecorder
from common.trainer import process_rank

# Fields of a trainer's record that a tutorial loop does not measure (it reads no loss).
NOT_MEASURED = "framework bn_mode test_loss time_to_target_sec epochs_to_target params"
NOT_MEASURED += " phases_ms_per_step"


class Tutorial(NamedTuple):  # what names a tutorial loop in its records
    name: str  # e.g. "d2l-torch"
    source: str  # the tutorial's title and address
    deviations: tuple[str, ...]  # where the rebuild differs from it, and why
    packages: tuple[str, ...]  # whose versions the record lists


class TutorialRecorder(RunRecorder):
    """Per epoch the training and evaluation seconds and the test accuracy (no losses: the
    tutorials do not read them); the record names the tutorial, its source and deviations."""

    def __init__(
        self,
        cfg: Config,
        tutorial: Tutorial,
        ds: Dataset | None = None,
        *,
        devices: int,
        device_kind: str,
        is_main: bool = True,
    ):
        super().__init__(
            cfg,
            devices=devices,
            device_kind=device_kind,
            params=0,
            is_main=is_main,
            packages=tutorial.packages,
            n_test=len(ds.test_x) if ds is not None else None,
            init=init_record(cfg, ds.channels, ds.num_classes) if ds is not None else None,
        )
        self.tutorial = tutorial

    def end_epoch(  # type: ignore[override]  # no losses, no early stop: the loop decides
        self, sec: float, images: int, eval_sec: float, test_correct: float, test_total: float
    ) -> None:
        total = float(test_total)
        self.add_epoch(
            {
                "epoch": len(self.epochs) + 1,
                "sec": float(sec),
                "images": int(images),
                "images_per_sec": images / sec if sec > 0 else 0.0,
                "eval_sec": float(eval_sec),
                "test_accuracy": float(test_correct) / max(1.0, total),
                "test_examples": int(round(total)),
                "wall_sec": self.elapsed(),
            }
        )
        row = self.epochs[-1]
        if self.is_main:
            print(
                f"epoch {row['epoch']}/{self.cfg.epochs} sec={row['sec']:.3f} "
                f"images_per_sec={row['images_per_sec']:.1f} eval_sec={row['eval_sec']:.3f} "
                f"test_accuracy={row['test_accuracy']:.4f}",
                flush=True,
            )

    def result(self) -> dict[str, Any]:
        record = super().result()
        for key in NOT_MEASURED.split():
            record.pop(key, None)
        timed = [e for e in self.epochs if e["timed"]] or self.epochs  # as RunRecorder
        return {
            "tutorial": self.tutorial.name,
            "source": self.tutorial.source,
            "deviations": list(self.tutorial.deviations),
            "compared_with": self.cfg.framework,
            **record,
            "eval_sec_per_epoch": statistics.median(e["eval_sec"] for e in timed)
            if timed
            else None,
        }


def failure_recorder(
    tutorial: Tutorial, *, devices: int | None = None, device_kind: str = "unknown"
) -> Callable[[Config, str], None]:
    """`on_failure` for `run_main`: a 'failed' record (rank 0) for a run that failed before its
    loop kept any epoch. `devices` defaults to --gpus."""

    def write(cfg: Config, error: str) -> None:
        n = cfg.gpus if devices is None else devices
        is_main = process_rank() == 0
        rec = TutorialRecorder(cfg, tutorial, devices=n, device_kind=device_kind, is_main=is_main)
        rec.fail(error)
        rec.finish()

    return write


def tutorial_steps(cfg: Config, n_train: int) -> int:
    """Steps per epoch; a global batch larger than the training set is one line (ConfigError)."""
    try:
        return steps_per_epoch(n_train, cfg.batch_size, cfg.max_steps_per_epoch)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def refuse_options(
    cfg: Config, loop: str, *extra: tuple[bool, str, str], early_stop: bool = False
) -> None:
    """Refuse what `loop` has no equivalent for (one ConfigError naming the fix), then check the
    dataset; `early_stop`: it stops at --target-accuracy; `extra`: (refused, option, fix) rows."""
    lr, target = cfg.lr_schedule, cfg.target_accuracy
    rows = [
        (cfg.precision != "fp32", f"--precision {cfg.precision}", "--precision fp32"),
        (cfg.optimizer != "sgd", f"--optimizer {cfg.optimizer}", "--optimizer sgd"),
        (lr != "constant", f"--lr-schedule {lr}", "--lr-schedule constant"),
        (cfg.warmup_epochs > 0, f"--warmup-epochs {cfg.warmup_epochs:g}", "--warmup-epochs 0"),
        (cfg.augment, "--augment", "--no-augment"),
        (bool(cfg.checkpoint_dir), "--checkpoint-dir/--resume", "a run without checkpoints"),
        (not early_stop and target > 0, f"--target-accuracy {target:g}", "--target-accuracy 0"),
        *extra,
    ]
    for refused, option, fix in rows:
        if refused:
            raise ConfigError(f"{option}: {loop} has no such option; use {fix}")
    check_available(cfg)
