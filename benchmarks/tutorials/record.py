"""One record per tutorial run, with the same timing definitions as `common.results.RunRecorder`.

`images_per_sec` is the training images of the epochs after the first divided by their summed
training seconds (the first epoch holds compilation and warm-up), exactly as in the trainers'
records, so `benchmarks.tutorial_loops` compares like with like. Training seconds end at the
framework's own sync (a tutorial that stops its clock before queued work finishes would
otherwise look faster than it is); evaluation is timed separately.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from common.config import Config
from common.results import host_info, versions, write_json_atomic


class TutorialRecorder:
    """Per-epoch bookkeeping for a tutorial loop; rank 0 prints and writes."""

    def __init__(
        self,
        cfg: Config,
        *,
        tutorial: str,
        source: str,
        deviations: tuple[str, ...],
        devices: int,
        device_kind: str,
        is_main: bool = True,
        packages: tuple[str, ...] = (),
        n_test: int | None = None,
    ):
        self.cfg = cfg
        self.tutorial = tutorial
        self.source = source
        self.deviations = deviations
        self.devices = devices
        self.device_kind = device_kind
        self.is_main = is_main
        self.packages = packages
        self.n_test = n_test
        self.epochs: list[dict[str, Any]] = []
        self.status = "ok"
        self.error = ""
        self.wall_start = time.perf_counter()

    def end_epoch(
        self, sec: float, images: int, eval_sec: float, test_correct: float, test_total: float
    ) -> None:
        row = {
            "epoch": len(self.epochs) + 1,
            "sec": float(sec),
            "images": int(images),
            "images_per_sec": images / sec if sec > 0 else 0.0,
            "eval_sec": float(eval_sec),
            "test_accuracy": float(test_correct) / max(1.0, float(test_total)),
            "test_examples": int(round(float(test_total))),
            "wall_sec": time.perf_counter() - self.wall_start,
        }
        self.epochs.append(row)
        if self.is_main:
            print(
                f"epoch {row['epoch']}/{self.cfg.epochs} sec={row['sec']:.3f} "
                f"images_per_sec={row['images_per_sec']:.1f} eval_sec={row['eval_sec']:.3f} "
                f"test_accuracy={row['test_accuracy']:.4f}",
                flush=True,
            )

    def fail(self, error: str) -> None:
        self.status = "failed"
        self.error = error

    def result(self) -> dict[str, Any]:
        timed = self.epochs[1:] or self.epochs  # the first epoch holds compile/warm-up
        secs = [e["sec"] for e in timed]
        images = sum(e["images"] for e in timed)
        last = self.epochs[-1] if self.epochs else {}
        return {
            "tutorial": self.tutorial,
            "source": self.source,
            "deviations": list(self.deviations),
            "compared_with": self.cfg.framework,
            "model": self.cfg.model,
            "dataset": self.cfg.dataset,
            "devices": self.devices,
            "device_kind": self.device_kind,
            "global_batch_size": self.cfg.batch_size,
            "epochs": self.epochs,
            "first_epoch_sec": self.epochs[0]["sec"] if self.epochs else None,
            "sec_per_epoch": statistics.median(secs) if secs else None,
            "images_per_sec": images / sum(secs) if secs and sum(secs) > 0 else None,
            "eval_sec_per_epoch": statistics.median(e["eval_sec"] for e in timed)
            if timed
            else None,
            "timed_epochs": len(timed) if len(self.epochs) > 1 else 0,
            "test_accuracy": last.get("test_accuracy"),
            "test_examples": last.get("test_examples"),
            "test_set_size": self.n_test,
            "wall_sec": time.perf_counter() - self.wall_start,
            "config": self.cfg.to_dict(),
            "versions": versions(self.packages),
            "host": host_info(),
            "command": [sys.executable, *sys.argv],
            "status": self.status,
            "error": self.error,
        }

    def finish(self) -> dict[str, Any]:
        """Build the record and, on rank 0, write it to `cfg.output` (atomically)."""
        record = self.result()
        if self.is_main and self.cfg.output:
            write_json_atomic(self.cfg.output, record)
        return record
