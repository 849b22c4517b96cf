"""mxnet-gluon's checkpoint bound to its content (issue #41 item 1; the other frameworks:
tests/test_checkpoint_integrity.py): a few bytes flipped in the weights or the optimiser states,
or a field of the index edited, is one line naming the file, exit 2, nothing trained. Before
the digests a flipped weight loaded without a word (MXNet's NDArray format has no checksum)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mxnet as mx
import numpy as np
import pytest

from tests.conftest import SMOKE, one_line_error, run_trainer
from tests.mxnet.test_mxnet_hostile_loads import INDEX


def flip_inside(path: Path, array: np.ndarray) -> None:
    """Flip a few bits in the middle of `array`'s raw bytes where they sit in `path`."""
    data = bytearray(path.read_bytes())
    needle = array.tobytes()
    at = bytes(data).find(needle)
    assert at >= 0, "the array's bytes are not in the file"
    for i in range(3):
        data[at + len(needle) // 2 + 4 * i] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("what", ["params", "states", "index"])
def test_a_damaged_checkpoint_is_one_line_and_nothing_trained(
    mxnet_ckpt: Path, tmp_path: Path, what: str
) -> None:
    ck = tmp_path / "ck"
    shutil.copytree(mxnet_ckpt, ck)
    index = ck / INDEX
    ckpt = json.loads(index.read_text())
    path = index if what == "index" else ck / ckpt[what]
    if what == "index":  # the step counter's record rows edited to agree: only the digest knows
        rows = ckpt["recorder"]["epochs"]
        rows[0]["train_loss"] = rows[0]["train_loss"] * 0.5
        index.write_text(json.dumps(ckpt))
    else:
        arrays = mx.nd.load(str(path))
        name = max(arrays, key=lambda k: arrays[k].size)  # the largest array
        flip_inside(path, arrays[name].asnumpy())
    before, out = path.read_bytes(), tmp_path / "run.json"
    proc = run_trainer(
        "mxnet-gluon", *SMOKE, "--checkpoint-dir", str(ck), "--resume", "--epochs", "3",
        "--output", str(out), timeout=60,
    )  # fmt: skip
    line = one_line_error(proc, f"checkpoint {path}", "sha256", "drop --resume")
    assert "Traceback" not in proc.stderr, line
    assert path.read_bytes() == before and not out.exists()
