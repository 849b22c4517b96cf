"""Datasets as uint8 NHWC numpy arrays with integer labels.

Real files are read in their official formats, never by executing code from them, and never
by inflating more than the official file holds: every file on disk is checked against the
published MD5 checksum (once; `<dir>/.verified.json` remembers it by size, mtime, ctime, inode
and a sample of its bytes; `--no-verify` skips it with a warning), and the readers are bounded
whether it was or not.
CIFAR's pickles go through a restricted unpickler that builds plain integer arrays, lists, bytes
and dicts only (nothing it reads is called); archives are read member by member in memory,
each member's size checked against the official one before it is read (nothing is extracted,
so no member can land outside the data directory); idx files are read header first, and a shape
beyond the official one is refused before its body is inflated. Labels are range-checked and
counted against the images at load time, for every dataset. Missing files are downloaded when
`download` is on and the network is reachable; otherwise one clear error says which files to
put where.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.util
import io
import json
import math
import os
import pickle
import struct
import sys
import tarfile
import tempfile
import urllib.request
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.config import train_size as train_size  # re-exported: its old home (common/memory.py)
from common.errors import DatasetError
from common.safe_io import open_regular, read_regular, regular_file


@dataclass(frozen=True)
class Dataset:
    name: str
    train_x: np.ndarray  # (N, H, W, C) uint8
    train_y: np.ndarray  # (N,) int32
    test_x: np.ndarray  # (M, H, W, C) uint8
    test_y: np.ndarray  # (M,) int32
    num_classes: int
    mean: tuple[float, ...]  # per channel, on the [0, 1] scale
    std: tuple[float, ...]
    flip: bool  # horizontal flips are label-preserving

    @property
    def image_shape(self) -> tuple[int, int, int]:
        return tuple(self.train_x.shape[1:])  # type: ignore[return-value]

    @property
    def channels(self) -> int:
        return int(self.train_x.shape[3])


# Official files and published MD5 checksums (the same ones torchvision verifies).
SOURCES: dict[str, dict[str, tuple[str, str]]] = {
    "cifar10": {
        "cifar-10-python.tar.gz": (
            "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
            "c58f30108f718f92721af3b95e74349a",
        ),
    },
    "cifar100": {
        "cifar-100-python.tar.gz": (
            "https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
            "eb9058c3a382ffc7106e4002c42a8d85",
        ),
    },
    "fashion-mnist": {
        name: ("http://fashion-mnist.s3-website.eu-central-1.amazonaws.com/" + name, md5)
        for name, md5 in [
            ("train-images-idx3-ubyte.gz", "8d4fb7e6c68d591d4c3dfef9ec88bf0d"),
            ("train-labels-idx1-ubyte.gz", "25c81989df183df01b3e8a0aad5dffbe"),
            ("t10k-images-idx3-ubyte.gz", "bef4ecab320f06d8554ea6380940ec79"),
            ("t10k-labels-idx1-ubyte.gz", "bb300cfdad3c16e7a12a480ee83cd310"),
        ]
    },
}
# The official files' sizes in bytes, by MD5: a file of another size cannot have that checksum,
# so it is refused without hashing it (and a download stops there).
SIZES: dict[str, int] = {
    "c58f30108f718f92721af3b95e74349a": 170_498_071,
    "eb9058c3a382ffc7106e4002c42a8d85": 169_001_437,
    "8d4fb7e6c68d591d4c3dfef9ec88bf0d": 26_421_880,
    "25c81989df183df01b3e8a0aad5dffbe": 29_515,
    "bef4ecab320f06d8554ea6380940ec79": 4_422_102,
    "bb300cfdad3c16e7a12a480ee83cd310": 5_148,
}
# What the official files hold, for the bounded readers (which also serve --no-verify).
# CIFAR: archive folder, {member: images}, label key, classes.
CIFAR: dict[str, tuple[str, dict[str, int], bytes, int]] = {
    "cifar10": (
        "cifar-10-batches-py",
        {**{f"data_batch_{i}": 10_000 for i in range(1, 6)}, "test_batch": 10_000},
        b"labels",
        10,
    ),
    "cifar100": ("cifar-100-python", {"train": 50_000, "test": 10_000}, b"fine_labels", 100),
}
# Fashion-MNIST: the idx shape of each file (a header may give fewer images, never more).
IDX_SHAPES: dict[str, tuple[int, ...]] = {
    "train-images-idx3-ubyte.gz": (60_000, 28, 28),
    "train-labels-idx1-ubyte.gz": (60_000,),
    "t10k-images-idx3-ubyte.gz": (10_000, 28, 28),
    "t10k-labels-idx1-ubyte.gz": (10_000,),
}
STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
}
# Bytes a CIFAR member may hold beyond its pixels: per image (its label(s) and file name, about
# 50 in the official files) and per member (keys, pickle framing).
PER_IMAGE_EXTRA, PER_MEMBER_EXTRA = 128, 64 << 10
OTHER_MEMBER_MAX = 1 << 20  # an archive member the reader does not use (readme, meta)
MAX_MEMBERS = 32  # the official archives hold 9 (CIFAR-10) and 5 (CIFAR-100), folders included
VERIFIED = ".verified.json"  # per dataset directory: {file: _marker(...)} of the files checked
SAMPLES, SAMPLE_BYTES = 16, 64 << 10  # the blocks of a verified file re-read on every load


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with _open_regular(path) as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(url: str, md5: str, dest: Path, timeout: float = 30.0) -> Path:
    """Download `url` to `dest` atomically, verifying its MD5; never leaves a partial file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    limit = SIZES.get(md5)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            got = 0
            while block := resp.read(1 << 20):
                got += len(block)
                if limit is not None and got > limit:
                    raise DatasetError(
                        f"download of {dest.name} from {url} is larger than the official file "
                        f"({limit} bytes); the server does not serve the official file"
                    )
                out.write(block)
        got_md5 = md5sum(Path(tmp))
        if got_md5 != md5:
            raise DatasetError(
                f"checksum mismatch for {dest.name} from {url}: MD5 {got_md5}, expected {md5}; "
                "the download is corrupt or not the official file; delete it and retry"
            )
        os.replace(tmp, dest)
        return dest
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _check_regular(path: Path) -> os.stat_result:
    """A dataset file must be a regular file (symlinks followed): a FIFO or device in its place
    would block or never end, so it is refused before it is opened (common/safe_io.py)."""
    return regular_file(path, None, "", f"put the official {path.name} there", DatasetError)


