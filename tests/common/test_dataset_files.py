"""Dataset files (common/datasets.py): an official file that is damaged is refused by its
published MD5 (hashed once, then remembered until the file changes); a file of the wrong kind
(not a CIFAR batch, not an idx file, labels that do not match the images or the classes) is one
line naming it; no code runs from a pickle. A trainer refuses such data with one line, exit 2,
before anything starts or is written. The readers on good files: tests/common/test_datasets.py."""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from common import datasets
from common.config import preset
from common.datasets import DatasetError
from tests.common.test_datasets import _cifar_pickle, _idx, _write_tar, write_cifar10, write_fashion
from tests.conftest import one_line_error, run_trainer, skip_without_interpreter

BATCHES = [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch"]


def _batch(data: object, labels: object) -> bytes:
    return pickle.dumps({b"data": data, b"labels": labels}, protocol=2)


def _cifar_with(tmp_path: Path, blob: bytes) -> None:
    """A CIFAR-10 archive whose first batch is `blob` (the others are well-formed)."""
    members = {f"cifar-10-batches-py/{m}": _cifar_pickle(4, "labels", i)[0]
               for i, m in enumerate(BATCHES)}  # fmt: skip
    members["cifar-10-batches-py/data_batch_1"] = blob
    _write_tar(tmp_path / "cifar10" / "cifar-10-python.tar.gz", members)


def refused(tmp_path: Path, name: str, *fragments: str) -> str:
    """Loading `name` (unverified: the readers' own checks) raises one-line DatasetError."""
    with pytest.raises(DatasetError) as exc:
        datasets.load(name, str(tmp_path), download=False, verify=False)
    msg = str(exc.value)
    assert "\n" not in msg and all(f in msg for f in fragments), msg
    return msg


# ---- no code runs from a pickle ---------------------------------------------------------------


class _Reduce:
    """Pickles as `func(*args)`."""

    def __init__(self, func: object, args: tuple) -> None:
        self.func, self.args = func, args

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return self.func, self.args


def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path: Path) -> None:
    blob = _batch(_Reduce(os.system, ("touch " + str(tmp_path / "pwned"),)), [0])
    _cifar_with(tmp_path, blob)
    refused(tmp_path, "cifar10", "refusing to unpickle posix.system")
    assert not (tmp_path / "pwned").exists()
    pickle.loads(blob)  # the file is live: an unrestricted unpickler runs it
    assert (tmp_path / "pwned").exists()


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


def test_the_restricted_unpickler_reads_the_official_python2_format(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, (3, 3072), dtype=np.uint8)
    _cifar_with(tmp_path, _py2_batch(x, [1, 9, 0]))
    ds = datasets.load("cifar10", str(tmp_path), download=False, verify=False)
    np.testing.assert_array_equal(ds.train_y[:3], [1, 9, 0])
    np.testing.assert_array_equal(ds.train_x[0], x[0].reshape(3, 32, 32).transpose(1, 2, 0))


# ---- a file of the wrong kind -----------------------------------------------------------------


def _fashion_with(tmp_path: Path, name: str, content: bytes) -> None:
    write_fashion(tmp_path, n_test=3)
    (tmp_path / "fashion-mnist" / name).write_bytes(content)


def _cut_short(tmp_path: Path) -> None:
    write_cifar10(tmp_path, n=50)
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


