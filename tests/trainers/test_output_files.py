"""Writes that fail (a full disk, an fsync or rename that raises): the old file stays, no
temporary file is left, the run ends with one line and a failed record that keeps its measured
epochs; a saved state changed since it was written is refused. A full disk is simulated
in-process by os.replace / os.fsync raising ENOSPC, in a child process by its file-size limit
(RLIMIT_FSIZE, SIGXFSZ ignored: every write past it fails with EFBIG). Refusals before any work:
tests/trainers/test_bad_input.py."""

from __future__ import annotations

import errno
import json
import os
import resource
import signal
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare, harness
from common import runtime
from common.config import ConfigError
from common.results import write_json_atomic
from common.trainer import run_main
from tests.conftest import ROOT, SMOKE, module_of, python_for, skip_without_interpreter

# ---- writes that fail: no temp file left, same mode as the logs ------------------------------


def enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["fsync", "replace", "half-way"])
def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch, where):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")
    if where == "half-way":  # mx.nd.save running out of space half-way

        def half(tmp: str) -> None:
            Path(tmp).write_bytes(b"partial")
            enospc()

        with pytest.raises(OSError):
            runtime.atomic_write_with(target, half)
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
    """--save-state's .npz with one array changed since it was written (every zip CRC right,
    its comment kept): parity's reader refuses it in one line naming it (its sha256)."""
    import io
    import zipfile

    import numpy as np

    from benchmarks import parity
    from common.checkpoints import save_final_state
    from common.config import preset

    path = tmp_path / "state.npz"
    arrays = {
        "conv1.weight": np.ones((4, 3, 3, 3), np.float32),
        "fc.bias": np.zeros(10, np.float32),
    }
    save_final_state(preset("smoke", save_state=str(path)), arrays)
    assert parity.load_state(path).keys() == arrays.keys()  # as written: read
    with zipfile.ZipFile(path) as z:
        comment = z.comment
    buf = io.BytesIO()
    np.savez(buf, **{**arrays, "fc.bias": arrays["fc.bias"] + np.float32(0.01)})
    with zipfile.ZipFile(buf, "a") as z:
        z.comment = comment
    path.write_bytes(buf.getvalue())
    with pytest.raises(ConfigError, match=f"saved state {path} .*sha256") as refused:
        parity.load_state(path)
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_results_and_checkpoints_get_the_same_mode_as_logs(tmp_path, umask) -> None:
    old = os.umask(umask)
    try:
        with open(tmp_path / "run.log", "w") as f:  # how the harness writes a log
            f.write("log\n")
        write_json_atomic(tmp_path / "run.json", {"status": "ok"})
        runtime.atomic_write_bytes(tmp_path / "ckpt.pt", b"x")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
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


# ---- compare on a --out that is in the way, busy, small or full ------------------------------

COMPARE = ["--frameworks", "torch-dp", "--gpus", "1", "--preset", "smoke"]


def fake_record(cmd: list[str]) -> dict[str, Any]:
    n = int(cmd[cmd.index("--gpus") + 1])
    fw = cmd[cmd.index("-m") + 1].split(".")[-1].replace("_", "-")
    return {
        "framework": fw, "devices": n, "status": "ok", "device_kind": "cpu-simulated",
        "bn_mode": "local", "global_batch_size": 24, "test_accuracy": 0.5, "sec_per_epoch": 1.0,
        "first_epoch_sec": 2.0, "images_per_sec": 96.0, "test_examples": 10, "test_set_size": 10,
        "time_to_target_sec": None, "epochs_to_target": None,
        "epochs": [{"epoch": 1, "wall_sec": 1.0, "test_accuracy": 0.5}],
        "load_avg": {"start": 0.5, "end": 0.5, "cores": 2}, "error": "",
    }  # fmt: skip


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
        write_json_atomic(cmd[cmd.index("--output") + 1], fake_record(cmd))
        return harness.Child(list(cmd), log, timeout, returncode=0)

    real_replace, real_plots = os.replace, compare.report.write_plots

    def full_replace(src, dst):
        if full_from == "the end" or str(dst).endswith(".png"):
            enospc()
        real_replace(src, dst)

    def plots(*args):  # the disk fills up when the sweep ends
        monkeypatch.setattr(os, "replace", full_replace)
        return real_plots(*args)

    monkeypatch.setattr(harness, "run_child", run_child)
    monkeypatch.setattr(compare.report, "write_plots", plots)
    if full_from == "the end":
        monkeypatch.setattr(compare, "write_json_atomic", _fail_config_json(compare))
    rc = compare.main(["--frameworks", "torch-ddp,jax-pmap", "--gpus", "2", "--preset", "smoke",
                       "--out", str(out)])  # fmt: skip
    monkeypatch.undo()
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "compare: could not write the plots: No space left on device" in text
    assert "compare: NOT written (disk full?)" in text
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "finished"
    assert len(list((out / "runs").glob("*.json"))) == 4  # every run kept
    assert (out / "results.csv").exists()
    left = [p.name for p in out.rglob("*") if ".tmp" in p.name or p.name.startswith(".")]
    assert left == [], left


