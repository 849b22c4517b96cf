"""Datasets as uint8 NHWC numpy arrays with integer labels.

Real files are read in their official formats, never by executing code from them: CIFAR's
pickles go through a restricted unpickler that admits plain containers and numpy arrays only, and
archives are read member by member in memory (nothing is extracted, so no member can land outside
the data directory). Missing files are downloaded when `download` is on and the network is
reachable, verified against the published MD5 checksums; otherwise one clear error says which
files to put where.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import pickle
import struct
import tarfile
import tempfile
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np


class DatasetError(RuntimeError):
    """A dataset cannot be read or fetched; the message says which file and what to do."""


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

STATS: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
    "cifar100": ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762)),
    "fashion-mnist": ((0.2860,), (0.3530,)),
}


def md5sum(path: Path) -> str:
    digest = hashlib.md5()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch(url: str, md5: str, dest: Path, timeout: float = 30.0) -> Path:
    """Download `url` to `dest` atomically, verifying its MD5; never leaves a partial file."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=dest.parent, prefix=dest.name + ".", suffix=".part")
    try:
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            while block := resp.read(1 << 20):
                out.write(block)
        got = md5sum(Path(tmp))
        if got != md5:
            raise DatasetError(
                f"checksum mismatch for {dest.name} from {url}: MD5 {got}, expected {md5}; "
                "the download is corrupt or not the official file; delete it and retry"
            )
        os.replace(tmp, dest)
        return dest
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def ensure_files(name: str, data_dir: str | os.PathLike[str], download: bool) -> dict[str, Path]:
    """Return the paths of `name`'s official files, downloading missing ones if allowed."""
    root = Path(data_dir) / name
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
        paths[filename] = path
    if missing:
        names = ", ".join(m[0] for m in missing)
        raise DatasetError(
            f"dataset {name!r} is not on disk: put {names} in {root}/ "
            f"(from {missing[0][1].rsplit('/', 1)[0]}/); {missing[0][2]}"
        )
    return paths


class _RestrictedUnpickler(pickle.Unpickler):
    """Admits only what CIFAR's pickles need: containers, bytes and numpy arrays."""

    ALLOWED = {
        ("numpy.core.multiarray", "_reconstruct"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy", "ndarray"),
        ("numpy", "dtype"),
        ("copyreg", "_reconstructor"),
        ("builtins", "object"),
        ("_codecs", "encode"),  # protocol-2 bytes from Python 3
    }

    def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
        if (module, name) in self.ALLOWED:
            return super().find_class(module, name)
        raise DatasetError(
            f"refusing to unpickle {module}.{name}: a dataset file must not execute code; "
            "the file is not an official CIFAR batch"
        )


def safe_unpickle(data: bytes) -> object:
    return _RestrictedUnpickler(io.BytesIO(data), encoding="bytes").load()


def _cifar_batch(blob: bytes, label_key: bytes, where: str) -> tuple[np.ndarray, np.ndarray]:
    try:
        d = safe_unpickle(blob)
    except DatasetError:
        raise
    except Exception as exc:  # truncated or not a pickle at all
        raise DatasetError(
            f"cannot read {where}: {exc}; the file is damaged, re-download it"
        ) from None
    if not isinstance(d, dict) or b"data" not in d or label_key not in d:
        raise DatasetError(f"{where} is not a CIFAR batch (keys b'data' and {label_key!r})")
    x = np.asarray(d[b"data"], dtype=np.uint8)
    if x.ndim != 2 or x.shape[1] != 3072:
        raise DatasetError(f"{where}: expected (N, 3072) uint8 rows, got {x.shape}")
    x = x.reshape(-1, 3, 32, 32).transpose(0, 2, 3, 1)  # (N, 32, 32, 3)
    y = np.asarray(d[label_key], dtype=np.int32)
    return np.ascontiguousarray(x), y


def load_cifar(name: str, data_dir: str, download: bool) -> Dataset:
    (archive,) = ensure_files(name, data_dir, download).values()
    if name == "cifar10":
        folder, train_members, test_members = (
            "cifar-10-batches-py",
            [f"data_batch_{i}" for i in range(1, 6)],
            ["test_batch"],
        )
        label_key, classes = b"labels", 10
    else:
        folder, train_members, test_members = "cifar-100-python", ["train"], ["test"]
        label_key, classes = b"fine_labels", 100
    try:
        with tarfile.open(archive, "r:gz") as tar:

            def read(member: str) -> tuple[np.ndarray, np.ndarray]:
                f = tar.extractfile(f"{folder}/{member}")
                if f is None:
                    raise KeyError(member)
                return _cifar_batch(f.read(), label_key, f"{archive.name}:{folder}/{member}")

            train = [read(m) for m in train_members]
            test = [read(m) for m in test_members]
    except (tarfile.TarError, EOFError, OSError, KeyError) as exc:
        raise DatasetError(
            f"cannot read {archive}: {exc!r}; the archive is truncated or not the official "
            f"file; delete it and download it again"
        ) from None
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


def _read_idx(path: Path) -> np.ndarray:
    try:
        with gzip.open(path, "rb") as f:
            raw = f.read()
    except (OSError, EOFError) as exc:
        raise DatasetError(
            f"cannot read {path}: {exc}; the file is truncated, re-download it"
        ) from None
    if len(raw) < 4:
        raise DatasetError(f"{path} is too short to be an idx file")
    zero, dtype_code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or dtype_code != 0x08:
        raise DatasetError(f"{path} is not an idx-ubyte file (magic {raw[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", raw[4 : 4 + 4 * ndim])
    body = np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * ndim)
    if body.size != int(np.prod(dims)):
        raise DatasetError(
            f"{path} is truncated: header says {dims}, found {body.size} bytes; re-download it"
        )
    return body.reshape(dims)


