"""Opening what the project loads, bounded: checkpoints, the init cache, dataset files
and their verification marker. Nothing is trusted because of its name.

- A file is opened only if it is a regular file once symbolic links are followed (a FIFO in its
  place would block the reader for ever; a link to /dev/zero would feed it until memory runs
  out), and only if it is no larger than what its configuration can need (`limit`, given by the
  loader). Checked with stat before the open (a device is never opened), and again on the open
  file (the file read is the file checked; O_NONBLOCK: a FIFO swapped in between cannot block).
- An archive is checked member by member before anything is inflated: a .npz (a zip) holds
  exactly the members its loader expects, each no larger (ZipInfo.file_size, the uncompressed
  size) than its array needs, and each .npy header gives the expected shape and dtype before
  its body is read.
- `weights_problem`: weights no initialiser and no training gives (a non-finite value, a weight
  tensor of zeros).

A file of the wrong kind or size raises `error` (ConfigError by default; datasets pass
DatasetError): one line naming the file, what is wrong and the fix (exit 2). `Mismatch` is a
file of the right kind that holds something else (other members, shapes, a damaged archive):
a cache is rebuilt, a checkpoint refused. What a file claims to be (the configuration it was
made for, its epoch) is checked by its loader: common/trainer.py (checkpoints), common/init.py
(the init cache), common/datasets.py (datasets).
"""

from __future__ import annotations

import math
import os
import stat
import zipfile
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from common.errors import ConfigError

NPY_HEADER_MAX = 1024  # an .npy member's magic and header (numpy writes 128 bytes)
ZIP_MEMBER_OVERHEAD = 1024  # a zip's local and central headers of one member (name, zip64)
ZIP_OVERHEAD = 64 << 10  # a zip's end records and comment


class Mismatch(ValueError):
    """A regular file of sane size that does not hold what its loader expects."""


def file_kind(mode: int) -> str:
    """What a stat mode is, for messages ("a FIFO", "a directory", ...)."""
    for test, kind in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISCHR, "a character device"),
                       (stat.S_ISBLK, "a block device")):  # fmt: skip
        if test(mode):
            return kind
    return "not a regular file"


def _check(
    st: os.stat_result, path: Path, limit: int | None, what: str, fix: str, error: type[Exception]
) -> None:
    where = f"{what} {path}" if what else str(path)
    if not stat.S_ISREG(st.st_mode):
        raise error(f"{where} is {file_kind(st.st_mode)}, not a file; {fix}")
    if limit is not None and st.st_size > limit:
        raise error(
            f"{where} is {st.st_size} bytes, more than this configuration's "
            f"{what or 'file'} can hold ({limit}); {fix}"
        )


def regular_file(
    path: str | os.PathLike[str],
    limit: int | None,
    what: str,
    fix: str,
    error: type[Exception] = ConfigError,
) -> os.stat_result:
    """stat `path` (links followed; nothing opened): a regular file of at most `limit` bytes
    (None: any size), else `error`. FileNotFoundError passes through."""
    path = Path(path)
    st = os.stat(path)
    _check(st, path, limit, what, fix, error)
    return st


@contextmanager
def open_regular(
    path: str | os.PathLike[str],
    limit: int | None,
    what: str,
    fix: str,
    error: type[Exception] = ConfigError,
) -> Iterator[BinaryIO]:
    """`path` open for binary reading once `regular_file` holds, checked again on the open file."""
    path = Path(path)
    regular_file(path, limit, what, fix, error)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        _check(os.fstat(fd), path, limit, what, fix, error)
        os.set_blocking(fd, True)
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        yield f


def read_regular(
    path: str | os.PathLike[str],
    limit: int | None,
    what: str,
    fix: str,
    error: type[Exception] = ConfigError,
) -> bytes:
    """The bytes of `path` (`open_regular`); never more than `limit` (a file that grows while
    it is read is refused)."""
    with open_regular(path, limit, what, fix, error) as f:
        data = f.read() if limit is None else f.read(limit + 1)
    if limit is not None and len(data) > limit:
        raise error(f"{what} {path} grew past {limit} bytes while it was read; {fix}")
    return data


def npy_bytes(shape: tuple[int, ...], dtype: Any) -> int:
    return math.prod(shape) * np.dtype(dtype).itemsize


