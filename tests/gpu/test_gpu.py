"""The trainers and tools on a CUDA GPU, each started as a user starts it (its own process, the
framework's own interpreter), at one GPU, plus the runs that need two where two exist:

- every trainer's smoke run on `--devices cuda` (MXNet: where its build sees the GPU);
- `--devices cpu` still simulates the devices on the CPU although a GPU is visible, and
  `--devices auto` takes the GPU;
- torch-ddp's NCCL process group (a world of one; two GPUs: the step equals the 1-GPU step);
- torch-dp with its device ids (`devices` in the record is the count asked for);
- jax-pmap and jax-shard on the GPU, taking the same step;
- benchmarks.parity at one GPU, every row ok;
- the JAX step cache on the GPU: a second run loads the train step and ends bit for bit where
  the first did;
- benchmarks.compare on a GPU machine chooses the GPU for every run.

The GPU pass runs them (tests/conftest.py; the main pass skips them, and so does a GPU pass
where nvidia-smi lists no GPU), with the CUDA builds in .venv (`bash scripts/setup.sh` on a
machine with an NVIDIA driver):

    DPBENCH_TEST_GPU=1 .venv/bin/python -m pytest tests/gpu/test_gpu.py -rs

NOT YET RUN ON A GPU: written against the trainers' CPU records, and dry-run on the CPU with
`--devices cpu` and the assertions on "cuda:" turned round. Replace this paragraph with the
machine, the result and the time taken once it has run there (aimed at ~3 minutes on one H100;
each JAX process compiles for 10-20 s there).

torch.compile's CUDA graphs on the GPU: tests/gpu/test_gpu_compile.py.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks.parity import TOLERANCE
from tests.conftest import (
    CONDITIONED_SEED,
    FRAMEWORKS,
    MAIN_PYTHON,
    MXNET_PYTHON,
    ROOT,
    SMOKE,
    ok,
    read_json,
    relative_update_difference,
    run_module,
    run_trainer,
    skip_without_interpreter,
    visible_gpus,
)

pytestmark = pytest.mark.gpu

Run = tuple[dict[str, Any], dict[str, np.ndarray]]  # a run's record and its final state

ON_GPU = ("--devices", "cuda")
# One training step from the shared initial weights, at the seed whose first step holds no
# near-tie (conftest.CONDITIONED_SEED): two programs of the same maths then agree to rounding
# (parity on an H200: 1.7e-6 of the update) and parity's one-step tolerance applies. Over the
# smoke preset's 8 steps a 1e-7 difference grows to 1e-2 now and then
# (tests/gpu/test_gpu_compile.py).
ONE_STEP = ("--seed", str(CONDITIONED_SEED), "--epochs", "1", "--max-steps-per-epoch", "1")
STATISTICS = ("running_mean", "running_var", "num_batches_tracked")  # BN buffers, not parameters


def gpu_count() -> int:
    """The GPUs a trainer may use (conftest.visible_gpus: CUDA_VISIBLE_DEVICES honoured)."""
    return len(visible_gpus())


def skip_below(n: int) -> None:
    count = gpu_count()
    if count < n:
        pytest.skip(f"needs {n} GPUs, {count} visible")


def train(framework: str, out: Path, *args: str, env: dict[str, str] | None = None) -> Run:
    """A smoke run of `framework` with `args`, which must succeed: its record and its final
    parameters and BN statistics (--save-state, torch's names). JAX_COMPILATION_CACHE_DIR is
    cleared so that --cache-dir, not the caller's environment, says where JAX's caches are."""
    out.mkdir(parents=True, exist_ok=True)
    record, state = out / "record.json", out / "state.npz"
    proc = run_trainer(
        framework,
        *SMOKE,
        *args,
        *("--output", str(record), "--save-state", str(state)),
        env={"JAX_COMPILATION_CACHE_DIR": "", **(env or {})},
    )
    ok(proc)
    result = read_json(record)
    assert result["status"] == "ok", result.get("error")
    with np.load(state) as f:
        return result, dict(f)


def assert_on_gpu(record: dict[str, Any], devices: int) -> None:
    """The run used `devices` CUDA GPUs, in every part of the record that says where it ran."""
    assert record["device_kind"].startswith("cuda:"), record["device_kind"]
    assert record["devices"] == devices, record["devices"]
    assert not any(cpu in record["execution"] for cpu in ("oneDNN", "XLA:CPU")), record["execution"]


def initial_parameters(record: dict[str, Any]) -> dict[str, np.ndarray]:
    """The parameters the run started from (`--init shared`, the default: one file for every
    framework). Not the BN running statistics: their update does not scale with the LR and
    would hide part of a wrong one (a 20% higher LR moves parameters and statistics together
    by 3%, measured, the parameters alone by 20%); parity checks the statistics."""
    with np.load(ROOT / record["init"]["file"]) as f:
        return {k: f[k] for k in f.files if not k.endswith(STATISTICS)}


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One --cache-dir for this module's JAX runs of the smoke configuration: a second run of
    it, wherever the devices were chosen, loads its programs instead of compiling for 10-20 s."""
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory: pytest.TempPathFactory, jax_cache: Path) -> Callable[[str], Run]:
    """framework -> its smoke run on `--devices cuda --gpus 1`, made once for the module (the
    smoke, NCCL and device-id tests read the same run)."""
    base = tmp_path_factory.mktemp("cuda")
    runs: dict[str, Run] = {}

    def get(framework: str) -> Run:
        if framework not in runs:
            args = (*ON_GPU, "--gpus", "1", "--cache-dir", str(jax_cache))
            runs[framework] = train(framework, base / framework, *args)
        return runs[framework]

    return get


