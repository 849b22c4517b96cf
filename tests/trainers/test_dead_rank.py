"""A dead rank named (issue #41 item 6): when a torch-ddp rank is killed, the run's one line
names that rank and the signal, with no traceback, and the record says "failed". Made
deterministic: the parent is stopped (SIGSTOP) while rank 1 is killed, so that rank 0's error
(gloo's "Connection closed by peer", with its traceback) is there before the parent looks; that
was the line the run gave, after rank 0's traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import ROOT, SMOKE, module_of, python_for, read_json


def workers_of(pid: int) -> list[int]:
    """The spawned ranks of `pid`, in the order they started (rank 0 first)."""
    kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    spawned = [int(k) for k in kids if b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    return sorted(spawned)


def test_a_killed_rank_is_named_in_one_line(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    args = [*SMOKE, "--gpus", "2", "--epochs", "200", "--data-dir", str(tmp_path / "data"),
            "--output", str(out)]  # fmt: skip
    proc = subprocess.Popen(
        [str(python_for("torch-ddp")), "-m", module_of("torch-ddp"), *args],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the ranks are training
            if line.startswith("epoch 1/"):
                break
        rank0, rank1 = workers_of(proc.pid)
        os.kill(proc.pid, signal.SIGSTOP)
        os.kill(rank1, signal.SIGKILL)
        time.sleep(3)  # rank 0 fails in its next all-reduce and reports it
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, err
    assert "Traceback" not in err, err
    (line,) = err.strip().splitlines()
    assert f"rank 1 (pid {rank1}) was killed by SIGKILL" in line, line
    record = read_json(out)
    assert record["status"] == "failed" and f"rank 1 (pid {rank1}) was killed" in record["error"]
