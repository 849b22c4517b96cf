"""Shared test helpers. Imports numpy + stdlib only: the MXNet environment's pytest run
(tests/mxnet) loads this file too."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent

# Two passes (scripts/test.sh runs both where nvidia-smi lists a GPU):
# - the main pass: every test simulates its devices on the CPU (pinned here, before any
#   framework loads, for every process the tests start), as CI does; `gpu` tests are skipped.
# - the GPU pass, DPBENCH_TEST_GPU=1 pytest -m gpu: only the `gpu` tests, nothing pinned.
GPU_PASS = os.environ.get("DPBENCH_TEST_GPU") == "1"
if not GPU_PASS:
    os.environ["DPBENCH_DEVICES"] = "cpu"
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    os.environ["JAX_PLATFORMS"] = "cpu"
else:  # the GPU tests ask for their devices themselves; a shell's default must not decide
    os.environ.pop("DPBENCH_DEVICES", None)
# JAX processes that share a GPU (pytest-xdist workers, the trainers they start) must not each
# take 75% of its memory up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Hermetic: the suite never reads or writes the user's folders. One folder per session
# (DPBENCH_TEST_HOME) stands in for HOME and the caches: made by the first process that loads
# this file, inherited by xdist's workers and every process a test starts, removed at the end.
HOME_VARS = {  # TORCHINDUCTOR_CACHE_DIR: by default /tmp/torchinductor_<user>
    "HOME": "", "XDG_CACHE_HOME": ".cache", "XDG_CONFIG_HOME": ".config",
    "XDG_DATA_HOME": ".local/share", "MPLCONFIGDIR": ".config/matplotlib",
    "TORCHINDUCTOR_CACHE_DIR": ".cache/torchinductor", "TRITON_CACHE_DIR": ".cache/triton",
    "CUDA_CACHE_PATH": ".cache/nv",
}  # fmt: skip
OWN_TEST_HOME = "DPBENCH_TEST_HOME" not in os.environ
if OWN_TEST_HOME:
    import tempfile

    os.environ["DPBENCH_TEST_HOME"] = tempfile.mkdtemp(prefix="dp-bench-test-home-")
TEST_HOME = Path(os.environ["DPBENCH_TEST_HOME"])
for _name, _sub in HOME_VARS.items():
    os.environ[_name] = str(TEST_HOME / _sub)
# A user's JAX_COMPILATION_CACHE_DIR would win over every --cache-dir (jax_support.py).
os.environ.pop("JAX_COMPILATION_CACHE_DIR", None)


# `bash scripts/test.sh --fast` (DPBENCH_TEST_FAST=1): only the tests that start no process. A
# test that starts one (subprocess, multiprocessing) is skipped at that moment: no list to drift.
FAST = os.environ.get("DPBENCH_TEST_FAST") == "1"
FAST_SKIP = "starts a process: the full suite runs it (bash scripts/test.sh)"


IN_TEST: list[bool] = [False]  # FAST: a test (its fixtures included) is running


def only_in_process() -> None:
    """Under FAST, every way a test could start a process skips the test instead (outside a
    test processes start as usual: torch's import runs `uname -p`)."""
    import multiprocessing.util

    def guarded(start: Any) -> Any:
        def start_or_skip(*args: Any, **kwargs: Any) -> Any:
            if IN_TEST[0]:
                pytest.skip(FAST_SKIP)
            return start(*args, **kwargs)

        return start_or_skip

    popen: Any = subprocess.Popen
    popen._execute_child = guarded(popen._execute_child)  # run, check_output, Popen
    multiprocessing.util.spawnv_passfds = guarded(multiprocessing.util.spawnv_passfds)  # spawn
    os.fork = guarded(os.fork)  # multiprocessing's fork start method
    os.posix_spawn = guarded(os.posix_spawn)
    os.posix_spawnp = guarded(os.posix_spawnp)


def pin_xdist_worker() -> None:
    """Each of N xdist workers (and its tests' processes) runs on every N-th core: a trainer
    sizes its threads to its cores, so 2 workers on 2 cores do not wait for each other."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 0)
    if not worker.startswith("gw") or count < 2 or not hasattr(os, "sched_setaffinity"):
        return
    cores = sorted(os.sched_getaffinity(0))
    if count <= len(cores):
        os.sched_setaffinity(0, cores[int(worker[2:]) % count :: count])


pin_xdist_worker()


def pytest_configure(config: pytest.Config) -> None:
    """JAX programs built here go to the session's compilation cache, the trainers' default
    (<HOME>/.cache/dp-bench/jax), shared with every worker and trainer."""
    if FAST and (hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", 0)):
        only_in_process()  # not in xdist's controller: it starts the workers
    import importlib.util

    if importlib.util.find_spec("jax") is None:
        return
    import jax

    path = TEST_HOME / ".cache" / "dp-bench" / "jax"
    path.mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", 4 * 1024**3)  # file lock: shared


def pytest_unconfigure(config: pytest.Config) -> None:
    if OWN_TEST_HOME and not hasattr(config, "workerinput"):  # the process that made it
        import shutil

        shutil.rmtree(TEST_HOME, ignore_errors=True)


# The device variables every test starts from and leaves behind: those set above, and the one
# devices.pin adds (common/devices.py: ENV, USER_ENV, SAVED_ENV). Only these: a test module sets
# XLA_FLAGS when imported, before JAX starts, and that must stay.
DEVICE_VARS = (
    "DPBENCH_DEVICES", "CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS", "DPBENCH_USER_DEVICE_ENV"
)  # fmt: skip
SESSION_DEVICE_ENV = {k: os.environ.get(k) for k in DEVICE_VARS}


def _device_env_as_the_session_set_it() -> None:
    for k, v in SESSION_DEVICE_ENV.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(autouse=True)
def session_device_env():
    """Every test starts and ends with the session's device variables (an in-process main()
    calls devices.pin, whose variables later tests' processes would inherit)."""
    _device_env_as_the_session_set_it()
    yield
    _device_env_as_the_session_set_it()


@pytest.fixture(autouse=True)
def stop_signal_dispositions(request: pytest.FixtureRequest):
    """A test that leaves a SIGINT / SIGTERM / SIGHUP handler changed is named in a warning and
    the handler put back (a later test's check must not depend on file order)."""
    import warnings

    found = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    yield
    for s, handler in found.items():
        now = signal.getsignal(s)
        if now is not handler and handler is not None:
            warnings.warn(f"{request.node.nodeid} left {signal.Signals(s).name} as {now!r} "
                          f"(was {handler!r}): put back", stacklevel=1)  # fmt: skip
            signal.signal(s, handler)


def _tensorboard_missing() -> str:
    """Why --tensorboard cannot be written and read back here ("" where it can): a GPU
    machine's own python may lack tensorboardX and tensorboard."""
    import importlib.util

    missing = [p for p in ("tensorboardX", "tensorboard") if importlib.util.find_spec(p) is None]
    return f"{' and '.join(missing)} not installed (bash scripts/setup.sh does)" if missing else ""


TENSORBOARD_MISSING = _tensorboard_missing()


def visible_gpus() -> list[str]:
    """The GPUs the runners count ([] in the main pass, which hides them)."""
    if not GPU_PASS:
        return []
    from benchmarks.harness import detect_gpus

    return detect_gpus()


CPU_LOG = os.environ.get("DPBENCH_TEST_CPU_LOG")  # scripts/test_weights.py's input


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Any:
    """With DPBENCH_TEST_CPU_LOG=FILE, one JSON line per test: its CPU seconds (children
    reaped included) and wall seconds, for scripts/test_weights.py (tests/weights.json)."""
    if not CPU_LOG:
        IN_TEST[0] = FAST
        try:
            yield
        finally:
            IN_TEST[0] = False
        return
    import resource
    import time

    def cpu() -> float:
        return sum(
            u.ru_utime + u.ru_stime
            for u in map(resource.getrusage, (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
        )

    cpu0, wall0 = cpu(), time.monotonic()
    yield
    line = {"test": item.nodeid, "cpu": round(cpu() - cpu0, 2),
            "wall": round(time.monotonic() - wall0, 2)}  # fmt: skip
    with open(CPU_LOG, "a") as f:  # one short write per line: workers may share the file
        f.write(json.dumps(line) + "\n")


def heaviest_files_first(items: list[pytest.Item]) -> None:
    """Files by their CPU seconds (tests/weights.json), heaviest first, each file's order kept:
    xdist's workers take whole files in this order, so the longest does not start last."""
    path = ROOT / "tests" / "weights.json"
    weights: dict[str, float] = json.loads(path.read_text()) if path.is_file() else {}

    def weight(item: pytest.Item) -> float:
        return -float(weights.get(item.nodeid.split("::", 1)[0], NEW_FILE_WEIGHT))

    items.sort(key=weight)  # stable: a file's tests keep their order


NEW_FILE_WEIGHT = 30.0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Files heaviest first; the main pass skips the `gpu` tests, the GPU pass runs only them."""
    heaviest_files_first(items)
    if not GPU_PASS:
        skip = pytest.mark.skip(
            reason="a GPU test: run by the GPU pass, `DPBENCH_TEST_GPU=1 .venv/bin/python -m "
            "pytest tests -m gpu` (scripts/test.sh runs it where nvidia-smi lists a GPU)"
        )
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
        return
    gpu_items = [item for item in items if "gpu" in item.keywords]
    config.hook.pytest_deselected(items=[i for i in items if "gpu" not in i.keywords])
    items[:] = gpu_items
    if not visible_gpus():
        skip = pytest.mark.skip(reason="no GPU visible (nvidia-smi -L lists none)")
        for item in items:
            item.add_marker(skip)


# The interpreters the tests start: the project's environments, or DPBENCH_TEST_PYTHON (a GPU
# machine's own python holding torch and JAX; benchmarks/gpu_suite.sh --python).
MAIN_PYTHON = Path(os.environ.get("DPBENCH_TEST_PYTHON") or ROOT / ".venv" / "bin" / "python")
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"

FRAMEWORKS = ("torch-dp", "torch-ddp", "torch-fsdp", "jax-pmap", "jax-shard", "jax-shardmap",
              "jax-fsdp", "mxnet-gluon")  # fmt: skip
SMOKE = ("--preset", "smoke", "--prefetch", "1")  # tiny model, 16x16 synthetic images
# For one step of two different programs (N devices vs 1): the smoke preset's first step with
# seed 0 holds a near-tie (within float rounding of a ReLU kink) that a multi-process reduction's
# rounding flips (1.1% of the update); with seed 1 the programs agree to 7e-7.
CONDITIONED_SEED = 1


def module_of(framework: str) -> str:
    """torch-ddp -> frameworks.torch_ddp"""
    return f"frameworks.{framework.replace('-', '_')}"


def python_for(framework: str) -> Path:
    """The interpreter a framework runs in: MXNet 1.9 has its own environment."""
    return MXNET_PYTHON if framework == "mxnet-gluon" else MAIN_PYTHON


def skip_without_interpreter(framework: str) -> None:
    if not python_for(framework).exists():
        pytest.skip(f"{framework} needs {python_for(framework).relative_to(ROOT)} (not built)")


def run_python(python: str | os.PathLike[str], *args: str, env: dict[str, str | None] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """`python args...` from the project root, output captured. XLA_FLAGS is not inherited (a
    JAX trainer sets its own device count) unless `env` gives it; None in `env` unsets."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    full_env.pop("XLA_FLAGS", None)
    for name, value in (env or {}).items():
        if value is None:
            full_env.pop(name, None)
        else:
            full_env[name] = value
    return subprocess.run([str(python), *args], cwd=ROOT, env=full_env, capture_output=True,
                          text=True, timeout=timeout)  # fmt: skip


def run_module(module: str, *args: str, python: str | os.PathLike[str] | None = None,
               env: dict[str, str | None] | None = None,
               timeout: float = 600) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """Run `python -m module args...` (this interpreter unless `python` is given)."""
    return run_python(python or sys.executable, "-m", module, *args, env=env, timeout=timeout)


def run_trainer(
    framework: str, *args: str, env: dict[str, str | None] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run a trainer's command line with its own interpreter."""
    return run_module(
        module_of(framework), *args, python=python_for(framework), env=env, timeout=timeout
    )


def ok(proc: subprocess.CompletedProcess[str]) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def one_line_error(proc: subprocess.CompletedProcess[str], *fragments: str) -> str:
    """Bad input: exit 2, one stderr line (no traceback) containing every fragment."""
    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-4000:]
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


def run_recorded(module: str, tmp_path: Path, *args: str) -> tuple[dict, str]:
    """`python -m module args --output tmp_path/record.json` must succeed: (record, stdout)."""
    out = tmp_path / "record.json"
    proc = run_module(module, *args, "--output", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_json(out), proc.stdout


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path) as f:
        return json.load(f)


def payload(path: Path) -> bytes:
    """The content of a checkpoint file (torch's .pt, JAX's .msgpack), its sha256 checked."""
    from common.checkpoints import read_checkpoint

    return read_checkpoint(path)


def relative_update_difference(
    before: dict[str, np.ndarray], a: dict[str, np.ndarray], b: dict[str, np.ndarray]
) -> float:
    """||dA - dB|| / ||dB|| over all float tensors together (dX = X - before): per tensor, a
    near-cancelling BN bias gradient moves by percents from rounding alone."""
    keys = [k for k in before if np.issubdtype(np.asarray(before[k]).dtype, np.floating)]
    assert keys and set(keys) <= set(a) and set(keys) <= set(b), (sorted(a), sorted(b))
    da = np.concatenate([(np.asarray(a[k], np.float64) - before[k]).ravel() for k in keys])
    db = np.concatenate([(np.asarray(b[k], np.float64) - before[k]).ravel() for k in keys])
    assert np.linalg.norm(db) > 0, "the step did not move the weights"
    return float(np.linalg.norm(da - db) / np.linalg.norm(db))


@pytest.fixture
def no_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    """Plan as if every framework were installed, on a machine without GPUs, probing nothing."""
    from benchmarks import harness

    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    monkeypatch.setattr(harness, "detect_gpus", lambda: [])


def fake_nvidia_smi(bin_dir: Path, gpus: int = 1, name: str = "NVIDIA H100 80GB HBM3",
                    compute_cap: str = "9.0", cuda: str = "13.0",
                    driver: str = "580.95.05") -> dict[str, str | None]:  # fmt: skip
    """A stand-in `nvidia-smi` in `bin_dir` listing `gpus` GPUs, and the `run_python(env=...)`
    that puts it first on PATH with neither the GPUs hidden nor the CPU pinned."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    listing = "".join(f"echo 'GPU {i}: {name} (UUID: GPU-{i})'\n" for i in range(gpus))
    rows = lambda fields: "".join(f"echo '{fields}'\n" for _ in range(gpus))  # noqa: E731
    tool = bin_dir / "nvidia-smi"
    tool.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f"  -L) {listing or 'true'};;\n"
        f"  *compute_cap*) {rows(compute_cap) or 'true'};;\n"
        f"  *name,driver_version*) {rows(f'{name}, {driver}, 81559 MiB') or 'true'};;\n"
        f"  *) echo '| NVIDIA-SMI {driver}  Driver Version: {driver}  CUDA Version: {cuda} |';;\n"
        "esac\n"
    )
    tool.chmod(0o755)
    path = f"{bin_dir}{os.pathsep}{os.environ['PATH']}"
    return {"PATH": path, "CUDA_VISIBLE_DEVICES": None, "DPBENCH_DEVICES": None}


# Run in place of `-m benchmarks.device_probe FAMILY`: the framework's answers about the machine
# are a CUDA build's on a GPU machine, then the real probe runs, unchanged.
FAKE_CUDA_PROBE = """
import json, os, runpy, sys, types
sys.path.insert(0, os.getcwd())  # the project root (the runners start the probe there)
gpus = json.loads(os.environ.pop("DPBENCH_STAND_IN_GPUS"))
family = sys.argv[1]
if family == "torch":
    import torch
    torch.cuda.device_count = lambda: len(gpus)
    torch.cuda.get_device_name = lambda i=0: gpus[i]
    torch.version.cuda = "13.0"
elif family == "jax":
    import jax
    cpu = jax.devices
    seen = [types.SimpleNamespace(platform="gpu", device_kind=g) for g in gpus]
    jax.devices = lambda *a, **k: seen or cpu(*a, **k)
elif family == "mxnet":
    import mxnet as mx
    features = mx.runtime.Features()
    mx.runtime.Features = lambda: types.SimpleNamespace(is_enabled=lambda name: name == "CUDA"
        or features.is_enabled(name))
    mx.context.num_gpus = lambda: len(gpus)
sys.argv = ["benchmarks.device_probe", *sys.argv[1:]]
runpy.run_module("benchmarks.device_probe", run_name="__main__", alter_sys=True)
"""


def stand_in_interpreter(path: Path, gpus: list[str], real: str | os.PathLike[str]) -> Path:
    """An interpreter whose framework sees `gpus` in the device probe (FAKE_CUDA_PROBE in the
    `real` interpreter); everything else runs in `real` as it is."""
    path.parent.mkdir(parents=True, exist_ok=True)
    probe = path.parent / f"{path.name}-fake-cuda-probe.py"
    probe.write_text(FAKE_CUDA_PROBE)
    path.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -m ] && [ "$2" = benchmarks.device_probe ]; then\n'
        "  shift 2\n"
        f'  DPBENCH_STAND_IN_GPUS=\'{json.dumps(gpus)}\' exec "{real}" "{probe}" "$@"\n'
        "fi\n"
        f'exec "{real}" "$@"\n'
    )
    path.chmod(0o755)
    return path