def _open_regular(path: Path) -> Any:
    """`path` open for reading if it is a regular file (common/safe_io.py), else DatasetError."""
    return open_regular(path, None, "", f"put the official {path.name} there", DatasetError)


def _read_verified(root: Path) -> dict[str, Any]:
    """The verification marker of `root` ({} when absent, unreadable or not a small regular
    file: verify again)."""
    try:
        cache = json.loads(read_regular(root / VERIFIED, 1 << 16, "", "", DatasetError))
        return cache if isinstance(cache, dict) else {}
    except (OSError, ValueError, DatasetError):
        return {}


def _marker(path: Path, st: os.stat_result, md5: str) -> list[Any]:
    """What `.verified.json` records of a verified file: its size, mtime, ctime and inode (a
    file rewritten, or replaced and its mtime set back, has another ctime or inode; ctime
    cannot be set back), its MD5, and the sha256 of SAMPLES blocks spread over it (read on
    every load: a file rewritten in place within one tick of the ctime clock, or a marker
    written by hand, does not match it)."""
    digest = hashlib.sha256()
    with _open_regular(path) as f:
        for i in range(SAMPLES):
            f.seek(max(0, st.st_size - SAMPLE_BYTES) * i // (SAMPLES - 1))
            digest.update(f.read(SAMPLE_BYTES))
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, md5, digest.hexdigest()]


def _write_verified(root: Path, cache: dict[str, Any]) -> None:
    """Record verified files (atomically; a read-only data directory just verifies every time)."""
    tmp = root / f"{VERIFIED}.tmp{os.getpid()}"
    try:
        tmp.write_text(json.dumps(cache, indent=1, sort_keys=True))
        os.replace(tmp, root / VERIFIED)
    except OSError:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass


def verify_files(name: str, paths: dict[str, Path]) -> None:
    """Check every file of dataset `name` against its published MD5 (size first); each file is
    hashed once and remembered in `<dir>/.verified.json` (`_marker`: size, mtime, ctime, inode,
    MD5 and a sample of its bytes); a file that no longer matches its marker is hashed again."""
    if not paths:
        return
    root = next(iter(paths.values())).parent
    cache = _read_verified(root)
    before = dict(cache)
    for filename, path in paths.items():
        md5 = SOURCES[name][filename][1]
        st = _check_regular(path)
        seen = cache.get(filename)
        if isinstance(seen, list) and seen[:5] == [st.st_size, st.st_mtime_ns, st.st_ctime_ns,
                                                    st.st_ino, md5]:  # fmt: skip
            if seen == _marker(path, st, md5):
                continue
        size = SIZES.get(md5)
        if size is not None and st.st_size != size:
            raise DatasetError(
                f"{path} is {st.st_size} bytes, the official {filename} is {size}: it is "
                "damaged or not the official file; delete it and download it again "
                "(--no-verify skips this check)"
            )
        got = md5sum(path)
        if got != md5:
            raise DatasetError(
                f"{path} has MD5 {got}, the official {filename} has {md5}: it is damaged or "
                "not the official file; delete it and download it again (--no-verify skips "
                "this check)"
            )
        cache[filename] = _marker(path, st, md5)
    if cache != before:
        _write_verified(root, cache)


@contextmanager
def dataset_io(name: str, root: Path) -> Iterator[None]:
    """Around the file-system work on dataset `name` in `root`: an OSError (a directory that
    cannot be read or listed, EACCES, EIO, ENAMETOOLONG) is one DatasetError naming the path,
    exit 2, not a traceback."""
    try:
        yield
    except OSError as exc:
        where = exc.filename or root
        raise DatasetError(
            f"dataset {name!r}: cannot read {where} ({exc.strerror or exc}); check that "
            f"--data-dir holds {root.name}/ and that it is readable"
        ) from None


def ensure_files(
    name: str, data_dir: str | os.PathLike[str], download: bool, verify: bool = True
) -> dict[str, Path]:
    """Return the paths of `name`'s official files, downloading missing ones if allowed, each a
    regular file and (`verify`) checked against its published MD5."""
    root = Path(data_dir) / name
    with dataset_io(name, root):
        return _ensure_files(name, root, download, verify)


def _ensure_files(name: str, root: Path, download: bool, verify: bool) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    missing = []
    for filename, (url, md5) in SOURCES[name].items():
        path = root / filename
        if not path.exists() and download:
            try:
                fetch(url, md5, path)
            except DatasetError:
                raise
            except OSError as exc:  # offline, DNS failure, HTTP error
                missing.append((filename, url, f"download failed: {exc}"))
                continue
        if not path.exists():
            missing.append((filename, url, "not downloaded (--no-download)"))
            continue
        _check_regular(path)
        paths[filename] = path
    if missing:
        names = ", ".join(m[0] for m in missing)
        raise DatasetError(
            f"dataset {name!r} is not on disk: put {names} in {root}/ "
            f"(from {missing[0][1].rsplit('/', 1)[0]}/); {missing[0][2]}"
        )
    if verify:
        verify_files(name, paths)
    return paths


# ---- CIFAR's pickles -----------------------------------------------------------------------
# An official batch is a protocol-2 pickle of {b"data": (N, 3072) uint8 ndarray, b"labels":
# [int] (CIFAR-100: b"fine_labels", b"coarse_labels"), b"filenames": [bytes], ...}. numpy writes
# the array as _reconstruct(ndarray, (0,), b"b") followed by __setstate__((1, shape, dtype,
# fortran, raw bytes)), the dtype as dtype("u1", 0, 1) with __setstate__((3, "|", None, ...)).
# The unpickler below calls no numpy function with the file's arguments: `find_class` hands out
# stand-ins that accept exactly those calls, check the shape against the bytes that are really
# in the file, and build the array with np.frombuffer (so an array can never be larger than the
# pickle). Anything else (copyreg._reconstructor, object arrays, sub-array dtypes) is refused.


def _refuse(what: str) -> DatasetError:
    return DatasetError(
        f"refusing to unpickle {what}: a dataset file must not execute code or build anything "
        "but plain arrays; the file is not an official CIFAR batch"
    )


def _text(value: object) -> object:
    return value.decode("latin1") if isinstance(value, bytes) else value


class _DType:
    """Stand-in for numpy.dtype(name, align, copy): integer types only, no fields/sub-arrays."""

    NAMES = ("u1", "i1", "u2", "i2", "u4", "i4", "u8", "i8")

    def __init__(self, name: object, align: object = 0, copy: object = 1) -> None:
        if _text(name) not in self.NAMES:
            raise _refuse(f"numpy.dtype({name!r})")
        self.name = str(_text(name))
        self.order = "|"

    def __setstate__(self, state: object) -> None:
        plain = (
            isinstance(state, tuple)
            and len(state) in (8, 9)
            and _text(state[1]) in ("|", "<", ">", "=")
            and state[2:5] == (None, None, None)  # no sub-array, no field names, no fields
        )
        if not plain:
            raise _refuse(f"a numpy.dtype state {str(state)[:80]}")
        self.order = str(_text(state[1]))  # type: ignore[index]

    def resolve(self) -> np.dtype:
        return np.dtype(self.name if self.order in "|=" else self.order + self.name)