def skip_unless_mxnet_sees_a_gpu() -> None:
    """MXNet 1.9.1's CUDA wheels stop at compute capability 8.x: on Hopper and newer the set-up
    gives .venv-mxnet the CPU build, and the trainer would refuse `--devices cuda`."""
    skip_without_interpreter("mxnet-gluon")
    proc = run_module("benchmarks.device_probe", "mxnet", python=MXNET_PYTHON, timeout=300)
    ok(proc)
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    if not seen["gpus"]:
        pytest.skip(f"MXNet sees no GPU ({seen['detail']}); MXNet 1.9.1 has no GPU build for "
                    "compute capability 9.0+ (Hopper)")  # fmt: skip


# ---- every trainer on the GPU ----------------------------------------------------------------


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_trainer_runs_its_smoke_run_on_the_gpu(
    framework: str, cuda_run: Callable[[str], Run]
) -> None:
    if framework == "mxnet-gluon":
        skip_unless_mxnet_sees_a_gpu()
    record, _ = cuda_run(framework)
    assert_on_gpu(record, 1)
    assert record["device_choice"]["asked"] == "cuda"


# ---- --devices on a GPU machine --------------------------------------------------------------


@pytest.mark.parametrize("framework", ["torch-ddp", "jax-pmap"])
def test_devices_cpu_simulates_the_devices_although_a_gpu_is_visible(
    framework: str, tmp_path: Path
) -> None:
    # --gpus 2 on a 1-GPU machine too: were the GPUs not hidden, the count would be refused.
    record, _ = train(framework, tmp_path, "--devices", "cpu", "--gpus", "2")
    assert record["device_kind"] == "cpu-simulated" and record["devices"] == 2
    if framework == "torch-ddp":
        assert record["process_group"] == "gloo"
    else:
        assert "XLA:CPU" in record["execution"], record["execution"]
    # The user's variables as they were, not the values the pin gave them (and every rank).
    user = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS")}
    assert record["device_choice"] == {"asked": "cpu", "env": user}


@pytest.mark.parametrize("framework", ["torch-ddp", "jax-pmap"])
def test_devices_auto_takes_the_gpu(framework: str, tmp_path: Path, jax_cache: Path) -> None:
    record, _ = train(framework, tmp_path, "--devices", "auto", "--gpus", "1",
                      "--cache-dir", str(jax_cache))  # fmt: skip
    assert_on_gpu(record, 1)
    assert record["device_choice"]["asked"] == "auto"


# ---- torch-ddp over NCCL, torch-dp's device ids ----------------------------------------------


def test_torch_ddp_joins_an_nccl_group_of_one(cuda_run: Callable[[str], Run]) -> None:
    # At one GPU create_train_state leaves the model unwrapped (DDP would average nothing): what
    # runs over NCCL here is the process group and the epoch's all-reduces of the metrics.
    record, _ = cuda_run("torch-ddp")
    assert record["process_group"] == "nccl"
    assert_on_gpu(record, 1)


def test_torch_ddp_averages_over_nccl_on_two_gpus(tmp_path: Path) -> None:
    """DDP's gradient all-reduce over NCCL: with SyncBatchNorm (--bn sync) two GPUs' step on a
    global batch is the 1-GPU step on it, to rounding."""
    skip_below(2)
    record, _ = train("torch-ddp", tmp_path / "smoke", *ON_GPU, "--gpus", "2")
    assert record["process_group"] == "nccl"
    assert_on_gpu(record, 2)
    one, one_state = train("torch-ddp", tmp_path / "1", *ON_GPU, "--gpus", "1", "--bn", "sync",
                           *ONE_STEP)  # fmt: skip
    two, two_state = train("torch-ddp", tmp_path / "2", *ON_GPU, "--gpus", "2", "--bn", "sync",
                           *ONE_STEP)  # fmt: skip
    assert_on_gpu(two, 2)
    assert relative_update_difference(initial_parameters(one), two_state, one_state) < TOLERANCE