def load_npz(
    path: str | os.PathLike[str],
    expected: Mapping[str, tuple[tuple[int, ...], Any]],
    what: str,
    fix: str,
    error: type[Exception] = ConfigError,
) -> tuple[dict[str, np.ndarray], bytes]:
    """The arrays of .npz `path`, which must hold exactly `expected` ({name: (shape, dtype)}),
    and the archive's comment (where a cache keeps its key; b"" when it has none).
    The file is no larger than those arrays and their headers need; a member that no such file
    has, or that would inflate past its array (ZipInfo.file_size), is `error` before anything is
    inflated; a member missing, of another shape or dtype, or damaged is `Mismatch`."""
    caps = {f"{n}.npy": npy_bytes(s, d) + NPY_HEADER_MAX for n, (s, d) in expected.items()}
    limit = sum(caps.values()) + ZIP_MEMBER_OVERHEAD * len(caps) + ZIP_OVERHEAD
    where = f"{what} {path}"
    with open_regular(path, limit, what, fix, error) as f:
        try:
            archive = zipfile.ZipFile(f)
        except (zipfile.BadZipFile, zipfile.LargeZipFile, OSError, ValueError, EOFError) as exc:
            raise Mismatch(f"not an .npz archive ({exc})") from None
        with archive:
            infos = archive.infolist()
            for info in infos:  # by the headers alone: nothing inflated yet
                cap = caps.get(info.filename)
                if cap is None:
                    raise error(f"{where} holds a member {info.filename[:60]!r} that no {what} "
                                f"has ({info.file_size} bytes); {fix}")  # fmt: skip
                if info.file_size > cap:
                    raise error(f"{where}: member {info.filename} inflates to {info.file_size} "
                                f"bytes, more than its array needs ({cap}); {fix}")  # fmt: skip
            names = sorted(i.filename for i in infos)
            if names != sorted(caps):
                missing = sorted(set(caps) - set(names)) or ["a member twice"]
                raise Mismatch(f"it lacks {missing[0]}")
            out = {}
            for info in infos:
                name = info.filename[: -len(".npy")]
                try:
                    with archive.open(info) as member:
                        out[name] = _read_npy(member, name, *expected[name])  # type: ignore[arg-type]  # a ZipExtFile reads as a BinaryIO
                except (zipfile.BadZipFile, OSError, EOFError, zlib.error, RuntimeError,
                        NotImplementedError, ValueError) as exc:  # fmt: skip
                    raise Mismatch(f"member {name}: {exc}") from None
            comment = archive.comment
    return out, comment


def _read_npy(member: BinaryIO, name: str, shape: tuple[int, ...], dtype: Any) -> np.ndarray:
    """One .npy of `shape` and `dtype`: the header first, then exactly the body it needs."""
    version = np.lib.format.read_magic(member)
    if version == (1, 0):
        got_shape, fortran, got_dtype = np.lib.format.read_array_header_1_0(member)
    elif version == (2, 0):
        got_shape, fortran, got_dtype = np.lib.format.read_array_header_2_0(member)
    else:
        raise Mismatch(f"member {name}: .npy version {version}")
    if tuple(got_shape) != tuple(shape) or got_dtype != np.dtype(dtype):
        raise Mismatch(
            f"{name} is {got_dtype}{tuple(got_shape)}, expected {np.dtype(dtype)}{tuple(shape)}"
        )
    out = np.empty(math.prod(shape), np.dtype(dtype))
    view, size, pos = memoryview(out).cast("B"), npy_bytes(shape, dtype), 0  # type: ignore[arg-type]
    while pos < size:
        chunk = member.read(min(1 << 20, size - pos))
        if not chunk:
            raise Mismatch(f"member {name} is truncated")
        view[pos : pos + len(chunk)] = chunk
        pos += len(chunk)
    return out.reshape(shape, order="F" if fortran else "C")


def weights_problem(arrays: Mapping[str, Any]) -> str | None:
    """Why `arrays` (a model's parameters and statistics, numpy) cannot be weights that an
    initialiser or training made, or None: a NaN or infinity anywhere, or a weight tensor (a
    conv or linear weight: 2 dimensions or more, in every framework's layout) of zeros only."""
    for name, value in arrays.items():
        a = np.asarray(value)
        if a.dtype.kind != "f":
            continue
        if not np.isfinite(a).all():
            return f"{name} holds NaN or infinite values"
        if a.ndim >= 2 and a.size and not a.any():
            return f"{name} is all zeros"
    return None
