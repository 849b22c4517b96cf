"""Hostile processes (issue 15, items 1, 9, 10): a cancelled run stops, records stay true after
a resume, a stuck rank is named, and nothing is left behind.

- a worker dies with its parent (parent-death signal); a stopped run:
  tests/trainers/test_stop_signals.py;
- a SIGSTOPped rank: the run fails after --collective-timeout, naming the stopped rank;
- `--checkpoint-dir` is locked: a second run on it is refused (one line, exit 2);
- `--resume` with other hyper-parameters, or `--epochs` below the checkpoint's epoch: refused;
  a resumed record keeps every epoch's LR, counts its epochs right, and times no warm-up epoch;
- stale SLURM / MASTER_ADDR variables: one line instead of a hang.

Each mechanism is also shown to matter: the same check run with it disabled (injected) fails.
"""

from __future__ import annotations

import json
import math
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from common.config import ConfigError, preset
from common.runtime import process_alive
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
        if not any(process_alive(p) for p in pids):
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


def test_a_stopped_rank_is_named_after_the_collective_timeout(tmp_path):
    out, tmp = tmp_path / "run.json", tmp_path / "tmp"
    args = [*LONG_DDP, "--collective-timeout", "3", "--output", str(out)]
    proc, _ = start_and_wait_for_epoch(args, env_with(tmp))
    ranks = [
        p
        for p in children(proc.pid)
        if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text(errors="replace")
    ]
    assert len(ranks) == 2
    stopped = max(ranks)  # rank 1, started second (either would do)
    os.kill(stopped, signal.SIGSTOP)
    t0 = time.monotonic()
    _, stderr = proc.communicate(timeout=120)
    assert time.monotonic() - t0 < 60  # the timeout, not the 10 minutes it used to be
    assert proc.returncode == 1
    assert "Traceback" not in stderr, stderr[-3000:]  # rank 0's timeout is only the echo
    last = stderr.strip().splitlines()[-1]
    named = re.search(
        rf"waited 3 s \(--collective-timeout\) for rank \d \(pid {stopped}, stopped\)", last
    )
    assert named, last
    rec = read_json(out)
    assert rec["status"] == "failed" and named.group() in rec["error"]
    assert len(rec["epochs"]) >= 2  # the epochs measured before it stopped
    assert gone(ranks)
    assert leftovers(tmp) == []  # no pytorch-errorfile-*.pickle, no temp directory


# ---- the parent-death mechanism, and that the tests above would see it missing ---------------

ORPHAN = """
import os, sys, time
sys.path.insert(0, {root!r})
from multiprocessing import Pipe
from common.runtime import die_with_parent
mode = sys.argv[1]
if mode == "kernel":
    die_with_parent(int(sys.argv[2]))
print("armed", flush=True)
time.sleep(60)
"""

