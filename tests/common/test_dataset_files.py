"""Dataset files (common/datasets.py): a damaged official file is refused by its published MD5;
a file of the wrong kind is one line naming it; no code runs from a pickle; a trainer refuses
such data with one line, exit 2, before anything starts or is written."""

from __future__ import annotations

import gzip
import hashlib
import os
import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from common import datasets
from common.config import preset
from common.datasets import DatasetError
from tests.common.test_datasets import _idx, write_cifar10, write_fashion
from tests.conftest import one_line_error, run_trainer, skip_without_interpreter


def _batch(data: object, labels: object) -> bytes:
    return pickle.dumps({b"data": data, b"labels": labels}, protocol=2)


def refused(tmp_path: Path, name: str, fragment: str) -> None:
    """Loading `name` (unverified: the readers' own checks) raises a one-line DatasetError."""
    with pytest.raises(DatasetError, match=re.escape(fragment)) as exc:
        datasets.load(name, str(tmp_path), download=False, verify=False)
    assert "\n" not in str(exc.value)


class _Touch:
    """Pickles as os.system("touch PATH")."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return os.system, (f"touch {self.path}",)


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


def test_the_unpickler_reads_the_official_python2_format_and_runs_no_code(tmp_path: Path) -> None:
    x = np.random.default_rng(0).integers(0, 256, (3, 3072), dtype=np.uint8)
    write_cifar10(tmp_path, first=_py2_batch(x, [1, 9, 0]))
    ds = datasets.load("cifar10", str(tmp_path), download=False, verify=False)
    np.testing.assert_array_equal(ds.train_y[:3], [1, 9, 0])
    np.testing.assert_array_equal(ds.train_x[0], x[0].reshape(3, 32, 32).transpose(1, 2, 0))
    write_cifar10(tmp_path, first=(blob := _batch(_Touch(tmp_path / "pwned"), [0])))
    refused(tmp_path, "cifar10", "refusing to unpickle posix.system")
    assert not (tmp_path / "pwned").exists()
    pickle.loads(blob)  # the file is live: an unrestricted unpickler runs it
    assert (tmp_path / "pwned").exists()


IMAGES = np.zeros((4, 3072), np.uint8)
T10K = "t10k-images-idx3-ubyte.gz"
WRONG_KIND = [  # (dataset, CIFAR's first batch or (Fashion-MNIST's file, content), fragment)
    ("cifar10", pickle.dumps({b"x": 1}), "is not a CIFAR batch"),
    ("cifar10", _batch(IMAGES[:, :1024], [0] * 4), "(N, 3072)"),
    ("cifar10", _batch(IMAGES, [0, 10, 0, 0]), "label 10 is outside"),
    ("cifar10", _batch(IMAGES, [0, 1, 2]), "4 images but 3 labels"),
    ("cifar10", _batch(IMAGES, [b"cat"] * 4), "list of integers"),
    ("cifar10", None, "cannot read"),  # the archive cut short
    ("fashion-mnist", (T10K, gzip.compress(b"x" * 99)), "not an idx-ubyte file"),
    ("fashion-mnist", (T10K, _idx(np.zeros((3, 28, 28)))[:-9]), "cannot read"),
    ("fashion-mnist", ("t10k-labels-idx1-ubyte.gz", _idx(np.zeros(2))), "3 images but 2 labels"),
]


@pytest.mark.parametrize("name,content,fragment", WRONG_KIND)
def test_a_file_of_the_wrong_kind_is_one_line(tmp_path: Path, name, content, fragment) -> None:
    if isinstance(content, tuple):
        write_fashion(tmp_path, n_test=3)
        (tmp_path / name / content[0]).write_bytes(content[1])
    elif content is None:
        write_cifar10(tmp_path, n=50)
        path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    else:
        write_cifar10(tmp_path, first=content)
    refused(tmp_path, name, fragment)


def test_a_damaged_file_is_refused_by_its_md5_once_it_changes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hashed once, remembered by size and mtime (.verified.json); a file changed since is
    hashed again, and one bit flipped is refused."""
    write_cifar10(tmp_path)  # made 'official': SOURCES names its MD5
    path = tmp_path / "cifar10" / "cifar-10-python.tar.gz"
    md5 = hashlib.md5(path.read_bytes()).hexdigest()
    monkeypatch.setitem(datasets.SOURCES, "cifar10", {path.name: ("file:///nowhere", md5)})
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
    write_cifar10(tmp_path, first=_batch(IMAGES, [0, 0, 0, 99]))
    with pytest.raises(DatasetError, match="label 99"):
        datasets.check_available(cfg)
    assert capsys.readouterr().err == ""  # refused: no warning, the error is the one line


@pytest.mark.parametrize("framework", ["torch-ddp", "mxnet-gluon"])  # each interpreter
def test_trainers_refuse_bad_data_with_one_line(tmp_path: Path, framework: str) -> None:
    skip_without_interpreter(framework)
    data = tmp_path / "data"
    write_cifar10(data, first=_batch(IMAGES, [0, -1, 0, 0]))
    proc = run_trainer(
        framework, "--preset", "smoke", "--dataset", "cifar10", "--data-dir", str(data),
        "--no-download", "--no-verify", "--gpus", "2", "--output", str(tmp_path / "rec.json"),
        "--save-state", str(tmp_path / "s.npz"), env={"TMPDIR": str(tmp_path)}, timeout=120,
    )  # fmt: skip
    one_line_error(proc, "label -1 is outside 0..9", "data_batch_1")  # nothing written or left:
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data"]
    assert [p.name for p in (data / "cifar10").iterdir()] == ["cifar-10-python.tar.gz"]


def test_a_workers_dataset_error_is_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    """A DatasetError raised inside a torch-ddp worker (the file changed after the parent's
    check) reaches the parent as torch's ProcessRaisedException: still exit 2, one line."""
    mp = pytest.importorskip("torch.multiprocessing")
    from common.trainer import run_main

    why = "data_batch_1: label -1 is outside 0..9; download it again"
    text = "\n\n-- Process 1 terminated with the following error:\nTraceback (most recent call "
    text += f'last):\n  File "x.py", line 1, in _wrap\ncommon.datasets.DatasetError: {why}\n'

    def train(cfg):  # type: ignore[no-untyped-def]
        raise mp.ProcessRaisedException(text, 1, 4242)

    rc = run_main(["--preset", "smoke"], "torch-ddp", check=lambda c: None, train=train)
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err.endswith(f": {why}"), err
    assert "DatasetError" not in err
