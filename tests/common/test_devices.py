"""--devices auto|cpu|cuda and the runners' device check, on the CPU with stand-ins for a GPU
machine (conftest.fake_nvidia_smi; conftest.stand_in_interpreter runs the real device probe with
the framework's CUDA answers replaced): a framework that sees no GPU where nvidia-smi lists one
stops the runner before any run, naming it and its install command (MXNet on Hopper: skipped with
the reason); `--devices cpu` runs everything on simulated CPU devices and says so; `--devices
cuda` without a GPU is one line, exit 2; the pin hides the GPUs from the process and its children
and the record keeps the user's own variables. On real GPUs: tests/gpu/test_gpu.py."""

from __future__ import annotations

import importlib.util
import json
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


def gpu_machine(
    tmp_path: Path, sees: dict[str, bool], compute_cap: str = "9.0"
) -> dict[str, str | None]:
    """The environment of a 1-GPU machine on which framework F's interpreter sees the GPU when
    sees[F] and none otherwise: stand-ins for both (a real interpreter would answer for the
    machine the tests run on, which may have GPUs of its own); everything but the device probe
    runs in the real interpreter."""
    env = fake_nvidia_smi(tmp_path / "bin", 1, compute_cap=compute_cap)
    for fw, yes in sees.items():
        real = MXNET_PYTHON if fw == "mxnet-gluon" else MAIN_PYTHON
        python = stand_in_interpreter(tmp_path / "py" / fw, [H100] if yes else [], real)
        env[PYTHON_VARS[fw]] = str(python)
    return env


# -- the runners' refusal -----------------------------------------------------------------------


def test_the_probe_asks_the_framework_itself() -> None:
    """What the stand-ins above replace: each framework's interpreter, asked with its framework
    imported (here with the GPUs hidden, as in the whole main pass)."""
    for family, python in (("torch", MAIN_PYTHON), ("jax", MAIN_PYTHON), ("mxnet", MXNET_PYTHON)):
        if not python.exists():
            continue
        seen = harness._probe(python, family)
        assert seen.gpus == () and seen.detail.startswith(f"{family} "), seen
        assert f"interpreter {python}" in seen.detail


def test_one_framework_seeing_the_gpus_and_another_not_is_refused(tmp_path: Path) -> None:
    sees = {"torch-ddp": True, "jax-pmap": False}
    args = ["--frameworks", "torch-ddp,jax-pmap", "--gpus", "1", "--preset", "smoke"]
    out = tmp_path / "out"
    proc = run_module(
        "benchmarks.compare", *args, "--out", str(out), env=gpu_machine(tmp_path, sees)
    )
    line = one_line_error(proc, "compare: error: ", H100, "jax-pmap sees none", "--devices cpu")
    assert "bash scripts/setup.sh main" in line and "jax " in line  # the real probe's words
    assert "torch-ddp" not in line  # the framework that sees the GPU is not the one named
    assert not out.exists()  # nothing started


