"""`--tensorboard DIR`: a run's curves as TensorBoard event files, written by process 0.

Once per epoch, from the figures `RunRecorder` already holds (no extra host sync), with the
global step (epochs done x steps per epoch) as the x axis:

    train/loss  test/accuracy  test/loss  perf/images_per_sec  perf/epoch_sec  lr

`lr` is the LR of the epoch's last step, which the recorder keeps in every epoch row
(`lr_last`, from the one LR table every trainer follows, `common.schedule.lr_table_for`). With
the first epoch come two text entries: `config` (the resolved config) and `environment`
(versions, device kind and count, threads, execution, host).

The writer is tensorboardX's (framework-neutral, installed in both environments), imported
lazily and without torch (`summary_writer_class`). Writing TensorBoard never costs the run its
record: the first error (a full disk, say) is one line and the run goes on without it. The
events are written in the calling thread (`EventFile`), so that every error reaches that line.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import Config
from common.errors import ConfigError
from common.runtime import injected

# Each tag and the epoch row (common.results.RunRecorder.end_epoch) field it plots; "lr" is apart.
SCALARS = {
    "train/loss": "train_loss",
    "test/accuracy": "test_accuracy",
    "test/loss": "test_loss",
    "perf/images_per_sec": "images_per_sec",
    "perf/epoch_sec": "sec",
}
PACKAGE = "tensorboardX"


def check(cfg: Config) -> None:
    """Refuse `--tensorboard DIR` before any work (ConfigError: exit 2, one line) when the writer
    is not installed here or DIR cannot be a directory; create DIR."""
    if not cfg.tensorboard:
        return
    if importlib.util.find_spec(PACKAGE) is None:
        raise ConfigError(
            f"--tensorboard needs the {PACKAGE} package, missing from {sys.prefix}; run "
            "`bash scripts/setup.sh` (requirements/*.txt pin it) or drop --tensorboard"
        )
    try:
        Path(cfg.tensorboard).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--tensorboard {cfg.tensorboard}: cannot create that directory "
            f"({exc.strerror or exc}); give a writable directory"
        ) from None


def summary_writer_class() -> Any:
    """tensorboardX.SummaryWriter, imported without torch: tensorboardX's writer imports torch
    whenever it is installed (to accept torch tensors), which would load torch into a JAX process
    that never uses it. This writer is only given Python floats and strings."""
    if "torch" in sys.modules or PACKAGE in sys.modules:
        from tensorboardX import SummaryWriter

        return SummaryWriter
    sys.modules["torch"] = None  # type: ignore[assignment]  # `import torch` -> ImportError
    try:
        from tensorboardX import SummaryWriter
    finally:
        if sys.modules.get("torch", 0) is None:
            del sys.modules["torch"]
    return SummaryWriter


class EventFile:
    """A run's event file, written synchronously through tensorboardX's EventsWriter (the file
    SummaryWriter writes, the same name and format): no thread, no exit handler, so that a
    write error is raised here, in `EventLog.epoch`'s try, and nowhere else."""

    def __init__(self, logdir: str):
        summary_writer_class()  # tensorboardX imported without torch; the modules below with it
        from tensorboardX.event_file_writer import EventsWriter
        from tensorboardX.proto.event_pb2 import Event
        from tensorboardX.summary import scalar, text

        Path(logdir).mkdir(parents=True, exist_ok=True)
        self._events = EventsWriter(os.path.join(logdir, "events"))
        self._event, self._scalar, self._text = Event, scalar, text

    def _add(self, summary: Any, step: int) -> None:
        self._events.write_event(self._event(summary=summary, step=step, wall_time=time.time()))

    def add_text(self, tag: str, text: str, step: int) -> None:
        self._add(self._text(tag, text), step)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self._add(self._scalar(tag, value), step)

    def flush(self) -> None:
        self._events.flush()

    def close(self) -> None:
        self._events.close()


def global_step(row: dict[str, Any], cfg: Config) -> int:
    """The global step at the end of the epoch of `row`: every trainer reports `images` = steps
    per epoch x the global batch."""
    return row["epoch"] * (row["images"] // cfg.batch_size)


def _markdown_json(obj: Any) -> str:
    # The text plugin renders Markdown: indent 4 spaces = a code block, kept verbatim.
    text = json.dumps(obj, indent=2, default=str)
    return "\n".join("    " + line for line in text.splitlines())


class EventLog:
    """Process 0's event file for one run of `cfg` (in its --tensorboard directory);
    `RunRecorder` calls `epoch` once per epoch and `close` when it builds the final record.
    `environment()`: how the run executed (the recorder's facts), written once as a text."""

    def __init__(self, cfg: Config, environment: Callable[[], dict[str, Any]]):
        self.cfg, self.environment = cfg, environment
        self.logdir = cfg.tensorboard
        self._writer: Any = None
        self.failed = ""  # why writing failed, once it has

    def epoch(self, row: dict[str, Any]) -> None:
        """Write the epoch `row` just recorded (and, first, the config and environment texts)."""
        if self.failed:
            return
        try:
            cfg = self.cfg
            if injected("tensorboard-error", cfg.framework):  # tests: a failing writer
                raise OSError(f"injected TensorBoard write error in {self.logdir}")
            step = global_step(row, cfg)
            if self._writer is None:
                self._writer = EventFile(self.logdir)
                self._writer.add_text("config", _markdown_json(cfg.to_dict()), step)
                self._writer.add_text("environment", _markdown_json(self.environment()), step)
            for tag, key in SCALARS.items():
                self._writer.add_scalar(tag, float(row[key]), step)
            self._writer.add_scalar("lr", float(row["lr_last"]), step)  # the epoch's last step's
            self._writer.flush()  # on disk now: a run killed later keeps its curves
        except Exception as exc:
            self.failed = f"{type(exc).__name__}: {exc}"
        if self.failed:
            self.close()  # the file's handle released now; what was flushed stays readable
            print(
                f"tensorboard: writing {self.logdir} failed ({self.failed}); the run goes on "
                "without TensorBoard (its record is unaffected)",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._writer is None:
            return
        # A full disk: the writer's buffered bytes cannot be written; its file, closed or freed
        # later, would print "Exception ignored ... OSError" (Python 3.13). Every epoch was
        # flushed when written, so those bytes are lost either way: freed here, quietly.
        writer, self._writer = self._writer, None
        hook, sys.unraisablehook = sys.unraisablehook, lambda unraisable: None
        try:
            writer.close()
        except Exception:
            pass
        finally:
            del writer
            gc.collect()
            sys.unraisablehook = hook
