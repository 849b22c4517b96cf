"""What every framework's checkpoint holds besides its tensors, and how it is written, read and
checked; each framework's support module hands its trainers one `Checkpoints`. A checkpoint of
another run or past `--epochs`, a file damaged or cut short (its sha256, written with it in one
atomic write, checked before anything is loaded), a full disk, a second run on the same
`--checkpoint-dir`: each is one line (docs/reliability.md). No checkpoint runs code.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import Config, check_same_run
from common.errors import ConfigError, WriteFailed, first_line
from common.init import digest
from common.results import RunRecorder, versions, write_json_atomic
from common.runtime import atomic_write_bytes, process_rank

CHECKPOINT_FORMAT = 2  # what checkpoint_meta writes; a checkpoint without it predates the checks
CHECKPOINT_FIX = "delete it or drop --resume"
DIGEST = b"\n#dp-bench sha256 "  # a checkpoint file: its payload, DIGEST, 64 hex digits, "\n"


@dataclass(frozen=True)
class Checkpoints:
    """A framework's checkpoint I/O (its support module's `CHECKPOINTS`): `path(cfg)`, the file
    (MXNet: the index naming its weights and optimiser files); `save(cfg, state, recorder,
    epoch)`; `load(cfg, state, recorder) -> (state, epoch to continue from)`; `meta_of(path)`,
    the `checkpoint_meta` saved in it (for `check_resume`)."""

    path: Callable[[Config], Path]
    save: Callable[[Config, Any, RunRecorder, int], None]
    load: Callable[[Config, Any, RunRecorder], tuple[Any, int]]
    meta_of: Callable[[Path], dict[str, Any]]


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
    """Check checkpoint `path`'s metadata against this run (`check_meta`; `run_binding`: the
    same devices, versions, execution), restore the recorder; return (next epoch, step)."""
    where = f"checkpoint {path}"
    check_meta(recorder.cfg, meta, where)
    now, saved = run_binding(recorder), meta.get("run") or {}
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
    (check_same_run), an epoch within --epochs. ConfigError (one line) otherwise."""
    if not isinstance(meta, dict) or meta.get("format") != CHECKPOINT_FORMAT:
        got = f"format {meta['format']!r}" if isinstance(meta, dict) and "format" in meta else None
        raise ConfigError(
            f"{where} has {got or 'no format'}, not checkpoint format {CHECKPOINT_FORMAT} (written "
            "by another version of dp-bench, or not a checkpoint); use a new --checkpoint-dir"
        )
    check_same_run(meta["config"], cfg, where.removeprefix("checkpoint "))
    if meta["epoch"] > cfg.epochs:
        raise ConfigError(
            f"{where} is after epoch {meta['epoch']} but --epochs is {cfg.epochs}; resume with "
            f"--epochs {meta['epoch']} or more, or use a new --checkpoint-dir"
        )


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def damaged(where: str, fix: str = CHECKPOINT_FIX) -> ConfigError:
    return ConfigError(
        f"cannot read {where} (damaged or cut short: its content does not match the sha256 "
        f"written with it); {fix}"
    )


def write_checkpoint(path: Path, payload: bytes) -> None:
    """A checkpoint file: `payload` (torch's .pt, JAX's .msgpack) and its sha256, in one atomic
    write; a full disk is one line, no temp file left."""
    with writing_checkpoint(path):
        atomic_write_bytes(path, payload + DIGEST + sha256_hex(payload).encode() + b"\n")


def read_checkpoint(path: Path) -> bytes:
    """The payload of a `write_checkpoint` file once it matches its sha256."""
    payload, _, tail = Path(path).read_bytes().rpartition(DIGEST)
    if tail != sha256_hex(payload).encode() + b"\n":
        raise damaged(f"checkpoint {path}")
    return payload


def check_digest(path: Path, want: Any) -> None:
    """A file a checkpoint index names (MXNet's weights, optimiser states) has sha256 `want`."""
    if sha256_hex(Path(path).read_bytes()) != want:
        raise damaged(f"checkpoint {path}")


