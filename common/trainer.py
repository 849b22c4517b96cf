"""Trainer glue that is the same in every framework: the command-line entry point and its error
policy, the resume check, checkpoint metadata, log points and failure records.

Each `frameworks/<name>.py` keeps what its framework makes it do (model, state, step, sharding,
the training loop with its sync points) and calls these for the rest, so the five trainers
behave the same wherever the framework is not the reason:

- `run_main`: parse -> set up the process -> check -> train -> exit code. Exit 0 when the run
  ended "ok", 1 when it failed or diverged (a failed run still leaves a record), 2 on bad input
  (one line naming the problem and the fix, before any training).
- `keep_measured_epochs`: a crash inside the training loop keeps the epochs measured so far;
  the record says "failed" and why.
- `should_log`: `--log-every N` counts the global step (the step number since the run began,
  resumed runs included) in every trainer.
- `checkpoint_meta` / `restore_meta`: what every checkpoint holds besides the framework's
  tensors (its format, epoch, step, the recorder's state, the config, how the run executed),
  and `check_resume`: a checkpoint of another run (other settings, device count, device kind,
  library versions), past `--epochs`, or whose counters disagree with its record, is refused
  with one line. Checkpoint files are opened bounded (`open_checkpoint`, common/safe_io.py)
  and carry the sha256 of their content, checked before anything is loaded (common/sealed.py).
- `lock_checkpoint_dir`: one run at a time per `--checkpoint-dir` (an exclusive flock held for
  the whole process); a second is refused with one line.
- SIGTERM / SIGINT (a cancelled job, Ctrl-C) raise `Interrupted` in the main thread: the record
  keeps the epochs measured so far with status "interrupted", exit code 128 + the signal. The
  signal also sets a flag that every step checks (`raise_if_interrupted`): a raise that Python
  swallowed (inside a gc callback, "Exception ignored in ...") still stops the run.
"""

from __future__ import annotations

import fcntl
import os
import re
import signal
import sys
import threading
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from common import cli, devices, tensorboard
from common.config import Config, ConfigError, check_same_run, data_dims
from common.datasets import DatasetError
from common.init import parameter_spec, state_bytes
from common.results import RunRecorder, versions
from common.runtime import (
    WriteFailed,
    atomic_write_bytes,
    remove_stale_temp_files,
    stop_with_harness,
    unnamable,
    unwritable,
)
from common.safe_io import open_regular, read_regular, regular_file, weights_problem
from common.sealed import SEAL_BYTES, seal, seal_arrays, unseal

BAD_INPUT = (ConfigError, DatasetError)


class RunFailed(RuntimeError):
    """Training failed and its record (with the epochs measured so far) is already written."""


@contextmanager
def writing_checkpoint(
    path: Path, errors: tuple[type[BaseException], ...] = (OSError,)
) -> Iterator[None]:
    """Around a checkpoint write: an OSError (ENOSPC, EFBIG, EDQUOT, EROFS; or one of the
    framework's `errors` that its C++ writer raises instead) is `WriteFailed`, one line naming
    the file, what failed and the fix."""
    try:
        yield
    except errors as exc:
        why = getattr(exc, "strerror", None) or first_line(exc)
        raise WriteFailed(
            f"cannot write checkpoint {path} ({why}): free some space or give another "
            "--checkpoint-dir; --resume continues from the last complete checkpoint",
            path,
        ) from None


class Interrupted(BaseException):
    """SIGTERM or SIGINT arrived (a cancelled job, a scheduler's time limit, Ctrl-C). A
    BaseException, like KeyboardInterrupt, so that no `except Exception` takes it for a failed
    step. `recorded`: the run's record already says "interrupted"."""

    def __init__(self, signum: int):
        super().__init__(f"interrupted by {signal.Signals(signum).name}")
        self.signum = signum
        self.recorded = False


def shield_interrupts() -> None:
    """Ignore further SIGTERM / SIGINT while an interrupted run stops its workers and writes its
    record (a scheduler signals every process of a job; a second Ctrl-C is common): a second
    `Interrupted` raised half-way would lose the record. `interruptible` restores the handlers."""
    if threading.current_thread() is threading.main_thread():
        for s in (signal.SIGTERM, signal.SIGINT):
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


# The SIGTERM / SIGINT handlers `interruptible` replaced: what a forked child gets back.
_BEFORE: dict[int, Any] = {}


