"""Timing shared by every framework. Each framework supplies `sync()`, the call that waits for
its queued device work (`torch.cuda.synchronize`, `jax.block_until_ready`, `mx.nd.waitall`):
asynchronous frameworks would otherwise be timed at enqueue, not at completion.

TIMING_RULE (the one definition; docs/fairness.md "Timing"; `common.results.timing_summary`):
- An epoch's time runs from `Timer.start()` before its first batch is read to `Timer.stop()`
  after its last step AND the end-of-epoch reconciliation of replicated state
  (`sync_batch_stats`: averaging per-device BN running statistics), each boundary behind the
  framework's sync. Evaluation, checkpoints and logging are outside it. torch-ddp takes the
  slowest rank's time (an epoch ends when its last rank is done).
- The first epoch of every process (compilation, allocator and thread-pool warm-up) is recorded
  but untimed, also the first epoch after `--resume`.
- `sec_per_epoch` = timed seconds / timed epochs; `images_per_sec` = timed training images /
  timed seconds; their medians and per-epoch min/max are extra fields.
- No host sync inside an epoch except at `--log-every` points (which the user asked for).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any


class Timer:
    """Wall time between `start()` and `stop()`, each preceded by the framework's sync."""

    def __init__(self, sync: Callable[[], None] = lambda: None):
        self.sync = sync
        self._t0 = 0.0

    def start(self) -> None:
        self.sync()
        self._t0 = time.perf_counter()

    def stop(self) -> float:
        self.sync()
        return time.perf_counter() - self._t0


PHASES = ("data_wait", "h2d", "forward_backward", "allreduce", "optimizer")


class PhaseTimer:
    """Per-phase time (data wait, host-to-device, forward+backward, gradient all-reduce,
    optimiser update), measured with a sync at every phase boundary.

    The syncs serialise work that would otherwise overlap, so phase timing is opt-in
    (`--phase-timing`) and never used for the headline sec/epoch. When disabled, `phase()` is a
    no-op that adds no sync; under --profile it marks the phase as a named range in the trace
    (`annotate(name)`: common/profiling.py's ProfileWindow.annotate, a range only inside the
    profiled window), still without a sync.
    """

    def __init__(
        self,
        sync: Callable[[], None],
        enabled: bool,
        annotate: Callable[[str], AbstractContextManager[Any]] | None = None,
    ):
        self.sync = sync
        self.enabled = enabled
        self.annotate = annotate
        self.reset()

    def reset(self) -> None:
        """Start counting again (after the warm-up epoch)."""
        self.totals: dict[str, float] = {p: 0.0 for p in PHASES}
        self.steps = 0

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if not self.enabled:
            with self.annotate(name) if self.annotate else nullcontext():
                yield
            return
        self.sync()
        t0 = time.perf_counter()
        yield
        self.sync()
        self.totals[name] = self.totals.get(name, 0.0) + time.perf_counter() - t0

    def add(self, name: str, seconds: float) -> None:
        if self.enabled:
            self.totals[name] = self.totals.get(name, 0.0) + seconds

    def per_step_ms(self) -> dict[str, float]:
        n = max(1, self.steps)
        return {k: 1000.0 * v / n for k, v in self.totals.items()}
