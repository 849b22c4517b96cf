"""Datasets as uint8 NHWC numpy arrays with integer labels.

Real files are read in their official formats, each checked once against its published MD5
(`--no-verify` skips it with a warning); nothing read can run code (CIFAR's pickles go through
a restricted unpickler). A missing file (offline, `--no-download`) or one of the wrong kind is
one DatasetError naming it and the fix (exit 2).
"""

from __future__ import annotations

import codecs
import gzip
import hashlib
import importlib.util
import io
import json
import os
import pickle
import struct
import sys
import tarfile
import tempfile
import urllib.request
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.errors import DatasetError


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
# CIFAR: archive folder, its batches, label key, classes.
CIFAR: dict[str, tuple[str, tuple[str, ...], bytes, int]] = {
    "cifar10": (
        "cifar-10-batches-py",
        (*(f"data_batch_{i}" for i in range(1, 6)), "test_batch"),
        b"labels",
        10,
    ),
    "cifar100": ("cifar-100-python", ("train", "test"), b"fine_labels", 100),
}
STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
}
VERIFIED = ".verified.json"  # per dataset directory: {file: [size, mtime_ns]} of the files checked
REDOWNLOAD = "the file is damaged or not the official one; delete it and download it again"


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(url: str, md5: str, dest: Path, timeout: float = 30.0) -> None:
    """Download `url` to `dest` atomically, verifying its MD5; never leaves a partial file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            while block := resp.read(1 << 20):
                out.write(block)
        got_md5 = md5sum(Path(tmp))
        if got_md5 != md5:
            raise DatasetError(
                f"checksum mismatch for {dest.name} from {url}: MD5 {got_md5}, expected {md5}; "
                "the download is corrupt or not the official file; delete it and retry"
            )
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def verify_files(name: str, paths: dict[str, Path]) -> None:
    """Check every file of dataset `name` against its published MD5; each file is hashed once
    and remembered in `<dir>/.verified.json` by its size and mtime (a file rewritten since is
    hashed again)."""
    marker = next(iter(paths.values())).parent / VERIFIED
    try:
        seen = json.loads(marker.read_text())
    except (OSError, ValueError):
        seen = {}
    before = dict(seen)
    for filename, path in paths.items():
        md5, st = SOURCES[name][filename][1], path.stat()
        if seen.get(filename) == [st.st_size, st.st_mtime_ns]:
            continue
        got = md5sum(path)
        if got != md5:
            raise DatasetError(
                f"{path} has MD5 {got}, the official {filename} has {md5}: it is damaged or "
                "not the official file; delete it and download it again (--no-verify skips "
                "this check)"
            )
        seen[filename] = [st.st_size, st.st_mtime_ns]
    if seen != before:
        try:  # a read-only data directory just verifies every time
            marker.write_text(json.dumps(seen, indent=1, sort_keys=True))
        except OSError:
            pass


def ensure_files(
    name: str, data_dir: str | os.PathLike[str], download: bool, verify: bool = True
) -> dict[str, Path]:
    """Return the paths of `name`'s official files, downloading missing ones if allowed, each
    (`verify`) checked against its published MD5. An OSError (a directory that cannot be read,
    EACCES, EIO, ENAMETOOLONG) is one DatasetError naming the path."""
    root = Path(data_dir) / name
    paths: dict[str, Path] = {}
    missing = []
    try:
        for filename, (url, md5) in SOURCES[name].items():
            path = root / filename
            if not path.exists() and download:
                try:
                    fetch(url, md5, path)
                except OSError as exc:  # offline, DNS failure, HTTP error
                    missing.append((filename, url, f"download failed: {exc}"))
                    continue
            if not path.exists():
                missing.append((filename, url, "not downloaded (--no-download)"))
                continue
            paths[filename] = path
        if missing:
            names = ", ".join(m[0] for m in missing)
            raise DatasetError(
                f"dataset {name!r} is not on disk: put {names} in {root}/ "
                f"(from {missing[0][1].rsplit('/', 1)[0]}/); {missing[0][2]}"
            )
        if verify:
            verify_files(name, paths)
    except OSError as exc:
        raise DatasetError(
            f"dataset {name!r}: cannot read {exc.filename or root} ({exc.strerror or exc}); "
            f"check that --data-dir holds {root.name}/ and that it is readable"
        ) from None
    return paths


# ---- CIFAR's pickles -----------------------------------------------------------------------
# An official batch is a protocol-2 pickle of {b"data": (N, 3072) uint8 ndarray, b"labels":
# [int] (CIFAR-100: b"fine_labels", b"coarse_labels"), b"filenames": [bytes], ...}; numpy
# writes the array as _reconstruct(ndarray, (0,), b"b") and its __setstate__. Those globals are
# all the unpickler admits: it builds containers and arrays, and calls nothing else.

_RECONSTRUCT = np.ndarray((0,)).__reduce__()[0]  # numpy's _reconstruct, in numpy 1 and 2


class _RestrictedUnpickler(pickle.Unpickler):
    GLOBALS: dict[tuple[str, str], object] = {
        ("numpy.core.multiarray", "_reconstruct"): _RECONSTRUCT,
        ("numpy._core.multiarray", "_reconstruct"): _RECONSTRUCT,
        ("numpy", "ndarray"): np.ndarray,
        ("numpy", "dtype"): np.dtype,
        ("_codecs", "encode"): codecs.encode,  # how protocol 2 writes bytes from Python 3
    }

    def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
        if (module, name) in self.GLOBALS:
            return self.GLOBALS[(module, name)]
        raise DatasetError(
            f"refusing to unpickle {module}.{name}: a dataset file must not execute code; "
            "the file is not an official CIFAR batch"
        )


def check_labels(y: np.ndarray, n: int, classes: int, where: str) -> None:
    """Labels match the images one to one and lie in [0, classes)."""
    if len(y) != n:
        raise DatasetError(f"{where}: {n} images but {len(y)} labels; {REDOWNLOAD}")
    if len(y) and (int(y.min()) < 0 or int(y.max()) >= classes):
        bad = int(y.min()) if int(y.min()) < 0 else int(y.max())
        raise DatasetError(f"{where}: label {bad} is outside 0..{classes - 1}; {REDOWNLOAD}")


def _cifar_batch(
    blob: bytes, label_key: bytes, classes: int, where: str
) -> tuple[np.ndarray, np.ndarray]:
    try:
        d = _RestrictedUnpickler(io.BytesIO(blob), encoding="bytes").load()
    except DatasetError:
        raise
    except Exception as exc:  # truncated or not a pickle at all
        raise DatasetError(
            f"cannot read {where}: {type(exc).__name__}: {str(exc)[:120]}; {REDOWNLOAD}"
        ) from None
    if not isinstance(d, dict) or b"data" not in d or label_key not in d:
        raise DatasetError(f"{where} is not a CIFAR batch (keys b'data' and {label_key!r})")
    x, y = d[b"data"], np.asarray(d[label_key])
    if not (isinstance(x, np.ndarray) and x.dtype == np.uint8 and x.ndim == 2
            and x.shape[1] == 3072 and len(x)):  # fmt: skip
        raise DatasetError(f"{where}: b'data' must be (N, 3072) uint8 rows; {REDOWNLOAD}")
    if y.ndim != 1 or y.dtype.kind not in "iu":
        raise DatasetError(f"{where}: labels must be a list of integers; {REDOWNLOAD}")
    check_labels(y, len(x), classes, where)
    x = x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # (N, 32, 32, 3)
    return np.ascontiguousarray(x), y.astype(np.int32)


def read_members(archive: Path, wanted: list[str]) -> dict[str, bytes]:
    """The members `wanted` of tar.gz `archive`, read in memory (nothing is extracted)."""
    out: dict[str, bytes] = {}
    try:
        with tarfile.open(archive, "r:gz") as tar:
            for info in tar:
                f = tar.extractfile(info) if info.name in wanted else None
                if f is not None:
                    out[info.name] = f.read()
    except (tarfile.TarError, EOFError, zlib.error) as exc:
        raise DatasetError(f"cannot read {archive}: {exc!r}; {REDOWNLOAD}") from None
    absent = [m for m in wanted if m not in out]
    if absent:
        raise DatasetError(f"{archive} has no member {absent[0]}; {REDOWNLOAD}")
    return out


def load_cifar(name: str, data_dir: str, download: bool, verify: bool = True) -> Dataset:
    (archive,) = ensure_files(name, data_dir, download, verify).values()
    folder, members, label_key, classes = CIFAR[name]
    blobs = read_members(archive, [f"{folder}/{m}" for m in members])
    batches = {}
    for member in members:
        blob = blobs.pop(f"{folder}/{member}")  # freed as soon as it is parsed
        batches[member] = _cifar_batch(blob, label_key, classes, f"{archive.name}:{member}")
    train = [b for m, b in batches.items() if not m.startswith("test")]
    test = [b for m, b in batches.items() if m.startswith("test")]
    tx, ty, vx, vy = (np.concatenate([b[i] for b in bs]) for bs in (train, test) for i in (0, 1))
    return Dataset(name, tx, ty, vx, vy, classes, *STATS[name], flip=True)


def _read_idx(path: Path, ndim: int) -> np.ndarray:
    """An idx-ubyte file of `ndim` dimensions whose body is exactly what its header says."""
    try:
        with gzip.open(path, "rb") as f:
            data = f.read()
    except (OSError, EOFError, zlib.error) as exc:
        raise DatasetError(f"cannot read {path}: {exc}; {REDOWNLOAD}") from None
    if len(data) < 4 + 4 * ndim or data[:4] != bytes([0, 0, 0x08, ndim]):
        raise DatasetError(f"{path} is not an idx-ubyte file of {ndim} dimensions; {REDOWNLOAD}")
    dims = struct.unpack(f">{ndim}I", data[4 : 4 + 4 * ndim])
    body = data[4 + 4 * ndim :]
    if len(body) != int(np.prod(dims)):
        raise DatasetError(
            f"{path}: its header gives {dims}, its body holds {len(body)} bytes; {REDOWNLOAD}"
        )
    return np.frombuffer(body, dtype=np.uint8).reshape(dims)


def load_fashion_mnist(data_dir: str, download: bool, verify: bool = True) -> Dataset:
    p = ensure_files("fashion-mnist", data_dir, download, verify)
    tx = _read_idx(p["train-images-idx3-ubyte.gz"], 3)[..., None]  # (60000, 28, 28, 1)
    ty = _read_idx(p["train-labels-idx1-ubyte.gz"], 1)
    vx = _read_idx(p["t10k-images-idx3-ubyte.gz"], 3)[..., None]
    vy = _read_idx(p["t10k-labels-idx1-ubyte.gz"], 1)
    check_labels(ty, len(tx), 10, "fashion-mnist train-labels-idx1-ubyte.gz")
    check_labels(vy, len(vx), 10, "fashion-mnist t10k-labels-idx1-ubyte.gz")
    return Dataset("fashion-mnist", tx, ty.astype(np.int32), vx, vy.astype(np.int32), 10,
                   *STATS["fashion-mnist"], flip=True)  # fmt: skip


def load_digits() -> Dataset:
    """scikit-learn's bundled 8x8 handwritten digits (1797 real images), split 80/20 by a fixed
    permutation (independent of the run seed, so every run tests on the same 360 images)."""
    images, target = digits_arrays()
    x = np.round(images * (255.0 / 16.0)).astype(np.uint8)[..., None]  # (1797, 8, 8, 1)
    y = target.astype(np.int32)
    order = np.random.default_rng(20_26).permutation(len(x))
    test, train = order[:360], order[360:]  # the last 360 of a fixed permutation: the test set
    mean, std = float(x[train].mean() / 255.0), float(x[train].std() / 255.0)
    return Dataset("digits", x[train], y[train], x[test], y[test], 10, (mean,), (std,), flip=False)


def digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """(images (1797, 8, 8) float64 of 0..16, targets (1797,)): what sklearn's `load_digits()`
    returns, read from the file it ships (digits.csv.gz: 64 pixels and the label per row)
    without importing sklearn.datasets, which costs 1.2 s of every digits run's start; sklearn's
    own loader where the file is not there. A damaged file is a DatasetError naming it."""
    spec = importlib.util.find_spec("sklearn")  # finds the package, runs none of it
    origin = spec.origin if spec else None
    bundled = Path(origin).parent / "datasets" / "data" / "digits.csv.gz" if origin else None
    if bundled is None or not bundled.exists():
        from sklearn.datasets import load_digits as _load  # ships its data: works offline

        d = _load()
        return d.images, d.target
    fix = "reinstall scikit-learn (pip install --force-reinstall scikit-learn)"
    try:
        with gzip.open(bundled, "rt") as f:
            data = np.loadtxt(f, delimiter=",", ndmin=2)
    except (OSError, EOFError, ValueError, zlib.error) as e:
        raise DatasetError(f"cannot read scikit-learn's digits file {bundled} ({e}): {fix}") from e
    if (
        data.shape != (1797, 65)
        or not (  # 64 pixels and the label per image
            np.isin(data[:, :-1], np.arange(17)).all() and np.isin(data[:, -1], np.arange(10)).all()
        )
    ):
        raise DatasetError(
            f"scikit-learn's digits file {bundled} is not 1797 images of 64 pixels in "
            f"0..16 and a label in 0..9: {fix}"
        )
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


def load(name: str, data_dir: str = "data", download: bool = True, image_size: int = 0,
         train_limit: int = 0, test_limit: int = 0, seed: int = 0, synthetic_train: int = 50_000,
         synthetic_test: int = 10_000, synthetic_classes: int = 10, synthetic_channels: int = 3,
         verify: bool = True) -> Dataset:  # fmt: skip
    """Load dataset `name`, optionally resized and truncated (the first N images)."""
    if name in ("cifar10", "cifar100"):
        ds = load_cifar(name, data_dir, download, verify)
    elif name == "fashion-mnist":
        ds = load_fashion_mnist(data_dir, download, verify)
    elif name == "digits":
        ds = load_digits()
    elif name == "synthetic":
        ds = make_synthetic(synthetic_train, synthetic_test, image_size or 32,
                            synthetic_channels, synthetic_classes, seed)  # fmt: skip
    else:
        raise DatasetError(f"unknown dataset {name!r}")
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
    return load(cfg.dataset, cfg.data_dir, cfg.download, cfg.image_size, cfg.train_limit,
                cfg.test_limit, cfg.seed, cfg.synthetic_train, cfg.synthetic_test,
                cfg.synthetic_classes, cfg.synthetic_channels, cfg.verify)  # fmt: skip


def check_available(cfg) -> None:  # type: ignore[no-untyped-def]
    """Raise DatasetError before any run starts (in the parent, before any worker process) if
    `cfg`'s dataset cannot be had offline or its files are not the official ones. With
    `--no-verify` the files are parsed and checked here in full instead, with a warning."""
    if cfg.dataset in SOURCES:
        root = Path(cfg.data_dir) / cfg.dataset
        ensure_files(cfg.dataset, cfg.data_dir, cfg.download, cfg.verify)
        if not cfg.verify:
            load(cfg.dataset, cfg.data_dir, cfg.download, verify=False)  # then freed
            print(
                f"warning: --no-verify: {', '.join(SOURCES[cfg.dataset])} in {root} not checked "
                "against the published MD5 checksums (they parse and pass the label checks)",
                file=sys.stderr,
            )
    elif cfg.dataset == "digits":
        if importlib.util.find_spec("sklearn") is None:
            raise DatasetError("dataset 'digits' needs scikit-learn: pip install scikit-learn")