def _restore_signals_in_child() -> None:
    """After a fork, in the child (a DataLoader's or a multiprocessing Pool's worker, forked
    inside `train`): the handlers from before `interruptible`. With the parent's handler a
    worker would answer its pool's terminate() by raising `Interrupted` through its copy of the
    parent's stack and ignore the next SIGTERM (shield_interrupts), and the pool's join could
    wait for it for ever (seen once: d2l-mxnet's DataLoader at the end of a run)."""
    for s, handler in _BEFORE.items():
        if signal.getsignal(s) is _raise_interrupted:
            with suppress(ValueError):  # not the main thread: handlers cannot be set
                signal.signal(s, handler)


os.register_at_fork(after_in_child=_restore_signals_in_child)


@contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM and SIGINT raise `Interrupted` in the main thread while inside (a no-op off the
    main thread, where Python cannot install handlers). SIGTERM's default would end the process
    without a record; torch-ddp's parent uses the exception to stop its workers first."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _pending.clear()
    previous = {s: signal.signal(s, _raise_interrupted) for s in (signal.SIGTERM, signal.SIGINT)}
    for s, handler in previous.items():
        if handler is not None and handler is not _raise_interrupted:  # None: set outside Python
            _BEFORE.setdefault(s, handler)
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _pending.clear()


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