_NDARRAY = object()  # stand-in for numpy.ndarray: only _reconstruct may take it


class _Array:
    """Stand-in for the empty array numpy's _reconstruct makes; __setstate__ fills it."""

    array: np.ndarray | None = None

    def __setstate__(self, state: object) -> None:
        if not (isinstance(state, tuple) and len(state) == 5):
            raise _refuse("an ndarray state that is not (version, shape, dtype, order, bytes)")
        _, shape, dtype, fortran, raw = state
        if isinstance(raw, str):
            raw = raw.encode("latin1")
        ok = (
            isinstance(shape, tuple)
            and len(shape) <= 4
            and all(type(d) is int and d >= 0 for d in shape)
            and isinstance(dtype, _DType)
            and isinstance(raw, bytes)
        )
        if not ok:
            raise _refuse(f"an ndarray of shape {str(shape)[:60]} with {type(raw).__name__} data")
        dt = dtype.resolve()
        if math.prod(shape) * dt.itemsize != len(raw):
            raise _refuse(f"an ndarray of shape {shape} from {len(raw)} bytes of data")
        self.array = np.frombuffer(raw, dt).reshape(shape, order="F" if fortran else "C")


def _reconstruct(cls: object, shape: object, typecode: object) -> _Array:
    if cls is not _NDARRAY or shape != (0,) or _text(typecode) != "b":
        raise _refuse(f"numpy _reconstruct({str(cls)[:40]}, {str(shape)[:40]}, {typecode!r})")
    return _Array()


def _encode(text: object, encoding: object = "utf-8") -> bytes:
    """_codecs.encode(str, 'latin1'): how protocol 2 writes bytes from Python 3."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise _refuse(f"_codecs.encode(..., {encoding!r})")
    return text.encode("latin1")


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only what CIFAR's pickles need: dicts, lists, ints, bytes and plain integer
    arrays, each global replaced by a checking stand-in (see above)."""

    GLOBALS: dict[tuple[str, str], object] = {
        ("numpy.core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy._core.multiarray", "_reconstruct"): _reconstruct,
        ("numpy", "ndarray"): _NDARRAY,
        ("numpy", "dtype"): _DType,
        ("_codecs", "encode"): _encode,
    }

    def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
        if (module, name) in self.GLOBALS:
            return self.GLOBALS[(module, name)]
        raise _refuse(f"{module}.{name}")


def safe_unpickle(data: bytes) -> object:
    """Unpickle a CIFAR batch; the stand-in arrays are replaced by the numpy arrays built."""
    obj = _RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()
    if isinstance(obj, dict):
        for key, value in obj.items():
            if isinstance(value, _Array):
                if value.array is None:
                    raise _refuse("an ndarray without its data")
                obj[key] = value.array
    return obj


def _labels(values: object, n: int, classes: int, where: str) -> np.ndarray:
    """`values` as (n,) int32 labels in [0, classes), or one clear error."""
    y = np.asarray(values) if isinstance(values, (list, np.ndarray)) else np.zeros((0, 0))
    if y.ndim != 1 or (y.size and y.dtype.kind not in "iu"):
        raise DatasetError(
            f"{where}: labels must be a list of integers (got {type(values).__name__} of "
            f"{y.dtype}); the file is damaged or not the official one, download it again"
        )
    check_labels(y, n, classes, where)
    return y.astype(np.int32)


def check_labels(y: np.ndarray, n: int, classes: int, where: str) -> None:
    """Labels match the images one to one and lie in [0, classes)."""
    if len(y) != n:
        raise DatasetError(
            f"{where}: {n} images but {len(y)} labels; the file is damaged or not the official "
            "one, download it again"
        )
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= classes):
        bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
        raise DatasetError(
            f"{where}: label {bad} is outside 0..{classes - 1}; the file is damaged or not the "
            "official one, download it again"
        )