def json_digest(obj: dict[str, Any]) -> str:
    """sha256 of `obj` without its "sha256" field, as canonical JSON."""
    rest = {k: v for k, v in obj.items() if k != "sha256"}
    return sha256_hex(json.dumps(rest, sort_keys=True, separators=(",", ":")).encode())


def write_index(path: Path, obj: dict[str, Any]) -> None:
    """A checkpoint index (JSON) with the sha256 of its fields, in one atomic write."""
    with writing_checkpoint(path):
        write_json_atomic(path, {**obj, "sha256": json_digest(obj)})


def read_index(path: Path) -> dict[str, Any]:
    """A `write_index` file once its fields match its sha256."""
    try:
        obj = json.loads(Path(path).read_bytes())
    except ValueError:
        obj = None
    if not (isinstance(obj, dict) and obj.get("sha256") == json_digest(obj)):
        raise damaged(f"checkpoint {path}")
    return obj


def save_final_state(cfg: Config, arrays: dict[str, Any]) -> None:
    """`--save-state PATH`: the final parameters and BN statistics (numpy, torch's names and
    layouts) as one .npz, written atomically, the sha256 of its arrays as its zip comment."""
    if not cfg.save_state:
        return
    plain = {k: np.asarray(v) for k, v in arrays.items()}
    buf = io.BytesIO()
    np.savez(buf, **plain)  # type: ignore[arg-type]  # numpy's stub: allow_pickle in **kwds
    with zipfile.ZipFile(buf, "a") as archive:
        archive.comment = json.dumps({"sha256": digest(plain)}).encode()
    try:
        atomic_write_bytes(cfg.save_state, buf.getvalue())
    except OSError as exc:  # a full disk: one line, the record says failed
        raise WriteFailed(
            f"cannot write --save-state {cfg.save_state} ({exc.strerror or exc}): free some "
            "space or give another --save-state",
            cfg.save_state,
        ) from None


def load_saved_state(path: Path, fix: str) -> dict[str, np.ndarray]:
    """The arrays of a `save_final_state` file once they match its sha256, else ConfigError."""
    try:
        with np.load(path, allow_pickle=False) as f:
            arrays = {k: f[k] for k in f.files}
            want = json.loads(f.zip.comment or b"{}").get("sha256")
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise ConfigError(f"cannot read saved state {path} ({first_line(exc)}); {fix}") from None
    if digest(arrays) != want:
        raise damaged(f"saved state {path}", fix)
    return arrays


@contextmanager
def writing_checkpoint(
    path: Path, errors: tuple[type[BaseException], ...] = (OSError,)
) -> Iterator[None]:
    """Around a checkpoint write: an OSError (a full disk; or one of the framework's `errors`
    that its C++ writer raises instead) is `WriteFailed`, one line."""
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
    """Around the load of a checkpoint: whatever the loader raised is one line, exit 2."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:
        raise ConfigError(
            f"cannot read checkpoint {path} ({type(exc).__name__}: {first_line(exc)}); "
            f"{CHECKPOINT_FIX}"
        ) from None


def check_resume(cfg: Config, checkpoints: Checkpoints) -> None:
    """Refuse to resume from a checkpoint that does not belong to this run (`check_meta`:
    format, settings, epochs; one line) before any work."""
    path = checkpoints.path(cfg)
    if not (cfg.resume and path.exists()):
        return
    with reading_checkpoint(path):
        meta = checkpoints.meta_of(path)
    check_meta(cfg, meta, f"checkpoint {path}")


LOCK_NAME = ".lock"


def lock_checkpoint_dir(cfg: Config) -> Any:
    """Hold an exclusive lock on `--checkpoint-dir` for the life of this process (rank 0: the
    others write no checkpoint), so that two runs never write the same checkpoint; a second is
    refused with one line. Returns the open lock file (closing it releases the lock)."""
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
    return handle
