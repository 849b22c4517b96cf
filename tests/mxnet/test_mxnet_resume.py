"""mxnet-gluon's side of tests/trainers/test_resume.py: a damaged checkpoint (bits flipped in
the weights, the optimiser states or the index; MXNet's NDArray format has no checksum of its
own) is one line naming the file, exit 2, nothing trained: the index holds the sha256 of each
file it names, and its own (common/checkpoints.py)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import SMOKE, one_line_error, run_trainer

INDEX = "mxnet-gluon.json"


@pytest.mark.parametrize("what", ["states", "index"])  # .params: the same digest check
def test_a_damaged_checkpoint_is_one_line_and_nothing_trained(
    mxnet_ckpt: Path, tmp_path: Path, what: str
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(mxnet_ckpt, ck)
    index = ck / INDEX
    path = index if what == "index" else ck / json.loads(index.read_text())[what]
    if what == "index":  # still JSON, one value changed: only the digest can tell
        ckpt = json.loads(index.read_text())
        ckpt["recorder"]["epochs"][0]["train_loss"] *= 0.5
        index.write_text(json.dumps(ckpt))
    else:
        damaged = bytearray(path.read_bytes())
        damaged[len(damaged) // 2] ^= 0x10
        path.write_bytes(bytes(damaged))
    data = path.read_bytes()
    out = tmp_path / "run.json"
    proc = run_trainer(
        "mxnet-gluon", *SMOKE, "--checkpoint-dir", str(ck), "--resume", "--epochs", "3",
        "--output", str(out), timeout=60,
    )  # fmt: skip
    one_line_error(proc, f"checkpoint {path}", "sha256", "drop --resume")
    assert "Traceback" not in proc.stderr and not out.exists()
    assert path.read_bytes() == data
