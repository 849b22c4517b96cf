"""The contract every trainer keeps, checked on each of the six through its command line (its own
interpreter: MXNet's is .venv-mxnet/bin/python):

- killed after epoch 1 (DPBENCH_FAIL=<framework>@1) and resumed, a `--pipeline device` run
  (crops gathered on the devices) ends with exactly the uninterrupted `--pipeline host` run's
  weights, optimiser state and per-epoch train losses (bitwise), and crops one pixel off
  would break it; a checkpoint of another run is refused in one line;
- an N-device step equals the 1-device step on the same global batch (two different programs:
  one step, compared on the update, see UPDATE_RTOL); torch-ddp's phase-timed step (its own
  all-reduce) equals its DDP step;
- a crash inside the training loop leaves a "failed" record, exit 1, with the epochs measured;
- real digits are learnt far above chance, and the record says how the run went.

Bad input (refused in common/ before a framework loads): tests/trainers/test_bad_input.py.
"""

from __future__ import annotations

import io
import json
import math
import os
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import (
    CONDITIONED_SEED,
    FRAMEWORKS,
    MXNET_PYTHON,
    SMOKE,
    TENSORBOARD_MISSING,
    module_of,
    ok,
    one_line_error,
    payload,
    python_for,
    read_json,
    relative_update_difference,
    run_python,
    run_trainer,
    skip_without_interpreter,
)
from tests.trainers.test_tensorboard import assert_events_match_record

# One step of two different programs (N devices vs 1): the updates from the same weights may
# differ by float32 rounding only (reduction order; XLA and oneDNN choose differently per CPU).
# Measured on one step of the smoke model, over all parameters and BN statistics: about 1e-5 of
# the update. 1e-3 leaves a wide margin for other CPUs; per-device BN statistics or a doubled
# gradient reduction move the update by 1e-1 to 1.
UPDATE_RTOL = 1e-3

# Killed and resumed: WideResNet with dropout (the masks must be redrawn identically after the
# restart) and a cosine schedule (the LR must continue where it stopped), 2 epochs of 2 steps.
RESUME_ARGS = (*SMOKE, "--gpus", "2", "--epochs", "2", "--max-steps-per-epoch", "2",
               "--model", "wideresnet", "--width", "0.05", "--dropout", "0.3",
               "--lr-schedule", "cosine")  # fmt: skip
# The same run with its batches made on the devices (crops gathered there): it must train
# exactly as the host pipeline's (`--pipeline auto` on a CPU).
DEVICE_RESUME_ARGS = (*RESUME_ARGS, "--pipeline", "device")
ONE_STEP_ARGS = (*SMOKE, "--seed", str(CONDITIONED_SEED),  # see its comment in conftest.py
                 "--epochs", "1", "--max-steps-per-epoch", "1")  # fmt: skip

# Runs a trainer's main() with its fault injection replaced by an exception after epoch 1 (inside
# the training loop, after the checkpoint): DPBENCH_FAIL can only raise at start-up or kill.
CRASH_IN_LOOP = """
import sys
from importlib import import_module

trainer = import_module(sys.argv[1])


def injected_failure(framework, epoch=None):
    if epoch == 1:
        raise RuntimeError("crash inside the training loop (test)")


import common.run  # noqa: E402  (the trainers' Run calls the failure hook)

common.run.injected_failure = injected_failure
sys.exit(trainer.main(sys.argv[2:]))
"""

# MXNet checkpoint -> .npz of its weights and optimiser states (run by the MXNet interpreter).
MXNET_DUMP = """
import json, sys
from pathlib import Path

import mxnet as mx
import numpy as np

index = Path(sys.argv[1])
ckpt = json.loads(index.read_text())
arrays = {k: v.asnumpy() for k, v in mx.nd.load(str(index.with_name(ckpt["params"]))).items()}
states = mx.nd.load(str(index.with_name(ckpt["states"])))  # named NDArrays, no pickle
arrays.update({f"optimizer/{k}": v.asnumpy() for k, v in states.items()})
np.savez(sys.argv[2], **arrays)
"""


def framework_params() -> list[Any]:
    return [pytest.param(fw, id=fw) for fw in FRAMEWORKS]


