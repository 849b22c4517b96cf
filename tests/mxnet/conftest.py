"""Fixtures of the MXNet tests (.venv-mxnet/bin/python -m pytest tests/mxnet)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import SMOKE, run_trainer


@pytest.fixture(scope="module")
def mxnet_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An mxnet-gluon checkpoint after the smoke preset's 2 epochs (a subprocess: ~3 s)."""
    ck = tmp_path_factory.mktemp("mxnet-ckpt") / "ck"
    proc = run_trainer("mxnet-gluon", *SMOKE, "--checkpoint-dir", str(ck))
    assert proc.returncode == 0, proc.stderr[-2000:]
    (ck / ".lock").unlink()
    return ck