@pytest.mark.parametrize("gpus", [1, 2])
def test_torch_dp_drives_the_gpus_asked_for(
    gpus: int, tmp_path: Path, cuda_run: Callable[[str], Run]
) -> None:
    skip_below(gpus)
    if gpus == 1:
        record, _ = cuda_run("torch-dp")
    else:
        record, _ = train("torch-dp", tmp_path, *ON_GPU, "--gpus", str(gpus))
    assert_on_gpu(record, gpus)  # device_ids 0..gpus-1: one replica per GPU


# ---- jax-pmap and jax-shard on the GPU -------------------------------------------------------


@pytest.mark.parametrize("framework", ["jax-pmap", "jax-shard"])
def test_jax_trainers_run_on_two_gpus(framework: str, tmp_path: Path) -> None:
    skip_below(2)
    record, _ = train(framework, tmp_path, *ON_GPU, "--gpus", "2")
    assert_on_gpu(record, 2)


@pytest.mark.parametrize("gpus", [1, 2])
def test_pmap_and_sharding_take_the_same_step_on_the_gpu(gpus: int, tmp_path: Path) -> None:
    """One program per device (pmap) and one SPMD program over the mesh (jit with shardings),
    both with per-device BatchNorm: the same update from the same weights and batch."""
    skip_below(gpus)
    pmap, pmap_state = train("jax-pmap", tmp_path / "pmap", *ON_GPU, "--gpus", str(gpus),
                             *ONE_STEP)  # fmt: skip
    shard, shard_state = train("jax-shard", tmp_path / "shard", *ON_GPU, "--gpus", str(gpus),
                               *ONE_STEP)  # fmt: skip
    assert_on_gpu(pmap, gpus)
    assert_on_gpu(shard, gpus)
    assert pmap["init"]["sha256"] == shard["init"]["sha256"]
    assert relative_update_difference(initial_parameters(pmap), shard_state, pmap_state) < TOLERANCE


# ---- the tools on the GPU --------------------------------------------------------------------


def test_parity_holds_at_one_gpu(tmp_path: Path) -> None:
    # Its defaults are already its smallest workload: 1 step, width 0.125, 16x16, batch 32.
    # Its 4 runs (torch-ddp is the reference) at once on the one GPU: JAX does not pre-allocate
    # (conftest sets XLA_PYTHON_CLIENT_PREALLOCATE=false, and parity does with --jobs > 1).
    out = tmp_path / "parity"
    frameworks = ("torch-dp", "jax-pmap", "jax-shard")
    proc = run_module(
        "benchmarks.parity",
        *("--gpus", "1", "--frameworks", ",".join(frameworks), "--models", "resnet18"),
        *("--bn", "local", *ON_GPU, "--jobs", "4", "--out", str(out)),
        python=MAIN_PYTHON,
    )
    ok(proc)
    rows = read_json(out / "parity.json")
    assert sorted(r["framework"] for r in rows) == sorted(frameworks)
    for r in rows:
        assert r["ok"] is True and r["status"] == "ok", r
    records = [read_json(p) for p in sorted((out / "runs").glob("*.json"))]
    assert len(records) == 4  # the three and the reference
    for record in records:
        assert_on_gpu(record, 1)


def test_compare_chooses_the_gpu_for_every_run(tmp_path: Path, jax_cache: Path) -> None:
    # --devices left to its default (auto): the runner itself must notice the GPU.
    out = tmp_path / "compare"
    proc = run_module(
        "benchmarks.compare",
        *("--frameworks", "torch-ddp,jax-pmap", "--gpus", "1", *SMOKE),
        *("--cache-dir", str(jax_cache), "--out", str(out), "--no-tensorboard"),
        python=MAIN_PYTHON,
    )
    ok(proc)
    assert "devices: torch-ddp on cuda" in proc.stdout, proc.stdout[-2000:]
    config = read_json(out / "config.json")
    assert config["devices"]["choice"] == "cuda", config["devices"]
    assert config["device_kind"].startswith("cuda:"), config["device_kind"]
    records = [read_json(p) for p in sorted((out / "runs").glob("*.json"))]
    assert sorted(r["framework"] for r in records) == ["jax-pmap", "torch-ddp"]
    for record in records:
        assert record["status"] == "ok", record.get("error")
        assert_on_gpu(record, 1)
        assert record["device_choice"]["asked"] == "cuda"  # the runner's choice, passed down
