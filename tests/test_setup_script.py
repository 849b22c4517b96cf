"""scripts/setup.sh on environments that exist: left alone when up to date; repaired in place
when a console script names another environment's interpreter (the checkout was moved, or
packages were installed through another path to it), which otherwise fails with "required file
not found" (`.venv/bin/tensorboard`, the viewer compare names). A stub interpreter stands in for
the environment's python, so nothing is installed."""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ROOT


@pytest.fixture
def project(tmp_path: Path) -> Path:
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "setup.sh", tmp_path / "scripts" / "setup.sh")
    (tmp_path / "requirements").mkdir()
    req = tmp_path / "requirements" / "main.txt"
    req.write_text("tensorboard==2.21.0\n")
    venv = tmp_path / ".venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"  # records how it was called: `-m pip install ...`
    python.write_text(f'#!/bin/sh\necho "$@" >> "{tmp_path}/calls"\n')
    python.chmod(0o755)
    (venv / ".requirements.sha256").write_text(hashlib.sha256(req.read_bytes()).hexdigest() + "\n")
    own = f"#!{venv.resolve()}/bin/python\n"
    for name in ("tensorboard", "ruff"):
        (venv / "bin" / name).write_text(own + "import sys\n")
    (venv / "bin" / "pip").write_text("#!/elsewhere/.venv/bin/python\n")  # pip's own: ignored
    return tmp_path


def setup(project: Path) -> str:
    proc = subprocess.run(
        ["bash", "scripts/setup.sh", "main"], cwd=project, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_an_up_to_date_environment_is_left_alone(project: Path) -> None:
    assert "is up to date" in setup(project)
    assert not (project / "calls").exists()


def test_a_script_naming_another_environment_is_reinstalled_in_place(project: Path) -> None:
    (project / ".venv" / "bin" / "tensorboard").write_text("#!/work/old/.venv/bin/python\n")
    out = setup(project)
    assert ".venv/bin/tensorboard runs /work/old/.venv/bin/python" in out
    calls = (project / "calls").read_text().splitlines()
    assert calls == ["-m pip install -q --force-reinstall --no-deps -r requirements/main.txt"]