IMAGES = np.zeros((4, 3072), np.uint8)
WRONG_KIND = {
    "not a batch": (lambda p: _cifar_with(p, pickle.dumps({b"x": 1})), "is not a CIFAR batch"),
    "1024 columns": (lambda p: _cifar_with(p, _batch(IMAGES[:, :1024], [0] * 4)), "(N, 3072)"),
    "label 10": (lambda p: _cifar_with(p, _batch(IMAGES, [0, 10, 0, 0])), "label 10 is outside"),
    "3 labels": (lambda p: _cifar_with(p, _batch(IMAGES, [0, 1, 2])), "4 images but 3 labels"),
    "text labels": (lambda p: _cifar_with(p, _batch(IMAGES, [b"cat"] * 4)), "list of integers"),
    "archive cut short": (_cut_short, "cannot read"),
    "not idx": (
        lambda p: _fashion_with(p, "t10k-images-idx3-ubyte.gz", gzip.compress(b"x" * 99)),
        "not an idx-ubyte file",
    ),  # fmt: skip
    "idx cut short": (
        lambda p: _fashion_with(p, "t10k-images-idx3-ubyte.gz", _idx(np.zeros((3, 28, 28)))[:-9]),
        "cannot read",
    ),
    "2 labels": (
        lambda p: _fashion_with(p, "t10k-labels-idx1-ubyte.gz", _idx(np.zeros(2))),
        "3 images but 2 labels",
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", sorted(WRONG_KIND))
def test_a_file_of_the_wrong_kind_is_one_line(tmp_path: Path, case: str) -> None:
    write, fragment = WRONG_KIND[case]
    write(tmp_path)
    name = "fashion-mnist" if (tmp_path / "fashion-mnist").exists() else "cifar10"
    refused(tmp_path, name, fragment)


# ---- a damaged file: its MD5 -------------------------------------------------------------------


def _official(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """A small CIFAR-10 archive made 'official' for the test: SOURCES names its MD5."""
    write_cifar10(tmp_path)
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    monkeypatch.setitem(datasets.SOURCES, "cifar10", {path.name: ("file:///nowhere", md5)})
    return path


def test_a_damaged_file_is_refused_by_its_md5_once_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashed once, remembered by size and mtime (.verified.json); a file changed since is
    hashed again, and one bit flipped is refused."""
    path = _official(monkeypatch, tmp_path)
    calls: list[Path] = []
    real = datasets.md5sum
    monkeypatch.setattr(datasets, "md5sum", lambda p: calls.append(p) or real(p))
    datasets.load("cifar10", str(tmp_path), download=False)
    datasets.load("cifar10", str(tmp_path), download=False)
    assert len(calls) == 1  # the second load trusts .verified.json
    raw = bytearray(path.read_bytes())
    raw[-40] ^= 1  # one bit, somewhere in the gzip stream
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))
    with pytest.raises(DatasetError, match="has MD5 .*, the official cifar-10-python.tar.gz has"):
        datasets.load("cifar10", str(tmp_path), download=False)


def test_no_verify_parses_in_full_before_anything_and_warns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_cifar10(tmp_path)
    cfg = preset("smoke", dataset="cifar10", data_dir=str(tmp_path), download=False, verify=False)
    datasets.check_available(cfg)
    warning = capsys.readouterr().err.strip().splitlines()
    assert len(warning) == 1 and "--no-verify" in warning[0], warning
    _cifar_with(tmp_path, _batch(IMAGES, [0, 0, 0, 99]))
    with pytest.raises(DatasetError, match="label 99"):
        datasets.check_available(cfg)
    assert capsys.readouterr().err == ""  # refused: no warning, the error is the one line


# ---- trainers: exit 2, one line, nothing started or written ----------------------------------


@pytest.mark.parametrize("framework", ["torch-ddp", "mxnet-gluon"])  # each interpreter
def test_trainers_refuse_bad_data_with_one_line(tmp_path: Path, framework: str) -> None:
    skip_without_interpreter(framework)
    data = tmp_path / "data"
    _cifar_with(data, _batch(IMAGES, [0, -1, 0, 0]))
    out, state = tmp_path / "rec.json", tmp_path / "final.npz"
    proc = run_trainer(
        framework, "--preset", "smoke", "--dataset", "cifar10", "--data-dir", str(data),
        "--no-download", "--no-verify", "--gpus", "2", "--output", str(out),
        "--save-state", str(state), env={"TMPDIR": str(tmp_path)}, timeout=120,
    )  # fmt: skip
    one_line_error(proc, "label -1 is outside 0..9", "data_batch_1")
    # Nothing written or left behind: no record, no state, no temp files, no cache entry.
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
    assert rc == 2 and len(err) == 1
    assert err[0].endswith("label -1 is outside 0..9; download it again")
    assert "DatasetError" not in err[0]