PARENT = """
import subprocess, sys, time, os
child = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2], str(os.getpid())],
                         stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize("mode", ["kernel", "injected-none"])
def test_a_worker_dies_with_its_parent(mode):
    code = ORPHAN.format(root=str(ROOT))
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, code, mode], stdout=subprocess.PIPE, text=True
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    try:
        if mode == "injected-none":  # the bug: a worker that does not watch its parent
            time.sleep(1.5)
            assert process_alive(child)  # the orphan lives on
        else:
            assert gone([child], within=5.0)
    finally:
        if process_alive(child):
            os.kill(child, signal.SIGKILL)


# ---- interrupted single-process trainers (in-process) --------------------------------------


@pytest.mark.parametrize("sigint", ["inherited", "ignored"])
def test_a_worker_forked_inside_train_dies_of_its_pools_terminate(sigint, request, monkeypatch):
    """A DataLoader's or Pool's worker forked inside `train` gets the signal handlers from before
    run_main (common.interrupts._restore_signals_in_child): the parent's would make it raise
    Interrupted through its copy of the parent's stack and ignore the next SIGTERM, so that its
    pool's terminate() could wait for ever (d2l-mxnet's DataLoader did once, in CI). "ignored":
    as in a background job (`(bash scripts/test.sh &)`, nohup), started with SIGINT ignored (the
    hostile sweep's case of issue 29, group 5)."""
    import common.interrupts as interrupts
    from common.interrupts import interruptible

    def child_handlers() -> tuple[object, object]:
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report its handlers, then leave at once
            handlers = [signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)]
            os.write(write, json.dumps([repr(h) for h in handlers]).encode())
            os._exit(0)
        os.close(write)
        os.waitpid(pid, 0)
        with os.fdopen(read) as f:
            return tuple(json.loads(f.read()))

    # What the child must get back: the handlers from before, whatever they are. From a
    # terminal, SIG_DFL and Python's default_int_handler; in a background job of a
    # non-interactive shell (`(bash scripts/test.sh &)`) SIGINT comes ignored, and the child
    # keeps it ignored as its shell meant.
    monkeypatch.setattr(interrupts, "_BEFORE", {})  # as in a new process (the first entry keeps it)
    if sigint == "ignored":
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        request.addfinalizer(lambda: signal.signal(signal.SIGINT, previous))
    before = tuple(repr(signal.getsignal(s)) for s in (signal.SIGTERM, signal.SIGINT))
    assert "_raise_interrupted" not in str(before)
    with interruptible():
        assert child_handlers() == before
        # The check fails without the hook: given no signals to restore, it restores nothing,
        # and the child keeps the parent's handler.
        monkeypatch.setattr(interrupts, "STOP_SIGNALS", ())
        assert "_raise_interrupted" in child_handlers()[0]
    # A real pool: its terminate() ends a worker idle in the task queue, and returns. In a
    # process of its own, as a trainer's: a pool forked from this test worker copies its other
    # threads' locks (execnet's, JAX's), and a worker that exits flushes the std streams (it hung
    # once in CI under load, with the hook in place).
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([str(MAIN_PYTHON), "-c", POOL_TERMINATE, sigint], env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 0 and proc.stdout.strip() == "terminated", proc.stderr[-2000:]


POOL_TERMINATE = """
import multiprocessing, os, signal, sys, threading
from common import interrupts
if sys.argv[1] == "ignored":
    signal.signal(signal.SIGINT, signal.SIG_IGN)
with interrupts.interruptible():
    pool = multiprocessing.get_context("fork").Pool(2)
    assert pool.apply(os.getpid) != os.getpid()
    done = threading.Event()
    threading.Thread(target=lambda: (pool.terminate(), done.set()), daemon=True).start()
    print("terminated" if done.wait(30) else "pool.terminate() did not return", flush=True)
"""


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


# ---- stale launch variables -----------------------------------------------------------------


def test_stale_slurm_and_master_variables_are_one_line(monkeypatch):
    from common.runtime import stale_launch_env
    from frameworks.torch_launch import check_master_addr

    for var in [v for v in os.environ if v.startswith("SLURM_")]:
        monkeypatch.delenv(var)
    assert stale_launch_env() is None
    monkeypatch.setenv("SLURM_NTASKS", "4")  # a salloc shell: no srun task
    assert "not started by srun" in stale_launch_env()
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_STEP_ID", "3")  # what srun gives each task
    assert stale_launch_env() is None
    with pytest.raises(ConfigError, match="MASTER_ADDR=192.0.2.7 is not this host"):
        check_master_addr("192.0.2.7", rank0=True)  # another job's first node
    check_master_addr("192.0.2.7", rank0=False)  # the other ranks connect to it
    check_master_addr("127.0.0.1", rank0=True)


def test_stale_slurm_refused_by_a_trainer_in_one_line(tmp_path, monkeypatch):
    out = tmp_path / "r.json"
    env = {"SLURM_NTASKS": "2", "SLURM_PROCID": "0"}  # no SLURM_STEP_ID: not srun's
    bad = run_trainer("torch-ddp", *SMOKE, "--gpus", "2", "--output", str(out), env=env)
    one_line_error(bad, "SLURM_NTASKS=2 is set but this process was not started by srun")
    assert not out.exists()
    from frameworks.jax_launch import init_distributed  # (JAX: the same check, in-process

    for var, value in env.items():
        monkeypatch.setenv(var, value)
    monkeypatch.delenv("SLURM_STEP_ID", raising=False)
    monkeypatch.delenv("JAX_COORDINATOR_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="not started by srun"):
        init_distributed(5)  # before jax.distributed.initialize would wait for task 1


def test_collective_timeout_is_range_checked():
    for bad in (0.0, -5.0, math.nan, math.inf, 1e9):
        with pytest.raises(ConfigError, match="--collective-timeout must be between 1 and"):
            preset("smoke", collective_timeout=bad)
    assert preset("smoke").collective_timeout == 300.0


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

    from frameworks.jax_launch import check_coordinator_here

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        address = f"127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(ConfigError, match="cannot listen on it .*choose a free port"):
            check_coordinator_here(address)
    check_coordinator_here(address)  # free again
