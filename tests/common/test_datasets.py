"""Dataset readers on small files in the official formats (bad ones: test_dataset_files.py)."""

from __future__ import annotations

import copy
import gzip
import io
import pickle
import struct
import tarfile
from pathlib import Path

import numpy as np
import pytest

from common import datasets
from common.datasets import DatasetError


def _cifar_pickle(n: int, label_key: str, seed: int) -> tuple[bytes, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, size=(n, 3072), dtype=np.uint8)
    labels = rng.integers(0, 10, size=n).tolist()
    batch = {label_key.encode(): labels, b"data": data, b"batch_label": b"x"}
    return pickle.dumps(batch, protocol=2), data, np.asarray(labels)


def _write_tar(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


def write_cifar10(root: Path, n: int = 4, first: bytes = b"") -> tuple[np.ndarray, np.ndarray]:
    """The archive; `first`: data_batch_1's file in place of the one written."""
    members, xs, ys = {}, [], []
    for i, member in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        members[f"cifar-10-batches-py/{member}"], x, y = _cifar_pickle(n, "labels", i)
        xs.append(x)
        ys.append(y)
    if first:
        members["cifar-10-batches-py/data_batch_1"] = first
    _write_tar(root / "cifar10" / "cifar-10-python.tar.gz", members)
    return np.concatenate(xs), np.concatenate(ys)


def _idx(arr: np.ndarray) -> bytes:
    header = struct.pack(">HBB", 0, 0x08, arr.ndim) + struct.pack(f">{arr.ndim}I", *arr.shape)
    return gzip.compress(header + arr.astype(np.uint8).tobytes())


def write_fashion(root: Path, n_train: int = 7, n_test: int = 3) -> None:
    rng = np.random.default_rng(0)
    d = root / "fashion-mnist"
    d.mkdir(parents=True)
    for prefix, n in (("train", n_train), ("t10k", n_test)):
        (d / f"{prefix}-images-idx3-ubyte.gz").write_bytes(_idx(rng.integers(0, 256, (n, 28, 28))))
        (d / f"{prefix}-labels-idx1-ubyte.gz").write_bytes(_idx(rng.integers(0, 10, n)))


def test_every_reader_reads_the_official_layout(tmp_path: Path) -> None:
    """CIFAR-10's rows are 1024 red, 1024 green, 1024 blue values; CIFAR-100 has fine labels;
    Fashion-MNIST is idx files, resized on request."""
    x, y = write_cifar10(tmp_path)
    ds = datasets.load("cifar10", str(tmp_path), download=False, verify=False)
    assert ds.train_x.shape == (20, 32, 32, 3) and ds.test_x.shape == (4, 32, 32, 3)
    assert ds.train_x.dtype == np.uint8 and ds.num_classes == 10
    assert ds.train_x[0, 5, 7, 2] == x[0].reshape(3, 32, 32)[2, 5, 7]  # pixel (5, 7), blue
    np.testing.assert_array_equal(ds.train_y, y[:20])
    np.testing.assert_array_equal(ds.test_y, y[20:])
    (tr, _, ty), (te, _, _) = _cifar_pickle(6, "fine_labels", 1), _cifar_pickle(3, "fine_labels", 2)
    members = {"cifar-100-python/train": tr, "cifar-100-python/test": te}
    _write_tar(tmp_path / "cifar100" / "cifar-100-python.tar.gz", members)
    ds = datasets.load("cifar100", str(tmp_path), download=False, verify=False)
    assert ds.num_classes == 100 and len(ds.train_x) == 6 and len(ds.test_x) == 3
    np.testing.assert_array_equal(ds.train_y, ty)
    write_fashion(tmp_path)
    ds = datasets.load("fashion-mnist", str(tmp_path), download=False, verify=False)
    assert ds.train_x.shape == (7, 28, 28, 1) and ds.test_x.shape == (3, 28, 28, 1)
    big = datasets.load("fashion-mnist", str(tmp_path), download=False, image_size=32, verify=False)
    assert big.train_x.shape == (7, 32, 32, 1)


def test_a_download_is_used_only_with_its_checksum(tmp_path: Path, monkeypatch) -> None:
    """Offline, a missing file says where to put it; a mismatch leaves no partial file."""
    write_cifar10(tmp_path / "mirror")
    src, data = tmp_path / "mirror" / "cifar10" / "cifar-10-python.tar.gz", tmp_path / "data"
    with pytest.raises(DatasetError) as exc:
        datasets.load("cifar10", str(data), download=False, verify=False)
    assert src.name in str(exc.value) and str(data / "cifar10") in str(exc.value)
    monkeypatch.setitem(datasets.SOURCES, "cifar10", {src.name: (src.as_uri(), "0" * 32)})
    with pytest.raises(DatasetError, match="checksum mismatch"):
        datasets.load("cifar10", str(data), download=True)
    assert list((data / "cifar10").iterdir()) == []
    right = {src.name: (src.as_uri(), datasets.md5sum(src))}
    monkeypatch.setitem(datasets.SOURCES, "cifar10", right)
    assert len(datasets.load("cifar10", str(data), download=True).train_x) == 20


def test_digits_is_real_and_split_deterministically() -> None:
    pytest.importorskip("sklearn")
    a = datasets.load("digits", image_size=16)
    b = datasets.load("digits", image_size=16, seed=5)
    assert a.train_x.shape == (1437, 16, 16, 1) and a.test_x.shape == (360, 16, 16, 1)
    np.testing.assert_array_equal(a.test_y, b.test_y)  # split independent of the run seed
    assert set(np.unique(a.train_y)) == set(range(10))
    assert a.train_x.max() > 200  # real ink, scaled to uint8


def test_digits_read_from_sklearns_file_are_sklearns_digits(monkeypatch, tmp_path) -> None:
    """digits_arrays reads sklearn's file (copied to a stand-in sklearn) as load_digits() does;
    a damaged one is one line naming it and the fix (sklearn reads it unchecked)."""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    want = sklearn_datasets.load_digits()
    spec = copy.copy(datasets.importlib.util.find_spec("sklearn"))  # sklearn's own stays
    real = (Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz").read_bytes()
    rows = gzip.decompress(real).decode().splitlines()
    fake = tmp_path / "sklearn" / "datasets" / "data" / "digits.csv.gz"
    fake.parent.mkdir(parents=True)
    spec.origin = str(tmp_path / "sklearn" / "__init__.py")
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name, *a: spec)
    for content in [
        real[: len(real) // 2],  # cut short
        gzip.compress("\n".join(rows[1:]).encode()),  # a row missing
        gzip.compress("\n".join(["17" + rows[0][1:], *rows[1:]]).encode()),  # no digit's pixel
        b"not gzip at all",
    ]:
        fake.write_bytes(content)
        with pytest.raises(datasets.DatasetError) as e:
            datasets.digits_arrays()
        line = str(e.value)
        assert "\n" not in line and f"scikit-learn's digits file {fake}" in line, line
        assert line.endswith("pip install --force-reinstall scikit-learn)"), line
    fake.write_bytes(real)
    calls: list[int] = []
    monkeypatch.setattr(sklearn_datasets, "load_digits", lambda: calls.append(1) or want)
    for expect_calls in ([], [1]):  # the file read; then, with it gone, sklearn's loader
        images, target = datasets.digits_arrays()
        assert calls == expect_calls
        np.testing.assert_array_equal(images, want.images)
        np.testing.assert_array_equal(target, want.target)
        fake.unlink(missing_ok=True)


def test_synthetic_is_seeded_and_sized_and_resize_keeps_a_constant_image() -> None:
    a, b, c = (datasets.make_synthetic(10, 4, 12, 3, 7, seed=seed) for seed in (1, 1, 2))
    assert a.train_x.shape == (10, 12, 12, 3) and a.test_y.max() < 7
    np.testing.assert_array_equal(a.train_x, b.train_x)
    assert not np.array_equal(a.train_x, c.train_x)
    out = datasets.resize(np.full((2, 8, 8, 1), 77, np.uint8), 16)
    assert out.shape == (2, 16, 16, 1) and (out == 77).all()
