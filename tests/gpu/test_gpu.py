"""The trainers and tools on a CUDA GPU, each started as a user starts it (its own process, the
framework's own interpreter), at one GPU, plus the runs that need two where two exist: every
trainer's smoke run on `--devices cuda` (MXNet: where its build sees the GPU; torch-ddp over
NCCL); `--devices cpu` still simulates the devices, `--devices auto` takes the GPU; two GPUs'
step equals one GPU's (torch-ddp), jax-pmap's equals jax-shard's; parity at one GPU, every row
ok; compare chooses the GPU for every run. The GPU pass runs them (tests/conftest.py), with the
CUDA builds in .venv (`bash scripts/setup.sh` on a machine with an NVIDIA driver):

    DPBENCH_TEST_GPU=1 .venv/bin/python -m pytest tests/gpu/test_gpu.py -rs

NOT YET RUN ON A GPU: written against the trainers' CPU records, and dry-run on the CPU with
`--devices cpu` and the assertions on "cuda:" turned round. Replace this paragraph with the
machine, the result and the time taken once it has run there (aimed at ~3 minutes on one H100;
each JAX process compiles for 10-20 s there). torch.compile's CUDA graphs: test_gpu_compile.py.
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


def skip_below(n: int) -> None:
    """Unless `n` GPUs are visible to a trainer (conftest.visible_gpus: CUDA_VISIBLE_DEVICES)."""
    if (count := len(visible_gpus())) < n:
        pytest.skip(f"needs {n} GPUs, {count} visible")


def train(framework: str, out: Path, *args: str) -> Run:
    """A smoke run that must succeed: its record and its --save-state (torch's names). With
    JAX_COMPILATION_CACHE_DIR cleared --cache-dir, not the caller, says where JAX's caches are."""
    out.mkdir(parents=True, exist_ok=True)
    record, state = out / "record.json", out / "state.npz"
    files = ("--output", str(record), "--save-state", str(state))
    ok(run_trainer(framework, *SMOKE, *args, *files, env={"JAX_COMPILATION_CACHE_DIR": ""}))
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
    """The parameters the run started from (`--init shared`). Not the BN statistics: their update
    does not scale with the LR and would hide part of a wrong one (a 20% higher LR moves both
    together by 3%, the parameters alone by 20%); parity checks the statistics."""
    with np.load(ROOT / record["init"]["file"]) as f:
        return {k: f[k] for k in f.files if not k.endswith(STATISTICS)}


@pytest.fixture(scope="module")
def jax_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One --cache-dir for the module's JAX smoke runs: a second run loads its programs."""
    return tmp_path_factory.mktemp("jax-cache")


@pytest.fixture(scope="module")
def cuda_run(tmp_path_factory: pytest.TempPathFactory, jax_cache: Path) -> Callable[[str], Run]:
    """framework -> its smoke run on `--devices cuda --gpus 1`, made once for the module."""
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


@pytest.mark.parametrize("framework", FRAMEWORKS)
def test_every_trainer_runs_its_smoke_run_on_the_gpu(
    framework: str, cuda_run: Callable[[str], Run]
) -> None:
    """torch-ddp in an NCCL group of one (at one GPU the model is left unwrapped: NCCL carries
    the epoch's all-reduces of the metrics); torch-dp's device ids 0..gpus-1."""
    if framework == "mxnet-gluon":
        skip_unless_mxnet_sees_a_gpu()
    record, _ = cuda_run(framework)
    assert_on_gpu(record, 1)
    assert record["device_choice"]["asked"] == "cuda"
    assert framework != "torch-ddp" or record["process_group"] == "nccl"


@pytest.mark.parametrize("framework", ["torch-ddp", "jax-pmap"])
def test_devices_cpu_simulates_the_devices_and_auto_takes_the_gpu(
    framework: str, tmp_path: Path, jax_cache: Path
) -> None:
    # --gpus 2 on a 1-GPU machine too: were the GPUs not hidden, the count would be refused.
    record, _ = train(framework, tmp_path / "cpu", "--devices", "cpu", "--gpus", "2")
    assert record["device_kind"] == "cpu-simulated" and record["devices"] == 2
    if framework == "torch-ddp":
        assert record["process_group"] == "gloo"
    else:
        assert "XLA:CPU" in record["execution"], record["execution"]
    # The user's variables as they were, not the values the pin gave them (and every rank).
    user = {k: os.environ.get(k) for k in ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS")}
    assert record["device_choice"] == {"asked": "cpu", "env": user}
    record, _ = train(framework, tmp_path / "auto", "--devices", "auto", "--gpus", "1",
                      "--cache-dir", str(jax_cache))  # fmt: skip
    assert_on_gpu(record, 1)
    assert record["device_choice"]["asked"] == "auto"


@pytest.mark.parametrize("framework", ["torch-ddp", "torch-dp", "jax-pmap", "jax-shard"])
def test_trainers_run_on_two_gpus(framework: str, tmp_path: Path) -> None:
    """torch-ddp over NCCL; torch-dp one replica per GPU (`devices` is the count asked for)."""
    skip_below(2)
    record, _ = train(framework, tmp_path, *ON_GPU, "--gpus", "2")
    assert_on_gpu(record, 2)
    assert framework != "torch-ddp" or record["process_group"] == "nccl"


@pytest.mark.parametrize(
    "first,second,gpus",
    [("torch-ddp", "torch-ddp", (1, 2)), ("jax-pmap", "jax-shard", (1, 1)),
     ("jax-pmap", "jax-shard", (2, 2))],
    ids=["torch-ddp-2-gpus-vs-1", "pmap-vs-shard-1-gpu", "pmap-vs-shard-2-gpus"],
)  # fmt: skip
def test_the_same_step_on_the_gpu(first: str, second: str, gpus: tuple[int, int], tmp_path) -> None:
    """DDP's gradient all-reduce over NCCL with SyncBatchNorm: two GPUs' step on a global batch
    is the 1-GPU step on it. One program per device (pmap) and one SPMD program over the mesh
    (jit with shardings), both with per-device BatchNorm: the same update. To rounding."""
    skip_below(max(gpus))
    bn = ("--bn", "sync") if first == "torch-ddp" else ()
    one, one_state = train(first, tmp_path / "a", *ON_GPU, "--gpus", str(gpus[0]), *bn, *ONE_STEP)
    two, two_state = train(second, tmp_path / "b", *ON_GPU, "--gpus", str(gpus[1]), *bn, *ONE_STEP)
    assert_on_gpu(one, gpus[0])
    assert_on_gpu(two, gpus[1])
    assert one["init"]["sha256"] == two["init"]["sha256"]
    assert relative_update_difference(initial_parameters(one), two_state, one_state) < TOLERANCE


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
    assert all(r["ok"] is True and r["status"] == "ok" for r in rows), rows
    records = [read_json(p) for p in sorted((out / "runs").glob("*.json"))]
    assert len(records) == 4  # the three and the reference
    for record in records:
        assert_on_gpu(record, 1)


def test_compare_chooses_the_gpu_for_every_run(tmp_path: Path, jax_cache: Path) -> None:
    # --devices left to its default (auto): the runner itself must notice the GPU.
    out = tmp_path / "compare"
    proc = run_module("benchmarks.compare",
                      *("--frameworks", "torch-ddp,jax-pmap", "--gpus", "1", *SMOKE),
                      *("--cache-dir", str(jax_cache), "--out", str(out), "--no-tensorboard"),
                      python=MAIN_PYTHON)  # fmt: skip
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
