"""No child outlives its tool (benchmarks/harness.py): a hung or stopped probe or run is killed
with its whole group, and the files written so far are complete; a trainer gets SIGTERM when the
tool dies, kill -9 included; `report` on a sweep whose runner is gone says so. The children are
stand-ins (a shell script in place of a framework's interpreter): no training runs."""

from __future__ import annotations

import csv
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks import harness, report
from common.runtime import process_alive
from tests.conftest import read_json, run_module

ROOT = Path(__file__).resolve().parents[2]


def stand_in(tmp: Path, probe: str, run: str = "exit 0") -> Path:
    """An executable in place of a framework's interpreter: `probe` answers the package probe
    (`python -c ...`) and the device probe (`python -m benchmarks.device_probe`), `run` the
    trainer (`python -m frameworks...`)."""
    path = tmp / "python"
    path.write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in\n'
        f"  '-c '*|'-m benchmarks.device_probe') {probe};;\n"
        f"  *) {run};;\n"
        "esac\n"
    )
    path.chmod(0o755)
    return path


def hang(tmp: Path, name: str) -> str:
    """Shell that forks a child (`sleep`), writes both pids to `name`.pids and waits."""
    return f"sleep 300 & echo $$ $! > {tmp / name}.pids; wait"


def pids_of(tmp: Path, name: str, within: float = 30.0) -> list[int]:
    path = tmp / f"{name}.pids"
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        text = path.read_text() if path.exists() else ""
        if text.endswith("\n"):
            return [int(p) for p in text.split()]
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written within {within} s")


def running(pids: list[int], within: float = 0.0) -> list[int]:
    """Those of `pids` still running after `within` seconds (a zombie, waiting for its reaper,
    does not run)."""
    deadline = time.monotonic() + within
    while True:
        left = [p for p in pids if process_alive(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.05)


@pytest.fixture
def reap():
    """Kills, at the end of a test, whatever a failing test left running."""
    pids: list[int] = []
    yield pids
    for pid in running(pids):
        os.kill(pid, signal.SIGKILL)


def test_a_hung_probe_is_killed_with_the_child_it_forked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, reap: list[int]
) -> None:
    python = stand_in(tmp_path, hang(tmp_path, "probe"))
    monkeypatch.setenv("DPBENCH_PYTHON_TORCH_DDP", str(python))
    monkeypatch.setattr(harness, "PROBE_TIMEOUT", 1.0)
    t0 = time.monotonic()
    why = harness.unavailable(["torch-ddp"])["torch-ddp"]  # compare's start-up check
    assert "does not start (TimeoutExpired)" in why, why
    assert time.monotonic() - t0 < 10
    reap += pids_of(tmp_path, "probe")
    assert running(reap, within=1.0) == []  # the interpreter and the child it forked