def _fail_config_json(module: Any) -> Any:
    """write_json_atomic that fails for the final config.json (the disk is full at the end)."""
    real = module.write_json_atomic

    def write(path: Any, obj: Any) -> None:
        if Path(path).name == "config.json" and obj.get("status") != "running":
            enospc()
        real(path, obj)

    return write


# ---- a full disk in a trainer: under a checkpoint, the record or TensorBoard ---------------


def limited(limit: int):
    def set_limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def run_limited(python: Path, args: list[str], limit: int) -> subprocess.CompletedProcess[str]:
    """`python args` under a file-size limit. A JAX trainer runs without its compilation cache:
    an entry the limit cut short would land in the session's cache, which every test shares
    (JAX then failed every later write there)."""
    if any(a.startswith("frameworks.jax") for a in args):
        args = [*args, "--no-compile-cache"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    return subprocess.run([str(python), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, preexec_fn=limited(limit))  # fmt: skip


# a smoke checkpoint is 0.7-1.5 MB, a record 5 KB: a checkpoint cannot be written, a record can
CHECKPOINT_LIMIT = 200_000


@pytest.mark.parametrize("framework", ["torch-dp", "jax-pmap", "mxnet-gluon"])
def test_a_full_disk_under_a_checkpoint_is_one_line_and_a_failed_record(framework, tmp_path):
    skip_without_interpreter(framework)
    out, ck = tmp_path / "r.json", tmp_path / "ck"
    args = ["-m", module_of(framework), *SMOKE, "--epochs", "2", "--output", str(out)]
    args += ["--checkpoint-dir", str(ck)]
    proc = run_limited(python_for(framework), args, CHECKPOINT_LIMIT)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in text, text[-3000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert "cannot write checkpoint" in last and "free some space" in last, last
    assert sorted(p.name for p in ck.iterdir()) == [".lock"]  # no temp file, no orphan .params
    record = json.loads(out.read_text())
    assert record["status"] == "failed" and "cannot write checkpoint" in record["error"]
    assert [e["epoch"] for e in record["epochs"]] == [1]  # the epoch measured is kept


@pytest.mark.parametrize(
    "what,limit,fragment",
    [("record", 1000, "cannot write the record --output"),
     ("save-state", 200_000, "cannot write --save-state")],
)  # fmt: skip
def test_a_full_disk_under_the_record_or_save_state_is_one_line(what, limit, fragment, tmp_path):
    out, state = tmp_path / "r.json", tmp_path / "s.npz"
    args = ["-m", "frameworks.jax_pmap", *SMOKE, "--epochs", "1", "--output", str(out)]
    extra = ["--save-state", str(state)] if what == "save-state" else []
    proc = run_limited(python_for("jax-pmap"), [*args, *extra], limit)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    failed = [ln for ln in proc.stderr.splitlines() if "jax_pmap:" in ln]
    assert len(failed) == 1 and fragment in failed[0], proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ([] if what == "record" else ["r.json"])
    if what == "save-state":
        assert json.loads(out.read_text())["status"] == "failed"


def test_tensorboard_on_a_full_disk_is_one_warning_and_the_run_goes_on(tmp_path):
    pytest.importorskip("tensorboardX")
    tb = tmp_path / "tb"
    # jax-pmap: torch's CPU loop runs 10x slower under a file-size limit (the shared code is
    # the same for every trainer: common/tensorboard.py)
    args = ["-m", "frameworks.jax_pmap", *SMOKE, "--epochs", "2", "--tensorboard", str(tb)]
    proc = run_limited(python_for("jax-pmap"), args, 2000)  # the event file fills at 2000 bytes
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("tensorboard:")]
    assert len(warnings) == 1 and "the run goes on without TensorBoard" in warnings[0], warnings
    assert "epoch 2/2" in proc.stdout  # training went on
