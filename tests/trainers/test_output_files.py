"""Writes that fail: the old file stays, no temporary file is left, the run ends with one line
and a failed record keeping its epochs. A full disk: os.replace / os.fsync raising ENOSPC
in-process, a file-size limit (RLIMIT_FSIZE) in a child process."""

from __future__ import annotations

import errno
import io
import json
import os
import resource
import signal
import stat
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import compare, harness
from common import runtime
from common.config import ConfigError
from common.results import write_json_atomic
from common.trainer import run_main
from tests.benchmarks.test_compare import _record
from tests.conftest import ROOT, SMOKE, module_of, python_for, skip_without_interpreter


def enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["fsync", "replace", "half-way"])
def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch, where):
    (target := tmp_path / "ckpt.pt").write_bytes(b"old")
    if where == "half-way":  # mx.nd.save running out of space half-way
        with pytest.raises(OSError, match="No space left"):
            runtime.atomic_write_with(target, lambda tmp: enospc(Path(tmp).write_bytes(b"part")))
    else:
        monkeypatch.setattr(os, where, enospc)
        with pytest.raises(OSError, match="No space left"):
            runtime.atomic_write_bytes(target, b"new" * 1000)
        with pytest.raises(OSError):
            write_json_atomic(tmp_path / "run.json", {"status": "ok"})
        monkeypatch.undo()
    with pytest.raises(TypeError):
        write_json_atomic(target, {"a": object()})  # fails mid-serialisation
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert target.read_bytes() == b"old"


def test_a_saved_state_with_a_changed_array_is_refused(tmp_path) -> None:
    """--save-state's .npz with one array changed (every zip CRC right, its comment kept):
    parity's reader refuses it in one line naming it (its sha256)."""
    from benchmarks import parity
    from common.checkpoints import save_final_state
    from common.config import preset

    path = tmp_path / "state.npz"
    arrays = {"conv1.weight": np.ones((4, 3), np.float32), "fc.bias": np.zeros(10, np.float32)}
    save_final_state(preset("smoke", save_state=str(path)), arrays)
    assert parity.load_state(path).keys() == arrays.keys()  # as written: read
    comment = zipfile.ZipFile(path).comment
    buf = io.BytesIO()
    np.savez(buf, **{**arrays, "fc.bias": arrays["fc.bias"] + np.float32(0.01)})
    with zipfile.ZipFile(buf, "a") as z:
        z.comment = comment
    path.write_bytes(buf.getvalue())
    with pytest.raises(ConfigError, match=f"saved state {path} .*sha256") as refused:
        parity.load_state(path)
    assert "\n" not in str(refused.value)


def test_results_and_checkpoints_get_the_same_mode_as_logs(tmp_path) -> None:
    for umask in (0o022, 0o077, 0o002):
        old, folder = os.umask(umask), tmp_path / oct(umask)
        try:
            folder.mkdir()
            (folder / "run.log").write_text("log\n")  # how the harness writes a log
            write_json_atomic(folder / "run.json", {"status": "ok"})
            runtime.atomic_write_bytes(folder / "ckpt.pt", b"x")
        finally:
            os.umask(old)
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in folder.iterdir()}
        assert set(modes.values()) == {0o666 & ~umask}, modes


def test_a_failure_record_that_cannot_be_written_is_one_more_line_not_a_traceback(
    tmp_path, monkeypatch, capsys
) -> None:
    def crash(cfg: Any) -> dict[str, Any]:
        monkeypatch.setattr(os, "replace", enospc)  # the disk fills up during the run
        raise RuntimeError("boom")

    out = tmp_path / "run.json"
    rc = run_main([*SMOKE, "--output", str(out)], "torch-dp", check=lambda c: None, train=crash)
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 2, err
    assert "failed: RuntimeError: boom" in err[0] and "could not write the failure record" in err[1]
    assert list(tmp_path.iterdir()) == []  # no half-written record, no temp file


