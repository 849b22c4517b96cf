"""What every framework's checkpoint holds besides its tensors, and how a checkpoint file is
written, read and checked: the same in every trainer (the framework's support module writes and
reads its own format through these).

- `checkpoint_meta` / `restore_meta`: its format, epoch, step, the recorder's state, the config,
  how the run executed; `check_resume`: a checkpoint of another run (other settings, device
  count, device kind, library versions), past `--epochs`, or whose counters disagree with its
  record, is refused with one line before any work. Checkpoint files are opened bounded
  (`open_checkpoint`, common/safe_io.py) and carry the sha256 of their content, checked before
  anything is loaded (common/sealed.py); a full disk is one line (`writing_checkpoint`).
- `lock_checkpoint_dir`: one run at a time per `--checkpoint-dir` (an exclusive flock held for
  the whole process); a second is refused with one line.
- `save_final_state`: `--save-state`, the final weights as one sealed .npz.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from common.config import Config, check_same_run, data_dims
from common.errors import ConfigError, WriteFailed, first_line
from common.init import parameter_spec, state_bytes
from common.results import RunRecorder, versions, write_json_atomic
from common.runtime import atomic_write_bytes, process_rank, remove_stale_temp_files
from common.safe_io import open_regular, read_regular, regular_file, weights_problem
from common.sealed import SEAL_BYTES, machine_key, seal, seal_arrays, seal_json, unseal, unseal_json

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
    return unseal(data, f"checkpoint {path}", CHECKPOINT_FIX, trust=str(path))


def trust_checkpoint(path: Path) -> None:
    """`python -m benchmarks.trust`: re-seal a checkpoint file (torch's .pt, JAX's .msgpack, MXNet's
    index .json) with this machine's key once its content matches its sha256: a checkpoint
    written on another machine, which `--resume` refuses until the user says it is theirs."""
    where, fix = f"checkpoint {path}", "it cannot be trusted as it is"
    data = read_checkpoint(path, None)
    if path.suffix == ".json":
        try:
            obj = json.loads(data)
        except ValueError:
            obj = None  # unseal_json: "no content digest"
        write_json_atomic(path, seal_json(unseal_json(obj, where, fix, keyed=False)))
    else:
        atomic_write_bytes(path, seal(unseal(data, where, fix, keyed=False)))


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


LOCK_NAME = ".lock"


def lock_checkpoint_dir(cfg: Config) -> Any:
    """Hold an exclusive lock on `--checkpoint-dir` for the life of this process (rank 0 only:
    the other ranks of a job write no checkpoint), so that two runs, a `--resume` and a run it
    races with say, never write the same checkpoint. A second run is refused with one line.
    Returns the open lock file (closing it, or the process ending, releases the lock)."""
    if not cfg.checkpoint_dir or process_rank() != 0:
        return None
    machine_key()  # made or read now: a home folder where it cannot be kept is one line at start
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
