"""Hostile and careless paths, files and disks (issues 15 and 29): output paths checked before
any work (a directory, a file in the way, read-only or full, a name the file system
cannot make), writes that fail leaving the old file and no temporary one, a saved state that
changed since it was written, compare on a full or busy --out, a full disk under a checkpoint, a
record or TensorBoard, a dataset that cannot be read.

Every case asserts the exit code (2 = bad input, 1 = failed run), the one-line message naming
the problem, and that nothing ran, was written or was left behind. A full disk is simulated
in-process by making os.replace / os.fsync raise ENOSPC, a read-only file system by os.access, a
full one by os.statvfs; in a child process by its file-size limit (RLIMIT_FSIZE, SIGXFSZ
ignored), which makes every write past it fail with EFBIG, as ENOSPC would: no root, no small
file system needed. Flags and variables: tests/trainers/test_bad_flags.py.
"""

from __future__ import annotations

import errno
import fcntl
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
from tests.conftest import ROOT, SMOKE, python_for, skip_without_interpreter

LONG = "x" * 300  # one component over NAME_MAX (255): ENAMETOOLONG
# `python -c MXNET_STATES_FAIL <trainer flags>`: frameworks.mxnet_gluon on a disk that fills up
# after the .params, during the .states
MXNET_STATES_FAIL = """
import runpy, sys
import mxnet as mx
real = mx.nd.save
def save(fname, data):  # a disk that fills up after the .params, during the .states
    if ".states." in fname:
        open(fname, "wb").write(b"half")
        raise mx.base.MXNetError("Check failed: FileStream.Write incomplete")
    return real(fname, data)
mx.nd.save = save
sys.argv = ["mxnet_gluon", *sys.argv[1:]]
runpy.run_module("frameworks.mxnet_gluon", run_name="__main__")
"""

# ---- output paths: checked before any work ----------------------------------------------------


def never_train(cfg: Any) -> dict[str, Any]:
    raise AssertionError("train() started although a path was bad")


def run_stub(*flags: str, capsys) -> tuple[int, list[str]]:
    rc = run_main([*SMOKE, *flags], "torch-dp", check=lambda cfg: None, train=never_train)
    return rc, capsys.readouterr().err.strip().splitlines()


