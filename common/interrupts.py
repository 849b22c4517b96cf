"""SIGTERM and SIGINT (a cancelled job, a scheduler's time limit, Ctrl-C) as `Interrupted`, the
same in every trainer: raised in the main thread inside `interruptible` (run_main,
common/trainer.py). The record then keeps the epochs measured so far with status
"interrupted", and the process exits 128 + the signal (143 / 130).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class Interrupted(BaseException):
    """A stop signal arrived. A BaseException, like KeyboardInterrupt, so that no `except
    Exception` takes it for a failed step. `recorded`: the run's record already says so."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.recorded = False


def shield_interrupts() -> None:
    """Ignore further stop signals while an interrupted run stops its workers and writes its
    record (a scheduler signals every process of a job: a second `Interrupted` raised half-way
    would lose the record). `interruptible` restores the handlers."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


def _raise_interrupted(signum: int, frame: Any) -> None:
    shield_interrupts()
    raise Interrupted(signum)


_BEFORE: dict[int, Any] = {}  # the handlers `interruptible` replaced: a forked child's


def _restore_signals_in_child() -> None:
    """After a fork inside `train` (tutorials/d2l_mxnet.py's DataLoader pools): the handlers from
    before `interruptible`, so that a worker dies of its pool's terminate() instead of raising
    `Interrupted` through its copy of the parent's stack (without: the tutorial hung 1 run in 3)."""
    for s in STOP_SIGNALS:
        if signal.getsignal(s) is _raise_interrupted:
            with suppress(ValueError, TypeError):  # not the main thread: cannot be set
                signal.signal(s, _BEFORE.get(s, signal.SIG_DFL))


os.register_at_fork(after_in_child=_restore_signals_in_child)


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM and SIGINT raise `Interrupted` in the main thread while inside (a no-op off the
    main thread, where Python cannot install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {s: signal.signal(s, _raise_interrupted) for s in STOP_SIGNALS}
    for s, handler in previous.items():
        if handler is not None and handler is not _raise_interrupted:  # None: set outside Python
            _BEFORE.setdefault(s, handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def exit_after(code: int) -> NoReturn:
    """The end of a trainer's `python -m` process. After a stop (exit 128 + the signal) it ends
    at once, streams flushed, without the interpreter's finalization: XLA's threads may still
    run what the interrupted step started, and its static destructors racing with them crashed
    3 of 53 interrupted jax-shardmap runs (SIGSEGV, exit -11)."""
    if code in [128 + s for s in STOP_SIGNALS]:
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
    sys.exit(code)
