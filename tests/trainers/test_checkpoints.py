"""Content-bound checkpoints and saved states (issue #41 item 1, common/sealed.py): a checkpoint
or saved state whose content changed after it was written (a few bytes flipped; a tensor
changed inside a torch zip with its CRCs rewritten to match) is one line naming the file, exit
2, nothing trained. Before the digests, each of these loaded without a word and the run went on
from wrong weights. An edit that rewrites the sha256 with the content is refused by the seal's
hmac under this machine's key, and `python -m benchmarks.trust` accepts a checkpoint written
elsewhere. MXNet's side: tests/mxnet/test_mxnet_checkpoint_integrity.py."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import numpy as np
import pytest

from common.config import ConfigError
from common.sealed import (
    SEAL_BYTES,
    SEAL_MAGIC,
    json_digest,
    key_path,
    machine_key,
    seal,
    seal_arrays,
    seal_json,
    sha256_hex,
    unseal,
    unseal_json,
)
from tests.conftest import SMOKE, one_line_error, read_json, run_trainer


def split_trailer(data: bytes) -> tuple[bytes, bytes]:
    """(content, trailer): the trailer is b"" for a file written without one."""
    if data[-SEAL_BYTES:].startswith(SEAL_MAGIC):
        return data[:-SEAL_BYTES], data[-SEAL_BYTES:]
    return data, b""


def forge(sealed: bytes, content: bytes) -> bytes:
    """`content` under `sealed`'s trailer with the sha256 rewritten to match and the hmac kept:
    what an edit by one who read common/sealed.py (and not the key) leaves."""
    tail = sealed[-SEAL_BYTES:]
    return content + SEAL_MAGIC + sha256_hex(content).encode() + tail[len(SEAL_MAGIC) + 64 :]


def flip_inside(path: Path, needle: bytes) -> None:
    """Flip a few bits in the middle of `needle` (an array's raw bytes) where it sits in `path`,
    the rest of the file (a trailer included) untouched."""
    data = bytearray(path.read_bytes())
    at = bytes(data).find(needle)
    assert at >= 0, "the array's bytes are not in the file"
    for i in range(3):
        data[at + len(needle) // 2 + 4 * i] ^= 0x10
    path.write_bytes(bytes(data))


def test_seal_binds_the_bytes() -> None:
    sealed = seal(b"weights")
    assert unseal(sealed, "checkpoint x", "fix") == b"weights"
    for damaged, why in ((b"weighTs" + sealed[7:], "damaged: the sha256"),
                         (sealed[:-SEAL_BYTES], "no content digest"),
                         (sealed[:-1], "no content digest")):  # fmt: skip
        with pytest.raises(ConfigError, match=why) as refused:
            unseal(damaged, "checkpoint x", "fix")
        assert "\n" not in str(refused.value) and "checkpoint x" in str(refused.value)
    index = seal_json({"epoch": 2, "params": "a.params"})
    assert unseal_json(json.loads(json.dumps(index)), "x", "fix") == index
    with pytest.raises(ConfigError, match="do not give the sha256"):
        unseal_json({**index, "epoch": 1}, "x", "fix")


def test_the_seal_is_this_machines_key(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A sha256 rewritten with the content (the forger's edit), or a file sealed under another
    key (another machine, another user), is one line naming the way to accept it; re-sealed
    here (`python -m benchmarks.trust`'s step) it is read. The key: 64 hex digits, mode 600."""
    sealed, index = seal(b"weights"), seal_json({"epoch": 2, "params": "a.params"})
    forged = forge(sealed, b"weighTs")
    assert forged[-SEAL_BYTES:] != sealed[-SEAL_BYTES:]  # the sha256 matches the new content:
    assert unseal(forged, "x", "fix", keyed=False) == b"weighTs"  # only the hmac can tell
    edited = {**index, "epoch": 1}
    edited["sha256"] = json_digest(edited)  # "hmac" kept
    for refused in (lambda: unseal(forged, "checkpoint x", "fix", trust="x"),
                    lambda: unseal_json(edited, "checkpoint x", "fix", trust="x")):  # fmt: skip
        with pytest.raises(ConfigError, match="not this machine's key") as why:
            refused()
        assert "python -m benchmarks.trust x" in str(why.value) and "\n" not in str(why.value)
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "elsewhere"))  # another machine's key
    with pytest.raises(ConfigError, match="not this machine's key"):
        unseal(sealed, "checkpoint x", "fix")
    with pytest.raises(ConfigError, match="not this machine's key"):
        unseal_json(index, "checkpoint x", "fix")
    assert unseal(seal(unseal(sealed, "x", "fix", keyed=False)), "x", "fix") == b"weights"
    assert unseal_json(seal_json(unseal_json(index, "x", "fix", keyed=False)), "x", "fix")
    key = key_path()
    assert key == tmp_path / "elsewhere" / "dp-bench" / "checkpoint.key"
    assert key.stat().st_mode & 0o777 == 0o600 and len(key.read_text().strip()) == 64
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "damaged"))
    (tmp_path / "damaged" / "dp-bench").mkdir(parents=True)
    (tmp_path / "damaged" / "dp-bench" / "checkpoint.key").write_text("0123\n")
    with pytest.raises(ConfigError, match="checkpoint key .* is damaged .*delete it"):
        machine_key()
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "a-file"))  # no folder can be made there
    with pytest.raises(ConfigError, match="cannot keep the checkpoint key .*XDG_DATA_HOME"):
        machine_key()


