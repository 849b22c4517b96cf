"""Hostile processes (issue 15, items 1, 9, 10): a cancelled run stops, records stay true after
a resume, and nothing is left behind (a dead rank, JAX processes: tests/trainers/test_launch.py).

- kill -9 of torch-ddp's parent: every worker dies with it (parent-death signal), no record
  says "ok", no temp file or directory is left; SIGTERM to the whole job (as scancel or the
  harness sends it): the record says "interrupted", nothing is left running;
  SIGTERM / SIGINT in a trainer: its epochs are kept as "interrupted";
- `--checkpoint-dir` is locked: a second run on it is refused (one line, exit 2);
- `--resume` with other hyper-parameters, or `--epochs` below the checkpoint's epoch: refused;
  a resumed record keeps every epoch's LR, counts its epochs right, and times no warm-up epoch;
- the harness kills its children's process groups on SIGHUP, and a trainer whose harness is
  killed -9 stops itself.

Each mechanism is also shown to matter: the same check run with it disabled (injected) fails.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from common.config import ConfigError, preset
from common.runtime import process_state
from tests.conftest import MAIN_PYTHON, ROOT, SMOKE, ok, one_line_error, read_json, run_trainer

PY = str(MAIN_PYTHON)
# torch-ddp at 2 CPU processes on the smoke preset, running long enough to be cancelled.
LONG_DDP = (*SMOKE, "--gpus", "2", "--epochs", "500")


def env_with(tmp: Path, **extra: str) -> dict[str, str]:
    """The trainer's environment, its TMPDIR a fresh directory (to prove nothing is left)."""
    tmp.mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", "TMPDIR": str(tmp)}
    env.pop("XLA_FLAGS", None)
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return {**env, **extra}