def test_with_every_framework_seeing_the_gpus_the_check_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The contrast to the refusals above, with the same stand-ins: the check passes and every
    run is given --devices cuda. In-process (the runs themselves would need a real GPU)."""
    for name, value in gpu_machine(tmp_path, {"torch-ddp": True, "jax-pmap": True}).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    from benchmarks import compare

    argv = ["--frameworks", "torch-ddp,jax-pmap", "--gpus", "1", "--preset", "smoke"]
    plan = compare.make_plan([*argv, "--out", str(tmp_path / "out")])
    assert plan.devices.choice == "cuda" and plan.expected_kind == f"cuda:{H100}"
    assert [r.command[r.command.index("--devices") + 1] for r in plan.runs] == ["cuda", "cuda"]
    assert "torch-ddp on cuda (NVIDIA H100" in plan.devices.line()


@pytest.mark.parametrize(
    "module,args",
    [
        ("benchmarks.throughput", ["--frameworks", "jax-shard", "--steps", "1", "--epochs", "2"]),
        ("benchmarks.tutorial_loops", ["--tutorials", "d2l-jax", "--gpus", "1"]),
    ],
)  # fmt: skip
def test_every_runner_refuses_a_framework_that_sees_no_gpu(
    tmp_path: Path, module: str, args: list[str]
) -> None:
    """torch sees the GPU, JAX does not (compare: the test above; every runner calls
    harness.choose_devices)."""
    sees = {"torch-ddp": True, "torch-dp": True, "jax-pmap": False, "jax-shard": False}
    out = tmp_path / "out"
    proc = run_module(module, *args, "--out", str(out), env=gpu_machine(tmp_path, sees))
    one_line_error(proc, "sees none", "bash scripts/setup.sh main", "--devices cpu")
    assert not out.exists()


def test_mxnet_on_hopper_is_skipped_with_the_reason_not_refused(tmp_path: Path) -> None:
    """MXNet 1.9.1 has no GPU build for compute capability 9.0: on an H100 it is a skipped row
    saying why, even where a CUDA build of it counts the GPU (it has no kernels for it); on an
    A100 (8.0), where `setup.sh mxnet` installs mxnet-cu117, a refusal."""
    if not MXNET_PYTHON.exists():
        pytest.skip(".venv-mxnet not built (bash scripts/setup.sh mxnet)")
    names = ["torch-ddp", "mxnet-gluon"]
    for cap, mxnet_counts_it, expect in (("9.0", True, "skipped"), ("8.0", False, "refused")):
        sees = {"torch-ddp": True, "mxnet-gluon": mxnet_counts_it}
        env = gpu_machine(tmp_path / f"{cap}-{mxnet_counts_it}", sees, compute_cap=cap)
        code = (
            "import json, os; from benchmarks import harness\n"
            "try:\n"
            f"    d = harness.choose_devices(None, {names!r})\n"
            "    print(json.dumps({'choice': d.choice, 'skipped': d.skipped}))\n"
            "except harness.UsageError as e:\n"
            "    print(json.dumps({'error': str(e)}))\n"
        )
        proc = run_python(MAIN_PYTHON, "-c", code, env=env)
        ok(proc)
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
        if expect == "skipped":
            assert answer["choice"] == "cuda", answer
            assert "compute capability 9.0" in answer["skipped"]["mxnet-gluon"], answer
        else:
            assert "mxnet-gluon sees none" in answer["error"], answer
            assert "bash scripts/setup.sh mxnet" in answer["error"], answer


def test_devices_cpu_on_a_gpu_machine_runs_every_framework_on_the_cpu(tmp_path: Path) -> None:
    env = gpu_machine(tmp_path, {"torch-ddp": False})
    out = tmp_path / "out"
    args = ["--frameworks", "torch-ddp", "--gpus", "1", "--preset", "smoke", "--devices", "cpu"]
    proc = run_module("benchmarks.compare", *args, "--out", str(out), "--no-tensorboard", env=env)
    ok(proc)
    assert "devices: simulated CPU devices for every framework (--devices cpu)" in proc.stdout
    config = read_json(out / "config.json")
    assert config["devices"]["choice"] == "cpu" and config["device_kind"] == "cpu-simulated"
    record = read_json(out / "runs" / "torch-ddp-1dev.json")
    assert record["device_kind"] == "cpu-simulated" and record["device_choice"]["asked"] == "cpu"
    assert record["process_group"] == "gloo"


def test_devices_cuda_without_a_gpu_is_one_line_for_the_runner_and_the_trainers() -> None:
    proc = run_module("benchmarks.compare", "--frameworks", "torch-ddp", "--devices", "cuda")
    one_line_error(proc, "--devices cuda but nvidia-smi -L lists no GPU", "--devices cpu")
    for fw, seen in (("torch-ddp", "torch 2"), ("jax-pmap", "jax 0"), ("mxnet-gluon", "mxnet 1")):
        if fw == "mxnet-gluon" and not MXNET_PYTHON.exists():
            continue
        proc = run_trainer(fw, *SMOKE, "--devices", "cuda")
        one_line_error(proc, f"--devices cuda but {fw} sees no GPU ({seen}", "--devices cpu")


def test_a_bad_dpbench_devices_names_the_variable() -> None:
    proc = run_trainer("torch-dp", *SMOKE, env={"DPBENCH_DEVICES": "gpu"})
    one_line_error(proc, "DPBENCH_DEVICES='gpu'", "auto, cpu, cuda")
    proc = run_module("benchmarks.compare", "--preset", "smoke", env={"DPBENCH_DEVICES": "gpu"})
    one_line_error(proc, "DPBENCH_DEVICES='gpu'")


def test_jax_platforms_cuda_without_a_gpu_is_one_line() -> None:
    proc = run_trainer("jax-pmap", *SMOKE, env={"JAX_PLATFORMS": "cuda", "DPBENCH_DEVICES": "auto"})
    one_line_error(
        proc, "JAX could not start its devices (JAX_PLATFORMS='cuda'", "unset JAX_PLATFORMS"
    )


# -- the pin and the record ----------------------------------------------------------------------


def test_devices_cpu_hides_the_gpus_from_the_process_and_its_children(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    monkeypatch.delenv("JAX_PLATFORMS")
    monkeypatch.setenv(devices.SAVED_ENV, "")  # so that the undo removes what pin() sets
    monkeypatch.delenv(devices.SAVED_ENV)
    devices.pin("cpu")
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "" and os.environ["JAX_PLATFORMS"] == "cpu"
    # The record keeps what the user had set, in this process and in one it starts.
    assert devices.record("cpu") == {
        "asked": "cpu",
        "env": {"CUDA_VISIBLE_DEVICES": "1", "JAX_PLATFORMS": None},
    }
    proc = run_python(MAIN_PYTHON, "-c", "from common import devices; print(devices.user_env())")
    assert "'CUDA_VISIBLE_DEVICES': '1'" in proc.stdout, proc.stderr


def test_need_gpus_names_the_framework_its_build_and_the_fix() -> None:
    assert devices.need_gpus("auto", 0, "jax-pmap", "x") is None
    assert devices.need_gpus("cuda", 1, "jax-pmap", "x") is None
    why = devices.need_gpus("cuda", 0, "jax-pmap", "jax 0.10.2, no CUDA plugin")
    assert why is not None and "jax-pmap sees no GPU (jax 0.10.2, no CUDA plugin" in why
    assert "bash scripts/setup.sh" in why and "--devices cpu" in why


def test_the_devices_command_shows_what_each_framework_sees(tmp_path: Path) -> None:
    """What setup.sh prints after a CUDA install: one line per framework, then the runners'
    decision; exit 1 where they would refuse, 0 where they would start."""
    env = gpu_machine(tmp_path, {"torch-ddp": True, "jax-pmap": False})
    proc = run_module("benchmarks.devices", "--frameworks", "torch-ddp,jax-pmap", env=env)
    assert proc.returncode == 1, proc.stderr
    assert f"torch-ddp    sees 1 GPU(s) ({H100})" in proc.stdout
    assert "jax-pmap     sees no GPU: jax " in proc.stdout  # the real probe's words
    assert "the runners would stop: " in proc.stdout and "jax-pmap sees none" in proc.stdout
    proc = run_module("benchmarks.devices", "--frameworks", "torch-ddp", env=env)
    assert proc.returncode == 0 and "devices: torch-ddp on cuda (" in proc.stdout, proc.stdout


@pytest.mark.parametrize(
    "visible,count",
    [(None, 4), ("", 0), ("-1", 0), ("0,1", 2), ("1,-1,0", 1), ("7", 0), ("GPU-ab12,0", 2)],
)
def test_cuda_visible_devices_hides_gpus_as_cuda_does(
    monkeypatch: pytest.MonkeyPatch, visible: str | None, count: int
) -> None:
    """CUDA stops at the first invalid entry ("-1", an index it does not have)."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert harness.visible_count(4) == count