def checkpoint(framework: str, ckpt_dir: Path) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """Every array of a framework's checkpoint (weights, BN statistics, optimiser state) by
    name, and its metadata {"epoch", "step", ...}."""
    if framework.startswith("torch"):
        import torch

        ckpt = torch.load(io.BytesIO(payload(ckpt_dir / f"{framework}.pt")), weights_only=True)
        arrays = {k: v.numpy() for k, v in ckpt["model"].items()}
        for i, state in ckpt["optimizer"]["state"].items():
            arrays.update({f"optimizer/{i}/{k}": np.asarray(v) for k, v in state.items()})
        return arrays, ckpt
    if framework.startswith("jax"):
        from flax import serialization, traverse_util

        ckpt = serialization.msgpack_restore(payload(ckpt_dir / f"{framework}.msgpack"))
        arrays = traverse_util.flatten_dict(ckpt["state"], sep="/")
        return {k: np.asarray(v) for k, v in arrays.items()}, json.loads(ckpt["meta"])
    index = ckpt_dir / f"{framework}.json"
    dump = ckpt_dir.parent / f"{ckpt_dir.name}-dump.npz"
    ok(run_python(MXNET_PYTHON, "-c", MXNET_DUMP, str(index), str(dump)))
    with np.load(dump) as f:
        return {k: f[k] for k in f.files}, read_json(index)


