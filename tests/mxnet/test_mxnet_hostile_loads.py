"""Hostile loads, MXNet's side (issue 29; the torch and JAX side and what is checked where:
tests/trainers/test_resume_checks.py): a checkpoint index, or a weights or optimiser file it names, that
is a FIFO (the reader blocked for ever), a link to /dev/zero (it grew to 6 GB before failing) or
larger than the configuration can need is refused in one line at once, as are all-zero weights;
nothing is written. (A resume's settings, device count and counters are checked by common code,
shown with torch-dp and jax-pmap.)
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import mxnet as mx
import pytest

from tests.conftest import SMOKE, one_line_error, reseal_index, run_trainer

INDEX = "mxnet-gluon.json"


def files(directory: Path) -> dict[str, object]:
    """What `directory` holds but the lock every run takes: link targets, file contents (size
    and mtime of a huge sparse one)."""

    def state(p: Path) -> object:
        if p.is_symlink():
            return os.readlink(p)
        st = p.stat()
        if not p.is_file() or st.st_size > 1 << 26:
            return (st.st_mode, st.st_size, st.st_mtime_ns)
        return p.read_bytes()

    return {p.name: state(p) for p in sorted(directory.iterdir()) if p.name != ".lock"}


def named(ck: Path, key: str) -> Path:
    return ck / json.loads((ck / INDEX).read_text())[key]


@pytest.mark.parametrize(
    "what,fragment",
    [("index-fifo", "is a FIFO, not a file"),
     ("index-dev-zero", "is a character device, not a file"),
     ("states-fifo", "is a FIFO, not a file"),
     ("params-oversized", "bytes, more than this configuration's checkpoint can hold"),
     ("zero-weights", "cannot be a trained model: conv1.weight is all zeros")],
)  # fmt: skip
def test_a_hostile_checkpoint_is_one_line_at_once(
    mxnet_ckpt: Path, tmp_path: Path, what: str, fragment: str
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(mxnet_ckpt, ck)
    index = ck / INDEX
    path = {"index": index, "states": named(ck, "states"), "params": named(ck, "params")}.get(
        what.split("-")[0], index
    )
    if what.endswith("fifo"):
        path.unlink()
        os.mkfifo(path)
    elif what.endswith("dev-zero"):
        path.unlink()
        path.symlink_to("/dev/zero")
    elif what.endswith("oversized"):
        with open(path, "r+b") as f:
            f.truncate(1 << 40)  # sparse: no disk used
    else:  # zero-weights (the message names the index)
        params = named(ck, "params")
        mx.nd.save(str(params), {k: v * 0 for k, v in mx.nd.load(str(params)).items()})
        reseal_index(index)  # matching digests: the check behind them
    before, out = files(ck), tmp_path / "run.json"
    start = time.perf_counter()
    proc = run_trainer(
        "mxnet-gluon", *SMOKE, "--checkpoint-dir", str(ck), "--resume", "--epochs", "3",
        "--output", str(out), timeout=30,
    )  # fmt: skip
    line = one_line_error(proc, f"checkpoint {path}", fragment)
    assert "Traceback" not in proc.stderr and time.perf_counter() - start < 20, line
    assert files(ck) == before and not out.exists()
