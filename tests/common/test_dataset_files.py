"""Hostile and careless dataset files (issue 15, items 2, 3 and the data parts of 8 and 10).

Every case writes a small file here and asserts that it is refused with one clear line
(DatasetError; exit 2 with one stderr line where a trainer runs), before anything is inflated,
allocated, executed or written. Bombs are a few MB on disk and claim up to 2 GiB: a child
process reports its own peak memory, and the same child with the cap removed (the bug
injected) shows that the measurement would catch the inflation.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import pickle
import re
import struct
import tarfile
import textwrap
from pathlib import Path

import numpy as np
import pytest

from common import datasets
from common.config import preset
from common.datasets import DatasetError
from tests.common.test_datasets import _cifar_pickle, _idx, _write_tar, write_cifar10, write_fashion
from tests.conftest import (
    MAIN_PYTHON,
    deadline,
    one_line_error,
    run_python,
    run_trainer,
    skip_without_interpreter,
)

BATCHES = [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]
ZEROS_16M = gzip.compress(bytes(16 << 20), compresslevel=9)  # 16 KB on disk, 16 MiB inflated


def _zeros(mib: int) -> bytes:
    """A gzip stream of `mib` MiB of zeros, as concatenated members (~1 KB per MiB on disk)."""
    return ZEROS_16M * (mib // 16)


def _cifar_dir(tmp_path: Path, members: dict[str, bytes]) -> Path:
    _write_tar(tmp_path / "cifar10" / "cifar-10-python.tar.gz", members)
    return tmp_path / "cifar10" / "cifar-10-python.tar.gz"


def _batch(data: object, labels: object, protocol: int = 2) -> bytes:
    return pickle.dumps({b"data": data, b"labels": labels}, protocol=protocol)


def _cifar_with(tmp_path: Path, blob: bytes) -> None:
    """A CIFAR-10 archive whose first batch is `blob` (the others are well-formed)."""
    members = {f"cifar-10-batches-py/{m}": _cifar_pickle(4, "labels", i)[0]
               for i, m in enumerate(BATCHES)}  # fmt: skip
    members["cifar-10-batches-py/data_batch_1"] = blob
    _cifar_dir(tmp_path, members)


def refused(tmp_path: Path, name: str = "cifar10", *fragments: str) -> str:
    """Loading `name` (unverified: the parsers' own defences) raises one-line DatasetError."""
    with pytest.raises(DatasetError) as exc:
        datasets.load(name, str(tmp_path), download=False, verify=False)
    msg = str(exc.value)
    assert "\n" not in msg and "Traceback" not in msg, msg
    for fragment in fragments:
        assert fragment in msg, msg
    return msg


# ---- bounded decompression: peak memory of a child process ---------------------------------

PROBE = textwrap.dedent(
    """
    import json, sys
    from common import datasets
    if sys.argv[3] == "uncapped":  # the bug injected: read everything, then look
        import gzip, numpy as np
        datasets._read_idx = lambda p, s=None: np.frombuffer(gzip.open(p).read(), np.uint8)[:0]
    try:
        datasets.load(sys.argv[2], sys.argv[1], download=False, verify=False)
        msg = "loaded"
    except Exception as exc:
        msg = f"{type(exc).__name__}: {exc}"
    # VmHWM: the peak RSS of this program's own memory map. Not ru_maxrss, which survives
    # exec and starts at the RSS of the forking parent (pytest's, ~1 GB late in the suite).
    hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")][0]
    peak = int(hwm.split()[1]) / 1024  # kB -> MiB
    print(json.dumps({"msg": msg, "peak_mib": peak}))
    """
)


def peak_load(data_dir: Path, name: str, mode: str = "capped") -> dict:
    proc = run_python(MAIN_PYTHON, "-c", PROBE, str(data_dir), name, mode, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def baseline_mib(tmp_path: Path) -> float:
    write_fashion(tmp_path / "base")
    return peak_load(tmp_path / "base", "fashion-mnist")["peak_mib"]


def write_idx_bomb(root: Path, inflated_mib: int) -> Path:
    """Official-looking t10k images (a right header, 10 images) followed by `inflated_mib` MiB
    of zeros: 1 KB per MiB on disk."""
    write_fashion(root, n_test=10)
    path = root / "fashion-mnist" / "t10k-images-idx3-ubyte.gz"
    header = struct.pack(">HBBIII", 0, 8, 3, 10, 28, 28)
    path.write_bytes(gzip.compress(header + bytes(10 * 784)) + _zeros(inflated_mib))
    return path


def refused_in_bounded_memory(data_dir: Path, name: str, says: str) -> None:
    """Loading dataset `name` from `data_dir` is refused, saying `says`, within 50 MiB of the
    memory a valid load takes."""
    base = baseline_mib(data_dir)
    got = peak_load(data_dir, name)
    assert says in got["msg"], got
    assert got["peak_mib"] < base + 50, (got, base)


def test_idx_bomb_is_refused_after_reading_only_what_its_header_says(tmp_path: Path) -> None:
    path = write_idx_bomb(tmp_path, 1024)  # 1 GiB inflated
    assert path.stat().st_size < 2 << 20
    refused_in_bounded_memory(tmp_path, "fashion-mnist", "holds more data than its header says")


def test_bomb_measurement_catches_an_uncapped_reader(tmp_path: Path) -> None:
    """The bug injected (read the whole stream, then check): the same probe sees the inflation,
    so the bounds asserted above can fail."""
    write_idx_bomb(tmp_path, 256)
    base = baseline_mib(tmp_path)
    got = peak_load(tmp_path, "fashion-mnist", "uncapped")
    assert got["peak_mib"] > base + 200, (got, base)


def test_tar_member_of_2gib_is_refused_by_its_header(tmp_path: Path) -> None:
    """A 2 GiB member (2 MB on disk): refused by its tar header before a byte of it is read."""
    info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
    info.size = 2 << 30
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(gzip.compress(info.tobuf(tarfile.GNU_FORMAT)) + _zeros(2048))
    assert path.stat().st_size < 3 << 20
    refused_in_bounded_memory(
        tmp_path, "cifar10", "member cifar-10-batches-py/data_batch_1 is 2147483648 bytes"
    )


def test_pax_header_bomb_is_refused_before_it_is_read(tmp_path: Path) -> None:
    """A pax extended header claiming 1 GiB: tarfile itself would read it whole into memory."""
    info = tarfile.TarInfo("././@PaxHeader")
    info.type, info.size = tarfile.XHDTYPE, 1 << 30
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    path.parent.mkdir(parents=True)
    path.write_bytes(gzip.compress(info.tobuf(tarfile.GNU_FORMAT)) + _zeros(1024))
    refused_in_bounded_memory(tmp_path, "cifar10", "asks to read 1073741824 bytes at once")


def test_idx_header_beyond_the_official_shape_is_refused_before_inflating(tmp_path: Path) -> None:
    write_fashion(tmp_path)
    path = tmp_path / "fashion-mnist" / "t10k-images-idx3-ubyte.gz"
    path.write_bytes(gzip.compress(struct.pack(">HBBIII", 0, 8, 3, 10**7, 28, 28)))
    refused(tmp_path, "fashion-mnist", "(10000000, 28, 28)", "at most 10000 items")


@pytest.mark.parametrize(
    "header, fragment",
    [
        (
            struct.pack(">HBB", 0, 8, 255) + bytes(16),
            "gives 255 dimensions, the official file has 3",
        ),
        (struct.pack(">HBBIII", 0, 8, 3, 5, 32, 32), "gives shape (5, 32, 32)"),
        (struct.pack(">HBBI", 0, 8, 3, 5), "truncated inside its idx header"),
        (struct.pack(">HBBIII", 0, 9, 3, 5, 28, 28), "not an idx-ubyte file"),
        (b"\0\0", "too short to be an idx file"),
    ],
    ids=["ndim 255", "28x28 -> 32x32", "header cut", "dtype code 9", "2 bytes"],
)
def test_idx_headers_give_clear_errors(tmp_path: Path, header: bytes, fragment: str) -> None:
    write_fashion(tmp_path)
    (tmp_path / "fashion-mnist" / "t10k-images-idx3-ubyte.gz").write_bytes(gzip.compress(header))
    msg = refused(tmp_path, "fashion-mnist", fragment)
    assert "unpack requires" not in msg


# ---- archives: members checked by their headers ---------------------------------------------


def test_too_many_members_refused(tmp_path: Path) -> None:
    _cifar_dir(tmp_path, {f"junk/{i}": b"x" for i in range(datasets.MAX_MEMBERS + 1)})
    refused(tmp_path, "cifar10", f"more than {datasets.MAX_MEMBERS} members")


def test_symlink_member_refused(tmp_path: Path) -> None:
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    path.parent.mkdir(parents=True)
    with tarfile.open(path, "w:gz") as tar:
        info = tarfile.TarInfo("cifar-10-batches-py/data_batch_1")
        info.type, info.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(info)
    refused(tmp_path, "cifar10", "is not one regular file")


def test_missing_member_refused(tmp_path: Path) -> None:
    _cifar_dir(tmp_path, {"cifar-10-batches-py/data_batch_1": _cifar_pickle(2, "labels", 0)[0]})
    refused(tmp_path, "cifar10", "has no member cifar-10-batches-py/data_batch_2")


def test_unused_member_too_large_refused(tmp_path: Path) -> None:
    _cifar_dir(tmp_path, {"cifar-10-batches-py/readme.html": bytes(datasets.OTHER_MEMBER_MAX + 1)})
    refused(tmp_path, "cifar10", "readme.html is 1048577 bytes")


# ---- the restricted unpickler ---------------------------------------------------------------


class _Reduce:
    """Pickles as `func(*args)` (the way an attacker writes a pickle)."""

    def __init__(self, func: object, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return self.func, self.args


def _copyreg_bomb() -> bytes:
    """copyreg._reconstructor(ndarray, ndarray, shape): a ~150-byte pickle that allocates
    20,000 CIFAR rows of float64 (491 MB) in an unrestricted unpickler (the old allow-list let
    it by; any shape fits in the same bytes)."""
    import copyreg

    return _batch(_Reduce(copyreg._reconstructor, (np.ndarray, np.ndarray, (20_000, 3072))), [0])


def test_copyreg_reconstructor_bomb_refused(tmp_path: Path) -> None:
    blob = _copyreg_bomb()
    assert len(blob) < 200
    _cifar_with(tmp_path, blob)
    refused(tmp_path, "cifar10", "refusing to unpickle copy_reg._reconstructor")
    # The bug injected (any unpickler): the same bytes build the 491 MB array.
    assert pickle.loads(blob)[b"data"].nbytes == 20_000 * 3072 * 8


def _reconstruct_bomb() -> bytes:
    """numpy's own _reconstruct asked for a 200,000-image array (not the (0,) numpy writes)."""
    from numpy._core.multiarray import _reconstruct

    return _batch(_Reduce(_reconstruct, (np.ndarray, (200_000, 3072), b"b")), [0])


def _array_state(shape: tuple, raw: object, dtype: object = "u1") -> bytes:
    """An ndarray pickle whose __setstate__ gets (1, shape, dtype, False, raw)."""

    class Arr:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            from numpy._core.multiarray import _reconstruct

            return _reconstruct, (np.ndarray, (0,), b"b"), (1, shape, np.dtype(dtype), False, raw)

    return _batch(Arr(), [0])


def _evil(tmp_path: Path) -> bytes:
    return _batch(_Reduce(os.system, ("touch " + str(tmp_path / "pwned"),)), [0])


UNPICKLE_CASES = {
    "os.system": (_evil, "refusing to unpickle posix.system"),
    "builtins.eval": (lambda p: _batch(_Reduce(eval, ("1+1",)), [0]), "__builtin__.eval"),
    "copyreg bomb": (lambda p: _copyreg_bomb(), "copy_reg._reconstructor"),
    "_reconstruct bomb": (lambda p: _reconstruct_bomb(), "numpy _reconstruct"),
    "ndarray called": (
        lambda p: _batch(_Reduce(np.ndarray, ((200_000, 3072),)), [0]),
        "cannot read",
    ),
    "shape larger than data": (
        lambda p: _array_state((200_000, 3072), b"\0" * 3072),
        "an ndarray of shape (200000, 3072) from 3072 bytes",
    ),
    "object array": (
        lambda p: _batch(np.array([[1], [2]], dtype=object), [0]),
        "refusing to unpickle",
    ),
    "float dtype": (lambda p: _batch(np.zeros((1, 3072), np.float64), [0]), "numpy.dtype('f8')"),
    "sub-array dtype": (
        lambda p: _array_state((1,), bytes(3072), dtype=("u1", (3072,))),
        "refusing to unpickle",
    ),
    "protocol 5 buffers": (
        lambda p: _batch(np.zeros((1, 3072), np.uint8), [0], protocol=5),
        "refusing to unpickle",
    ),
    "not a pickle": (lambda p: b"\x80\x02garbage", "cannot read"),
}


@pytest.mark.parametrize("case", sorted(UNPICKLE_CASES))
def test_hostile_pickles_are_refused(tmp_path: Path, case: str) -> None:
    make, fragment = UNPICKLE_CASES[case]
    _cifar_with(tmp_path, make(tmp_path))
    refused(tmp_path, "cifar10", fragment)
    assert not (tmp_path / "pwned").exists()


def _py2_batch(x: np.ndarray, labels: list[int]) -> bytes:
    """A batch as Python 2's cPickle wrote the official files (protocol 2, str as
    SHORT_BINSTRING/BINSTRING, dtype('u1', 0, 1)), written opcode by opcode."""

    def s(b: bytes) -> bytes:
        return (b"U" + bytes([len(b)]) if len(b) < 256 else b"T" + struct.pack("<i", len(b))) + b

    n, width = x.shape
    array = (
        b"cnumpy.core.multiarray\n_reconstruct\ncnumpy\nndarray\nK\x00\x85" + s(b"b") + b"\x87R"
        b"(K\x01M" + struct.pack("<H", n) + b"M" + struct.pack("<H", width) + b"\x86"
        b"cnumpy\ndtype\n" + s(b"u1") + b"K\x00K\x01\x87R"
        b"(K\x03" + s(b"|") + b"NNNJ\xff\xff\xff\xffJ\xff\xff\xff\xffK\x00tb"
        b"\x89" + s(x.tobytes()) + b"tb"
    )
    labels_op = b"](" + b"".join(b"K" + bytes([v]) for v in labels) + b"e"
    return b"\x80\x02}(" + s(b"data") + array + s(b"labels") + labels_op + b"u."


def test_python2_official_pickle_format_still_reads(tmp_path: Path) -> None:
    """The restricted unpickler still reads the official files' exact format."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
    _cifar_with(tmp_path, _py2_batch(x, [1, 9, 0]))
    ds = datasets.load("cifar10", str(tmp_path), download=False, verify=False)
    np.testing.assert_array_equal(ds.train_y[:3], [1, 9, 0])
    np.testing.assert_array_equal(ds.train_x[0], x[0].reshape(3, 32, 32).transpose(1, 2, 0))


# ---- labels and counts ----------------------------------------------------------------------

LABEL_CASES = {
    "label 255": ([255, 0, 0, 0], "label 255 is outside 0..9"),
    "label -1": ([0, -1, 0, 0], "label -1 is outside 0..9"),
    "label 10": ([0, 10, 0, 0], "label 10 is outside 0..9"),
    "fewer labels": ([0, 1, 2], "4 images but 3 labels"),
    "more labels": ([0, 1, 2, 3, 4], "4 images but 5 labels"),
    "float labels": ([0.5, 1, 2, 3], "labels must be a list of integers"),
    "text labels": ([b"cat", b"dog", b"cat", b"dog"], "labels must be a list of integers"),
    "huge label": ([2**70, 0, 0, 0], "labels must be a list of integers"),
    "nested labels": ([[0], [1], [2], [3]], "labels must be a list of integers"),
    "labels not a list": ({0: 1}, "labels must be a list of integers"),
}


@pytest.mark.parametrize("case", sorted(LABEL_CASES))
def test_cifar_labels_and_counts_checked(tmp_path: Path, case: str) -> None:
    labels, fragment = LABEL_CASES[case]
    _cifar_with(tmp_path, _batch(np.zeros((4, 3072), np.uint8), labels))
    refused(tmp_path, "cifar10", "data_batch_1", fragment)


def test_label_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The bug injected (no label check): label 255 loads, and would train."""
    monkeypatch.setattr(datasets, "check_labels", lambda *a: None)
    _cifar_with(tmp_path, _batch(np.zeros((4, 3072), np.uint8), [255, 0, 0, 0]))
    ds = datasets.load("cifar10", str(tmp_path), download=False, verify=False)
    assert ds.train_y.max() == 255


@pytest.mark.parametrize(
    "data, fragment",
    [
        (np.zeros((4, 1024), np.uint8), "expected (N, 3072) uint8 rows"),
        (np.zeros((10_001, 3072), np.uint8), "N <= 10000"),
        (np.zeros((4, 3072), np.int64), "b'data' must be (N, 3072) uint8 rows"),
        ([[0] * 3072] * 4, "b'data' must be (N, 3072) uint8 rows"),
    ],
    ids=["1024 columns", "10001 rows", "int64", "a list"],
)
def test_cifar_images_checked(tmp_path: Path, data: object, fragment: str) -> None:
    n = len(data) if isinstance(data, list) else data.shape[0]  # type: ignore[union-attr]
    _cifar_with(tmp_path, _batch(data, [0] * n))
    refused(tmp_path, "cifar10", fragment)


def test_cifar100_fine_label_100_refused(tmp_path: Path) -> None:
    blob = pickle.dumps({b"data": np.zeros((2, 3072), np.uint8), b"fine_labels": [99, 100]}, 2)
    _write_tar(
        tmp_path / "cifar100" / "cifar-100-python.tar.gz",
        {"cifar-100-python/train": blob, "cifar-100-python/test": blob},
    )
    refused(tmp_path, "cifar100", "label 100 is outside 0..99")


@pytest.mark.parametrize(
    "labels, fragment",
    [(np.array([0, 1, 10]), "label 10 is outside 0..9"), (np.array([0, 1]), "3 images but 2")],
    ids=["label 10", "2 labels for 3 images"],
)
def test_fashion_labels_checked(tmp_path: Path, labels: np.ndarray, fragment: str) -> None:
    write_fashion(tmp_path, n_test=3)
    (tmp_path / "fashion-mnist" / "t10k-labels-idx1-ubyte.gz").write_bytes(_idx(labels))
    refused(tmp_path, "fashion-mnist", "t10k-labels", fragment)


def _with(ds: datasets.Dataset, **changes: object) -> datasets.Dataset:
    return datasets.Dataset(**{**ds.__dict__, **changes})


GOOD = datasets.make_synthetic(6, 3, 8, 1, 4, seed=0)
DATASET_CASES = {
    "label = classes": (_with(GOOD, test_y=np.array([0, 1, 4], np.int32)), "label 4 is outside"),
    "negative label": (_with(GOOD, train_y=-GOOD.train_y - 1), "label -"),
    "count mismatch": (_with(GOOD, train_y=GOOD.train_y[:5]), "6 images but 5 labels"),
    "empty test set": (_with(GOOD, test_x=GOOD.test_x[:0], test_y=GOOD.test_y[:0]), "no images"),
    "float images": (_with(GOOD, train_x=GOOD.train_x.astype(np.float32)), "expected (N, H, W, C)"),
    "float labels": (_with(GOOD, train_y=GOOD.train_y.astype(np.float32)), "expected (N, H, W, C)"),
}


@pytest.mark.parametrize("loader", ["digits", "synthetic"])
@pytest.mark.parametrize("case", sorted(DATASET_CASES))
def test_every_loader_is_checked(monkeypatch: pytest.MonkeyPatch, loader: str, case: str) -> None:
    """A loader that returned bad arrays (digits and synthetic too) is refused by `load`."""
    bad, fragment = DATASET_CASES[case]
    if loader == "digits":
        pytest.importorskip("sklearn")
        monkeypatch.setattr(datasets, "load_digits", lambda: bad)
    else:
        monkeypatch.setattr(datasets, "make_synthetic", lambda *a: bad)
    with pytest.raises(DatasetError, match=re.escape(fragment)):
        datasets.load(loader)


def test_synthetic_with_no_images_refused() -> None:
    with pytest.raises(DatasetError, match="training set.*holds no images"):
        datasets.load("synthetic", synthetic_train=0)


# ---- files on disk: regular, verified once --------------------------------------------------


def _official(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A small CIFAR-10 archive made 'official' for the test: SOURCES names its MD5."""
    write_cifar10(tmp_path)
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    monkeypatch.setitem(datasets.SOURCES, "cifar10", {path.name: ("file:///nowhere", md5)})
    return path


def _count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    calls: list[Path] = []
    real = datasets.md5sum
    monkeypatch.setattr(datasets, "md5sum", lambda p: calls.append(p) or real(p))
    return calls


def test_tampered_file_on_disk_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _official(monkeypatch, tmp_path)
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 1  # one bit, somewhere in the gzip stream
    path.write_bytes(bytes(raw))
    with pytest.raises(DatasetError, match="has MD5 .*, the official cifar-10-python.tar.gz has"):
        datasets.load("cifar10", str(tmp_path), download=False)


def test_each_file_is_hashed_once_until_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _official(monkeypatch, tmp_path)
    calls = _count_hashes(monkeypatch)
    datasets.load("cifar10", str(tmp_path), download=False)
    datasets.load("cifar10", str(tmp_path), download=False)
    assert len(calls) == 1  # the second load trusts .verified.json (same size and mtime)
    cache = json.loads((path.parent / datasets.VERIFIED).read_text())
    assert cache[path.name][:2] == [path.stat().st_size, path.stat().st_mtime_ns]
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    datasets.load("cifar10", str(tmp_path), download=False)
    assert len(calls) == 2  # touched: hashed again
    (path.parent / datasets.VERIFIED).write_text("{not json")
    datasets.load("cifar10", str(tmp_path), download=False)
    assert len(calls) == 3  # a damaged cache is ignored: hashed again


def test_read_only_data_dir_still_verifies(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fault: the cache cannot be written. Loading still works (and verifies every time)."""
    path = _official(monkeypatch, tmp_path)
    calls = _count_hashes(monkeypatch)
    monkeypatch.setattr(datasets.os, "replace", _raise_enospc)
    datasets.load("cifar10", str(tmp_path), download=False)
    datasets.load("cifar10", str(tmp_path), download=False)
    assert len(calls) == 2
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # no temp file left


def _raise_enospc(*args: object) -> None:
    raise OSError(28, "No space left on device")


def test_wrong_size_is_refused_without_hashing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_cifar10(tmp_path)  # the real SOURCES: the official MD5, and its size
    calls = _count_hashes(monkeypatch)
    with pytest.raises(
        DatasetError, match="bytes, the official cifar-10-python.tar.gz is 170498071"
    ):
        datasets.load("cifar10", str(tmp_path), download=False)
    assert calls == []


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_non_regular_file_refused_at_once(tmp_path: Path, kind: str) -> None:
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    path.parent.mkdir(parents=True)
    os.mkfifo(path) if kind == "fifo" else path.mkdir()

    with deadline(10):
        for verify in (True, False):
            with pytest.raises(DatasetError, match=f"is a {'FIFO' if kind == 'fifo' else kind}"):
                datasets.load("cifar10", str(tmp_path), download=False, verify=verify)


def test_download_larger_than_the_official_file_stops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = tmp_path / "mirror.tar.gz"
    src.write_bytes(bytes(3 << 20))
    md5 = "0" * 32
    monkeypatch.setitem(
        datasets.SOURCES, "cifar10", {"cifar-10-python.tar.gz": (src.as_uri(), md5)}
    )
    monkeypatch.setitem(datasets.SIZES, md5, 1 << 20)
    with pytest.raises(DatasetError, match="larger than the official file"):
        datasets.load("cifar10", str(tmp_path / "data"), download=True)
    assert list((tmp_path / "data" / "cifar10").iterdir()) == []


def test_no_verify_parses_in_full_before_anything_and_warns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    write_cifar10(tmp_path)
    cfg = preset("smoke", dataset="cifar10", data_dir=str(tmp_path), download=False, verify=False)
    datasets.check_available(cfg)
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "--no-verify" in warning[0], warning
    _cifar_with(tmp_path, _batch(np.zeros((4, 3072), np.uint8), [0, 0, 0, 99]))
    with pytest.raises(DatasetError, match="label 99"):
        datasets.check_available(cfg)
    assert capsys.readouterr().err == ""  # refused: no warning, the error is the one line


# ---- trainers: exit 2, one line, nothing started or written ----------------------------------


def _bad_label_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    _cifar_with(data, _batch(np.zeros((4, 3072), np.uint8), [0, -1, 0, 0]))
    return data


@pytest.mark.parametrize(
    "framework", ["torch-dp", "torch-ddp", "jax-pmap", "jax-shard", "mxnet-gluon"]
)
def test_trainers_refuse_bad_data_with_one_line(tmp_path: Path, framework: str) -> None:
    skip_without_interpreter(framework)
    data = _bad_label_dir(tmp_path)
    out, state = tmp_path / "rec.json", tmp_path / "final.npz"
    proc = run_trainer(
        framework, "--preset", "smoke", "--dataset", "cifar10", "--data-dir", str(data),
        "--no-download", "--no-verify", "--gpus", "2", "--output", str(out),
        "--save-state", str(state),
        env={"TMPDIR": str(tmp_path)},
        timeout=120,
    )  # fmt: skip
    one_line_error(proc, "label -1 is outside 0..9", "data_batch_1")
    # Nothing written or left behind: no record, no state, no temp files, no cache entry.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert [p.name for p in (data / "cifar10").iterdir()] == ["cifar-10-python.tar.gz"]


def test_torch_ddp_tampered_file_refused_before_any_process(tmp_path: Path) -> None:
    """The default (verified) path: the parent refuses, no worker is spawned."""
    data = _bad_label_dir(tmp_path)
    proc = run_trainer(
        "torch-ddp", "--preset", "smoke", "--dataset", "cifar10", "--data-dir", str(data),
        "--no-download", "--gpus", "2", "--output", str(tmp_path / "rec.json"),
        env={"TMPDIR": str(tmp_path), "DPBENCH_FAIL": "torch-ddp"},  # a worker would raise
        timeout=120,
    )  # fmt: skip
    one_line_error(proc, "the official cifar-10-python.tar.gz is 170498071")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert [p.name for p in (data / "cifar10").iterdir()] == ["cifar-10-python.tar.gz"]


def test_a_workers_dataset_error_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    """A DatasetError raised inside a torch-ddp worker (the file changed after the parent's
    check) reaches the parent as torch's ProcessRaisedException: still exit 2, one line."""
    mp = pytest.importorskip("torch.multiprocessing")
    from common.trainer import run_main

    text = (
        "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call "
        'last):\n  File "x.py", line 1, in _wrap\ncommon.datasets.DatasetError: data_batch_1: '
        "label -1 is outside 0..9; download it again\n"
    )

    def train(cfg):  # type: ignore[no-untyped-def]
        raise mp.ProcessRaisedException(text, 1, 4242)

    rc = run_main(["--preset", "smoke"], "torch-ddp", check=lambda c: None, train=train)
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2 and len(err) == 1 and err[0].endswith("label -1 is outside 0..9; download it again")
    )
    assert "DatasetError" not in err[0]


def test_capped_stream_refuses_to_go_past_its_limit() -> None:
    """The backstop under every archive read: no seek or read past the official size."""
    import io

    capped = datasets._Capped(io.BytesIO(bytes(100)), limit=64, per_read=32, where="x.tar.gz")
    assert capped.read(32) == bytes(32) and capped.tell() == 32
    with pytest.raises(DatasetError, match="asks to read 33 bytes at once"):
        capped.read(33)
    with pytest.raises(DatasetError, match="asks to read all bytes"):
        capped.read()
    with pytest.raises(DatasetError, match="inflates past 64 bytes"):
        capped.seek(65)
    capped.seek(40)
    with pytest.raises(DatasetError, match="inflates past 64 bytes"):
        capped.read(30)
