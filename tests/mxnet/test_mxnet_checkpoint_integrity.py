"""mxnet-gluon's checkpoint bound to its content (issue #41 item 1; the other frameworks:
tests/trainers/test_checkpoints.py): a few bytes flipped in the weights or the optimiser states,
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


def test_a_forged_checkpoint_is_refused_until_trusted(mxnet_ckpt: Path, tmp_path: Path) -> None:
    """The largest weight scaled by 1.5 with the index's digests (the file's and its own sha256)
    rewritten to match, the hmac kept (battery case D42, which resumed from the changed weights
    and exited 0): one line naming the way to accept it, nothing trained; re-sealed here
    (`python -m benchmarks.trust`'s step, common/checkpoints.trust_checkpoint) it resumes."""
    from common.checkpoints import trust_checkpoint
    from common.sealed import json_digest, sha256_hex

    ck = tmp_path / "ck"
    shutil.copytree(mxnet_ckpt, ck)
    index = ck / INDEX
    ckpt = json.loads(index.read_text())
    params = ck / ckpt["params"]
    arrays = mx.nd.load(str(params))
    name = max(arrays, key=lambda k: arrays[k].size)
    arrays[name] = arrays[name] * 1.5
    mx.nd.save(str(params), arrays)
    ckpt["params_sha256"] = sha256_hex(params.read_bytes())
    ckpt["sha256"] = json_digest(ckpt)  # "hmac" kept: the key is not in the file
    index.write_text(json.dumps(ckpt))
    out = tmp_path / "run.json"
    args = (*SMOKE, "--checkpoint-dir", str(ck), "--resume", "--epochs", "3", "--output", str(out))
    proc = run_trainer("mxnet-gluon", *args, timeout=60)
    line = one_line_error(proc, f"checkpoint {index}", "not this machine's key",
                          f"python -m benchmarks.trust {index}")  # fmt: skip
    assert "Traceback" not in proc.stderr, line
    assert not out.exists()
    trust_checkpoint(index)
    proc = run_trainer("mxnet-gluon", *args, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(out.read_text())["status"] == "ok"
