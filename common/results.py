"""The run-result record: one JSON per run, written atomically by rank 0 only.

`RunRecorder` collects per-epoch figures as a framework's `train()` goes, decides early stops
(target accuracy held for `patience` epochs, divergence), prints one line per epoch (rank 0 only,
in a fixed `key=value` format the benchmark runner parses) and builds the final record.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from importlib import metadata
from typing import Any

import numpy as np

from common import devices
from common.config import Config
from common.errors import WriteFailed
from common.runtime import atomic_write_bytes
from common.schedule import lr_table_for
from common.tensorboard import EventLog


def write_json_atomic(path: str | os.PathLike[str], obj: Any) -> None:
    """Write `obj` as JSON to `path` via a temporary file and rename: never half-written, no
    temporary file left behind when the write fails, the same file mode as the logs."""
    text = json.dumps(obj, indent=2, sort_keys=False, default=_json_default) + "\n"
    atomic_write_bytes(path, text.encode())


def _json_default(o: Any) -> Any:
    if hasattr(o, "tolist"):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def versions(packages: tuple[str, ...] = ()) -> dict[str, str]:
    """Versions of python, numpy and `packages`, read from package metadata (no imports)."""
    out = {"python": platform.python_version()}
    for name in ("numpy", *packages):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def host_info() -> dict[str, Any]:
    """CPU model and count, and GPU names and driver where nvidia-smi answers."""
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        info["cpu"] = platform.processor()
    if shutil.which("nvidia-smi"):
        try:
            query = ["--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"]
            out = subprocess.run(["nvidia-smi", *query], capture_output=True, text=True,
                                 timeout=20).stdout  # fmt: skip
            rows = [r.split(", ") for r in out.strip().splitlines() if r.strip()]
            info["gpus"] = [r[0] for r in rows]
            if rows:
                info["driver"] = rows[0][1]
                info["gpu_memory"] = rows[0][2] if len(rows[0]) > 2 else ""
        except (OSError, subprocess.SubprocessError):
            pass
    return info


def timing_summary(epochs: list[dict[str, Any]]) -> dict[str, Any]:
    """The timing fields of a record, by the one rule (common/timing.py, TIMING_RULE): over the
    timed epochs, `sec_per_epoch` = timed seconds / timed epochs and `images_per_sec` = timed
    images / timed seconds; medians and per-epoch ranges as extra fields. With no timed epoch
    (a one-epoch run) the figures fall back to every epoch and `timed_epochs` is 0."""
    timed = [e for e in epochs if e.get("timed", e["epoch"] > 1)]
    used = timed or epochs
    secs = [e["sec"] for e in used]
    rates = [e["images"] / e["sec"] for e in used if e["sec"] > 0]
    total = sum(secs)
    return {
        "first_epoch_sec": epochs[0]["sec"] if epochs else None,
        "sec_per_epoch": total / len(secs) if secs else None,
        "images_per_sec": sum(e["images"] for e in used) / total if total > 0 else None,
        "timed_epochs": len(timed),
        "sec_per_epoch_median": statistics.median(secs) if secs else None,
        "sec_per_epoch_min": min(secs) if secs else None,
        "sec_per_epoch_max": max(secs) if secs else None,
        "images_per_sec_min": min(rates) if rates else None,
        "images_per_sec_max": max(rates) if rates else None,
    }


def load_average() -> float | None:
    """The host's 1-minute load average (None where the OS has none)."""
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None