def _cifar_batch(
    blob: bytes, label_key: bytes, classes: int, max_images: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    try:
        d = safe_unpickle(blob)
    except DatasetError:
        raise
    except Exception as exc:  # truncated or not a pickle at all
        raise DatasetError(
            f"cannot read {where}: {type(exc).__name__}: {str(exc)[:120]}; the file is damaged, "
            "re-download it"
        ) from None
    if not isinstance(d, dict) or b"data" not in d or label_key not in d:
        raise DatasetError(f"{where} is not a CIFAR batch (keys b'data' and {label_key!r})")
    x = d[b"data"]
    if not (isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 2):
        raise DatasetError(f"{where}: b'data' must be (N, 3072) uint8 rows")
    if x.shape[1] != 3072 or not 1 <= len(x) <= max_images:
        raise DatasetError(
            f"{where}: expected (N, 3072) uint8 rows with N <= {max_images}, got {x.shape}"
        )
    y = _labels(d[label_key], len(x), classes, where)
    x = x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # (N, 32, 32, 3)
    return np.ascontiguousarray(x), y


class _Capped:
    """A read-only, forward-seeking view of a decompressed stream that refuses to go past
    `limit` bytes or to read more than `per_read` bytes at once, so that no header inside an
    archive (a tar size, a pax record) can make the reader inflate more than the official
    file holds."""

    def __init__(self, raw: Any, limit: int, per_read: int, where: str) -> None:
        self.raw, self.limit, self.per_read, self.where = raw, limit, per_read, where

    def _refuse(self, what: str) -> DatasetError:
        return DatasetError(
            f"{self.where} {what}; it is not the official archive, delete it and download it again"
        )

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > self.per_read:
            raise self._refuse(
                f"asks to read {size if size >= 0 else 'all'} bytes at once, more than any "
                f"member of the official archive ({self.per_read})"
            )
        if self.raw.tell() + size > self.limit:
            raise self._refuse(f"inflates past {self.limit} bytes, more than the official one")
        return self.raw.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        target = offset if whence == 0 else self.raw.tell() + offset if whence == 1 else -1
        if target < 0 or target > self.limit:
            raise self._refuse(f"inflates past {self.limit} bytes, more than the official one")
        return self.raw.seek(target)

    def tell(self) -> int:
        return self.raw.tell()


def read_members(archive: Path, wanted: dict[str, int]) -> dict[str, bytes]:
    """The members `wanted` ({name: most bytes}) of tar.gz `archive`, each checked by its header
    (a regular file, no larger than allowed) before it is read; nothing is extracted."""
    per_read = max(wanted.values())
    limit = sum(wanted.values()) + (MAX_MEMBERS + 1) * (OTHER_MEMBER_MAX + 1024)
    out: dict[str, bytes] = {}
    try:
        with _open_regular(archive) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as gz:
            capped: Any = _Capped(gz, limit, per_read, archive.name)  # a readable file object
            with tarfile.open(fileobj=capped, mode="r:") as tar:
                for count, info in enumerate(tar, 1):
                    if count > MAX_MEMBERS:
                        raise DatasetError(
                            f"{archive.name} holds more than {MAX_MEMBERS} members; it is not "
                            "the official archive, delete it and download it again"
                        )
                    most = wanted.get(info.name, OTHER_MEMBER_MAX)
                    if info.size > most:
                        raise DatasetError(
                            f"{archive.name}: member {info.name} is {info.size} bytes, the "
                            f"official one at most {most}; it is not the official archive, "
                            "delete it and download it again"
                        )
                    if info.name not in wanted:
                        continue
                    if not info.isreg() or info.name in out:
                        raise DatasetError(
                            f"{archive.name}: member {info.name} is not one regular file; "
                            "it is not the official archive, delete it and download it again"
                        )
                    f = tar.extractfile(info)
                    assert f is not None  # a regular member
                    out[info.name] = f.read(info.size)
    except DatasetError:
        raise
    except (tarfile.TarError, EOFError, OSError, zlib.error) as exc:
        raise DatasetError(
            f"cannot read {archive}: {exc!r}; the archive is truncated or not the official "
            f"file; delete it and download it again"
        ) from None
    absent = [m for m in wanted if m not in out]
    if absent:
        raise DatasetError(
            f"{archive} has no member {absent[0]}; the archive is truncated or not the "
            "official file; delete it and download it again"
        )
    return out


def load_cifar(name: str, data_dir: str, download: bool, verify: bool = True) -> Dataset:
    (archive,) = ensure_files(name, data_dir, download, verify).values()
    folder, members, label_key, classes = CIFAR[name]
    caps = {
        f"{folder}/{m}": n * (3072 + PER_IMAGE_EXTRA) + PER_MEMBER_EXTRA for m, n in members.items()
    }
    blobs = read_members(archive, caps)
    batches = {}
    for member, n in members.items():
        where = f"{archive.name}:{folder}/{member}"
        blob = blobs.pop(f"{folder}/{member}")  # freed as soon as it is parsed
        batches[member] = _cifar_batch(blob, label_key, classes, n, where)
    train = [b for m, b in batches.items() if not m.startswith("test")]
    test = [b for m, b in batches.items() if m.startswith("test")]
    mean, std = STATS[name]
    return Dataset(
        name,
        np.concatenate([b[0] for b in train]),
        np.concatenate([b[1] for b in train]),
        np.concatenate([b[0] for b in test]),
        np.concatenate([b[1] for b in test]),
        classes,
        mean,
        std,
        flip=True,
    )


def _read_idx(path: Path, shape: tuple[int, ...] | None = None) -> np.ndarray:
    """An idx-ubyte file, read header first: a shape beyond the official `shape` (more images,
    other dimensions) is refused before the body is inflated, and the body is read to exactly
    the size the header gives."""
    shape = shape or IDX_SHAPES[path.name]
    fix = "the file is damaged or not the official one; delete it and download it again"
    try:
        with _open_regular(path) as raw, gzip.GzipFile(fileobj=raw, mode="rb") as f:
            head = f.read(4)
            if len(head) < 4:
                raise DatasetError(f"{path} is too short to be an idx file ({len(head)} bytes)")
            zero, dtype_code, ndim = struct.unpack(">HBB", head)
            if zero != 0 or dtype_code != 0x08:
                raise DatasetError(f"{path} is not an idx-ubyte file (magic {head.hex()}); {fix}")
            if ndim != len(shape):
                raise DatasetError(
                    f"{path}: the idx header gives {ndim} dimensions, the official file has "
                    f"{len(shape)} {shape}; {fix}"
                )
            raw_dims = f.read(4 * ndim)
            if len(raw_dims) < 4 * ndim:
                raise DatasetError(f"{path} is truncated inside its idx header; {fix}")
            dims = struct.unpack(f">{ndim}I", raw_dims)
            if dims[1:] != shape[1:] or not 1 <= dims[0] <= shape[0]:
                raise DatasetError(
                    f"{path}: the idx header gives shape {dims}, the official file is {shape} "
                    f"(at most {shape[0]} items); {fix}"
                )
            size = math.prod(dims)
            body = f.read(size)
            if len(body) < size:
                raise DatasetError(
                    f"{path} is truncated: header says {dims}, found {len(body)} of {size} "
                    "bytes; re-download it"
                )
            if f.read(1):
                raise DatasetError(f"{path} holds more data than its header says ({dims}); {fix}")
    except DatasetError:
        raise
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(
            f"cannot read {path}: {exc}; the file is truncated, re-download it"
        ) from None
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def load_fashion_mnist(data_dir: str, download: bool, verify: bool = True) -> Dataset:
    p = ensure_files("fashion-mnist", data_dir, download, verify)
    tx = _read_idx(p["train-images-idx3-ubyte.gz"])[..., None]  # (60000, 28, 28, 1)
    ty = _read_idx(p["train-labels-idx1-ubyte.gz"])
    vx = _read_idx(p["t10k-images-idx3-ubyte.gz"])[..., None]
    vy = _read_idx(p["t10k-labels-idx1-ubyte.gz"])
    check_labels(ty, len(tx), 10, "fashion-mnist train-labels-idx1-ubyte.gz")
    check_labels(vy, len(vx), 10, "fashion-mnist t10k-labels-idx1-ubyte.gz")
    mean, std = STATS["fashion-mnist"]
    return Dataset(
        "fashion-mnist", tx, ty.astype(np.int32), vx, vy.astype(np.int32), 10, mean, std, True
    )


DIGITS_TOTAL = 1797  # images in sklearn's digits file
DIGITS_TEXT_MAX = 4 << 20  # its text unpacked is 0.3 MB
DIGITS_TEST = 360  # sklearn's 1797 digits: the last 360 of a fixed permutation are the test set


def load_digits() -> Dataset:
    """scikit-learn's bundled 8x8 handwritten digits (1797 real images), split 80/20 by a fixed
    permutation (independent of the run seed, so every run tests on the same 360 images)."""
    images, target = digits_arrays()
    x = np.round(images * (255.0 / 16.0)).astype(np.uint8)[..., None]  # (1797, 8, 8, 1)
    y = target.astype(np.int32)
    order = np.random.default_rng(20_26).permutation(len(x))
    n_test = DIGITS_TEST
    test, train = order[:n_test], order[n_test:]
    mean = float(x[train].mean() / 255.0)
    std = float(x[train].std() / 255.0)
    return Dataset("digits", x[train], y[train], x[test], y[test], 10, (mean,), (std,), flip=False)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) float64 of 0..16, targets (1797,)): what sklearn's `load_digits()`
    returns, read from the file it ships (sklearn/datasets/data/digits.csv.gz, 64 pixels and
    the label per row) as it reads it, without importing sklearn.datasets, which costs 1.2 s of
    every digits run's start (its other loaders, scipy, ...); sklearn's own loader where the
    file is not there. A file that is not 1797 rows of 64 pixels in 0..16 and a label in 0..9
    (cut short, damaged, inflating) is a DatasetError naming it. tests/common/test_datasets.py holds
    the two equal."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    origin = spec.origin if spec else None
    bundled = Path(origin).parent / "datasets" / "data" / "digits.csv.gz" if origin else None
    if bundled is None or not bundled.exists():  # (a FIFO or device there: refused below)
        from sklearn.datasets import load_digits as _load  # ships its data: works offline

        d = _load()
        return d.images, d.target
    fix = "reinstall scikit-learn (pip install --force-reinstall scikit-learn)"
    packed = read_regular(bundled, 1 << 20, "scikit-learn's digits file", fix, DatasetError)
    data, why = np.empty((0, 0)), ""
    try:
        with gzip.GzipFile(fileobj=io.BytesIO(packed)) as f:
            text = f.read(DIGITS_TEXT_MAX + 1)  # ~0.3 MB: no inflating file is read whole
        if len(text) > DIGITS_TEXT_MAX:
            why = f"; over {DIGITS_TEXT_MAX} bytes unpacked"
        else:
            data = np.loadtxt(io.StringIO(text.decode()), delimiter=",", ndmin=2)
    except (OSError, EOFError, ValueError) as e:
        why = f"; {str(e).splitlines()[0] if str(e) else type(e).__name__}"
    if not why and data.shape != (DIGITS_TOTAL, 65):  # 64 pixels and the label per image
        why = f"; {data.shape[0]} x {data.shape[1]} values, not {DIGITS_TOTAL} x 65"
    elif not why and not (np.isin(data[:, :-1], np.arange(17)).all()
                          and np.isin(data[:, -1], np.arange(10)).all()):  # fmt: skip
        why = "; a pixel outside 0..16 or a label outside 0..9"
    if why:
        raise DatasetError(f"cannot read scikit-learn's digits file {bundled}{why}: {fix}")
    return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(int)