def children(pid: int) -> list[int]:
    out = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def gone(pids: list[int], within: float = 10.0) -> bool:
    """True once none of `pids` runs (gone, or a zombie nobody has reaped yet)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if all(process_state(p) in ("", "Z", "X") for p in pids):
            return True
        time.sleep(0.1)
    return False


def start_and_wait_for_epoch(args: list[str], env: dict[str, str], epoch: int = 2):
    """Start a trainer in its own process group; return it once it printed `epoch N/`."""
    proc = subprocess.Popen(
        [PY, "-m", "frameworks.torch_ddp", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(f"epoch {epoch}/"):
            return proc, seen
    proc.wait()
    raise AssertionError("".join(seen) + proc.stderr.read()[-3000:])


def leftovers(*dirs: Path) -> list[str]:
    """Temp files, temp directories, torch error-file pickles: anything unexpected."""
    found = []
    for d in dirs:
        for p in d.rglob("*"):
            if p.name == ".lock" or p.suffix == ".pt" or p.name == "run.json":
                continue
            if p.parts[len(d.parts)].startswith("torchinductor_"):
                continue  # torch's own compilation cache (kept on purpose), not a leak
            found.append(str(p.relative_to(d)))
    return found


# ---- a cancelled torch-ddp run stops --------------------------------------------------------


def test_kill_9_of_the_parent_leaves_no_orphan_and_no_ok_record(tmp_path):
    out, ck, tmp = tmp_path / "run.json", tmp_path / "ck", tmp_path / "tmp"
    args = [*LONG_DDP, "--output", str(out), "--checkpoint-dir", str(ck)]
    proc, _ = start_and_wait_for_epoch(args, env_with(tmp))
    workers = children(proc.pid)
    assert len(workers) >= 2, workers  # two ranks (and multiprocessing's resource tracker)
    proc.kill()  # SIGKILL: the parent can do nothing about it
    proc.wait()
    assert gone(workers), [(w, process_state(w)) for w in workers]
    time.sleep(1.0)  # an orphan would write its record within one short epoch
    assert not out.exists()  # the parent writes --output, and it is dead: no "ok" from orphans
    # Nothing is left but, when the kill hit rank 0 mid-checkpoint (SIGKILL: nothing can clean
    # up), that checkpoint's temp file, whose writer is gone: a zombie that nobody reaped yet
    # counts as gone, here and in the resume's clean-up below (runtime.process_alive; counted
    # alive, a rank's zombie failed here on a loaded 2-core machine).
    debris = leftovers(ck, tmp)
    assert all(
        d.startswith("torch-ddp.pt.") and gone([int(d.rpartition(".tmp")[2])]) for d in debris
    ), [(d, process_state(int(d.rpartition(".tmp")[2]))) for d in debris]
    # The lock died with the parent: a resume may start at once (and continues the run), and,
    # once it holds the lock, removes such debris.
    assert (ck / "torch-ddp.pt").exists()
    (ck / "torch-ddp.pt.debris00.tmp999999999").write_bytes(b"half a checkpoint")  # a dead pid
    resumed, seen = start_and_wait_for_epoch([*args, "--resume"], env_with(tmp), epoch=4)
    try:
        assert any(line.startswith("resumed from") for line in seen), seen

        # Debris is a temp file whose writer is dead. The resumed run's rank 0 may be writing
        # its own next checkpoint at this moment (seen once in CI: its .tmp<pid>, alive).
        def written_now(name: str) -> bool:
            pid = int(name.rpartition(".tmp")[2]) if name.startswith("torch-ddp.pt.") else 0
            return pid > 0 and process_state(pid) not in ("", "Z", "X")

        assert [d for d in leftovers(ck, tmp) if not written_now(d)] == []
    finally:
        os.killpg(resumed.pid, signal.SIGKILL)
        resumed.wait()


def test_sigterm_to_the_job_stops_the_workers_and_records_interrupted(tmp_path):
    # As a scheduler (scancel) or the harness cancels a job: SIGTERM to every process of it,
    # workers included. (SIGTERM to the parent alone, and SIGINT: the in-process test below.)
    out, ck, tmp = tmp_path / "run.json", tmp_path / "ck", tmp_path / "tmp"
    args = [*LONG_DDP, "--output", str(out), "--checkpoint-dir", str(ck)]
    # Epoch 3 printed: epoch 2 has surely reached the parent (a rank 0 killed between printing
    # an epoch and reporting it loses that one epoch).
    proc, _ = start_and_wait_for_epoch(args, env_with(tmp), epoch=3)
    workers = children(proc.pid)
    os.killpg(proc.pid, signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]  # (torch's DDP FutureWarning aside)
    assert stderr.strip().splitlines()[-1] == (
        "python -m frameworks.torch_ddp: interrupted by SIGTERM; the record keeps the epochs "
        "measured so far"
    )
    assert gone(workers)
    rec = read_json(out)
    assert rec["status"] == "interrupted" and rec["error"] == "interrupted by SIGTERM"
    assert len(rec["epochs"]) >= 2
    assert leftovers(ck, tmp) == []


def test_ctrl_c_while_the_workers_start_is_one_line_not_their_tracebacks(tmp_path):
    """Ctrl-C reaches the whole process group, the workers too while they still import torch
    (independent battery for #41, wave 3: a KeyboardInterrupt traceback from each, or a C++
    'terminate called ... KeyboardInterrupt', and the run failed). They start with SIGINT
    blocked until they ignore it; the parent stops them: one line, exit 130."""
    proc = subprocess.Popen(
        [PY, "-m", "frameworks.torch_ddp", *LONG_DDP], cwd=ROOT, env=env_with(tmp_path / "tmp"),
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        workers: list[int] = []
        while len(workers) < 2 and time.monotonic() < deadline and proc.poll() is None:
            workers = [  # (multiprocessing's resource tracker is a child too)
                p for p in children(proc.pid)
                if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
            ]  # fmt: skip
            time.sleep(0.02)
        assert len(workers) == 2, proc.communicate()[1][-3000:]
        for worker in workers:  # Ctrl-C's SIGINT, as it reaches them while they start
            os.kill(worker, signal.SIGINT)
        time.sleep(1.0)
        assert [process_state(w) not in ("", "Z", "X") for w in workers] == [True, True]
        os.killpg(proc.pid, signal.SIGINT)
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr, stderr[-3000:]
    assert (
        stderr.strip()
        .splitlines()[-1]
        .startswith("python -m frameworks.torch_ddp: interrupted by SIGINT")
    ), stderr[-3000:]
    assert gone(workers)


# ---- interrupted single-process trainers (in-process) --------------------------------------


def test_sigterm_in_a_trainer_keeps_its_epochs_as_interrupted(tmp_path):
    from common.results import RunRecorder
    from common.trainer import keep_measured_epochs, run_main

    out = tmp_path / "run.json"

    def train(cfg):
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

    def before_the_loop(cfg):  # interrupted while loading data or compiling
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(5)
        return {"status": "ok"}

    assert run_main(argv, "torch-dp", check=lambda cfg: None, train=before_the_loop) == 130
    rec = read_json(out)
    assert rec["status"] == "interrupted" and rec["epochs"] == []


# ---- one run per checkpoint directory -------------------------------------------------------


def test_a_second_run_on_a_locked_checkpoint_dir_is_refused(tmp_path, monkeypatch):
    from common.checkpoints import lock_checkpoint_dir

    cfg = preset("smoke", checkpoint_dir=str(tmp_path / "ck"), resume=True)
    held = lock_checkpoint_dir(cfg)
    try:
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} "):
            lock_checkpoint_dir(cfg)
        out = tmp_path / "run.json"
        bad = run_trainer(
            "torch-dp", *SMOKE, "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
            "--output", str(out),
        )  # fmt: skip
        one_line_error(bad, "is in use by another run", "use another --checkpoint-dir")
        assert not out.exists() and sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".lock"]
        import fcntl

        monkeypatch.setattr(fcntl, "flock", lambda *a: None)  # injected: no lock at all
        lock_checkpoint_dir(cfg).close()  # the race the lock prevents goes unnoticed
    finally:
        held.close()
    lock_checkpoint_dir(cfg).close()  # released: the next run may take it


# ---- resume: same run, true records ---------------------------------------------------------


def test_resume_refuses_other_hyper_parameters_and_fewer_epochs(tmp_path):
    from common.checkpoints import CHECKPOINT_FORMAT, check_resume

    ck = tmp_path / "ck.pt"
    ck.write_text("")
    base = preset("smoke", checkpoint_dir=str(tmp_path), resume=True, epochs=4)
    saved = json.loads(json.dumps(base.to_dict()))  # as a JSON checkpoint keeps it: lists
    rows = [{"epoch": e, "images": 96} for e in (1, 2)]  # 4 steps of 24 per epoch
    meta = {"format": CHECKPOINT_FORMAT, "config": saved, "epoch": 2, "step": 8,
            "recorder": {"epochs": rows}}  # fmt: skip
    check_resume(base, ck, lambda p, limit: meta)  # the same run (tuples as lists): accepted
    check_resume(base.replace(epochs=7), ck, lambda p, limit: meta)  # constant: may grow
    for change, flag in [
        (dict(lr=0.5), "--lr 0.05 (now 0.5)"),
        (dict(momentum=0.0), "--momentum"),
        (dict(weight_decay=0.0), "--weight-decay"),
        (dict(lr_schedule="step"), "--lr-schedule"),
        (dict(warmup_epochs=1.0), "--warmup-epochs"),
        (dict(label_smoothing=0.1), "--label-smoothing"),
        (dict(max_steps_per_epoch=1), "--max-steps-per-epoch"),
        (dict(batch_size=48, lr_base_batch=48), "--batch-size"),
        (dict(gpus=2), "--gpus 1 (now 2)"),  # the record would mix two device counts' timings
        (dict(precision="bf16"), "--precision"),
        (dict(prefetch=3), "--prefetch"),
        (dict(framework="jax-shard"), "--framework"),
    ]:
        with pytest.raises(ConfigError, match=f"is from another run: .*{re.escape(flag)}"):
            check_resume(base.replace(**change), ck, lambda p, limit: meta)
    with pytest.raises(
        ConfigError, match="after epoch 2 but --epochs is 1; resume with --epochs 2"
    ):
        check_resume(base.replace(epochs=1), ck, lambda p, limit: meta)
    cosine = base.replace(lr_schedule="cosine")
    cos_meta = {**meta, "config": {**saved, "lr_schedule": "cosine"}}
    check_resume(cosine, ck, lambda p, limit: cos_meta)
    with pytest.raises(ConfigError, match="--epochs 4 \\(now 6\\)"):  # cosine spans --epochs
        check_resume(cosine.replace(epochs=6), ck, lambda p, limit: cos_meta)


def test_a_resumed_record_is_true(tmp_path, capsys):
    """torch-dp runs 2 epochs, then a resume with --epochs 1 is refused (one line, nothing
    written), then one with --epochs 3 ends with a record that counts 3 epochs, keeps every
    epoch's LR (a step schedule, read from the schedule) and times neither process's first
    epoch. The trainings run in processes of their own (tests/trainers/test_resume_checks.py's
    torch_ckpt says why); the refusal, which trains nothing, in-process."""
    from common.schedule import lr_table_for
    from frameworks.torch_dp import main

    ck, out = str(tmp_path / "ck"), tmp_path / "run.json"
    sched = ("--lr-schedule", "step", "--lr-step-epochs", "1,2", "--lr-step-factor", "0.5")
    args = [*SMOKE, *sched, "--checkpoint-dir", ck, "--output", str(out)]
    ok(run_trainer("torch-dp", *args, "--epochs", "2"))
    first = read_json(out)
    files = lambda: {p.name: p.stat().st_mtime_ns for p in Path(ck).iterdir() if p.name != ".lock"}  # noqa: E731
    before = files()
    capsys.readouterr()
    assert main([*args, "--epochs", "1", "--resume"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "is after epoch 2 but --epochs is 1; resume with --epochs 2 or more" in line
    assert read_json(out) == first  # nothing written, the checkpoint untouched
    assert files() == before
    ok(run_trainer("torch-dp", *args, "--epochs", "3", "--resume"))
    rec = read_json(out)
    assert rec["config"]["epochs"] == 3 and [e["epoch"] for e in rec["epochs"]] == [1, 2, 3]
    assert rec["epochs"][:2] == first["epochs"]  # the first process's rows, kept as they were
    assert [e["timed"] for e in rec["epochs"]] == [False, True, False]
    assert rec["sec_per_epoch"] == pytest.approx(rec["epochs"][1]["sec"])
    cfg = preset("smoke", lr_schedule="step", lr_step_epochs=(1, 2), lr_step_factor=0.5)
    steps = rec["epochs"][0]["images"] // cfg.batch_size
    table = lr_table_for(cfg.replace(epochs=3), steps)
    assert [e["lr"] for e in rec["epochs"]] == pytest.approx([0.05, 0.025, 0.0125])
    for e in rec["epochs"]:
        assert e["lr"] == pytest.approx(table[(e["epoch"] - 1) * steps])
        assert e["lr_last"] == pytest.approx(table[e["epoch"] * steps - 1])


# ---- the harness ----------------------------------------------------------------------------


def test_harness_kills_the_child_group_on_sighup(tmp_path):
    from benchmarks import harness

    grandchild = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {grandchild}; wait"
    result = {}

    def execute(plan):
        threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGHUP)).start()
        result["child"] = harness.run_child(["bash", "-c", script], tmp_path / "log", 60, tag="t")
        return 130

    before = signal.getsignal(signal.SIGHUP)
    t0 = time.monotonic()
    assert harness.run_tool("t", [], lambda args: None, execute) == 130
    assert time.monotonic() - t0 < 20
    assert result["child"].ended == "interrupted"
    assert gone([int(grandchild.read_text())], within=5)  # the whole group, not the leader only
    assert signal.getsignal(signal.SIGHUP) == before


HARNESS = """
import subprocess, sys, os
env = {**os.environ, "DPBENCH_PARENT_PID": str(os.getpid())}
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], env=env, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
print(child.stdout.readline().strip(), flush=True)
import time; time.sleep(60)
"""

TRAINER = """
import os, signal, sys, time
sys.path.insert(0, {root!r})
from common.runtime import stop_with_harness
def stop(signum, frame):
    open({flag!r}, "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
if {arm}:
    stop_with_harness()
print(os.getpid(), flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("arm", [True, False])
def test_a_trainer_stops_when_its_harness_is_killed(tmp_path, arm):
    flag = tmp_path / "stopped"
    code = TRAINER.format(root=str(ROOT), flag=str(flag), arm=arm)
    tool = subprocess.Popen(
        [sys.executable, "-c", HARNESS, code], stdout=subprocess.PIPE, text=True
    )
    assert tool.stdout is not None
    trainer = int(tool.stdout.readline())
    tool.kill()  # kill -9: the harness cannot kill the group itself
    tool.wait()
    try:
        if arm:
            assert gone([trainer], within=5) and flag.read_text() == "SIGTERM"
        else:  # injected: without the watchdog the trainer trains on, unattended
            time.sleep(1.5)
            assert process_state(trainer) not in ("", "Z") and not flag.exists()
    finally:
        if process_state(trainer) not in ("", "Z"):
            os.kill(trainer, signal.SIGKILL)