class RunRecorder:
    """Per-epoch bookkeeping shared by every framework's `train()`."""

    def __init__(
        self,
        cfg: Config,
        *,
        devices: int,
        device_kind: str,
        params: int,
        is_main: bool,
        packages: tuple[str, ...] = (),
        bn_mode: str | None = None,
        n_test: int | None = None,
        init: dict[str, Any] | None = None,
    ):
        self.cfg = cfg
        self.devices = devices
        self.device_kind = device_kind
        self.params = params
        self.is_main = is_main
        self.packages = packages
        self.bn_mode = bn_mode or cfg.bn
        self.n_test = n_test
        self.init = init or {"mode": None, "sha256": None, "file": None}
        self.epochs: list[dict[str, Any]] = []
        self.status = "ok"
        self.error = ""
        self.time_to_target: float | None = None
        self.epochs_to_target: int | None = None
        self.wall_start = time.perf_counter()
        self.load_start = load_average()
        self.elapsed_before = 0.0  # wall time of earlier (resumed-from) processes
        self.phases: dict[str, float] = {}
        self.extra: dict[str, Any] = {}
        self.epochs_this_process = 0  # the first epoch of every process is untimed
        self._host: tuple[dict[str, str], dict[str, Any]] | None = None  # see _about_host
        # How the run executed, set by the trainer (common.runtime.threads_record; e.g. "eager",
        # "jit", "hybridized"; the float32 matmul/conv precision on CUDA).
        self.threads: dict[str, Any] | None = None
        self.execution: str | None = None
        self.float32_precision: str | None = None
        self.pipeline: str | None = None  # common.pipeline.pipeline_record
        # What one device keeps between steps and sends per step (common/footprint.py).
        self.state_bytes: dict[str, int] | None = None
        self.collective_bytes: dict[str, Any] | None = None
        # What the step ran, read from the run (never copied from a flag): the activations'
        # dtype, the input's memory format, the execution mode ({"activation_dtype", ...}).
        self.ran: dict[str, str] | None = None
        # --tensorboard: process 0's event file, written per epoch from the rows below.
        self.tensorboard = EventLog(cfg, self.environment) if is_main and cfg.tensorboard else None
        # Where finish() writes the record; torch-ddp's spawned workers leave it to the parent.
        self.output = cfg.output
        self._lr: np.ndarray | None = None  # the run's LR of every step (see epoch_lr)

    def add_epoch(self, row: dict[str, Any]) -> dict[str, Any]:
        """Append one epoch's row, marked `timed` unless it is this process's first epoch (it
        holds compilation and warm-up, also after --resume: TIMING_RULE in common/timing.py)."""
        row["timed"] = self.epochs_this_process > 0
        self.epochs_this_process += 1
        self.epochs.append(row)
        return row

    # -- per epoch ----------------------------------------------------------------------------
    def end_epoch(
        self,
        epoch: int,
        sec: float,
        images: int,
        train_loss: float,
        test_correct: float,
        test_total: float,
        test_loss_sum: float,
    ) -> bool:
        """Record one epoch; return True when training should stop (target held, diverged)."""
        total = max(1.0, float(test_total))
        row = {
            "epoch": epoch + 1,
            "sec": float(sec),
            "images": int(images),
            "images_per_sec": images / sec if sec > 0 else 0.0,
            "train_loss": float(train_loss),
            "test_accuracy": float(test_correct) / total,
            "test_loss": float(test_loss_sum) / total,
            "test_examples": int(round(float(test_total))),
            "wall_sec": self.elapsed(),
            **self.epoch_lr(epoch, images),
        }
        self.add_epoch(row)
        if self.tensorboard is not None:
            self.tensorboard.epoch(row)
        if self.is_main:
            print(
                f"epoch {row['epoch']}/{self.cfg.epochs} sec={row['sec']:.3f} "
                f"images_per_sec={row['images_per_sec']:.1f} train_loss={row['train_loss']:.4f} "
                f"test_accuracy={row['test_accuracy']:.4f} test_loss={row['test_loss']:.4f}",
                flush=True,
            )
        if not math.isfinite(row["train_loss"]):
            self.status = "diverged"
            if self.is_main:
                print(
                    f"diverged: train loss {row['train_loss']} at epoch {row['epoch']}", flush=True
                )
            return True
        target = self.cfg.target_accuracy
        if target > 0 and self.time_to_target is None and row["test_accuracy"] >= target:
            self.time_to_target = float(row["wall_sec"])
            self.epochs_to_target = int(row["epoch"])
        # the target held for the last `patience` epochs (target 0: never)
        recent = [e["test_accuracy"] for e in self.epochs[-self.cfg.patience :]]
        return target > 0 and len(recent) >= self.cfg.patience and min(recent) >= target

    def epoch_lr(self, epoch: int, images: int) -> dict[str, float]:
        """The LR of epoch `epoch`'s (0-based) first and last step, from the schedule every
        trainer indexes by its global step (common.schedule.lr_table_for). Kept in each epoch's
        row, so a resumed run's record holds the LR history of every process."""
        steps = max(1, images // self.cfg.batch_size)
        if self._lr is None or len(self._lr) != self.cfg.epochs * steps:
            self._lr = lr_table_for(self.cfg, steps)
        first, last = epoch * steps, min((epoch + 1) * steps, len(self._lr)) - 1
        if not 0 <= first <= last:
            return {}
        return {"lr": float(self._lr[first]), "lr_last": float(self._lr[last])}

    def elapsed(self) -> float:
        return self.elapsed_before + time.perf_counter() - self.wall_start

    def fail(self, error: str) -> None:
        self.status = "failed"
        self.error = error

    def interrupt(self, error: str) -> None:
        """SIGTERM / SIGINT: the epochs so far stay, the record says "interrupted"."""
        self.status = "interrupted"
        self.error = error

    # -- checkpoint support ---------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        return {
            "epochs": self.epochs,
            "elapsed": self.elapsed(),
            "time_to_target": self.time_to_target,
            "epochs_to_target": self.epochs_to_target,
        }

    def load_state(self, state: dict[str, Any]) -> None:
        self.epochs = list(state["epochs"])
        self.elapsed_before = float(state["elapsed"])
        self.wall_start = time.perf_counter()
        self.time_to_target = state.get("time_to_target")
        self.epochs_to_target = state.get("epochs_to_target")

    # -- the record -------------------------------------------------------------------------------
    def result(self) -> dict[str, Any]:
        last = self.epochs[-1] if self.epochs else {}
        return {
            "framework": self.cfg.framework,
            "model": self.cfg.model,
            "dataset": self.cfg.dataset,
            "devices": self.devices,
            "device_kind": self.device_kind,
            "device_choice": devices.record(self.cfg.devices),  # --devices and CUDA's variables
            "bn_mode": self.bn_mode,
            "global_batch_size": self.cfg.batch_size,
            "epochs": self.epochs,
            **timing_summary(self.epochs),
            "test_accuracy": last.get("test_accuracy"),
            "test_loss": last.get("test_loss"),
            "test_examples": last.get("test_examples"),
            "test_set_size": self.n_test,
            # The host's 1-minute load average when this process started and now: a timing
            # taken while other work held the cores says so in its own record.
            "load_avg": {"start": self.load_start, "end": load_average(), "cores": os.cpu_count()},
            "init": self.init,
            "threads": self.threads,
            "execution": self.execution,
            "float32_precision": self.float32_precision,
            "ran": self.ran,
            "pipeline": self.pipeline,
            "state_bytes_per_device": self.state_bytes,
            "collective_bytes_per_step": self.collective_bytes,
            "time_to_target_sec": self.time_to_target,
            "epochs_to_target": self.epochs_to_target,
            "wall_sec": self.elapsed(),
            "params": self.params,
            "phases_ms_per_step": self.phases,
            "config": self.cfg.to_dict(),
            "versions": self._about_host()[0],
            "host": self._about_host()[1],
            "command": [sys.executable, *sys.argv],
            "status": self.status,
            "error": self.error,
            **self.extra,
        }

    def environment(self) -> dict[str, Any]:
        """How the run executed (the same facts as its record): --tensorboard's text."""
        record = self.result()
        keys = "framework devices device_kind threads execution float32_precision pipeline"
        return {k: record[k] for k in (*keys.split(), "versions", "host", "command")}

    def _about_host(self) -> tuple[dict[str, str], dict[str, Any]]:
        """(versions, host): read once per recorder (host_info may call nvidia-smi), since a
        record can be built every epoch (torch-ddp's per-epoch snapshot)."""
        if self._host is None:
            self._host = (versions(self.packages), host_info())
        return self._host

    def finish(self) -> dict[str, Any]:
        """Build the record and, on rank 0, write it to `cfg.output` (atomically)."""
        record = self.result()
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.is_main and self.output:
            try:
                write_json_atomic(self.output, record)
            except OSError as exc:  # a full disk: one line (run_main), no traceback
                raise WriteFailed(
                    f"cannot write the record --output {self.output} ({exc.strerror or exc}): "
                    f"free some space or give another --output (run status: {record['status']})",
                    self.output,
                ) from None
        return record