# ---- torch-dp: one in-process run, its checkpoint and saved state ------------------------------


@pytest.fixture(scope="module")
def torch_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch-dp checkpoint and --save-state after the smoke preset's 2 epochs (~3 s)."""
    from frameworks.torch_dp import main

    root = tmp_path_factory.mktemp("torch-run")
    args = [*SMOKE, "--checkpoint-dir", str(root / "ck"), "--data-dir", str(root / "data"),
            "--save-state", str(root / "state.npz")]  # fmt: skip
    assert main(args) == 0
    return root


def rewrite_tensor_with_crcs(path: Path) -> None:
    """Change conv1.weight inside torch's zip and rewrite the zip so that every CRC and size
    matches (what a zip-aware tool leaves behind); a trailer, if any, is kept as it was."""
    import torch

    content, trailer = split_trailer(path.read_bytes())
    weight = torch.load(io.BytesIO(content), weights_only=True)["model"]["conv1.weight"]
    old = bytes(weight.untyped_storage())  # as stored (the layout may be channels-last)
    new = (np.frombuffer(old, np.float32) * np.float32(1.01)).tobytes()
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(content)) as src, zipfile.ZipFile(out, "w") as dst:
        changed = 0
        for info in src.infolist():
            body = src.read(info)
            if body == old:
                body, changed = new, changed + 1
            dst.writestr(info, body)  # a fresh CRC for the new body
    assert changed == 1
    path.write_bytes(out.getvalue() + trailer)
    assert not zipfile.ZipFile(io.BytesIO(out.getvalue())).testzip()  # every CRC holds


@pytest.mark.parametrize("damage", ["bytes-flipped", "tensor-with-crcs"])
def test_a_damaged_torch_checkpoint_is_one_line_and_nothing_trained(
    torch_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], damage: str
) -> None:
    import torch

    from frameworks.torch_dp import main

    ck = tmp_path / "ck"
    shutil.copytree(torch_run / "ck", ck)
    (ck / ".lock").unlink(missing_ok=True)
    path = ck / "torch-dp.pt"
    if damage == "bytes-flipped":
        content, _ = split_trailer(path.read_bytes())
        fc = torch.load(io.BytesIO(content), weights_only=True)["model"]["fc.weight"]
        flip_inside(path, fc.numpy().tobytes())
    else:
        rewrite_tensor_with_crcs(path)
    before, out = path.read_bytes(), tmp_path / "run.json"
    capsys.readouterr()
    args = [*SMOKE, "--checkpoint-dir", str(ck), "--data-dir", str(torch_run / "data"),
            "--output", str(out), "--resume", "--epochs", "3"]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    (line,) = err.strip().splitlines()  # (torch-dp's CPU note is on stdout)
    assert f"checkpoint {path}" in line and "sha256" in line and "drop --resume" in line, line
    assert path.read_bytes() == before and not out.exists()  # nothing trained, nothing written


