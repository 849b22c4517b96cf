"""Hostile and careless input, round two, the rest of issue 29: a device count in XLA_FLAGS that
is no integer, paths the file system cannot name, records and arrays that are no regular files,
a full disk under a checkpoint or TensorBoard, an unreachable JAX coordinator, a dataset
directory that cannot be read.

Same style as tests/test_hostile_inputs2.py: exit 2 and one line naming the problem for bad
input, exit 1, one line and a "failed" record for a runtime failure; nothing left behind. A full
disk is a child process whose file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes every
write past it fail with EFBIG, as ENOSPC would: no root, no small file system needed."""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from common.config import ConfigError
from tests.conftest import (
    MXNET_PYTHON,
    ROOT,
    SMOKE,
    one_line_error,
    python_for,
    run_trainer,
    skip_without_interpreter,
)
from tests.hostile_helpers import MXNET_STATES_FAIL, a_comparison

LONG = "x" * 300  # one component over NAME_MAX (255): ENAMETOOLONG


# ---- 1. a device count in XLA_FLAGS that is no integer ------------------------------------


@pytest.mark.parametrize("value", ["abc", "", "0", "-1", "2.5", "1e3"])
def test_an_xla_device_count_that_is_no_integer_is_one_line(monkeypatch, value):
    from common.runtime import check_xla_flags

    monkeypatch.setenv("XLA_FLAGS", f"--xla_force_host_platform_device_count={value}")
    with pytest.raises(ConfigError, match="needs a positive integer device count"):
        check_xla_flags()  # was: silently replaced by --gpus
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=08")
    check_xla_flags()


def test_an_xla_device_count_that_is_no_integer_is_refused_by_a_trainer(tmp_path):
    out = tmp_path / "r.json"
    env = {"XLA_FLAGS": "--xla_force_host_platform_device_count=abc"}
    bad = run_trainer("jax-pmap", *SMOKE, "--output", str(out), env=env)
    one_line_error(bad, "XLA_FLAGS=", "positive integer device count", "unset XLA_FLAGS")
    assert not out.exists()


def test_an_xla_device_count_that_is_no_integer_is_refused_by_compare(
    tmp_path, no_probe, monkeypatch, capsys
):
    from benchmarks import compare

    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=abc")
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    rc = compare.main(["--frameworks", "jax-pmap", "--gpus", "1", "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()  # was: dropped from every run's XLA_FLAGS
    assert rc == 2 and len(err) == 1 and "positive integer device count" in err[0], err


# ---- 2. a path the file system cannot name, or under a file --------------------------------


def never_train(cfg):
    raise AssertionError("train() started although a path was bad")


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
    ],
    ids=lambda v: v[:20],
)
def test_a_path_the_file_system_cannot_name_is_one_line(flag, where, fragment, tmp_path, capsys):
    from common.trainer import run_main

    (tmp_path / "file").write_text("x")
    path = str(tmp_path / where)
    rc = run_main([*SMOKE, flag, path], "torch-dp", check=lambda cfg: None, train=never_train)
    err = capsys.readouterr().err.strip().splitlines()  # was: exit 1, OSError (ENAMETOOLONG)
    assert rc == 2 and len(err) == 1 and f"{flag} {path}" in err[0] and fragment in err[0], err


@pytest.fixture
def no_probe(monkeypatch) -> None:
    from benchmarks import harness

    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    monkeypatch.setattr(harness, "detect_gpus", lambda: [])