def process_rank() -> int:
    """This process's rank from the launcher's environment (torchrun, jax.distributed, SLURM);
    0 when none is set. Used where the framework has not started yet (failure records)."""
    for var in ("RANK", "JAX_PROCESS_ID", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


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


LOCK_NAME = ".lock"


def lock_checkpoint_dir(cfg: Config) -> Any:
    """Hold an exclusive lock on `--checkpoint-dir` for the life of this process (rank 0 only:
    the other ranks of a job write no checkpoint), so that two runs, a `--resume` and a run it
    races with say, never write the same checkpoint. A second run is refused with one line.
    Returns the open lock file (closing it, or the process ending, releases the lock)."""
    if not cfg.checkpoint_dir or process_rank() != 0:
        return None
    directory = Path(cfg.checkpoint_dir)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        handle = open(directory / LOCK_NAME, "a+")
    except OSError as exc:
        raise ConfigError(
            f"--checkpoint-dir {directory}: cannot create its lock file ({exc.strerror}); "
            "give a writable directory"
        ) from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise ConfigError(
            f"--checkpoint-dir {directory} is in use by another run (pid {holder} holds its "
            "lock); wait for it to end, or use another --checkpoint-dir"
        ) from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    # The lock is ours: a temp file whose writer is dead is debris of a run killed mid-write.
    remove_stale_temp_files(directory, prefix=cfg.framework)
    return handle


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
    so far (the record is still written). `reraise` for a rank of a multi-process job, which
    must exit so that the launcher stops the others (they would wait in a collective): the
    record is written first and RunFailed raised. An interruption (SIGTERM, SIGINT) writes the
    record as "interrupted" and goes on up to `run_main`, as does bad input found on the way (a
    cache file that is a FIFO, say: one line, exit 2, no record). The traceback of a crash goes
    to stderr, or to `on_traceback` (a spawned rank: its parent decides whether it is the cause,
    or the echo of another rank's death)."""
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


CHECKPOINT_FORMAT = 2  # what checkpoint_meta writes; a checkpoint without it predates the checks
CHECKPOINT_FIX = "delete it or drop --resume"


def checkpoint_meta(cfg: Config, recorder: RunRecorder, epoch: int, step: int) -> dict[str, Any]:
    """What every checkpoint holds besides the framework's tensors, after `epoch` (0-based)."""
    return {
        "format": CHECKPOINT_FORMAT,
        "epoch": epoch + 1,
        "step": step,
        "recorder": recorder.state(),
        "config": cfg.to_dict(),
        "run": run_binding(recorder),
    }


def run_binding(recorder: RunRecorder) -> dict[str, Any]:
    """How a run executes beyond its config, as its record says (JSON-plain): devices and their
    kind, the execution mode, float32 precision, where batches are made, threads, the versions
    of Python, numpy and the framework. A resume that would execute otherwise is refused: its
    timings (and, for some, its results) would not be the same run's."""
    threads = recorder.threads or {}
    return {
        "devices": recorder.devices,
        "device kind": recorder.device_kind,
        "execution": recorder.execution,
        "float32 precision": recorder.float32_precision,
        "pipeline": recorder.pipeline,
        "threads": [threads.get("total"), threads.get("per_device")],
        "versions": versions(recorder.packages),
    }


def restore_meta(meta: dict[str, Any], recorder: RunRecorder, path: Path) -> tuple[int, int]:
    """Check the metadata of checkpoint `path` against this run (`check_meta`, and
    `run_binding`: the same devices, versions, execution), restore the recorder from it;
    return (epoch to continue from, step)."""
    where = f"checkpoint {path}"
    check_meta(recorder.cfg, meta, where)
    now, saved = run_binding(recorder), meta.get("run")
    saved = saved if isinstance(saved, dict) else {}
    diff = [f"{k} {saved.get(k)!r} (now {v!r})" for k, v in now.items() if saved.get(k) != v]
    if diff:
        raise ConfigError(
            f"{where} is from another run: {'; '.join(diff)}; resume where it was made, or use "
            "a new --checkpoint-dir"
        )
    recorder.load_state(meta["recorder"])
    return int(meta["epoch"]), int(meta["step"])


def check_meta(cfg: Config, meta: Any, where: str) -> None:
    """Checkpoint metadata that belongs to this run: the current format, the same settings
    (check_same_run), an epoch counter in 0..--epochs that agrees with the record's rows
    (numbered 1..epoch) and a step counter that agrees with their steps. ConfigError (one line)
    otherwise."""
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        got = f"format {meta['format']!r}" if isinstance(meta, dict) and "format" in meta else None
        raise ConfigError(
            f"{where} has {got or 'no format'}, not checkpoint format {CHECKPOINT_FORMAT} (written "
            "by another version of dp-bench, or not a checkpoint); use a new --checkpoint-dir"
        )
    if not isinstance(meta.get("config"), dict):
        raise ConfigError(f"{where} holds no run configuration; {CHECKPOINT_FIX}")
    epoch, step, record = meta.get("epoch"), meta.get("step"), meta.get("recorder")
    if type(epoch) is not int or not 0 <= epoch <= cfg.epochs:
        if type(epoch) is int and epoch > cfg.epochs:
            raise ConfigError(
                f"{where} is after epoch {epoch} but --epochs is {cfg.epochs}; resume with "
                f"--epochs {epoch} or more, or use a new --checkpoint-dir"
            )
        raise ConfigError(
            f"{where}: its epoch counter {epoch!r} is outside 0..{cfg.epochs}; {CHECKPOINT_FIX}"
        )
    check_same_run(meta["config"], cfg, where.removeprefix("checkpoint "))
    rows = record.get("epochs") if isinstance(record, dict) else None
    rows = rows if isinstance(rows, list) and all(isinstance(r, dict) for r in rows) else []
    numbers = [r.get("epoch") for r in rows]
    if numbers != list(range(1, epoch + 1)):
        raise ConfigError(
            f"{where}: its epoch counter {epoch} disagrees with the epochs its record holds "
            f"({', '.join(map(str, numbers[:8])) or 'none'}): edited or damaged; {CHECKPOINT_FIX}"
        )
    images = [r.get("images") for r in rows]
    steps = sum(n // cfg.batch_size for n in images if type(n) is int)
    if type(step) is not int or step != steps or any(type(n) is not int for n in images):
        raise ConfigError(
            f"{where}: its step counter {step!r} disagrees with the {steps} steps of its "
            f"{epoch} epochs: edited or damaged; {CHECKPOINT_FIX}"
        )


def checkpoint_limit(cfg: Config) -> int:
    """The most bytes one checkpoint file of `cfg` can need: the weights and BN statistics, an
    optimiser state of at most twice as much (SGD's momentum; NovoGrad's moments), the
    framework's framing and the metadata (a record row per epoch, the config)."""
    weights = state_bytes(parameter_spec(cfg.model, cfg.width, *data_dims(cfg)))
    return 4 * weights + (16 << 20) + cfg.epochs * (4 << 10)


def open_checkpoint(path: Path, limit: int | None) -> Any:
    """A checkpoint file open for reading: a regular file of at most `limit` bytes (None: as
    checked before, `check_resume`), else one line (common/safe_io.py)."""
    return open_regular(path, limit, "checkpoint", CHECKPOINT_FIX)


def read_checkpoint(path: Path, limit: int | None) -> bytes:
    """The bytes of a checkpoint file (`open_checkpoint`)."""
    return read_regular(path, limit, "checkpoint", CHECKPOINT_FIX)


def write_sealed_checkpoint(path: Path, payload: bytes) -> None:
    """A checkpoint file (torch's .pt, JAX's .msgpack): `payload` and the sha256 that binds it
    (common/sealed.py), in one atomic write; a full disk is one line, no temp file left."""
    with writing_checkpoint(path):
        atomic_write_bytes(path, seal(payload))


def read_sealed_checkpoint(path: Path, limit: int | None) -> bytes:
    """The payload of a `write_sealed_checkpoint` file, read bounded, once its content matches
    its sha256: a damaged file is one line naming it (exit 2) before anything is loaded."""
    data = read_checkpoint(path, None if limit is None else limit + SEAL_BYTES)
    return unseal(data, f"checkpoint {path}", CHECKPOINT_FIX)


def check_checkpoint_file(path: Path, limit: int | None) -> None:
    """A checkpoint file is a regular file of at most `limit` bytes (stat only: nothing opened)."""
    regular_file(path, limit, "checkpoint", CHECKPOINT_FIX)


def check_weights(arrays: dict[str, Any], path: Path) -> None:
    """A checkpoint's weights (numpy, any framework's names and layouts) as training leaves
    them: finite, no weight tensor all zeros (common/safe_io.weights_problem)."""
    why = weights_problem(arrays)
    if why:
        raise ConfigError(f"checkpoint {path} cannot be a trained model: {why}; {CHECKPOINT_FIX}")


def save_final_state(cfg: Config, arrays: dict[str, Any]) -> None:
    """`--save-state PATH`: the final parameters and BN statistics (numpy arrays in torch's
    names and layouts, from the framework's support module) as one .npz, written atomically
    with the sha256 of its arrays (its zip comment, common/sealed.py)."""
    if not cfg.save_state:
        return
    try:
        atomic_write_bytes(cfg.save_state, seal_arrays(arrays))
    except OSError as exc:  # a full disk: one line, the record says failed
        raise WriteFailed(
            f"cannot write --save-state {cfg.save_state} ({exc.strerror or exc}): free some "
            "space or give another --save-state",
            cfg.save_state,
        ) from None


def check_outputs(cfg: Config) -> None:
    """--output, --save-state, --checkpoint-dir and --profile-dir writable, --data-dir and
    --cache-dir directories the file system can name, before anything starts (not after an
    hour of training; --tensorboard has its own check): one line naming the path, exit 2.
    Creates nothing."""
    for flag, path, kind in (
        ("--output", cfg.output, "file"),
        ("--save-state", cfg.save_state, "file"),
        ("--checkpoint-dir", cfg.checkpoint_dir, "dir"),
        ("--profile-dir", cfg.profile_dir if cfg.profile else "", "dir"),
    ):
        why = path and unwritable(path, kind)
        if why:
            raise ConfigError(f"{flag} {path}: {why}; choose another path")
    # read (and cached into) as directories: a name the file system cannot look up, or one
    # under a file, fails at the first open, after the set-up
    for flag, path in (("--data-dir", cfg.data_dir), ("--cache-dir", cfg.cache_dir)):
        why = path and unnamable(path)
        if not why and path and Path(path).expanduser().exists():
            why = None if Path(path).expanduser().is_dir() else "it is not a directory"
        if why:
            raise ConfigError(f"{flag} {path}: {why}; choose another path")


def first_line(exc: BaseException) -> str:
    """An exception's message as one line: its first non-empty line (torch's load errors run
    over several lines, with advice that does not apply), the last one of a message that holds
    a C++ traceback (MXNet), or its type name."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    if lines and lines[0].startswith("Traceback"):  # MXNet's C++ errors: the cause comes last
        return re.sub(r"^\w+Error: ", "", lines[-1])
    return lines[0] if lines else type(exc).__name__


@contextmanager
def reading_checkpoint(path: Path) -> Iterator[None]:
    """Around the load of a checkpoint: a corrupt, truncated or foreign file is bad input (one
    line, exit 2), whatever the framework's loader raised."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"cannot read checkpoint {path} ({type(exc).__name__}: {first_line(exc)}); "
            "delete it or drop --resume"
        ) from None


def check_resume(
    cfg: Config, path: Path, read_meta: Callable[[Path, int | None], dict[str, Any]]
) -> None:
    """Refuse to resume from checkpoint `path` unless it belongs to this run (`check_meta`:
    format, settings, counters; one clear error). `path` must be a regular file no larger than
    the configuration can need; `read_meta(path, limit)` returns the metadata saved in it
    (`checkpoint_meta`; the framework knows the format)."""
    if not (cfg.resume and path.exists()):
        return
    limit = checkpoint_limit(cfg)
    check_checkpoint_file(path, limit)  # a FIFO would block the read
    with reading_checkpoint(path):
        meta = read_meta(path, limit)
    check_meta(cfg, meta, f"checkpoint {path}")