def assert_same_arrays(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def differs(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> bool:
    return any(not np.array_equal(a[k], b[k]) for k in a)


def assert_threads_rule(rec: dict[str, Any]) -> None:
    """The threads rule on a CPU (common/runtime.py's threads_record): the run's C cores (those
    it may run on) filled, at least one thread per device; JAX's pool is XLA's own."""
    threads, devices = rec["threads"], rec["devices"]
    cores = threads["cores"]
    assert cores == len(os.sched_getaffinity(0))  # this test's cores, which the run inherits
    if threads["per_device"] is not None:  # a process or an OpenMP team per device
        assert threads["per_device"] == max(1, cores // devices)
        assert threads["total"] == threads["per_device"] * devices
    else:  # torch-dp's one process (1 device on a CPU), XLA:CPU's one pool
        assert threads["total"] == max(cores, devices)


def final_state(path: Path) -> dict[str, np.ndarray]:
    """A run's --save-state file: its final weights, BN statistics and optimiser state."""
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


@pytest.fixture(scope="module")
def full_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`run(framework)` -> the folder of RESUME_ARGS's uninterrupted run (`--pipeline auto`:
    the host pipeline on a CPU), made once per module: ckpt/ (its checkpoint), record.json and
    state.npz (--save-state). The kill/resume test resumes a killed `--pipeline device` run
    to it. The JAX runs share the session's compilation cache (conftest's HOME): the killed
    and resumed runs load its programs."""
    made: dict[str, Path] = {}

    def run(framework: str) -> Path:
        if framework not in made:
            where = tmp_path_factory.mktemp(f"{framework}-full")
            ok(
                run_trainer(
                    framework,
                    *RESUME_ARGS,
                    *("--checkpoint-dir", str(where / "ckpt")),
                    *("--output", str(where / "record.json")),
                    *("--save-state", str(where / "state.npz")),
                )
            )
            made[framework] = where
        return made[framework]

    return run


@pytest.mark.parametrize("framework", framework_params())
def test_kill_resume_on_the_device_pipeline_ends_with_the_uninterrupted_host_weights(
    framework: str, tmp_path: Path, full_runs: Any
) -> None:
    """Killed after epoch 1 and resumed, a `--pipeline device` run (crops gathered on the
    devices) ends with exactly the uninterrupted `--pipeline host` run's weights, optimiser
    state and per-epoch losses, bitwise: one comparison for two promises, each of which alone
    would break it (a resume that loses or repeats anything; batches that reach other devices,
    or crops that differ: the normalisation is the same float32 operations on both paths). The
    batch-level equality of the two pipelines and its failure modes are in
    tests/trainers/test_device_pipeline.py; that this comparison fails on crops one pixel off
    (DPBENCH_INJECT=crop-shift@device-pipeline, in common/pipeline.py: the same for every
    framework) is shown once, with the cheapest."""
    skip_without_interpreter(framework)
    full_dir = full_runs(framework)
    assert read_json(full_dir / "record.json")["pipeline"].startswith("host")
    killed = run_trainer(
        framework,
        *DEVICE_RESUME_ARGS,
        "--checkpoint-dir",
        str(tmp_path / "cut"),
        "--output",
        str(tmp_path / "cut.json"),
        env={"DPBENCH_FAIL": f"{framework}@1"},
    )
    assert "epoch 2/2" not in killed.stdout
    if framework in ("torch-ddp", "torch-fsdp"):
        # Its ranks are children of the launching process, which marks the run failed and keeps
        # the epochs rank 0 measured.
        assert killed.returncode == 1, killed.stderr[-2000:]
        rec = read_json(tmp_path / "cut.json")
        assert rec["status"] == "failed" and [e["epoch"] for e in rec["epochs"]] == [1]
    else:  # os._exit(17) in the one process: nothing ran after the checkpoint
        assert killed.returncode == 17, killed.stderr[-2000:]
        assert not (tmp_path / "cut.json").exists()
    after_epoch_1, meta = checkpoint(framework, tmp_path / "cut")
    assert meta["epoch"] == 1 and meta["step"] == 2

    resumed = run_trainer(
        framework,
        *DEVICE_RESUME_ARGS,
        "--checkpoint-dir",
        str(tmp_path / "cut"),
        "--resume",
        "--output",
        str(tmp_path / "cut.json"),
        "--save-state",
        str(tmp_path / "cut.npz"),
    )
    ok(resumed)
    assert "resumed from" in resumed.stdout and "epoch 1/2" not in resumed.stdout
    full, full_meta = checkpoint(framework, full_dir / "ckpt")
    cut, cut_meta = checkpoint(framework, tmp_path / "cut")
    assert full_meta["epoch"] == cut_meta["epoch"] == 2
    assert full_meta["step"] == cut_meta["step"] == 4
    assert any(k.startswith("optimizer/") for k in full) or framework.startswith("jax")
    assert_same_arrays(cut, full)  # weights, BN statistics, optimiser state: bitwise
    assert_same_arrays(final_state(tmp_path / "cut.npz"), final_state(full_dir / "state.npz"))
    # The comparison can fail: the checkpoint after epoch 1 (what a resume that skipped
    # epoch 2, or restarted at the wrong epoch, would have ended with) is not the final one.
    assert differs(after_epoch_1, full)
    a, b = read_json(full_dir / "record.json"), read_json(tmp_path / "cut.json")
    assert b["pipeline"].startswith("device")
    assert [e["epoch"] for e in b["epochs"]] == [1, 2]  # epoch 1 from the checkpoint
    assert [e["train_loss"] for e in b["epochs"]] == [e["train_loss"] for e in a["epochs"]]
    assert a["epochs"][0]["train_loss"] != a["epochs"][1]["train_loss"]
    if framework == "mxnet-gluon":  # older epochs' weight files are removed (.lock: the lock)
        assert sorted(p.name for p in (tmp_path / "cut").iterdir() if p.name != ".lock") == [
            "mxnet-gluon-epoch2.params",
            "mxnet-gluon-epoch2.states",
            "mxnet-gluon.json",
        ]

    # A checkpoint of another run is refused with one line naming the difference.
    other = ["0.1" if a == "0.05" else a for a in DEVICE_RESUME_ARGS]  # --width 0.1
    one_line_error(
        run_trainer(framework, *other, "--checkpoint-dir", str(tmp_path / "cut"), "--resume"),
        "--width 0.05 (now 0.1)",
    )


@pytest.fixture(scope="module")
def one_step_runs(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """`run(framework, devices)` -> (process, record, checkpoint dir) of one step on the first
    global batch, made once per module. The 1-device run goes through CRASH_IN_LOOP: it raises
    after epoch 1, i.e. after its record row and checkpoint; the N-device test reads its
    checkpoint, the crash test its record."""
    made: dict[tuple[str, int], tuple[subprocess.CompletedProcess[str], Any, Path]] = {}

    def run(framework: str, devices: int) -> tuple[subprocess.CompletedProcess[str], Any, Path]:
        if (framework, devices) not in made:
            where = tmp_path_factory.mktemp(f"{framework}-{devices}")
            bn = "local" if framework == "mxnet-gluon" else "sync"  # MXNet: no sync BN on CPU
            args = [*ONE_STEP_ARGS, "--gpus", str(devices), "--bn", bn, "--checkpoint-dir",
                    str(where / "ckpt"), "--output", str(where / "record.json")]  # fmt: skip
            if devices == 1:
                proc = run_python(
                    python_for(framework), "-c", CRASH_IN_LOOP, module_of(framework), *args
                )
            else:
                proc = run_trainer(framework, *args)
                ok(proc)
            made[framework, devices] = (proc, read_json(where / "record.json"), where / "ckpt")
        return made[framework, devices]

    return run


def initial_arrays(framework: str) -> dict[str, np.ndarray]:
    """The weights every run of the smoke preset starts from (--init shared), named as in the
    framework's checkpoint."""
    from common.config import preset
    from common.init import initial_state

    arrays, _ = initial_state(preset("smoke", seed=CONDITIONED_SEED), 3, 10)  # torch's names
    if framework.startswith("torch"):
        return arrays
    from flax import traverse_util

    from frameworks.jax_models import from_torch_state

    flat = traverse_util.flatten_dict(from_torch_state(arrays), sep="/")
    return {k: np.asarray(v) for k, v in flat.items()}


@pytest.mark.parametrize("framework", framework_params())
def test_n_device_step_equals_1_device_step(framework: str, one_step_runs: Any) -> None:
    if framework == "torch-dp":
        pytest.skip(
            "nn.DataParallel on a CPU-only machine runs one device (test_torch_dp.py checks "
            "that its record says so and that its step equals the SGD step written out)"
        )
    if framework == "mxnet-gluon":
        pytest.skip(
            "--bn sync is refused on CPU contexts and per-context BN statistics make the "
            "2-context step differ by design; tests/mxnet/test_mxnet_gluon.py::"
            "test_n_context_step_equals_one_context_step checks N contexts = 1 with fixed BN"
        )
    _, one_rec, one_dir = one_step_runs(framework, 1)
    _, two_rec, two_dir = one_step_runs(framework, 2)
    assert two_rec["devices"] == 2 and two_rec["device_kind"] == "cpu-simulated"
    assert two_rec["bn_mode"] == "sync" and two_rec["test_examples"] == 10
    assert two_rec["epochs"][0]["train_loss"] == pytest.approx(
        one_rec["epochs"][0]["train_loss"], rel=1e-5
    )
    before = initial_arrays(framework)
    one, _ = checkpoint(framework, one_dir)
    two, _ = checkpoint(framework, two_dir)
    # Parameters and BN running statistics (the helper asserts that the step moved them).
    diff = relative_update_difference(before, two, one)
    assert diff <= UPDATE_RTOL, diff


def test_torch_ddp_phase_timed_step_equals_its_ddp_step(tmp_path: Path, one_step_runs: Any) -> None:
    """With --phase-timing torch-ddp averages the gradients by its own explicit all-reduce
    instead of DDP's (to time the phases apart), which must not change the step: compared with
    the 2-process DDP step above (two programs, bucketed vs one flat all-reduce: the same sums
    in another order, float rounding only)."""
    _, ddp_rec, ddp_dir = one_step_runs("torch-ddp", 2)
    phased_dir, out = tmp_path / "phased", tmp_path / "phased.json"
    args = (*ONE_STEP_ARGS, "--gpus", "2", "--bn", "sync", "--phase-timing")
    ok(run_trainer("torch-ddp", *args, "--checkpoint-dir", str(phased_dir), "--output", str(out)))
    ddp, _ = checkpoint("torch-ddp", ddp_dir)
    phased, _ = checkpoint("torch-ddp", phased_dir)
    diff = relative_update_difference(initial_arrays("torch-ddp"), phased, ddp)
    assert diff <= 1e-4, diff
    rec = read_json(out)
    assert rec["epochs"][0]["train_loss"] == pytest.approx(
        ddp_rec["epochs"][0]["train_loss"], rel=1e-6
    )
    phases = rec["phases_ms_per_step"]
    assert set(phases) == {"data_wait", "h2d", "forward_backward", "allreduce", "optimizer"}
    assert phases["forward_backward"] > 0 and phases["allreduce"] > 0


@pytest.mark.parametrize("framework", framework_params())
def test_crash_inside_the_loop_keeps_the_measured_epochs(
    framework: str, one_step_runs: Any
) -> None:
    skip_without_interpreter(framework)
    proc, rec, ckpt_dir = one_step_runs(framework, 1)
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "failed: RuntimeError: crash inside the training loop" in proc.stderr
    assert rec["status"] == "failed" and "crash inside the training loop" in rec["error"]
    assert [e["epoch"] for e in rec["epochs"]] == [1]
    assert math.isfinite(rec["epochs"][0]["train_loss"]) and rec["test_examples"] == 10
    assert rec["devices"] == 1 and rec["framework"] == framework
    assert ckpt_dir.exists()


@pytest.mark.parametrize("framework", framework_params())
def test_learns_real_digits_and_records_how_it_ran(framework: str, tmp_path: Path) -> None:
    """The digits preset at 1/8 width, 2 devices, 4 epochs: far above chance (0.10) on every
    test image, one epoch line per epoch (process 0 alone prints), and a record that says how
    the run went: the shared start, the threads, the execution mode, the BN mode it used; and
    its TensorBoard curves (--tensorboard; MXNet's written in its own environment), read back
    with TensorBoard's reader, hold the record's values (tests/trainers/test_tensorboard.py)."""
    skip_without_interpreter(framework)
    bn = "sync" if framework == "jax-shard" else "local"  # jax-shard's global-batch BN
    out = tmp_path / "digits.json"
    args = ("--preset", "digits", "--width", "0.125", "--gpus", "2", "--epochs", "4")
    tb = tmp_path / "tb"
    args += () if TENSORBOARD_MISSING else ("--tensorboard", str(tb))
    proc = run_trainer(framework, *args, "--bn", bn, "--output", str(out))
    ok(proc)
    if framework == "torch-ddp":  # not DDP's 4-line note on oneDNN's gradient strides per rank
        assert proc.stderr == "", proc.stderr[-2000:]
    rec = read_json(out)
    assert rec["status"] == "ok" and rec["bn_mode"] == bn
    assert rec["devices"] == (1 if framework == "torch-dp" else 2)  # torch-dp on CPU: 1 replica
    assert rec["test_examples"] == rec["test_set_size"] == 360
    assert rec["test_accuracy"] >= 0.90, rec["epochs"]
    epoch_lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("epoch ")]
    assert len(epoch_lines) == rec["config"]["epochs"] == len(rec["epochs"]) == 4
    assert rec["init"]["mode"] == "shared" and len(rec["init"]["sha256"]) == 64
    assert_threads_rule(rec)
    assert rec["execution"] and rec["float32_precision"] == "fp32 (CPU)"
    assert rec["ran"]["activation_dtype"] == "float32"  # the default fp32, read from the run
    assert rec["pipeline"].startswith("host")  # --pipeline auto on a CPU
    kept, sent = rec["state_bytes_per_device"], rec["collective_bytes_per_step"]
    full = 4 * rec["params"]  # float32 bytes of every parameter
    sharded = framework.endswith("fsdp")  # half on each of 2 devices (an odd-sized array whole)
    assert full / 2 <= kept["params"] <= 0.51 * full if sharded else kept["params"] == full
    assert kept["total"] > 3 * kept["params"]  # params, grads, SGD's momentum, BN buffers
    # 2 ways: DDP's all-reduce sends the grads once; FSDP gathers the params (twice where it
    # reshards after forward) and reduce-scatters the grads; torch-dp on a CPU: 1 replica
    sends = {"torch-dp": 0, "torch-fsdp": 1.5 * full, "jax-fsdp": full}.get(framework, full)
    assert sent["total"] == pytest.approx(sends, rel=0.03)
    assert sent["source"] == "computed from the shardings"
    if framework.startswith("jax"):  # the default XLA:CPU path at 16x16 on 2 devices
        assert rec["execution"].endswith("XLA:CPU (its own code)")  # tests/trainers/test_xla_cpu.py
    assert [e["timed"] for e in rec["epochs"]] == [False, True, True, True]
    written = {"digits.json"} | (set() if TENSORBOARD_MISSING else {"tb"})
    assert {p.name for p in tmp_path.iterdir()} == written  # --profile off: no trace
    assert "profile" not in rec and "breakdown" not in rec
    if TENSORBOARD_MISSING:  # a python without the writer (a GPU machine's own): said by -rs
        pytest.skip(f"the TensorBoard part of this test: {TENSORBOARD_MISSING}")
    assert_events_match_record(tb, rec)  # one event file: process 0 alone writes


def test_the_host_and_device_comparison_fails_on_crops_one_pixel_off(
    tmp_path: Path, full_runs: Any
) -> None:
    """The kill/resume comparison can fail on the device pipeline's batches: torch-dp's
    uninterrupted `--pipeline device` run with its crops one pixel off
    (DPBENCH_INJECT=crop-shift@device-pipeline, in common/pipeline.py: the same code for every
    framework) does not end with the host run's state."""
    host = final_state(full_runs("torch-dp") / "state.npz")
    out = tmp_path / "shifted"
    ok(
        run_trainer(
            "torch-dp",
            *(*DEVICE_RESUME_ARGS, "--output", str(out / "record.json")),
            *("--save-state", str(out / "state.npz")),
            env={"DPBENCH_INJECT": "crop-shift@device-pipeline"},
        )
    )
    assert read_json(out / "record.json")["pipeline"].startswith("device")
    assert differs(final_state(out / "state.npz"), host)