@pytest.mark.parametrize("flag", ["--checkpoint-dir", "--data-dir", "--save-state"])
def test_compare_refuses_a_trainer_path_before_any_run(
    flag, tmp_path, no_probe, monkeypatch, capsys
):
    from benchmarks import compare

    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    out = tmp_path / "out"
    rc = compare.main(["--frameworks", "torch-dp", "--gpus", "1", "--preset", "smoke",
                       flag, str(tmp_path / LONG), "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()  # was: every run failed, exit 1
    assert rc == 2 and len(err) == 1 and flag in err[0] and "too long" in err[0], err
    assert not out.exists()


@pytest.mark.parametrize("tool", ["parity", "throughput"])
def test_a_python_the_file_system_cannot_name_is_one_line(tool, tmp_path, no_probe, capsys):
    import importlib

    module = importlib.import_module(f"benchmarks.{tool}")
    rc = module.main(["--python", str(tmp_path / LONG), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()  # was: an OSError traceback
    assert rc == 2 and len(err) == 1 and "no executable interpreter there" in err[0], err


def test_report_of_a_directory_the_file_system_cannot_name_is_one_line(tmp_path, capsys):
    from benchmarks import report

    rc = report.main([str(tmp_path / LONG)])
    err = capsys.readouterr().err.strip().splitlines()  # was: an OSError traceback
    assert rc == 2 and len(err) == 1 and "File name too long" in err[0], err


# ---- 3. records and arrays the tools load: regular files of sane size only -----------------


@pytest.mark.parametrize("which", ["config.json", "runs/torch-dp-1dev.json"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "oversized"])
def test_report_refuses_a_record_that_is_no_file_at_once(
    which, kind, tmp_path, no_probe, capsys, hang_fails
):
    from benchmarks import harness, report

    out = tmp_path / "out"
    a_comparison(out)
    capsys.readouterr()
    path = out / which
    path.unlink(missing_ok=True)
    if kind == "fifo":
        os.mkfifo(path)  # was: report blocked for ever reading it
    elif kind == "/dev/zero":
        path.symlink_to("/dev/zero")  # was: read until memory ran out
    else:
        with open(path, "wb") as f:
            f.truncate(harness.RECORD_LIMIT + 1)
    start = time.monotonic()
    rc = report.main([str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert time.monotonic() - start < 1.0
    assert rc == 2 and len(err) == 1 and str(path) in err[0], err
    assert ("more than" if kind == "oversized" else "not a file") in err[0], err


@pytest.fixture
def hang_fails():
    """A read that blocks (the failure these tests guard against) fails the test after 10 s
    instead of hanging the suite."""

    def on_alarm(*_: object) -> None:
        pytest.fail("blocked for 10 s: the hang this test guards against")

    old = signal.signal(signal.SIGALRM, on_alarm)
    signal.alarm(10)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


def test_read_record_of_a_fifo_is_no_record_at_once(tmp_path, hang_fails):
    from benchmarks import harness

    os.mkfifo(tmp_path / "r.json")
    start = time.monotonic()
    assert harness.read_record(tmp_path / "r.json") is None  # compare: the run left no record
    assert time.monotonic() - start < 1.0


def test_predict_refuses_a_breakdown_or_table_that_is_a_fifo(tmp_path, hang_fails):
    from benchmarks import predict
    from benchmarks.harness import UsageError

    os.mkfifo(tmp_path / "b.json")
    with pytest.raises(UsageError, match="--breakdown .* is a FIFO, not a file"):
        predict.read_breakdown(str(tmp_path / "b.json"))
    with pytest.raises(UsageError, match="--throughput-table .* is a FIFO, not a file"):
        predict.read_throughput_table(str(tmp_path / "b.json"))


def test_parity_loads_no_state_that_is_a_fifo_or_inflates(tmp_path, hang_fails):
    import zipfile

    from benchmarks import parity

    os.mkfifo(tmp_path / "s.npz")
    with pytest.raises(ConfigError, match="saved state .* is a FIFO, not a file"):
        parity.load_state(tmp_path / "s.npz", 1 << 20)  # was: np.load blocked
    with zipfile.ZipFile(tmp_path / "big.npz", "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("w.npy", b"\0" * (4 << 20))  # 4 MiB inflated from a few KB
    with pytest.raises(ConfigError, match="inflates past"):
        parity.load_state(tmp_path / "big.npz", 1 << 20)
    with zipfile.ZipFile(tmp_path / "many.npz", "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(8):  # each member under the limit, together 4 MiB
            z.writestr(f"w{i}.npy", b"\0" * (512 << 10))
    with pytest.raises(ConfigError, match="inflates past"):
        parity.load_state(tmp_path / "many.npz", 1 << 20)


# ---- 4. a full disk under a checkpoint or TensorBoard --------------------------------------


def limited(limit: int):
    def set_limit() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return set_limit


def run_limited(python: Path, args: list[str], limit: int) -> subprocess.CompletedProcess[str]:
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


def test_mxnet_leaves_no_orphan_params_when_the_states_write_fails(tmp_path):
    skip_without_interpreter("mxnet-gluon")
    out, ck = tmp_path / "r.json", tmp_path / "ck"
    args = ["-c", MXNET_STATES_FAIL, *SMOKE, "--output", str(out), "--checkpoint-dir", str(ck)]
    proc = run_limited(MXNET_PYTHON, args, 1 << 30)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "cannot write checkpoint" in proc.stderr.strip().splitlines()[-1]
    assert sorted(p.name for p in ck.iterdir()) == [".lock"]  # was: mxnet-gluon-epoch1.params
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


# ---- 5. an unreachable JAX coordinator -----------------------------------------------------


@pytest.mark.parametrize(
    "rank, says, names",
    [
        ("1", "did not answer within 3 s", "JAX_COORDINATOR_ADDRESS"),  # nothing listens there
        ("0", "did not all join", "JAX_NUM_PROCESSES=2"),  # process 0 alone: 1 never starts
    ],
)
def test_a_jax_job_that_never_forms_ends_in_bounded_time_with_a_record(tmp_path, rank, says,
                                                                       names):  # fmt: skip
    from common.runtime import free_port

    out = tmp_path / "r.json"
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": rank}  # fmt: skip
    start = time.monotonic()
    proc = run_trainer("jax-pmap", *SMOKE, "--collective-timeout", "3", "--output", str(out),
                       env=env, timeout=120)  # fmt: skip
    took = time.monotonic() - start
    assert proc.returncode == 1, proc.stderr[-3000:]  # was: 134 (SIGABRT in XLA), no record
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], proc.stderr[-3000:]
    assert took < 30, took
    record = json.loads(out.read_text())
    assert record["status"] == "failed" and names in record["error"]


def test_process_0_refuses_a_coordinator_address_that_is_not_its_own(tmp_path):
    out = tmp_path / "r.json"
    env = {"JAX_COORDINATOR_ADDRESS": "192.0.2.1:23456",  # TEST-NET-1: never this host
           "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "0"}  # fmt: skip
    start = time.monotonic()
    bad = run_trainer("jax-pmap", *SMOKE, "--collective-timeout", "5", "--output", str(out),
                      env=env, timeout=120)  # fmt: skip
    one_line_error(bad, "cannot listen on it", "start process 0 on 192.0.2.1")  # was: rc 134
    assert time.monotonic() - start < 20 and not out.exists()


def test_process_0_refuses_a_coordinator_port_in_use():
    import socket

    from frameworks.jax_support import check_coordinator_here

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(ConfigError, match="cannot listen on it .*choose a free port"):
            check_coordinator_here(address)
    check_coordinator_here(address)  # free again


# ---- 6. a dataset directory that cannot be read --------------------------------------------


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

    monkeypatch.setattr(datasets, "_check_regular", denied)
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
    from benchmarks import compare

    archive = unreadable(monkeypatch, tmp_path)
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    data, out = str(tmp_path / "data"), str(tmp_path / "out")
    rc = compare.main(["--frameworks", "torch-dp", "--gpus", "1", "--preset", "cifar10-resnet18",
                       "--data-dir", data, "--out", out])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"cannot read {archive}" in err[0], err
