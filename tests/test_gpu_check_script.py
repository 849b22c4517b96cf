"""scripts/gpu_check.sh, the whole GPU check in one call, on the CPU: its own plumbing, not the
GPU work (benchmarks/gpu_suite.sh has its own tests where a GPU is, tests/test_gpu.py). In a copy
of the scripts: .venv/bin/python becomes a script that execs the given interpreter (a link
would lose a virtual environment's packages), a real environment is left alone, a step that no
longer fits the budget is listed as skipped, everything ends up in ONE archive, and bad flags
are one line with exit 2."""

from __future__ import annotations

import os
import shutil
import subprocess
import tarfile
from pathlib import Path

from tests.conftest import MAIN_PYTHON, ROOT


def project(where: Path) -> Path:
    for rel in ("scripts/gpu_check.sh", "benchmarks/gpu_suite.sh"):
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, where / rel)
    return where


def check(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=root, capture_output=True,
                          text=True, timeout=120, env=os.environ | {"TESTS_SEC": "60"})  # fmt: skip


def test_the_interpreter_is_wrapped_and_everything_is_one_archive(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    archive = tmp_path / "out" / "gpu.tar.xz"
    # no tests, a step the budget cannot hold (it needs 40 s): skipped, listed, exit 1
    proc = check(root, "--python", str(MAIN_PYTHON), "--no-tests", "--steps", "1",
                 "--archive", str(archive), str(tmp_path / "run"), "50")  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    wrapper = root / ".venv" / "bin" / "python"
    assert not wrapper.is_symlink() and wrapper.read_text().startswith("#!/bin/sh\nexec ")
    prefix = subprocess.run([str(wrapper), "-c", "import sys, numpy; print(sys.prefix)"],
                            capture_output=True, text=True, check=True).stdout.strip()  # fmt: skip
    assert Path(prefix) == MAIN_PYTHON.parent.parent  # its environment, packages and all
    assert not (tmp_path / "run").exists()  # packed, not left loose
    with tarfile.open(archive) as tar:
        names = {Path(n).name: n for n in tar.getnames()}
        commands = tar.extractfile(names["commands.txt"]).read().decode()
    assert {"commands.txt", "machine.txt"} <= set(names)
    assert "- skipped (time budget): env STEPS=1 bash benchmarks/gpu_suite.sh" in commands
    assert "(exit 1)" in commands


def test_a_real_environment_is_left_alone_and_the_tests_step_is_timed(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    # an environment of its own (it has a pyvenv.cfg) whose python runs the tests' interpreter
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")
    own = root / ".venv" / "bin" / "python"
    own.write_text(f'#!/bin/sh\n# its own\nexec "{MAIN_PYTHON}" "$@"\n')
    own.chmod(0o755)
    (root / "tests").mkdir()
    (root / "tests" / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "run"
    proc = check(root, "--steps", "", str(out), "120")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "# its own" in own.read_text()  # not replaced
    assert "1 passed" in (out / "tests.log").read_text()
    assert (out / "tests.xml").is_file()
    commands = (out / "commands.txt").read_text()
    assert "-n " in commands and "--dist loadfile" in commands and "exit 0 after" in commands


def test_bad_flags_are_one_line_and_exit_2(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    for args, says in (
        (["--steps", "one", "out"], "--steps takes numbers such as 1,8, not one"),
        (["--fast", "out"], "unknown option --fast"),
        (["--python", str(tmp_path / "nope"), "out"], "no interpreter"),
        (["out", "soon"], "SECONDS must be a whole number, not soon"),
    ):
        proc = check(root, *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, args
        assert not (root / "out").exists(), args  # nothing written before the check