def test_a_cuda_plugin_that_cannot_start_is_one_line(tmp_path: Path) -> None:
    """JAX's CUDA plugin on a machine where CUDA does not start (no driver) logs a traceback at
    the first device query: the trainer says it in one line, and runs on the CPU under auto (its
    record keeps what was asked and the user's device variables) or refuses --devices cuda in
    one line. A stand-in plugin (jax_plugins/ on PYTHONPATH) raises as the real one does there."""
    plugin = tmp_path / "site" / "jax_plugins" / "xla_standin"
    plugin.mkdir(parents=True)
    (plugin / "__init__.py").write_text(
        "def initialize():\n    raise RuntimeError('operation cuInit(0) failed (stand-in)')\n"
    )
    site = f"{tmp_path / 'site'}{os.pathsep}{Path(__file__).resolve().parents[2]}"
    # "-1": CUDA's own way to hide every GPU (the real plugin, on a GPU machine, sees none)
    env = {"PYTHONPATH": site, "JAX_PLATFORMS": None, "DPBENCH_DEVICES": None,
           "CUDA_VISIBLE_DEVICES": "-1"}  # fmt: skip
    # A compilation cache of its own: the session's, shared with other workers' trainers, may
    # add its own note line (an entry another process was writing).
    cache = ("--cache-dir", str(tmp_path / "cache"))
    out = tmp_path / "r.json"
    proc = run_trainer("jax-pmap", *SMOKE, "--epochs", "1", *cache, "--output", str(out), env=env)
    ok(proc)
    record = read_json(out)
    assert record["device_choice"] == {
        "asked": "auto",
        "env": {"CUDA_VISIBLE_DEVICES": "-1", "JAX_PLATFORMS": None},
    }
    assert record["device_kind"] == "cpu-simulated"
    (line,) = proc.stderr.strip().splitlines()
    # the stand-in's reason, or on a GPU machine (GPUs hidden by the main pass) the real
    # plugin's, which may fail first
    assert line.startswith("note: JAX's CUDA plugin did not start (") and line.endswith(
        "); this run is on the CPU (--devices cpu says so up front)"
    ), line
    real = ("jax_cuda12_plugin", "jax_cuda13_plugin")
    if not any(importlib.util.find_spec(m) for m in real):  # a CPU build: the stand-in alone
        assert "operation cuInit(0) failed (stand-in)" in line, line
    proc = run_trainer("jax-pmap", *SMOKE, "--epochs", "1", "--devices", "cuda", env=env)
    one_line_error(proc, "--devices cuda but jax-pmap sees no GPU")
