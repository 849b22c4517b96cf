"""A stopped run (SIGTERM: a cancelled job; SIGINT: Ctrl-C) ends "interrupted" with the epochs
measured so far, exit 128 + the signal (common/interrupts.py); after a kill -9 of torch-ddp's
parent no worker is left (common.runtime.die_with_parent). A kill -9 of compare:
tests/benchmarks/test_process_groups.py."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.conftest import MAIN_PYTHON, ROOT, SMOKE, read_json

LONG_DDP = (*SMOKE, "--gpus", "2", "--epochs", "500")  # torch-ddp, long enough to be stopped


def test_sigterm_or_ctrl_c_ends_a_run_as_interrupted_with_its_epochs(tmp_path: Path) -> None:
    from common.results import RunRecorder
    from common.trainer import keep_measured_epochs, run_main

    out = tmp_path / "run.json"

    def train(cfg: Any) -> dict[str, Any]:
        recorder = RunRecorder(cfg, devices=1, device_kind="cpu", params=0, is_main=True)
        with keep_measured_epochs(recorder):
            for epoch in range(cfg.epochs):
                recorder.end_epoch(epoch, 0.1, 96, 2.0, 1, 10, 20.0)
                if epoch == 1:
                    os.kill(os.getpid(), signal.SIGTERM)  # a scheduler cancels the job
                    time.sleep(5)  # the handler raises in here
        return recorder.finish()

    argv = [*SMOKE, "--epochs", "9", "--output", str(out)]
    assert run_main(argv, "torch-dp", check=lambda cfg: None, train=train) == 143
    rec = read_json(out)
    assert rec["status"] == "interrupted" and [e["epoch"] for e in rec["epochs"]] == [1, 2]
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # handlers restored

    def before_the_loop(cfg: Any) -> dict[str, Any]:  # Ctrl-C while loading data or compiling
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        return {"status": "ok"}

    assert run_main(argv, "torch-dp", check=lambda cfg: None, train=before_the_loop) == 130
    rec = read_json(out)
    assert rec["status"] == "interrupted" and rec["epochs"] == []


def start_ddp(tmp_path: Path, epoch: int) -> tuple[subprocess.Popen[str], list[int]]:
    """torch-ddp on 2 CPU processes in a session of its own, once it printed `epoch N/`; and
    its two ranks."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    argv = [*LONG_DDP, "--output", str(tmp_path / "run.json")]
    proc = subprocess.Popen(
        [str(MAIN_PYTHON), "-m", "frameworks.torch_ddp", *argv], cwd=ROOT, env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(f"epoch {epoch}/"):
            kids = psutil.Process(proc.pid).children()  # and multiprocessing's resource tracker
            return proc, [c.pid for c in kids if "spawn_main" in " ".join(c.cmdline())]
    proc.wait()
    raise AssertionError(proc.stderr.read()[-3000:] if proc.stderr else "no output")


def gone(pids: list[int], within: float = 10.0) -> bool:
    """True once none of `pids` runs (a zombie nobody has reaped yet does not)."""
    from common.runtime import process_alive

    deadline = time.monotonic() + within
    while any(process_alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_sigterm_to_a_torch_ddp_job_stops_its_ranks_and_keeps_its_epochs(tmp_path: Path) -> None:
    """As a scheduler cancels a job: SIGTERM to every process of it, the ranks included. Epoch
    3 printed: epoch 2 has surely reached the parent."""
    proc, ranks = start_ddp(tmp_path, epoch=3)
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert stderr.strip().splitlines()[-1] == (
        "python -m frameworks.torch_ddp: interrupted by SIGTERM; the record keeps the epochs "
        "measured so far"
    )
    assert len(ranks) == 2 and gone(ranks)
    rec = read_json(tmp_path / "run.json")
    assert rec["status"] == "interrupted" and rec["error"] == "interrupted by SIGTERM"
    assert len(rec["epochs"]) >= 2


def test_kill_9_of_torch_ddps_parent_leaves_no_rank_and_no_record(tmp_path: Path) -> None:
    proc, ranks = start_ddp(tmp_path, epoch=2)
    proc.kill()  # SIGKILL: the parent can do nothing about it
    proc.wait()
    try:
        assert len(ranks) == 2 and gone(ranks)
        time.sleep(1.0)  # an orphan would write a record within one short epoch
        assert not (tmp_path / "run.json").exists()  # only the parent writes --output
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


@pytest.mark.parametrize("code", [130, 143, 0, 1, 2])
def test_a_stopped_trainer_ends_without_the_interpreters_finalization(
    monkeypatch: pytest.MonkeyPatch, code: int
) -> None:
    """After a stop, a trainer's process ends with os._exit (its record written by then): the
    finalization, racing XLA threads still running the interrupted step, crashed 3 of 53
    interrupted jax-shardmap runs with SIGSEGV. Any other exit code leaves as before."""
    from common import interrupts

    class Ended(BaseException):
        pass

    def os_exit(code: int) -> None:
        raise Ended(code)

    monkeypatch.setattr(interrupts.os, "_exit", os_exit)
    with pytest.raises(Ended if code > 100 else SystemExit) as ended:
        interrupts.exit_after(code)
    assert ended.value.args == (code,)


def test_a_worker_forked_inside_a_run_dies_of_sigterm_as_its_pool_expects() -> None:
    """A DataLoader's pool forked inside `interruptible` (tutorials/d2l_mxnet.py): its worker gets
    the handlers from before it, so the pool's terminate() ends it (the tutorial hung without)."""
    from common.interrupts import interruptible

    with interruptible():
        pid = os.fork()
        if pid == 0:  # the worker: SIGTERM must kill it, not raise Interrupted (exit 0 here)
            try:
                time.sleep(30)
            finally:
                os._exit(0)
        time.sleep(0.2)
        os.kill(pid, signal.SIGTERM)
        _, status = os.waitpid(pid, 0)
    assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM, status
