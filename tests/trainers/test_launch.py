"""Launching processes (torch-ddp's ranks: spawned, torchrun's, srun's; JAX's: jax.distributed):
a dead rank is one line naming it, no rank left behind; a bad launch variable is one line, exit
2; a JAX job that never forms ends within --collective-timeout with a record."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
from flax import serialization
from flax.traverse_util import flatten_dict

from common.config import ConfigError, preset
from common.init import initial_state
from common.runtime import free_port
from frameworks.jax_models import from_torch_state
from tests.conftest import (
    CONDITIONED_SEED,
    ROOT,
    SMOKE,
    ok,
    one_line_error,
    payload,
    read_json,
    relative_update_difference,
    run_trainer,
)
from tests.trainers.test_jax_pmap import UPDATE_RTOL

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_", "SLURM_", "JAX_")


def test_a_killed_rank_is_named_in_one_line_and_no_rank_is_left(tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    args = [*SMOKE, "--gpus", "2", "--epochs", "200", "--output", str(out)]
    proc = subprocess.Popen([sys.executable, "-m", "frameworks.torch_ddp", *args], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert proc.stdout is not None
        for line in proc.stdout:  # the ranks are training
            if line.startswith("epoch 1/"):
                break
        kids = psutil.Process(proc.pid).children()  # the ranks, and multiprocessing's tracker
        ranks = [p for p in kids if "spawn_main" in " ".join(p.cmdline())]
        rank0, rank1 = sorted(ranks, key=lambda p: p.pid)  # started in rank order
        # The parent stopped while rank 1 dies: rank 0's error (gloo's "Connection closed by
        # peer") is there too when it looks, and must not be taken for the cause.
        os.kill(proc.pid, signal.SIGSTOP)
        rank1.kill()
        time.sleep(3)
        os.kill(proc.pid, signal.SIGCONT)
        _, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    (line,) = err.strip().splitlines()
    assert f"rank 1 (pid {rank1.pid}) was killed by SIGKILL" in line, line
    assert not rank0.is_running() or rank0.status() == psutil.STATUS_ZOMBIE  # none left behind
    record = read_json(out)
    assert record["status"] == "failed" and "rank 1" in record["error"]


@pytest.mark.parametrize(
    "framework, env, says",
    [
        ("torch-ddp", {"RANK": "0", "WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be an integer"),
        ("jax-pmap", {"JAX_COORDINATOR_ADDRESS": "127.0.0.1:1", "JAX_NUM_PROCESSES": "2",
                      "JAX_PROCESS_ID": "x"}, "JAX_PROCESS_ID='x' must be an integer"),
    ],
)  # fmt: skip
def test_a_launch_variable_that_is_no_integer_is_one_line(framework, env, says, tmp_path):
    bad = run_trainer(framework, *SMOKE, "--output", str(tmp_path / "r.json"), env=env)
    one_line_error(bad, says)


def test_a_jax_job_that_never_forms_ends_within_its_timeout_with_a_record(tmp_path):
    out = tmp_path / "r.json"
    env = {"JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{free_port()}", "JAX_NUM_PROCESSES": "2",
           "JAX_PROCESS_ID": "0"}  # process 0 alone: process 1 never starts  # fmt: skip
    start = time.monotonic()
    proc = run_trainer("jax-pmap", *SMOKE, "--collective-timeout", "3", "--output", str(out),
                       env=env, timeout=120)  # fmt: skip
    assert proc.returncode == 1, proc.stderr[-3000:]  # not XLA's abort (134), with no record
    (line,) = proc.stderr.strip().splitlines()
    assert "did not all join within 3 s" in line, line
    assert time.monotonic() - start < 30  # XLA's own timeout comes 30 s later
    assert read_json(out)["status"] == "failed"


def test_srun_variables_make_the_launch(monkeypatch):
    from frameworks.torch_launch import Launch, launch_env

    env = {k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_VARS)}
    monkeypatch.setattr(os, "environ", env)  # launch_env writes RANK etc.: keep it in here
    assert launch_env() is None  # plain `python -m`: --gpus spawns the processes
    env.update(SLURM_PROCID="5", SLURM_NTASKS="8", SLURM_LOCALID="1", SLURM_NTASKS_PER_NODE="4(x2)")
    with pytest.raises(ConfigError, match="export MASTER_ADDR"):
        launch_env()
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29500")
    assert launch_env() == Launch(rank=5, world=8, local_rank=1, local_world=4)
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("5", "8", "1")  # for env://


def test_collective_timeout_is_range_checked():
    with pytest.raises(ConfigError, match="--collective-timeout must be between 1 and"):
        preset("smoke", collective_timeout=0.0)


def test_torchrun_two_nodes_one_process_each_on_loopback(tmp_path):
    port, out = free_port(), tmp_path / "rec.json"
    torchrun = [str(ROOT / ".venv" / "bin" / "torchrun"), "--nnodes=2", "--nproc-per-node=1",
                f"--rdzv-endpoint=127.0.0.1:{port}"]  # fmt: skip
    args = ["-m", "frameworks.torch_ddp", *SMOKE, "--epochs", "1", "--max-steps-per-epoch", "2",
            "--output", str(out)]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    procs = [subprocess.Popen([*torchrun, f"--node-rank={node}", *args], cwd=ROOT, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for node in (0, 1)]  # fmt: skip
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stdout + stderr[-4000:]
    rec = read_json(out)
    assert rec["status"] == "ok" and rec["devices"] == rec["config"]["gpus"] == 2  # not --gpus
    assert rec["test_examples"] == 10
    assert results[1][0].strip() == ""  # only rank 0 prints


# One step with global-batch BN, the seed whose first step has no near-tie (conftest.py).
ONE_STEP = (*SMOKE, "--seed", str(CONDITIONED_SEED), "--bn", "sync", "--epochs", "1")
ONE_STEP += ("--max-steps-per-epoch", "1")


def test_two_jax_processes_of_two_devices_equal_one_device(tmp_path: Path) -> None:
    """2 processes x 2 simulated CPU devices joined through jax.distributed, as two hosts run
    it: one step over the 4 devices equals the 1-device step, every test image counts once,
    only process 0 prints and writes."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1",
               "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}", "JAX_NUM_PROCESSES": "2",
               "JAX_PROCESS_ID": str(rank)}  # fmt: skip
        env.pop("XLA_FLAGS", None)  # main() sets the per-process device count (--gpus 2)
        args = [sys.executable, "-m", "frameworks.jax_shard", *ONE_STEP, "--gpus", "2",
                "--checkpoint-dir", str(tmp_path / f"ckpt{rank}"),
                "--output", str(tmp_path / f"record{rank}.json")]  # fmt: skip
        procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))  # fmt: skip
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=400))
        finally:
            p.kill()
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    assert "epoch 1/1" in outs[0][0] and "epoch 1/1" not in outs[1][0]  # only process 0 prints
    assert not (tmp_path / "record1.json").exists() and not (tmp_path / "ckpt1").exists()
    record = read_json(tmp_path / "record0.json")
    assert record["devices"] == 4 and record["status"] == "ok"
    assert record["test_examples"] == record["test_set_size"] == 10
    ckpt = serialization.msgpack_restore(payload(tmp_path / "ckpt0" / "jax-shard.msgpack"))
    assert int(ckpt["state"]["step"]) == 1
    # One step of two different programs (4 devices in 2 processes, 1 device): their updates
    # agree to float rounding (see UPDATE_RTOL), relative to the update.
    ref = tmp_path / "one"  # the same first global batch on one device
    ok(run_trainer("jax-pmap", *ONE_STEP, "--gpus", "1", "--checkpoint-dir", str(ref)))
    one = serialization.msgpack_restore(payload(ref / "jax-pmap.msgpack"))["state"]
    arrays, _ = initial_state(preset("smoke", seed=CONDITIONED_SEED), 3, 10)
    diff = relative_update_difference(flatten_dict(from_torch_state(arrays)["params"]),
                                      flatten_dict(ckpt["state"]["params"]),
                                      flatten_dict(one["params"]))  # fmt: skip
    assert diff <= UPDATE_RTOL