def load_fashion_mnist(data_dir: str, download: bool) -> Dataset:
    p = ensure_files("fashion-mnist", data_dir, download)
    tx = _read_idx(p["train-images-idx3-ubyte.gz"])[..., None]  # (60000, 28, 28, 1)
    ty = _read_idx(p["train-labels-idx1-ubyte.gz"]).astype(np.int32)
    vx = _read_idx(p["t10k-images-idx3-ubyte.gz"])[..., None]
    vy = _read_idx(p["t10k-labels-idx1-ubyte.gz"]).astype(np.int32)
    if len(tx) != len(ty) or len(vx) != len(vy):
        raise DatasetError("fashion-mnist: image and label files disagree in length")
    mean, std = STATS["fashion-mnist"]
    return Dataset("fashion-mnist", tx, ty, vx, vy, 10, mean, std, flip=True)


DIGITS_TEST = 360  # sklearn's 1797 digits: the last 360 of a fixed permutation are the test set
# Training-set sizes (before --train-limit), known without reading a file: a runner rejects a
# global batch larger than the training set before it starts any run.
TRAIN_SIZES = {"cifar10": 50_000, "cifar100": 50_000, "fashion-mnist": 60_000,
               "digits": 1797 - DIGITS_TEST}  # fmt: skip


def train_size(cfg) -> int:  # type: ignore[no-untyped-def]
    """Training images a run of `cfg` sees per epoch (synthetic: --synthetic-train)."""
    n = cfg.synthetic_train if cfg.dataset == "synthetic" else TRAIN_SIZES[cfg.dataset]
    return min(n, cfg.train_limit or n)


def load_digits() -> Dataset:
    """scikit-learn's bundled 8x8 handwritten digits (1797 real images), split 80/20 by a fixed
    permutation (independent of the run seed, so every run tests on the same 360 images)."""
    from sklearn.datasets import load_digits as _load  # ships its data: works offline

    d = _load()
    x = np.round(d.images * (255.0 / 16.0)).astype(np.uint8)[..., None]  # (1797, 8, 8, 1)
    y = d.target.astype(np.int32)
    order = np.random.default_rng(20_26).permutation(len(x))
    n_test = DIGITS_TEST
    test, train = order[:n_test], order[n_test:]
    mean = float(x[train].mean() / 255.0)
    std = float(x[train].std() / 255.0)
    return Dataset("digits", x[train], y[train], x[test], y[test], 10, (mean,), (std,), flip=False)


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
) -> Dataset:
    """Load dataset `name`, optionally resized and truncated (the first N images)."""
    if name in ("cifar10", "cifar100"):
        ds = load_cifar(name, data_dir, download)
    elif name == "fashion-mnist":
        ds = load_fashion_mnist(data_dir, download)
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
    )


def check_available(cfg) -> None:  # type: ignore[no-untyped-def]
    """Raise DatasetError before any run starts if `cfg`'s dataset cannot be had offline."""
    if cfg.dataset in SOURCES:
        root = Path(cfg.data_dir) / cfg.dataset
        missing = [f for f in SOURCES[cfg.dataset] if not (root / f).exists()]
        if missing and not cfg.download:
            raise DatasetError(
                f"dataset {cfg.dataset!r} is not on disk: put {', '.join(missing)} in {root}/"
            )
        if missing:
            ensure_files(cfg.dataset, cfg.data_dir, True)
    elif cfg.dataset == "digits":
        import importlib.util

        if importlib.util.find_spec("sklearn") is None:
            raise DatasetError("dataset 'digits' needs scikit-learn: pip install scikit-learn")