def test_a_forged_torch_checkpoint_is_refused_until_trusted(
    torch_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A tensor changed with the zip's CRCs AND the sha256 rewritten (battery case D37, which
    resumed from the changed weights and exited 0 with the sha256 alone): one line naming the
    way to accept it, nothing trained; trusted (`python -m benchmarks.trust`), it resumes. A
    damaged file is not trusted (exit 2, one line)."""
    from benchmarks import trust
    from frameworks.torch_dp import main

    ck = tmp_path / "ck"
    shutil.copytree(torch_run / "ck", ck)
    (ck / ".lock").unlink(missing_ok=True)
    path = ck / "torch-dp.pt"
    sealed = path.read_bytes()
    rewrite_tensor_with_crcs(path)
    path.write_bytes(forge(sealed, split_trailer(path.read_bytes())[0]))
    before, out = path.read_bytes(), tmp_path / "run.json"
    capsys.readouterr()
    args = [*SMOKE, "--checkpoint-dir", str(ck), "--data-dir", str(torch_run / "data"),
            "--output", str(out), "--resume", "--epochs", "3"]  # fmt: skip
    assert main(args) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "not this machine's key" in line and f"python -m benchmarks.trust {path}" in line, line
    assert path.read_bytes() == before and not out.exists()
    assert trust.main([str(path)]) == 0
    assert f"trusted {path}" in capsys.readouterr().out
    assert main(args) == 0 and read_json(out)["status"] == "ok"  # the user vouched for it
    damaged = bytearray(path.read_bytes())
    damaged[100] ^= 0x10
    path.write_bytes(bytes(damaged))
    capsys.readouterr()
    assert trust.main([str(path)]) == 2 and path.read_bytes() == bytes(damaged)
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("trust: error: cannot read checkpoint") and "sha256" in line, line
    assert trust.main([str(tmp_path / "none.pt")]) == 2


def test_a_saved_state_with_a_changed_array_is_refused(torch_run: Path, tmp_path: Path) -> None:
    """--save-state's .npz rewritten with one array changed and every CRC right (np.savez, the
    comment kept): parity's reader refuses it in one line (it compared the wrong weights)."""
    from benchmarks import parity

    path = tmp_path / "state.npz"
    shutil.copy(torch_run / "state.npz", path)
    assert parity.load_state(path, 1 << 24)  # as written: read
    with zipfile.ZipFile(path) as z:
        comment = z.comment
    with np.load(path) as f:
        arrays = {k: f[k] for k in f.files}
    arrays["conv1.weight"] = arrays["conv1.weight"] * np.float32(1.01)
    buf = io.BytesIO()
    np.savez(buf, **arrays)  # type: ignore[arg-type]
    with zipfile.ZipFile(buf, "a") as z:
        z.comment = comment
    path.write_bytes(buf.getvalue())
    with pytest.raises(ConfigError, match=f"saved state {path} .*sha256") as refused:
        parity.load_state(path, 1 << 24)
    assert "\n" not in str(refused.value)
    assert np.load(io.BytesIO(seal_arrays(arrays))).files  # a sealed state is still an .npz


# ---- jax-pmap: a subprocess, its checkpoint's bytes flipped ----------------------------------


def test_a_jax_checkpoint_with_flipped_bytes_is_one_line_and_nothing_trained(
    tmp_path: Path,
) -> None:
    from flax import serialization, traverse_util

    ck, data = tmp_path / "ck", tmp_path / "data"
    common = [*SMOKE, "--max-steps-per-epoch", "1", "--checkpoint-dir",
              str(ck), "--data-dir", str(data)]  # fmt: skip
    proc = run_trainer("jax-pmap", *common, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    path = ck / "jax-pmap.msgpack"
    content, _ = split_trailer(path.read_bytes())
    params = serialization.msgpack_restore(content)["state"]["params"]
    kernel = np.asarray(traverse_util.flatten_dict(params, sep="/")["fc/kernel"])
    flip_inside(path, kernel.tobytes())
    before, out = path.read_bytes(), tmp_path / "run.json"
    proc = run_trainer("jax-pmap", *common, "--resume", "--epochs", "3", "--output", str(out),
                       timeout=60)  # fmt: skip
    line = one_line_error(proc, f"checkpoint {path}", "sha256", "drop --resume")
    assert "Traceback" not in proc.stderr, line
    assert path.read_bytes() == before and not out.exists()
