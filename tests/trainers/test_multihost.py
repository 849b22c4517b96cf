"""Multi-process JAX on one host: 2 processes x 2 simulated CPU devices, joined through
jax.distributed (coordinator on a free loopback port) with Gloo CPU collectives, exactly as two
hosts would run it. One step over the 4 devices must equal the 1-device step, every test image
must be counted once, and only process 0 prints and writes the record and the checkpoint."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from flax import serialization
from flax.traverse_util import flatten_dict

from common.config import preset
from common.init import initial_state
from common.runtime import free_port
from frameworks.jax_models import from_torch_state
from tests.conftest import (
    CONDITIONED_SEED,
    ROOT,
    SMOKE,
    ok,
    payload,
    read_json,
    relative_update_difference,
    run_trainer,
)
from tests.trainers.test_jax_pmap import UPDATE_RTOL

# One step with global-batch BN, the seed whose first step has no near-tie (conftest.py).
ONE_STEP = (*SMOKE, "--seed", str(CONDITIONED_SEED), "--bn", "sync", "--epochs", "1")
ONE_STEP += ("--max-steps-per-epoch", "1")


@pytest.mark.parametrize("framework", ["jax-shard"])
def test_two_processes_of_two_devices_equal_one_device(framework: str, tmp_path: Path) -> None:
    module = f"frameworks.{framework.replace('-', '_')}"
    port = free_port()
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "PYTHONUNBUFFERED": "1",
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": "2",
            "JAX_PROCESS_ID": str(rank),
        }
        env.pop("XLA_FLAGS", None)  # main() sets the per-process device count (--gpus 2)
        args = [sys.executable, "-m", module, *ONE_STEP, "--gpus", "2"]
        args += ["--checkpoint-dir", str(tmp_path / f"ckpt{rank}")]
        args += ["--output", str(tmp_path / f"record{rank}.json")]
        procs.append(
            subprocess.Popen(
                args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
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
    ckpt = serialization.msgpack_restore(payload(tmp_path / "ckpt0" / f"{framework}.msgpack"))
    assert int(ckpt["state"]["step"]) == 1
    # One step of two different programs (4 devices in 2 processes, 1 device): their updates
    # agree to float rounding (see UPDATE_RTOL), relative to the update.
    ref = tmp_path / "one"  # the same first global batch on one device
    ok(run_trainer("jax-pmap", *ONE_STEP, "--gpus", "1", "--checkpoint-dir", str(ref)))
    one = serialization.msgpack_restore(payload(ref / "jax-pmap.msgpack"))["state"]
    arrays, _ = initial_state(preset("smoke", seed=CONDITIONED_SEED), 3, 10)
    diff = relative_update_difference(
        flatten_dict(from_torch_state(arrays)["params"]),
        flatten_dict(ckpt["state"]["params"]),
        flatten_dict(one["params"]),
    )
    assert diff <= UPDATE_RTOL
