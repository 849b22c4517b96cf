"""Shared test helpers. Imports numpy + stdlib only: this file is also loaded by the MXNet
environment's pytest run (tests/mxnet).

- `run_trainer(framework, *args)`: `python -m frameworks.<module> args...` with the framework's
  own interpreter (MXNet's is .venv-mxnet/bin/python), from the project root.
- `ok(proc)`: assert exit 0, showing the ends of stdout and stderr otherwise.
- `one_line_error(proc, *fragments)`: exit 2 with exactly one stderr line naming the problem.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"

FRAMEWORKS = ("torch-dp", "torch-ddp", "jax-pmap", "jax-shard", "mxnet-gluon")
SMOKE = ("--preset", "smoke", "--prefetch", "1")  # tiny model, 16x16 synthetic images
# For one step of two different programs (N devices vs 1): the smoke preset's first step with
# seed 0 holds a near-tie (a value within float rounding of a ReLU kink, say) that the rounding
# of a multi-process reduction flips: torch-ddp and jax-shard at 2 processes then differ from
# the 1-process step by 1.1% of the update, every single-process program by 3e-6. With seeds 1
# and 2 the 2-process step agrees with the 1-process step to 7e-7.
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


def run_python(
    python: str | os.PathLike[str],
    *args: str,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run `python args...` from the project root; capture text output. XLA_FLAGS is not
    inherited (a JAX trainer sets its own device count) unless `env` gives it."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    full_env.pop("XLA_FLAGS", None)
    full_env.update(env or {})
    return subprocess.run(
        [str(python), *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def run_module(
    module: str,
    *args: str,
    python: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m module args...` (this interpreter unless `python` is given)."""
    return run_python(python or sys.executable, "-m", module, *args, env=env, timeout=timeout)


def run_trainer(
    framework: str, *args: str, env: dict[str, str] | None = None, timeout: float = 300
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
    """Run `python -m module args --output tmp_path/record.json`, which must succeed; its record
    and its stdout."""
    out = tmp_path / "record.json"
    proc = run_module(module, *args, "--output", str(out), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return read_json(out), proc.stdout


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path) as f:
        return json.load(f)


def relative_update_difference(
    before: dict[str, np.ndarray], a: dict[str, np.ndarray], b: dict[str, np.ndarray]
) -> float:
    """||dA - dB|| / ||dB|| over all float tensors together, dX = X - before: how far two
    programs' updates from the same starting point disagree, relative to the update (the
    weights' own magnitude would hide a wrong update). Over all tensors, not per tensor: a BN
    bias whose gradient is a near-cancelling sum has a tiny update, and float rounding alone
    moves it by percents (2% measured for 2 processes x 2 devices vs 1 device)."""
    keys = [k for k in before if np.issubdtype(np.asarray(before[k]).dtype, np.floating)]
    assert keys and set(keys) <= set(a) and set(keys) <= set(b), (sorted(a), sorted(b))
    da = np.concatenate([(np.asarray(a[k], np.float64) - before[k]).ravel() for k in keys])
    db = np.concatenate([(np.asarray(b[k], np.float64) - before[k]).ravel() for k in keys])
    assert np.linalg.norm(db) > 0, "the step did not move the weights"
    return float(np.linalg.norm(da - db) / np.linalg.norm(db))


@pytest.fixture
def root() -> Path:
    return ROOT