def test_an_output_that_is_a_directory_is_refused_before_training(tmp_path, capsys) -> None:
    rc, err = run_stub("--output", str(tmp_path), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "exists and is not a file" in err[0], err


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "f").write_text("x")
    rc, err = run_stub("--checkpoint-dir", str(tmp_path / "f"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "--checkpoint-dir" in err[0], err
    rc, err = run_stub("--save-state", str(tmp_path / "f" / "state.npz"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "is not a directory" in err[0], err


def test_a_read_only_output_directory_is_refused(tmp_path, monkeypatch, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != ro and real_access(p, m))
    rc, err = run_stub("--output", str(ro / "sub" / "run.json"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "is not writable" in err[0], err
    assert list(ro.iterdir()) == []  # nothing created, not even the missing sub-directory


def test_a_full_file_system_is_refused(tmp_path, monkeypatch, capsys) -> None:
    full = os.statvfs(tmp_path)

    class Full:
        f_bavail, f_frsize = 0, full.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Full())
    rc, err = run_stub("--output", str(tmp_path / "run.json"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "is full" in err[0], err


def test_a_real_trainer_refuses_a_bad_output_before_it_loads_anything(tmp_path, capsys) -> None:
    from frameworks import torch_dp

    rc = torch_dp.main([*SMOKE, "--output", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("python -m frameworks.torch_dp: error")


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


def test_compare_out_that_is_a_file_or_full_is_refused(tmp_path, monkeypatch, no_probe, capsys):
    (tmp_path / "f").write_text("x")
    assert compare.main([*COMPARE, "--out", str(tmp_path / "f")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    monkeypatch.setattr(os, "access", lambda p, m: False)
    assert compare.main([*COMPARE, "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not writable" in err[0], err
    assert not (tmp_path / "new").exists()


def test_two_compares_on_one_out_cannot_both_start(tmp_path, no_probe, monkeypatch, capsys):
    """'already holds a comparison' was check-then-write: two runs started together both
    passed. The second now finds the first's lock (and, after it, the first's config.json)."""
    out = tmp_path / "out"
    out.mkdir()
    ran = []
    monkeypatch.setattr(compare, "execute", lambda plan: ran.append(plan) or 0)
    with open(out / harness.LOCK_NAME, "a") as first:  # the first compare, still starting
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert compare.main([*COMPARE, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is in use by another run" in err[0] and not ran
    assert compare.main([*COMPARE, "--out", str(out)]) == 0 and len(ran) == 1  # free again
    assert not (out / harness.LOCK_NAME).exists()  # released and removed


def test_compare_small_disk_says_bytes_needed_and_free(tmp_path, no_probe, monkeypatch, capsys):
    from common.runtime import MIN_FREE_BYTES

    frsize = os.statvfs(tmp_path).f_frsize

    class Small:  # 1.5 MiB free: enough for a trainer's --output, not for compare's reserve
        f_blocks, f_bavail, f_frsize = 1000, (3 << 19) // frsize, frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Small())
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    rc = compare.main(["--frameworks", "torch-dp", "--gpus", "1", "--preset", "smoke",
                       "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    free, need = Small.f_bavail * frsize, MIN_FREE_BYTES + compare.RESERVE_BYTES
    assert rc == 2 and len(err) == 1, err
    assert f"is full ({free} bytes free, {need} needed)" in err[0], err


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


# ---- paths the file system cannot name, or under a file -----------------------------------


@pytest.mark.parametrize(
    "flag,where,fragment",
    [
        ("--output", f"{LONG}.json", "File name too long"),
        ("--output", f"{LONG}/r.json", "File name too long"),
        ("--checkpoint-dir", LONG, "File name too long"),
        ("--save-state", f"{LONG}.npz", "File name too long"),
        ("--data-dir", LONG, "File name too long"),
        ("--data-dir", "file/data", "is a file, not a directory"),
        ("--data-dir", "file", "it is not a directory"),
        ("--cache-dir", f"{LONG}/c", "File name too long"),
        ("--checkpoint-dir", "file/ck", "is not a directory, so"),
        ("--cache-dir", "file/c", "is a file, not a directory"),
    ],
    ids=lambda v: v[:20],
)
def test_a_path_the_file_system_cannot_name_is_one_line(flag, where, fragment, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    path = str(tmp_path / where)
    rc, err = run_stub(flag, path, capsys=capsys)  # was: exit 1, OSError (ENAMETOOLONG)
    assert rc == 2 and len(err) == 1 and f"{flag} {path}" in err[0] and fragment in err[0], err


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


@pytest.mark.parametrize("framework", ["torch-dp", "torch-ddp", "jax-pmap", "mxnet-gluon"])
def test_a_full_disk_under_a_checkpoint_is_one_line_and_a_failed_record(framework, tmp_path):
    skip_without_interpreter(framework)
    out, ck = tmp_path / "r.json", tmp_path / "ck"
    module = f"frameworks.{framework.replace('-', '_')}"
    args = [
        "-m",
        module,
        *SMOKE,
        "--epochs",
        "2",
        "--output",
        str(out),
        "--checkpoint-dir",
        str(ck),
    ]
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
    assert len(failed) == 1 and fragment in failed[0], proc.stderr  # was: 2 lines, no path
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
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]  # was: the writer thread's, atexit's
    warnings = [ln for ln in proc.stderr.splitlines() if ln.startswith("tensorboard:")]
    assert len(warnings) == 1 and "the run goes on without TensorBoard" in warnings[0], warnings
    assert "epoch 2/2" in proc.stdout  # training went on


# ---- a dataset directory that cannot be read -----------------------------------------------


def unreadable(monkeypatch, tmp_path: Path) -> Path:
    """cifar10's archive in place, but reading it fails as in a directory without read
    permission (root reads everything, so EACCES is simulated)."""
    from common import datasets

    root = tmp_path / "data" / "cifar10"
    root.mkdir(parents=True)
    archive = root / "cifar-10-python.tar.gz"
    archive.write_bytes(b"x")

    def denied(path: Path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(datasets, "md5sum", denied)
    return archive


def test_a_dataset_that_cannot_be_read_is_one_line(tmp_path, monkeypatch):
    from common.config import preset
    from common.datasets import DatasetError, check_available, load_for

    archive = unreadable(monkeypatch, tmp_path)
    cfg = preset("cifar10-resnet18", data_dir=str(tmp_path / "data"))
    for load in (check_available, load_for):
        with pytest.raises(DatasetError, match=f"cannot read {archive} \\(Permission denied\\)"):
            load(cfg)  # was: PermissionError's traceback


def test_compare_over_an_unreadable_dataset_is_one_line(tmp_path, no_probe, monkeypatch, capsys):

    archive = unreadable(monkeypatch, tmp_path)
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    rc = compare.main(["--frameworks", "torch-dp", "--gpus", "1", "--preset", "cifar10-resnet18",
                       "--data-dir", data, "--out", out])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"cannot read {archive}" in err[0], err