TRAINER = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from common.runtime import stop_with_harness
def stop(signum, frame):
    open({told!r}, "w").write("TERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
stop_with_harness()
open({pids!r} + "/trainer.pids", "w").write(f"{{os.getpid()}}\\n")
time.sleep(300)
"""


def test_compare_killed_9_ends_its_trainer_and_report_says_its_runner_is_gone(
    tmp_path: Path, reap: list[int], capsys: pytest.CaptureFixture[str]
) -> None:
    """The trainer (a stand-in that arms common.runtime.stop_with_harness, as run_main does)
    gets SIGTERM when compare dies, and writes its record."""
    told = tmp_path / "told"
    trainer = tmp_path / "trainer.py"
    trainer.write_text(TRAINER.format(root=str(ROOT), told=str(told), pids=str(tmp_path)))
    python = stand_in(tmp_path, "exit 0", f"exec {sys.executable} {trainer}")
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DPBENCH_PYTHON_TORCH_DDP": str(python)}
    args = ["--frameworks", "torch-ddp", "--gpus", "1", "--preset", "smoke", "--devices", "cpu"]
    tool = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.compare", *args, "--out", str(out)],
        cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        start_new_session=True,
    )  # fmt: skip
    try:
        reap += pids_of(tmp_path, "trainer")
    finally:
        tool.kill()  # kill -9: compare can do nothing about it
        tool.wait()
    assert running(reap, within=3.0) == []
    assert told.read_text() == "TERM"  # told to stop (a trainer writes its record)

    assert report.main([str(out)]) == 0
    said = f"report: the comparison in {out} stopped: its runner (pid {tool.pid}) is gone"
    assert said in capsys.readouterr().out


def test_a_stop_during_the_start_up_checks_kills_their_probes(
    tmp_path: Path, reap: list[int]
) -> None:
    python = stand_in(tmp_path, hang(tmp_path, "probe"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DPBENCH_PYTHON_TORCH_DDP": str(python)}
    args = ["--frameworks", "torch-ddp", "--gpus", "1", "--preset", "smoke", "--devices", "cpu"]
    tool = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.compare", *args, "--out", str(tmp_path / "out")],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        reap += pids_of(tmp_path, "probe")
        tool.send_signal(signal.SIGTERM)  # a cancelled CI job, during the 60 s probe
        said, _ = tool.communicate(timeout=20)
    finally:
        if tool.poll() is None:
            tool.kill()
    assert tool.returncode == 143, said  # 128 + SIGTERM
    assert said.strip().splitlines()[-1] == "compare: interrupted before any run started"
    assert running(reap, within=1.0) == []


def test_a_stopped_compare_kills_its_run_whole_and_keeps_complete_files(
    tmp_path: Path, reap: list[int]
) -> None:
    python = stand_in(tmp_path, "exit 0", hang(tmp_path, "run"))
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DPBENCH_PYTHON_TORCH_DDP": str(python)}
    args = ["--frameworks", "torch-ddp", "--gpus", "2", "--preset", "smoke", "--out", str(out)]
    tool = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.compare", *args], cwd=ROOT, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip
    try:
        reap += pids_of(tmp_path, "run")
        tool.send_signal(signal.SIGTERM)  # a cancelled CI job
        said, _ = tool.communicate(timeout=60)
    finally:
        if tool.poll() is None:
            tool.kill()
    assert tool.returncode == 143, said  # 128 + SIGTERM, as a trainer
    assert "interrupted; 0 of 2 runs finished" in said
    assert running(reap, within=5.0) == []  # the run and the child it forked
    assert read_json(out / "config.json")["status"] == "interrupted"
    record = read_json(out / "runs" / "torch-ddp-1dev.json")
    assert record["status"] == "interrupted" and record["runner"]["ended"] == "interrupted"
    with open(out / "results.csv") as f:
        assert [r["status"] for r in csv.DictReader(f)] == ["interrupted", "not run"]
    assert not list(out.rglob("*.tmp"))


def test_a_hung_run_is_killed_at_the_timeout_with_its_child(
    tmp_path: Path, reap: list[int]
) -> None:
    epoch = "epoch 1/3 sec=1.0 images_per_sec=10.0 train_loss=2.3 test_accuracy=0.25 test_loss=2.2"
    python = stand_in(tmp_path, "exit 0", f"echo '{epoch}'; " + hang(tmp_path, "run"))
    out = tmp_path / "out"
    args = ["--frameworks", "torch-ddp", "--gpus", "1", "--preset", "smoke", "--timeout", "3"]
    proc = run_module("benchmarks.compare", *args, "--out", str(out),
                      env={"DPBENCH_PYTHON_TORCH_DDP": str(python)}, timeout=60)  # fmt: skip
    reap += pids_of(tmp_path, "run")
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert running(reap, within=5.0) == []
    record = read_json(out / "runs" / "torch-ddp-1dev.json")
    assert record["status"] == "timeout" and record["runner"]["ended"] == "timeout"
    assert record["epochs"][0]["test_accuracy"] == 0.25  # progress parsed from the log
    said = (out / record["runner"]["log"]).read_text()
    assert "[compare] still running after 3 s (--timeout): killed" in said


def test_the_nvidia_course_ranks_die_with_their_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tutorial's ranks (torch.multiprocessing.spawn) arm common.runtime.die_with_parent with
    the pid of the process that spawned them, before any work. Run in-process: spawn hands its
    arguments to one worker here."""
    from common.config import preset
    from tutorials import nvidia_course

    class Armed(BaseException):  # not an Exception: spawn's own handler lets it through
        pass

    def die_with_parent(parent: int) -> None:
        raise Armed(parent)

    def work(*args: object, **kwargs: object) -> None:
        raise AssertionError("the rank started its work before arming die_with_parent")

    monkeypatch.setattr(nvidia_course, "die_with_parent", die_with_parent)
    monkeypatch.setattr(nvidia_course.dist, "init_process_group", work)
    monkeypatch.setattr(nvidia_course.mp, "spawn", lambda fn, args, nprocs: fn(0, *args))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(Armed) as armed:
        nvidia_course.spawn(preset("smoke"))
    assert armed.value.args == (os.getpid(),)
