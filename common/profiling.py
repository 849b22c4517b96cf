"""`--profile STEPS`: a few training steps recorded with the framework's own profiler, and the
breakdown of their time read from that trace (common/breakdown.py).

Which steps: the first epoch of the process, from its WARMUP-th step on (compilation, cuDNN's
algorithm search and the allocator's warm-up are over), STEPS of them or as many as the epoch
has left (less a MARGIN, so that a trainer that fetches batches ahead still runs every profiled
step inside the window). The first epoch is untimed (TIMING_RULE in common/timing.py), so the
profiler never touches the s/epoch and images/s a record reports; its cost shows instead as the
profiled step time against the timed epochs' step time, both in the record.

How: Run wraps the training batches of that epoch (`ProfileWindow.wrap`): the window starts and
ends after a sync; the window, the loader waits and the trainer's phases are marked as ranges.
Off (STEPS 0, the default), nothing is wrapped. Each trainer passes its framework's `Profiler`
(frameworks/profilers.py) to `Run(..., profiler=...)`.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, ExitStack, nullcontext
from pathlib import Path
from typing import Any, Protocol

from common.breakdown import INPUT_WAIT, PARTS, WINDOW, TraceError, read_trace
from common.config import Config

WARMUP = 3  # steps of the first epoch before the window (the first compiles / autotunes)
MARGIN = 2  # steps kept after the window: prefetching trainers fetch that far ahead


class Profiler(Protocol):
    """A framework's profiler, as --profile drives it."""

    flavour: str  # how common.breakdown reads its trace: "torch", "jax" or "mxnet"
    viewer: str  # what opens the trace (for the record and the log line)

    def start(self, trace_dir: Path) -> None: ...

    def stop(self) -> Path:
        """Stop; write the trace under the trace_dir given to start; return the Chrome-trace
        JSON file common.breakdown reads."""
        ...

    def annotate(self, name: str) -> AbstractContextManager[Any]:
        """A named host range in the trace."""
        ...


def trace_dir(cfg: Config, rank: int) -> Path:
    """Where rank `rank` writes its trace: --profile-dir, else beside --output (its name without
    .json, plus .profile), else ./profile/<framework>-<gpus>gpu; one folder per rank."""
    if cfg.profile_dir:
        base = Path(cfg.profile_dir)
    elif cfg.output:
        out = Path(cfg.output)
        base = out.with_name(out.name.removesuffix(".json") + ".profile")
    else:
        base = Path("profile") / f"{cfg.framework}-{cfg.gpus}gpu"
    return base / f"rank{rank}"


def window_of(steps_per_epoch: int, steps: int) -> tuple[int, int]:
    """(first, count): the steps of the first epoch the window holds (count 0: none fit)."""
    first = min(WARMUP, max(0, steps_per_epoch - 1))
    count = max(0, min(steps, steps_per_epoch - first - MARGIN))
    return first, count


