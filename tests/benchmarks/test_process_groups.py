"""No child outlives its tool (benchmarks/harness.py), and the files written so far are complete.
The children are stand-ins (a shell script in place of a framework's interpreter)."""

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
from tests.conftest import ROOT, read_json


def stand_in(tmp: Path, probe: str, run: str = "exit 0") -> Path:
    """A framework's interpreter: `probe` answers the package and device probes, `run` runs."""
    path = tmp / "python"
    path.write_text(f"#!/bin/sh\ncase \"$1 $2\" in '-c '*|'-m benchmarks.device_probe') {probe};;\n"
                    f"  *) {run};;\nesac\n")  # fmt: skip
    path.chmod(0o755)
    return path


def hang(tmp: Path, name: str) -> str:
    """Shell that forks a child (`sleep`), writes both pids to `name`.pids and waits."""
    return f"sleep 300 & echo $$ $! > {tmp / name}.pids; wait"


def pids_of(tmp: Path, name: str, within: float = 30.0) -> list[int]:
    path, deadline = tmp / f"{name}.pids", time.monotonic() + within
    while time.monotonic() < deadline:
        if (text := path.read_text() if path.exists() else "").endswith("\n"):
            return [int(p) for p in text.split()]
        time.sleep(0.05)
    raise AssertionError(f"{path} was not written within {within} s")


def running(pids: list[int], within: float = 0.0) -> list[int]:
    """Those of `pids` still running after `within` seconds (a zombie does not run)."""
    deadline = time.monotonic() + within
    while (left := [p for p in pids if process_alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


@pytest.fixture
def reap():
    pids: list[int] = []
    yield pids
    for pid in running(pids):
        os.kill(pid, signal.SIGKILL)


def test_a_hung_probe_is_killed_with_the_child_it_forked(tmp_path, monkeypatch, reap) -> None:
    monkeypatch.setenv("DPBENCH_PYTHON_TORCH_DDP", str(stand_in(tmp_path, hang(tmp_path, "p"))))
    monkeypatch.setattr(harness, "PROBE_TIMEOUT", 1.0)
    t0 = time.monotonic()
    why = harness.unavailable(["torch-ddp"])["torch-ddp"]  # compare's start-up check
    assert "does not start (TimeoutExpired)" in why and time.monotonic() - t0 < 10, why
    reap += pids_of(tmp_path, "p")
    assert running(reap, within=1.0) == []  # the interpreter and the child it forked


TRAINER = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from common.runtime import stop_with_harness
def stop(signum, frame):
    open({tmp!r} + "/told", "w").write("TERM")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
stop_with_harness()
open({tmp!r} + "/child.pids", "w").write(f"{{os.getpid()}}\\n")
time.sleep(300)
"""
EPOCH = "epoch 1/3 sec=1.0 images_per_sec=10.0 train_loss=2.3 test_accuracy=0.25 test_loss=2.2"


@pytest.mark.parametrize("stage", ["probe", "run", "timeout", "kill-9"])
def test_no_child_outlives_compare_and_the_files_are_complete(
    tmp_path: Path, reap: list[int], stage: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """SIGTERM (a cancelled CI job) during the 60 s start-up probe or a run: exit 143 (128 +
    SIGTERM, as a trainer). A run past --timeout: killed, its progress kept. compare killed -9:
    its trainer (a stand-in arming common.runtime.stop_with_harness, as run_main does) is told
    to stop, and `report` says the runner is gone. Each time no child of it is left."""
    out, hung = tmp_path / "out", hang(tmp_path, "child")
    (tmp_path / "t.py").write_text(TRAINER.format(root=str(ROOT), tmp=str(tmp_path)))
    trainer = f"exec {sys.executable} {tmp_path / 't.py'}"
    run = {"timeout": f"echo '{EPOCH}'; {hung}", "kill-9": trainer}.get(stage, hung)
    python = stand_in(tmp_path, hung) if stage == "probe" else stand_in(tmp_path, "exit 0", run)
    flags = {"timeout": ["--gpus", "1", "--timeout", "3"], "kill-9": ["--gpus", "1"]}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DPBENCH_PYTHON_TORCH_DDP": str(python)}
    args = ["--frameworks", "torch-ddp", "--preset", "smoke", "--devices", "cpu", "--out", str(out)]
    tool = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.compare", *args, *flags.get(stage, ["--gpus", "2"])],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        reap += pids_of(tmp_path, "child")
        if stage != "timeout":
            tool.send_signal(signal.SIGKILL if stage == "kill-9" else signal.SIGTERM)
        said, _ = tool.communicate(timeout=60)
    finally:
        if tool.poll() is None:
            tool.kill()
    assert tool.returncode == {"timeout": 1, "kill-9": -9}.get(stage, 143), said
    assert running(reap, within=5.0) == []
    if stage == "kill-9":
        assert (
            tmp_path / "told"
        ).read_text() == "TERM"  # told to stop (a trainer writes its record)
        assert report.main([str(out)]) == 0
        said = f"report: the comparison in {out} stopped: its runner (pid {tool.pid}) is gone"
        assert said in capsys.readouterr().out
    elif stage == "probe":
        assert said.strip().splitlines()[-1] == "compare: interrupted before any run started"
    else:
        record = read_json(out / "runs" / "torch-ddp-1dev.json")
        ended = "timeout" if stage == "timeout" else "interrupted"
        assert record["status"] == record["runner"]["ended"] == ended
        assert not list(out.rglob("*.tmp"))
    if stage == "timeout":
        assert record["epochs"][0]["test_accuracy"] == 0.25  # progress parsed from the log
        log = (out / record["runner"]["log"]).read_text()
        assert "[compare] still running after 3 s (--timeout): killed" in log
    elif stage == "run":
        assert "interrupted; 0 of 2 runs finished" in said
        assert read_json(out / "config.json")["status"] == "interrupted"
        status = csv.DictReader((out / "results.csv").read_text().splitlines())
        assert [r["status"] for r in status] == ["interrupted", "not run"]


def test_the_nvidia_course_ranks_die_with_their_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tutorial's ranks arm common.runtime.die_with_parent with the pid of the process that
    spawned them, before any work (in-process: spawn hands its arguments to one worker here)."""
    from common.config import preset
    from tutorials import nvidia_course

    class Armed(BaseException):  # not an Exception: spawn's own handler lets it through
        pass

    def die_with_parent(parent: int) -> None:
        raise Armed(parent)

    monkeypatch.setattr(nvidia_course, "die_with_parent", die_with_parent)
    monkeypatch.setattr(nvidia_course.dist, "init_process_group", None)  # work: a TypeError
    monkeypatch.setattr(nvidia_course.mp, "spawn", lambda fn, args, nprocs: fn(0, *args))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    with pytest.raises(Armed) as armed:
        nvidia_course.spawn(preset("smoke"))
    assert armed.value.args == (os.getpid(),)
