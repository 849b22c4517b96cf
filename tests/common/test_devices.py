"""--devices auto|cpu|cuda and the runners' device check, on the CPU with stand-ins for a GPU
machine (conftest.fake_nvidia_smi, conftest.stand_in_interpreter). On real GPUs:
tests/gpu/test_gpu.py."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

from benchmarks import harness
from common import devices
from tests.conftest import (
    MAIN_PYTHON,
    MXNET_PYTHON,
    SMOKE,
    fake_nvidia_smi,
    ok,
    one_line_error,
    read_json,
    run_module,
    run_python,
    run_trainer,
    stand_in_interpreter,
)

H100 = "NVIDIA H100 80GB HBM3"
PYTHON_VARS = {f: harness.PYTHON_ENV.format(f.upper().replace("-", "_")) for f in harness.REGISTRY}


def gpu_machine(tmp_path: Path, sees: dict[str, bool], cap: str = "9.0") -> dict[str, str | None]:
    """A 1-GPU machine on which framework F's interpreter sees the GPU when sees[F]."""
    env = fake_nvidia_smi(tmp_path / "bin", 1, compute_cap=cap)
    for fw, yes in sees.items():
        real = MXNET_PYTHON if fw == "mxnet-gluon" else MAIN_PYTHON
        python = stand_in_interpreter(tmp_path / "py" / fw, [H100] if yes else [], real)
        env[PYTHON_VARS[fw]] = str(python)
    return env


def test_the_probe_asks_the_framework_itself() -> None:
    """What the stand-ins replace: each framework's interpreter, with its framework imported."""
    for family, python in (("torch", MAIN_PYTHON), ("jax", MAIN_PYTHON), ("mxnet", MXNET_PYTHON)):
        if python.exists():
            seen = harness._probe(python, family)
            assert seen.gpus == () and seen.detail.startswith(f"{family} "), seen
            assert f"interpreter {python}" in seen.detail


@pytest.mark.parametrize("module,args", [
    ("benchmarks.compare", ["--frameworks", "torch-ddp,jax-pmap", "--gpus", "1"]),
    ("benchmarks.throughput", ["--frameworks", "jax-shard", "--steps", "1", "--epochs", "2"]),
    ("benchmarks.tutorial_loops", ["--tutorials", "d2l-jax", "--gpus", "1"]),
])  # fmt: skip
def test_every_runner_refuses_a_framework_that_sees_no_gpu(
    tmp_path: Path, module: str, args: list[str]
) -> None:
    sees = {"torch-ddp": True, "torch-dp": True, "jax-pmap": False, "jax-shard": False}
    out = tmp_path / "out"
    proc = run_module(module, *args, "--out", str(out), env=gpu_machine(tmp_path, sees))
    line = one_line_error(proc, "sees none", "bash scripts/setup.sh main", "--devices cpu")
    assert "jax " in line and "torch-ddp" not in line  # the real probe's words; only JAX named
    assert not out.exists()


