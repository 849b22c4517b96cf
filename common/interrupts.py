"""SIGTERM and SIGINT (a cancelled job, a scheduler's time limit, Ctrl-C) as `Interrupted`, the
same in every trainer and tool: raised in the main thread inside `interruptible` (run_main,
common/trainer.py), and also kept as a flag that every step checks (`raise_if_interrupted`, the
training loader's per-step hook in common/run.py): a raise that Python swallowed (inside a gc
callback, "Exception ignored in ...") still stops the run. The record then keeps the epochs
measured so far with status "interrupted", exit code 128 + the signal.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, NoReturn


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived (a cancelled job, a scheduler's time limit, Ctrl-C). A
    BaseException, like KeyboardInterrupt, so that no `except Exception` takes it for a failed
    step. `recorded`: the run's record already says "interrupted"."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.recorded = False


# The signals that stop a run: SIGHUP too (the terminal of a run started by hand was closed: the
# process died without a word and without its record). A SIGHUP ignored by the parent (nohup)
# stays ignored.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def shield_interrupts() -> None:
    """Ignore further stop signals while an interrupted run stops its workers and writes its
    record (a scheduler signals every process of a job; a second Ctrl-C is common): a second
    `Interrupted` raised half-way would lose the record. `interruptible` restores the handlers."""
    if threading.current_thread() is threading.main_thread():
        for s in STOP_SIGNALS:
            signal.signal(s, signal.SIG_IGN)


_pending: list[int] = []  # the stop signal received inside `interruptible` (at most one)


def _raise_interrupted(signum: int, frame: Any) -> None:
    if not _pending:
        _pending.append(signum)  # first: a raise that lands in a callback may be swallowed
    shield_interrupts()
    raise Interrupted(signum)


def raise_if_interrupted() -> None:
    """Raise `Interrupted` if a stop signal came (checked at every step, common/run.py): the
    handler's own raise is lost where it lands in code whose exceptions Python ignores (a gc
    callback such as JAX's _xla_gc_callback, a __del__, a weakref callback), and the run
    trained on and recorded "ok"."""
    if _pending:
        raise Interrupted(_pending[0])


# Before `interruptible` is first entered (the interpreter importing torch or JAX, the flags
# being parsed), Python's own SIGINT handler raised KeyboardInterrupt wherever the import was:
# a 30-line traceback from importlib for a Ctrl-C at start-up. `quiet_start_up` (the trainers'
# `python -m` entry, common/runtime.check_interpreter) makes a stop there one line and exit
# 128 + the signal; nothing has been written yet, and the children a trainer starts later (the
# guard's, torch-ddp's ranks) are not started yet.
_START_UP: dict[str, Any] = {}


def _stop_at_start_up(signum: int, frame: Any) -> None:
    if os.getpid() != _START_UP.get("pid"):  # a forked child: the signal's default action
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        return
    if not _START_UP.get("entered"):
        name = signal.Signals(signum).name
        with suppress(OSError, ValueError):
            sys.stderr.write(
                f"{_START_UP['prog']}: interrupted by {name} at start-up; nothing ran\n"
            )
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError, ValueError):
            stream.flush()
    os._exit(128 + signum)


def quiet_start_up(prog: str) -> None:
    """SIGINT / SIGTERM before the run begins (and after it ended): one line, exit 128 + the
    signal, no traceback. Main thread only; `interruptible` takes over while the run runs."""
    if threading.current_thread() is not threading.main_thread():
        return
    _START_UP.update(pid=os.getpid(), prog=prog, entered=False)
    for s in STOP_SIGNALS:
        handler = signal.getsignal(s)
        if handler is None or kept_ignored(s):
            continue
        _ORIGINAL.setdefault(s, handler)
        signal.signal(s, _stop_at_start_up)


def kept_ignored(s: int) -> bool:
    """SIGHUP ignored by whoever started this process (nohup: the run outlives its terminal)
    stays ignored. SIGINT and SIGTERM stop the run even where they came in ignored: a shell
    starts a background job (`cmd &`) with SIGINT ignored, and an explicit `kill -INT` to it,
    or to a run whose runner was started so, was lost (independent battery for #41, wave 3:
    a torch-ddp run at start-up and a compare trained on to "ok")."""
    return s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN


def exit_after(code: int) -> NoReturn:
    """The end of a trainer's `python -m` process. After a stop (exit 128 + the signal) it ends
    at once, without the interpreter's finalization, which went wrong two ways after the
    "interrupted" record and its line were written: in JAX, XLA's own threads may still be
    compiling or running what the interrupted step started, and its static destructors racing
    with them crashed 3 of 53 interrupted jax-shardmap runs here (SIGSEGV, exit -11); in every
    trainer, finalization puts the default action back on the signals Python handles, and a
    second Ctrl-C then ended torch-dp and mxnet-gluon by the signal (exit -2; independent
    battery for #41, wave 3). The streams are flushed first."""
    if code in [128 + s for s in STOP_SIGNALS]:
        for stream in (sys.stdout, sys.stderr):
            with suppress(OSError, ValueError):
                stream.flush()
        os._exit(code)
    sys.exit(code)


# The SIGTERM / SIGINT handlers `interruptible` replaced: what a forked child gets back.
_BEFORE: dict[int, Any] = {}
# The handlers `quiet_start_up` replaced (SIGTERM's and SIGHUP's default action, Python's
# KeyboardInterrupt for SIGINT): what a forked child gets back in place of `_stop_at_start_up`.
_ORIGINAL: dict[int, Any] = {}


def _restore_signals_in_child() -> None:
    """After a fork, in the child (a DataLoader's or a multiprocessing Pool's worker, forked
    inside `train`): the handlers from before `interruptible`. With the parent's handler a
    worker would answer its pool's terminate() by raising `Interrupted` through its copy of the
    parent's stack and ignore the next SIGTERM (shield_interrupts), and the pool's join could
    wait for it for ever (seen once: d2l-mxnet's DataLoader at the end of a run). Never a
    handler of ours, `quiet_start_up`'s included: a Python-level handler runs only when the
    child's main thread runs Python, and a pool worker blocked in its task queue's semaphore,
    with the signal taken by another of its threads (MXNet's engine, OpenMP), never does: its
    pool's terminate() waited on it for ever (fresh-clone CI, d2l-mxnet's DataLoader, after
    `quiet_start_up` came). The default action ends it whichever thread takes the signal."""
    for s in STOP_SIGNALS:
        handler = signal.getsignal(s)
        if handler is _raise_interrupted:
            handler = _BEFORE.get(s, signal.SIG_DFL)
        if handler is _stop_at_start_up:
            handler = _ORIGINAL.get(s, signal.SIG_DFL)
        if handler is not signal.getsignal(s):
            with suppress(ValueError, TypeError):  # not the main thread: cannot be set
                signal.signal(s, handler)


os.register_at_fork(after_in_child=_restore_signals_in_child)


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM, SIGINT and SIGHUP raise `Interrupted` in the main thread while inside (a no-op
    off the main thread, where Python cannot install handlers). SIGTERM's default would end the
    process without a record; torch-ddp's parent uses the exception to stop its workers first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending.clear()
    _START_UP["entered"] = True
    previous = {
        s: signal.signal(s, _raise_interrupted) for s in STOP_SIGNALS if not kept_ignored(s)
    }
    for s, handler in previous.items():
        if handler is not None and handler is not _raise_interrupted:  # None: set outside Python
            _BEFORE.setdefault(s, handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _pending.clear()
