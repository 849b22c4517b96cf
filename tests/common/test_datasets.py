"""Dataset readers on small files written here in the official formats; bad files are refused."""

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
    blob = pickle.dumps(
        {label_key.encode(): labels, b"data": data, b"batch_label": b"x"}, protocol=2
    )
    return blob, data, np.asarray(labels)


def _write_tar(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w:gz") as tar:
        for name, blob in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


def write_cifar10(root: Path, n: int = 4) -> tuple[np.ndarray, np.ndarray]:
    members, xs, ys = {}, [], []
    for i, member in enumerate([f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]):
        blob, x, y = _cifar_pickle(n, "labels", i)
        members[f"cifar-10-batches-py/{member}"] = blob
        xs.append(x)
        ys.append(y)
    _write_tar(root / "cifar10" / "cifar-10-python.tar.gz", members)
    return np.concatenate(xs), np.concatenate(ys)


def test_cifar10_reader_official_layout(tmp_path: Path) -> None:
    x, y = write_cifar10(tmp_path)
    ds = datasets.load("cifar10", str(tmp_path), download=False, verify=False)
    assert ds.train_x.shape == (20, 32, 32, 3) and ds.test_x.shape == (4, 32, 32, 3)
    assert ds.train_x.dtype == np.uint8 and ds.num_classes == 10
    # The row layout is 1024 red, 1024 green, 1024 blue values: pixel (r, c) of channel k.
    first = x[0].reshape(3, 32, 32)
    assert ds.train_x[0, 5, 7, 2] == first[2, 5, 7]
    np.testing.assert_array_equal(ds.train_y, y[:20])
    np.testing.assert_array_equal(ds.test_y, y[20:])


def test_cifar100_reader_uses_fine_labels(tmp_path: Path) -> None:
    tr, _, ty = _cifar_pickle(6, "fine_labels", 1)
    te, _, vy = _cifar_pickle(3, "fine_labels", 2)
    _write_tar(
        tmp_path / "cifar100" / "cifar-100-python.tar.gz",
        {"cifar-100-python/train": tr, "cifar-100-python/test": te},
    )
    ds = datasets.load("cifar100", str(tmp_path), download=False, verify=False)
    assert ds.num_classes == 100 and len(ds.train_x) == 6 and len(ds.test_x) == 3
    np.testing.assert_array_equal(ds.train_y, ty)


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


def test_fashion_mnist_reader_and_resize(tmp_path: Path) -> None:
    write_fashion(tmp_path)
    ds = datasets.load("fashion-mnist", str(tmp_path), download=False, verify=False)
    assert ds.train_x.shape == (7, 28, 28, 1) and ds.test_x.shape == (3, 28, 28, 1)
    big = datasets.load("fashion-mnist", str(tmp_path), download=False, image_size=32, verify=False)
    assert big.train_x.shape == (7, 32, 32, 1)


def test_missing_files_offline_say_where_to_put_them(tmp_path: Path) -> None:
    with pytest.raises(DatasetError) as exc:
        datasets.load("cifar10", str(tmp_path), download=False, verify=False)
    msg = str(exc.value)
    assert "cifar-10-python.tar.gz" in msg and str(tmp_path / "cifar10") in msg


def test_download_verifies_checksum_and_leaves_no_partial_file(tmp_path: Path, monkeypatch) -> None:
    src = tmp_path / "mirror" / "cifar-10-python.tar.gz"
    src.parent.mkdir()
    src.write_bytes(b"not the official archive")
    monkeypatch.setitem(
        datasets.SOURCES,
        "cifar10",
        {"cifar-10-python.tar.gz": (src.as_uri(), "c58f30108f718f92721af3b95e74349a")},
    )
    with pytest.raises(DatasetError, match="checksum mismatch"):
        datasets.load("cifar10", str(tmp_path / "data"), download=True)
    assert list((tmp_path / "data" / "cifar10").iterdir()) == []


def test_download_with_matching_checksum_is_used(tmp_path: Path, monkeypatch) -> None:
    write_cifar10(tmp_path / "mirror")
    src = tmp_path / "mirror" / "cifar10" / "cifar-10-python.tar.gz"
    monkeypatch.setitem(
        datasets.SOURCES,
        "cifar10",
        {"cifar-10-python.tar.gz": (src.as_uri(), datasets.md5sum(src))},
    )
    ds = datasets.load("cifar10", str(tmp_path / "data"), download=True)
    assert len(ds.train_x) == 20
    assert (tmp_path / "data" / "cifar10" / "cifar-10-python.tar.gz").exists()


def test_digits_is_real_and_split_deterministically() -> None:
    pytest.importorskip("sklearn")
    a = datasets.load("digits", image_size=16)
    b = datasets.load("digits", image_size=16, seed=5)
    assert a.train_x.shape == (1437, 16, 16, 1) and a.test_x.shape == (360, 16, 16, 1)
    np.testing.assert_array_equal(a.test_y, b.test_y)  # split independent of the run seed
    assert set(np.unique(a.train_y)) == set(range(10))
    assert a.train_x.max() > 200  # real ink, scaled to uint8


def test_digits_read_from_sklearns_file_are_sklearns_digits(monkeypatch) -> None:
    """digits_arrays reads sklearn's bundled file without importing sklearn.datasets: the same
    images and labels as sklearn's load_digits(), in the same order; with the file missing it
    takes them from sklearn's loader. (A row or column off, or the label read as a pixel,
    would differ: checked on a copy with the first two rows swapped.)"""
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    want = sklearn_datasets.load_digits()
    images, target = datasets.digits_arrays()
    np.testing.assert_array_equal(images, want.images)
    np.testing.assert_array_equal(target, want.target)
    swapped = images[[1, 0, *range(2, len(images))]]
    assert not np.array_equal(swapped, want.images)  # the comparison sees an order slip
    real = datasets.importlib.util.find_spec

    def elsewhere(name, *args):  # a sklearn whose file is not where this build keeps it
        spec = copy.copy(real(name, *args))  # a copy: sklearn's own spec stays as it is
        if name == "sklearn" and spec is not None:
            spec.origin = "/nonexistent/sklearn/__init__.py"
        return spec

    calls = []

    def sklearns_loader():
        calls.append(1)
        return want

    monkeypatch.setattr(datasets.importlib.util, "find_spec", elsewhere)
    monkeypatch.setattr(sklearn_datasets, "load_digits", sklearns_loader)
    images, target = datasets.digits_arrays()
    assert calls == [1]
    np.testing.assert_array_equal(images, want.images)
    np.testing.assert_array_equal(target, want.target)


def test_a_damaged_digits_file_is_one_line_naming_it_and_the_fix(monkeypatch, tmp_path) -> None:
    """sklearn's bundled digits file, cut short, missing rows, holding a value no digit has, or
    not gzip: one DatasetError naming the file and the fix, never a dataset of other images or
    numpy's traceback (sklearn's own loader reads it unchecked)."""
    pytest.importorskip("sklearn")
    real = (Path(datasets.importlib.util.find_spec("sklearn").origin).parent / "datasets" /
            "data" / "digits.csv.gz").read_bytes()  # fmt: skip
    rows = gzip.decompress(real).decode().splitlines()
    fake = tmp_path / "sklearn" / "datasets" / "data" / "digits.csv.gz"
    fake.parent.mkdir(parents=True)
    spec = copy.copy(datasets.importlib.util.find_spec("sklearn"))
    spec.origin = str(tmp_path / "sklearn" / "__init__.py")
    monkeypatch.setattr(datasets.importlib.util, "find_spec", lambda name, *a: spec)
    seventeen = rows[0].split(",")
    seventeen[5] = "17"
    cases = [
        real[: len(real) // 2],  # cut short
        gzip.compress("\n".join(rows[1:]).encode()),  # a row missing
        gzip.compress("\n".join([",".join(seventeen), *rows[1:]]).encode()),  # no digit's pixel
        b"not gzip at all",
    ]
    for content in cases:
        fake.write_bytes(content)
        with pytest.raises(datasets.DatasetError) as e:
            datasets.digits_arrays()
        line = str(e.value)
        assert "\n" not in line and f"scikit-learn's digits file {fake}" in line, line
        assert line.endswith("pip install --force-reinstall scikit-learn)"), line
    fake.write_bytes(real)  # the same file, unharmed, where this sklearn would keep it
    images, target = datasets.digits_arrays()
    assert images.shape == (1797, 8, 8) and target.shape == (1797,)


def test_synthetic_is_seeded_and_sized() -> None:
    a = datasets.make_synthetic(10, 4, 12, 3, 7, seed=1)
    b = datasets.make_synthetic(10, 4, 12, 3, 7, seed=1)
    c = datasets.make_synthetic(10, 4, 12, 3, 7, seed=2)
    assert a.train_x.shape == (10, 12, 12, 3) and a.test_y.max() < 7
    np.testing.assert_array_equal(a.train_x, b.train_x)
    assert not np.array_equal(a.train_x, c.train_x)


def test_resize_keeps_constant_images_constant() -> None:
    img = np.full((2, 8, 8, 1), 77, np.uint8)
    out = datasets.resize(img, 16)
    assert out.shape == (2, 16, 16, 1) and (out == 77).all()
