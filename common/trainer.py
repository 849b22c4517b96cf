"""Trainer glue that is the same in every framework, so that the trainers behave the same
wherever the framework is not the reason: `run_main` (parse -> set up -> check -> train -> exit
0 ok, 1 failed or diverged, 2 bad input in one line), `keep_measured_epochs` (a crash keeps the
epochs measured so far), `should_log` (`--log-every` counts the global step), failure records.
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from common import cli, devices, tensorboard
from common.checkpoints import lock_checkpoint_dir
from common.config import Config
from common.errors import BAD_INPUT, RunFailed, WriteFailed
from common.interrupts import Interrupted, interruptible
from common.preflight import check_outputs
from common.results import RunRecorder
from common.runtime import process_rank, stop_with_harness


def prog_name(framework: str) -> str:
    """`python -m frameworks.<module>` of a framework name (torch-ddp -> torch_ddp)."""
    return f"python -m frameworks.{framework.replace('-', '_')}"


def describe(exc: BaseException) -> str:
    """`TypeName: message`, one line. An exception that carries a worker's traceback (torch's
    ProcessRaisedException) is described by the traceback's last line, the worker's own error."""
    text = str(exc).strip()
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if isinstance(exc, WriteFailed):  # its line names what failed
        return text
    if not lines:
        return f"{type(exc).__name__}: {exc!r}"
    worker = re.match(r"^(?:\w+\.)*(\w+): (.*)$", lines[-1]) if "Traceback" in text else None
    if worker:
        name, message = worker.groups()
        return message if name == RunFailed.__name__ else f"{name}: {message}"
    return f"{type(exc).__name__}: {lines[-1]}"


def failure_record(
    cfg: Config,
    error: str,
    packages: tuple[str, ...],
    status: str = "failed",
    alone: bool = False,
) -> dict[str, Any]:
    """Write a "failed" (or, for a run stopped by SIGTERM / SIGINT, "interrupted") run record
    (rank 0 only; any rank that is `alone`: it never joined the others, e.g. its coordinator
    never answered) for a run that ended before its training loop kept any epoch, so the runner
    sees what happened."""
    rec = RunRecorder(
        cfg,
        devices=cfg.gpus,
        device_kind="unknown",
        params=0,
        is_main=alone or process_rank() == 0,
        packages=packages,
    )
    if status == "interrupted":
        rec.interrupt(error)
    else:
        rec.fail(error)
    return rec.finish()


def run_main(
    argv: Sequence[str] | None,
    framework: str,
    *,
    check: Callable[[Config], None],
    train: Callable[[Config], dict[str, Any]],
    packages: tuple[str, ...] = (),
    setup: Callable[[Config], None] | None = None,
    on_failure: Callable[[Config, str], Any] | None = None,
    prog: str | None = None,
) -> int:
    """The command line of a trainer (or a tutorial loop): parse -> setup -> check -> train.

    `setup(cfg)` prepares the process before the framework starts (thread counts, simulated
    devices, the distributed runtime); `check(cfg)` refuses bad input before any work;
    both may raise ConfigError / DatasetError (exit 2), as may `train` (a check that needs the
    framework running). Any other exception from `train` is a failed run: one line on stderr,
    a 'failed' record (`on_failure`, default `failure_record`), exit 1. SIGTERM / SIGINT: an
    'interrupted' record (the epochs so far), one line, exit 128 + the signal (143 / 130).
    Rank 0 holds `--checkpoint-dir`'s lock from the checks to the end.
    """
    prog = prog or prog_name(framework)
    cfg = cli.parse_args(argv, framework, prog=prog)
    lock = None
    try:
        with interruptible():
            stop_with_harness()
            devices.pin(cfg.devices)  # --devices cpu hides the GPUs before any CUDA call
            check_outputs(cfg)
            if setup is not None:
                setup(cfg)
            check(cfg)
            tensorboard.check(cfg)
            lock = lock_checkpoint_dir(cfg)  # after the checks: bad input creates nothing
            record = train(cfg)
    except BAD_INPUT as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except Interrupted as exc:
        if not exc.recorded:
            failure_record(cfg, str(exc), packages, status="interrupted")
        print(f"{prog}: {exc}; the record keeps the epochs measured so far", file=sys.stderr)
        return 128 + exc.signum
    except RunFailed as exc:
        print(f"{prog}: failed: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        error = describe(exc)
        name, _, message = error.partition(": ")
        if name in {e.__name__ for e in BAD_INPUT}:  # raised in a worker process (torch-ddp)
            print(f"{prog}: error: {message}", file=sys.stderr)
            return 2
        print(f"{prog}: failed: {error}", file=sys.stderr)
        if isinstance(exc, WriteFailed) and exc.path and exc.path == cfg.output:
            return 1  # the record itself could not be written: its line says so
        try:
            alone = bool(getattr(exc, "alone", False))  # a rank that never joined its job
            (on_failure or (lambda c, e: failure_record(c, e, packages, alone=alone)))(cfg, error)
        except (OSError, WriteFailed) as write_error:  # the disk filled up: no traceback
            print(f"{prog}: could not write the failure record: {write_error}", file=sys.stderr)
        return 1
    finally:
        if lock is not None:
            lock.close()
    if record.get("status") == "failed":
        print(f"{prog}: failed: {record.get('error', '')}", file=sys.stderr)
    return 0 if record.get("status") == "ok" else 1


@contextmanager
def keep_measured_epochs(
    recorder: RunRecorder,
    reraise: bool = False,
    on_traceback: Callable[[str], Any] | None = None,
) -> Iterator[None]:
    """Around a training loop: an exception marks the run failed and keeps the epochs measured
    so far. `reraise` for a rank of a multi-process job, which must exit so that the launcher
    stops the others (they would wait in a collective): the record is written, RunFailed raised.
    An interruption writes the record as "interrupted" and goes on up to `run_main`, as does bad
    input. A crash's traceback goes to stderr, or to `on_traceback` (a spawned rank: its parent
    decides whether it is the cause or the echo of another rank's death)."""
    try:
        yield
    except BAD_INPUT:
        raise
    except Interrupted as exc:
        recorder.interrupt(str(exc))
        recorder.finish()
        exc.recorded = True
        raise
    except Exception as exc:
        if isinstance(exc, WriteFailed):  # its one line says it all
            pass
        elif on_traceback is not None:
            on_traceback(traceback.format_exc())
        else:
            traceback.print_exc()
        recorder.fail(describe(exc))
        if reraise:
            recorder.finish()
            raise RunFailed(recorder.error) from exc


def should_log(cfg: Config, step: int) -> bool:
    """True at a `--log-every` point; `step` is the global step (1-based, since the run began)."""
    return cfg.log_every > 0 and step % cfg.log_every == 0