def make_synthetic(
    n_train: int, n_test: int, size: int, channels: int, classes: int, seed: int
) -> Dataset:
    """Seeded random images and labels of any size (for throughput; nothing to learn)."""
    rng = np.random.default_rng([seed, 7])
    n = n_train + n_test
    x = rng.integers(0, 256, size=(n, size, size, channels), dtype=np.uint8)
    y = rng.integers(0, classes, size=n, dtype=np.int32)
    c = (0.5,) * channels
    s = (0.2887,) * channels  # std of U(0, 1)
    return Dataset(
        "synthetic", x[:n_train], y[:n_train], x[n_train:], y[n_train:], classes, c, s, flip=True
    )


def resize(images: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize of uint8 (N, H, W, C) images to (N, size, size, C) (half-pixel centres)."""
    n, h, w, c = images.shape
    if (h, w) == (size, size):
        return images

    def axis(src: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        pos = np.clip((np.arange(size) + 0.5) * (src / size) - 0.5, 0, src - 1)
        lo = np.floor(pos).astype(np.int64)
        hi = np.minimum(lo + 1, src - 1)
        return lo, hi, (pos - lo).astype(np.float32)

    y0, y1, wy = axis(h)
    x0, x1, wx = axis(w)
    f = images.astype(np.float32)
    rows = f[:, y0] * (1 - wy)[None, :, None, None] + f[:, y1] * wy[None, :, None, None]
    out = rows[:, :, x0] * (1 - wx)[None, None, :, None] + rows[:, :, x1] * wx[None, None, :, None]
    return np.clip(np.round(out), 0, 255).astype(np.uint8)


def load(
    name: str,
    data_dir: str = "data",
    download: bool = True,
    image_size: int = 0,
    train_limit: int = 0,
    test_limit: int = 0,
    seed: int = 0,
    synthetic_train: int = 50_000,
    synthetic_test: int = 10_000,
    synthetic_classes: int = 10,
    synthetic_channels: int = 3,
    verify: bool = True,
) -> Dataset:
    """Load dataset `name`, checked (`check_dataset`), optionally resized and truncated (the
    first N images). `verify`: check the files against the published MD5 first."""
    if name in ("cifar10", "cifar100"):
        ds = load_cifar(name, data_dir, download, verify)
    elif name == "fashion-mnist":
        ds = load_fashion_mnist(data_dir, download, verify)
    elif name == "digits":
        ds = load_digits()
    elif name == "synthetic":
        ds = make_synthetic(
            synthetic_train,
            synthetic_test,
            image_size or 32,
            synthetic_channels,
            synthetic_classes,
            seed,
        )
    else:
        raise DatasetError(f"unknown dataset {name!r}")
    check_dataset(ds)
    tx, ty, vx, vy = ds.train_x, ds.train_y, ds.test_x, ds.test_y
    if train_limit:
        tx, ty = tx[:train_limit], ty[:train_limit]
    if test_limit:
        vx, vy = vx[:test_limit], vy[:test_limit]
    if image_size:
        tx, vx = resize(tx, image_size), resize(vx, image_size)
    return Dataset(ds.name, tx, ty, vx, vy, ds.num_classes, ds.mean, ds.std, ds.flip)


def load_for(cfg) -> Dataset:  # type: ignore[no-untyped-def]
    """`load` with the values of a Config."""
    return load(
        cfg.dataset,
        cfg.data_dir,
        cfg.download,
        cfg.image_size,
        cfg.train_limit,
        cfg.test_limit,
        cfg.seed,
        cfg.synthetic_train,
        cfg.synthetic_test,
        cfg.synthetic_classes,
        cfg.synthetic_channels,
        cfg.verify,
    )


def check_dataset(ds: Dataset) -> None:
    """What every loader must return, checked before any run uses it: (N, H, W, C) uint8
    images, as many integer labels, each in [0, num_classes), and neither split empty."""
    for split, x, y in (("training", ds.train_x, ds.train_y), ("test", ds.test_x, ds.test_y)):
        where = f"dataset {ds.name!r} ({split} set)"
        if x.ndim != 4 or x.dtype != np.uint8 or y.ndim != 1 or y.dtype.kind not in "iu":
            raise DatasetError(
                f"{where}: images {x.shape} {x.dtype} and labels {y.shape} {y.dtype}, expected "
                "(N, H, W, C) uint8 and (N,) integers"
            )
        if len(x) == 0:
            raise DatasetError(f"{where} holds no images")
        check_labels(y, len(x), ds.num_classes, where)


def check_available(cfg) -> None:  # type: ignore[no-untyped-def]
    """Raise DatasetError before any run starts (in the parent, before any worker process) if
    `cfg`'s dataset cannot be had offline or its files are not the official ones: each must be
    a regular file with the published MD5 (hashed once, then remembered until it changes). With
    `--no-verify` the files are parsed and checked here in full instead, and a warning says
    that they were not verified."""
    if cfg.dataset in SOURCES:
        root = Path(cfg.data_dir) / cfg.dataset
        with dataset_io(cfg.dataset, root):
            missing = [f for f in SOURCES[cfg.dataset] if not (root / f).exists()]
        if missing and not cfg.download:
            raise DatasetError(
                f"dataset {cfg.dataset!r} is not on disk: put {', '.join(missing)} in {root}/"
            )
        ensure_files(cfg.dataset, cfg.data_dir, cfg.download, cfg.verify)
        if not cfg.verify:
            load(cfg.dataset, cfg.data_dir, cfg.download, verify=False)  # bounded, then freed
            print(
                f"warning: --no-verify: {', '.join(SOURCES[cfg.dataset])} in {root} not checked "
                "against the published MD5 checksums (they parse and pass the label checks)",
                file=sys.stderr,
            )
    elif cfg.dataset == "digits":
        if importlib.util.find_spec("sklearn") is None:
            raise DatasetError("dataset 'digits' needs scikit-learn: pip install scikit-learn")