def test_the_check_passes_where_every_framework_sees_the_gpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contrast to the refusals: every run is given --devices cuda. MXNet 1.9.1 has no
    kernels for compute capability 9.0: on an H100 a skipped row saying why (even where a CUDA
    build counts the GPU); on an A100 (8.0) a refusal. In-process."""

    def machine(name: str, sees: dict[str, bool], cap: str = "9.0") -> None:
        for var, value in gpu_machine(tmp_path / name, sees, cap).items():
            if value is None:
                monkeypatch.delenv(var, raising=False)
            else:
                monkeypatch.setenv(var, value)

    machine("both", {"torch-ddp": True, "jax-pmap": True})
    from benchmarks import compare

    argv = ["--frameworks", "torch-ddp,jax-pmap", "--gpus", "1", "--preset", "smoke"]
    plan = compare.make_plan([*argv, "--out", str(tmp_path / "out")])
    assert plan.devices.choice == "cuda" and plan.expected_kind == f"cuda:{H100}"
    assert [r.command[r.command.index("--devices") + 1] for r in plan.runs] == ["cuda", "cuda"]
    if not MXNET_PYTHON.exists():
        pytest.skip(".venv-mxnet not built (bash scripts/setup.sh mxnet)")
    names = ["torch-ddp", "mxnet-gluon"]
    machine("h100", {"torch-ddp": True, "mxnet-gluon": True})
    chosen = harness.choose_devices(None, names)
    assert chosen.choice == "cuda", chosen
    assert "compute capability 9.0" in chosen.skipped["mxnet-gluon"], chosen.skipped
    machine("a100", {"torch-ddp": True, "mxnet-gluon": False}, "8.0")
    with pytest.raises(harness.UsageError, match="mxnet-gluon sees none.*setup.sh mxnet"):
        harness.choose_devices(None, names)


def test_devices_cpu_on_a_gpu_machine_runs_every_framework_on_the_cpu(tmp_path: Path) -> None:
    env = gpu_machine(tmp_path, {"torch-ddp": False})
    out = tmp_path / "out"
    args = ["--frameworks", "torch-ddp", "--gpus", "1", "--preset", "smoke", "--devices", "cpu"]
    ok(run_module("benchmarks.compare", *args, "--out", str(out), "--no-tensorboard", env=env))
    config = read_json(out / "config.json")
    assert config["devices"]["choice"] == "cpu" and config["device_kind"] == "cpu-simulated"
    record = read_json(out / "runs" / "torch-ddp-1dev.json")
    assert record["device_kind"] == "cpu-simulated" and record["device_choice"]["asked"] == "cpu"
    assert record["process_group"] == "gloo"


MX = "mxnet-gluon"
NO_GPU = [  # --devices cuda, a bad DPBENCH_DEVICES, JAX_PLATFORMS=cuda: no GPU here
    (["-m", "benchmarks.compare", "--frameworks", "torch-ddp", "--devices", "cuda"], {},
     ["--devices cuda but nvidia-smi -L lists no GPU", "--devices cpu"]),
    *[([fw, *SMOKE, "--devices", "cuda"], {}, [f"--devices cuda but {fw} sees no GPU ({seen}",
                                               "--devices cpu"])
      for fw, seen in (("torch-ddp", "torch 2"), ("jax-pmap", "jax 0"), (MX, "mxnet 1"))],
    (["torch-dp", *SMOKE], {"DPBENCH_DEVICES": "gpu"},
     ["DPBENCH_DEVICES='gpu'", "auto, cpu, cuda"]),
    (["-m", "benchmarks.compare", "--preset", "smoke"], {"DPBENCH_DEVICES": "gpu"},
     ["DPBENCH_DEVICES='gpu'"]),
    (["jax-pmap", *SMOKE], {"JAX_PLATFORMS": "cuda", "DPBENCH_DEVICES": "auto"},
     ["JAX could not start its devices (JAX_PLATFORMS='cuda'", "unset JAX_PLATFORMS"]),
]  # fmt: skip


@pytest.mark.parametrize("cmd,env,fragments", NO_GPU)
def test_asking_for_a_gpu_that_is_not_there_is_one_line(
    cmd: list[str], env: dict[str, str], fragments: list[str]
) -> None:
    if cmd[0] == MX and not MXNET_PYTHON.exists():
        pytest.skip(".venv-mxnet not built (bash scripts/setup.sh mxnet)")
    run = run_module(*cmd[1:], env=env) if cmd[0] == "-m" else run_trainer(*cmd, env=env)
    one_line_error(run, *fragments)


def test_devices_cpu_hides_the_gpus_from_the_process_and_its_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setenv(devices.SAVED_ENV, "")  # so that the undo removes what pin() sets
    monkeypatch.delenv(devices.SAVED_ENV)
    devices.pin("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["JAX_PLATFORMS"] == "cpu"
    env = {"CUDA_VISIBLE_DEVICES": "1", "JAX_PLATFORMS": None}  # as the user had them
    assert devices.record("cpu") == {"asked": "cpu", "env": env}
    proc = run_python(MAIN_PYTHON, "-c", "from common import devices; print(devices.user_env())")
    assert "'CUDA_VISIBLE_DEVICES': '1'" in proc.stdout, proc.stderr


def test_the_devices_command_shows_what_each_framework_sees(tmp_path: Path) -> None:
    """What setup.sh prints after a CUDA install; exit 1 where the runners would refuse."""
    env = gpu_machine(tmp_path, {"torch-ddp": True, "jax-pmap": False})
    proc = run_module("benchmarks.devices", "--frameworks", "torch-ddp,jax-pmap", env=env)
    assert proc.returncode == 1, proc.stderr
    assert f"torch-ddp    sees 1 GPU(s) ({H100})" in proc.stdout
    assert "the runners would stop: " in proc.stdout and "jax-pmap sees none" in proc.stdout
    proc = run_module("benchmarks.devices", "--frameworks", "torch-ddp", env=env)
    assert proc.returncode == 0 and "devices: torch-ddp on cuda (" in proc.stdout, proc.stdout


def test_cuda_visible_devices_hides_gpus_as_cuda_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA stops at the first invalid entry ("-1", an index it does not have)."""
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert harness.visible_count(4) == 4
    for visible, count in [("", 0), ("-1", 0), ("0,1", 2), ("1,-1,0", 1), ("7", 0), ("GPU-a,0", 2)]:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        assert harness.visible_count(4) == count, visible


def test_a_cuda_plugin_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    """JAX's CUDA plugin where CUDA does not start: one note and a CPU run under auto, one error
    line under --devices cuda. A stand-in plugin (on PYTHONPATH) raises as the real one does."""
    plugin = tmp_path / "site" / "jax_plugins" / "xla_standin"
    plugin.mkdir(parents=True)
    raising = "def initialize():\n    raise RuntimeError('operation cuInit(0) failed (stand-in)')"
    (plugin / "__init__.py").write_text(raising)
    site = f"{tmp_path / 'site'}{os.pathsep}{Path(__file__).resolve().parents[2]}"
    # "-1" hides every GPU (from the real plugin too); a cache of its own adds no note of its own
    env = {"PYTHONPATH": site, "JAX_PLATFORMS": None, "DPBENCH_DEVICES": None,
           "CUDA_VISIBLE_DEVICES": "-1"}  # fmt: skip
    args = ("--epochs", "1", "--cache-dir", str(tmp_path / "c"), "--output", str(tmp_path / "r"))
    ok(proc := run_trainer("jax-pmap", *SMOKE, *args, env=env))
    record = read_json(tmp_path / "r")
    asked = {"asked": "auto", "env": {"CUDA_VISIBLE_DEVICES": "-1", "JAX_PLATFORMS": None}}
    assert record["device_choice"] == asked and record["device_kind"] == "cpu-simulated"
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("note: JAX's CUDA plugin did not start (") and "the CPU" in line
    real = ("jax_cuda12_plugin", "jax_cuda13_plugin")
    if not any(importlib.util.find_spec(m) for m in real):  # a CPU build: the stand-in alone
        assert "operation cuInit(0) failed (stand-in)" in line, line
    proc = run_trainer("jax-pmap", *SMOKE, "--epochs", "1", "--devices", "cuda", env=env)
    one_line_error(proc, "--devices cuda but jax-pmap sees no GPU")