class ProfileWindow:
    """One run's profiled window (module docstring). `make` builds the framework's Profiler;
    `sync` waits for its queued work; only `is_main` reads the trace into the record."""

    def __init__(
        self,
        cfg: Config,
        make: Callable[[], Profiler],
        sync: Callable[[], None],
        rank: int,
        is_main: bool,
        log: Callable[[str], None],
    ):
        self.cfg, self.make, self.sync = cfg, make, sync
        self.rank, self.is_main, self.log = rank, is_main, log
        self.dir = trace_dir(cfg, rank)
        self.done = False
        self.trace: Path | None = None
        self.first = self.count = self.epoch = 0
        self.wall_sec = 0.0
        self.flavour = self.viewer = ""
        self.active: _Profiled | None = None
        self.error = ""

    def wrap(self, batches: Any, steps_per_epoch: int, epoch: int) -> Any:
        """`batches` (epoch `epoch`'s iterator with `wait_sec`, 0-based), profiled if this is
        the window's epoch: the first epoch this process trains."""
        if self.done:
            return batches
        self.done, self.epoch = True, epoch + 1
        self.first, self.count = window_of(steps_per_epoch, self.cfg.profile)
        if self.count == 0:
            self.log(f"note: --profile: an epoch of {steps_per_epoch} steps leaves none to "
                     f"profile after {WARMUP} warm-up steps; no trace")  # fmt: skip
            return batches
        self.active = _Profiled(batches, self)
        return self.active

    def annotate(self, name: str) -> AbstractContextManager[Any]:
        """A named range in the trace while the window records (the PhaseTimer's phases);
        nothing outside it."""
        profiler = self.active.profiler if self.active is not None else None
        return nullcontext() if profiler is None else profiler.annotate(name)

    def failed(self, why: str) -> None:
        """The profiler failed: the run goes on, unprofiled, and its record says why."""
        self.error = why
        self.log(f"note: --profile: {why}; training goes on without a trace")

    def close(self) -> None:
        """Stop the profiler if a step failed inside the window (the trace keeps what ran)."""
        if self.active is not None:
            self.active._stop()

    def record(self, step_sec: float | None) -> dict[str, Any]:
        """The record's "profile" entry and, on the main process, "breakdown": the parts per
        step, with the timed epochs' step time (`step_sec`, None without timed epochs) beside
        them."""
        if self.trace is None or self.count == 0:  # (a loader that failed at the window's start)
            return {"profile": {"steps": 0, "note": self.error or "no step was profiled"}}
        prof: dict[str, Any] = {
            "trace": str(self.trace),
            "trace_dir": str(self.dir),
            "viewer": self.viewer,
            "profiler": self.flavour,
            "epoch": self.epoch,
            "first_step": self.first + 1,
            "steps": self.count,
            "profiled_step_ms": 1000.0 * self.wall_sec / self.count,
            "rank": self.rank,
        }
        if not self.is_main:
            return {"profile": prof}
        try:
            bd = read_trace(self.trace, self.flavour, self.count)
        except (TraceError, OSError) as exc:
            prof["error"] = str(exc)
            return {"profile": prof}
        bd["parts_sum_ms"] = sum(bd[k] for k in PARTS)
        if step_sec:  # the same steps, unprofiled: the timed epochs' mean
            bd["measured_step_ms"] = 1000.0 * step_sec
            bd["parts_vs_measured"] = bd["parts_sum_ms"] / bd["measured_step_ms"]
            prof["overhead"] = prof["profiled_step_ms"] / bd["measured_step_ms"] - 1.0
        return {"profile": prof, "breakdown": bd}


class _Profiled:
    """An epoch's batches with the window's steps profiled (see ProfileWindow)."""

    def __init__(self, batches: Any, window: ProfileWindow):
        self.batches, self.w = batches, window
        self.fetched = 0
        self.profiler: Profiler | None = None
        self.stack = ExitStack()
        self.t0 = 0.0

    @property
    def wait_sec(self) -> float:
        return self.batches.wait_sec

    def __iter__(self) -> Iterator[Any]:
        return self

    def __next__(self) -> Any:
        w = self.w
        if self.fetched == w.first:
            self._start()
        elif self.fetched == w.first + w.count:
            self._stop()
        try:
            if self.profiler is None:
                return next(self.batches)
            with self.profiler.annotate(INPUT_WAIT):
                return next(self.batches)
        except BaseException:
            self._stop()  # the epoch ended early (a stop, a crash): keep what was recorded
            raise
        finally:
            self.fetched += 1

    def _start(self) -> None:
        w = self.w
        w.sync()  # host sync: the window starts with no queued work
        try:  # a profiler that cannot start (no CUPTI, a read-only folder) costs the trace only
            w.dir.mkdir(parents=True, exist_ok=True)
            profiler = w.make()
            w.flavour, w.viewer = profiler.flavour, profiler.viewer
            profiler.start(w.dir)
        except Exception as exc:
            w.failed(f"the profiler did not start ({type(exc).__name__}: {exc})")
            return
        self.profiler = profiler
        self.stack.enter_context(self.profiler.annotate(WINDOW))
        self.t0 = time.perf_counter()

    def _stop(self) -> None:
        if self.profiler is None:
            return
        w, profiler, self.profiler = self.w, self.profiler, None
        w.sync()  # host sync: the window's steps are done
        w.wall_sec = time.perf_counter() - self.t0
        w.count = max(0, min(w.count, self.fetched - w.first))
        self.stack.close()
        try:
            w.trace = profiler.stop()
        except Exception as exc:
            w.failed(f"the profiler did not write its trace ({type(exc).__name__}: {exc})")
            return
        finally:
            del profiler
            gc.collect()  # the profiler's events (cyclic object graphs) go now, not mid-epoch
        w.log(f"profile: {w.count} steps from step {w.first + 1} -> {w.trace} ({w.viewer})")
