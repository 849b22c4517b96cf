"""Shared test helpers. Imports numpy + stdlib only: this file is also loaded by the MXNet
environment's pytest run (tests/mxnet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
MAIN_PYTHON = ROOT / ".venv" / "bin" / "python"
MXNET_PYTHON = ROOT / ".venv-mxnet" / "bin" / "python"


def run_module(
    module: str,
    *args: str,
    python: str | os.PathLike[str] | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """Run `python -m module args...` from the project root; capture text output."""
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1", **(env or {})}
    full_env.pop("XLA_FLAGS", None) if "XLA_FLAGS" not in (env or {}) else None
    return subprocess.run(
        [str(python or sys.executable), "-m", module, *args],
        cwd=ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def read_json(path: str | os.PathLike[str]) -> Any:
    with open(path) as f:
        return json.load(f)


@pytest.fixture
def root() -> Path:
    return ROOT