@pytest.mark.parametrize("full_from", ["plots", "the end"])
def test_compare_on_a_full_disk_finishes_and_never_leaves_config_running(
    full_from, tmp_path, no_probe, monkeypatch, capsys
) -> None:
    """The runs' records are kept; a file that cannot be written is named in one line; the
    exit code is 1; config.json says "finished" (never "running"); no temp file is left."""
    out = tmp_path / "out"

    def run_child(cmd, log, timeout, **kwargs):  # a finished run, no process started
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("done\n")
        fw = cmd[cmd.index("-m") + 1].split(".")[-1].replace("_", "-")
        record = _record(fw, int(cmd[cmd.index("--gpus") + 1]), 0, 96.0, 0.5)
        write_json_atomic(cmd[cmd.index("--output") + 1], record)
        return harness.Child(list(cmd), log, timeout, returncode=0)

    def write_json(path, obj):  # the disk fills up as the sweep ends, at the final config.json
        if Path(path).name == "config.json" and obj["status"] != "running":
            monkeypatch.setattr(os, "replace", enospc)
        real_write(path, obj)

    real_write = write_json_atomic
    monkeypatch.setattr(harness, "run_child", run_child)
    if full_from == "plots":
        monkeypatch.setattr(compare.report, "write_plots", enospc)
    else:
        monkeypatch.setattr(compare, "write_json_atomic", write_json)
    argv = ["--frameworks", "torch-ddp,jax-pmap", "--gpus", "2", "--preset", "smoke"]
    rc = compare.main([*argv, "--out", str(out)])
    monkeypatch.undo()
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "could not write the plots: No space left" in text and "NOT written (disk full?)" in text
    assert json.loads((out / "config.json").read_text())["status"] == "finished"
    assert len(list((out / "runs").glob("*.json"))) == 4  # every run kept
    assert (out / "results.csv").exists()
    left = [p.name for p in out.rglob("*") if ".tmp" in p.name or p.name.startswith(".")]
    assert left == [], left


def run_limited(framework: str, args: list[str], limit: int) -> subprocess.CompletedProcess[str]:
    """The trainer's smoke run under a file-size limit. JAX without its compilation cache: an
    entry cut short would land in the session's cache, which every test shares."""

    def set_limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    args = ["-m", module_of(framework), *SMOKE, *args]
    args += ["--no-compile-cache"] if framework.startswith("jax") else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    cmd = [str(python_for(framework)), *args]
    kw: Any = {"capture_output": True, "text": True, "timeout": 300, "preexec_fn": set_limit}
    return subprocess.run(cmd, cwd=ROOT, env=env, **kw)


@pytest.mark.parametrize("framework", ["torch-dp", "jax-pmap", "mxnet-gluon"])
def test_a_full_disk_under_a_checkpoint_is_one_line_and_a_failed_record(framework, tmp_path):
    """A smoke checkpoint is 0.7-1.5 MB, a record 5 KB: at 200 KB the record is written."""
    skip_without_interpreter(framework)
    out, ck = tmp_path / "r.json", tmp_path / "ck"
    args = ["--epochs", "2", "--output", str(out), "--checkpoint-dir", str(ck)]
    proc = run_limited(framework, args, 200_000)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in text, text[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "cannot write checkpoint" in last and "free some space" in last, last
    assert sorted(p.name for p in ck.iterdir()) == [".lock"]  # no temp file, no orphan .params
    record = json.loads(out.read_text())
    assert record["status"] == "failed" and "cannot write checkpoint" in record["error"]
    assert [e["epoch"] for e in record["epochs"]] == [1]  # the epoch measured is kept


@pytest.mark.parametrize("what", ["tensorboard", "save-state"])
def test_a_full_disk_under_tensorboard_the_record_or_save_state(what, tmp_path):
    """A full TensorBoard event file is one warning and the run goes on, to a record it cannot
    write either: one line (jax-pmap: torch runs 10x slower under the limit)."""
    out, args = tmp_path / "r.json", ["--epochs", "2", "--output", str(tmp_path / "r.json")]
    if what == "tensorboard":
        pytest.importorskip("tensorboardX")  # the event file and the 5 KB record fill at 2000
        proc = run_limited("jax-pmap", [*args, "--tensorboard", str(tmp_path / "tb")], 2000)
        tb = [ln for ln in proc.stderr.splitlines() if ln.startswith("tensorboard:")]
        assert len(tb) == 1 and "the run goes on without TensorBoard" in tb[0], proc.stderr
        assert "epoch 2/2" in proc.stdout  # training went on
    else:
        proc = run_limited("jax-pmap", [*args, "--save-state", str(tmp_path / "s")], 200_000)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    failed = [ln for ln in proc.stderr.splitlines() if "jax_pmap:" in ln]
    fragment = "cannot write the record --output" if what == "tensorboard" else "--save-state"
    assert len(failed) == 1 and fragment in failed[0], proc.stderr
    left = sorted(p.name for p in tmp_path.iterdir())  # no temp file
    assert left == (["tb"] if what == "tensorboard" else ["r.json"]), left
    if what == "save-state":
        assert json.loads(out.read_text())["status"] == "failed"
