"""scripts/setup.sh on environments that exist: left alone when up to date; console scripts that
name another environment's interpreter (a moved checkout) pointed back at this one's, in place
and offline (scripts/fix_scripts.py); scripts/test.sh's refusals and notes."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import ROOT

CODE = "import sys\nprint('tool')\n"


def make_project(where: Path) -> Path:
    (where / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "setup_plan.py", "fix_scripts.py"):
        shutil.copy(ROOT / "scripts" / name, where / "scripts" / name)
    (where / "requirements").mkdir()
    req = where / "requirements" / "main.txt"
    req.write_text("tensorboard==2.21.0\n")
    venv = where / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)  # runs fix_scripts.py, nothing else
    (venv / "pyvenv.cfg").write_text("home = /usr/bin\n")
    (venv / ".requirements.sha256").write_text(hashlib.sha256(req.read_bytes()).hexdigest() + "\n")
    return where


def script(project: Path, name: str, header: str) -> Path:
    path = project / ".venv" / "bin" / name
    path.write_text(header + CODE)
    path.chmod(0o755)
    return path


def setup(project: Path) -> str:
    env = os.environ | {"DPBENCH_SETUP_DEVICE": "cpu"}  # the CPU plan on a GPU machine too
    proc = subprocess.run(
        ["bash", "scripts/setup.sh", "main"], cwd=project, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_scripts_naming_another_environment_are_pointed_back_once(tmp_path: Path) -> None:
    project = make_project(tmp_path / "moved here")  # a space: pip's /bin/sh form
    python = f"{project / '.venv' / 'bin' / 'python'}"
    own = script(project, "ruff", f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\n")
    system = script(project, "tool", "#!/usr/bin/python3\n")  # not an environment: left alone
    old = tmp_path / "was here" / ".venv" / "bin" / "python"  # deleted with the old checkout
    stale = script(project, "tensorboard", f"#!{tmp_path}/old/.venv/bin/python\n")
    stale_sh = script(project, "pip", f"#!/bin/sh\n'''exec' \"{old}\" \"$0\" \"$@\"\n' '''\n")
    before = {p: p.read_text() for p in (own, system)}
    bare = project / ".venv" / "bin" / "bare"  # an interpreter line and nothing else
    bare.write_text(f"#!{old}")

    out = setup(project)
    assert "3 console script(s) named another environment's python" in out
    expected = f"#!/bin/sh\n'''exec' \"{python}\" \"$0\" \"$@\"\n' '''\n" + CODE
    assert stale.read_text() == expected and stale_sh.read_text() == expected
    assert bare.read_text() == expected.removesuffix(CODE)
    assert os.access(stale, os.X_OK)
    assert {p: p.read_text() for p in (own, system)} == before
    assert subprocess.run([str(stale)], capture_output=True, text=True).stdout == "tool\n"
    assert "console script" not in setup(project)  # repaired for good
    assert "is up to date" in setup(project)


def test_a_symlinked_environment_is_this_one(tmp_path: Path) -> None:
    """A .venv linked to an environment elsewhere (CI's clone): scripts naming the real path
    are its own; a stale one is pointed at the real path."""
    real = make_project(tmp_path / "real")
    tool = script(real, "tensorboard", f"#!{real / '.venv' / 'bin' / 'python'}\n")
    clone = tmp_path / "clone"
    shutil.copytree(real, clone, symlinks=True, ignore=shutil.ignore_patterns(".venv"))
    (clone / ".venv").symlink_to(real / ".venv")
    assert "console script" not in setup(clone)
    assert tool.read_text().startswith(f"#!{real / '.venv' / 'bin' / 'python'}\n")
    # one that is stale is pointed at the real environment, not through the link, which may go
    stale = script(real, "ruff", f"#!{tmp_path}/gone/.venv/bin/python\n")
    assert "1 console script(s)" in setup(clone)
    assert stale.read_text() == f"#!{real / '.venv' / 'bin' / 'python'}\n" + CODE


def test_test_sh_refuses_a_bad_worker_count_before_any_set_up(tmp_path: Path) -> None:
    """DPBENCH_TEST_WORKERS not a whole number from 1: one line, exit 2, before setup.sh
    (absent from this copy: reaching it would fail)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    for bad in ("2x", "0", "-1"):
        env = os.environ | {"DPBENCH_TEST_WORKERS": bad}
        proc = subprocess.run(["bash", "scripts/test.sh"], cwd=tmp_path, env=env,
                              capture_output=True, text=True)  # fmt: skip
        assert proc.returncode == 2 and proc.stdout == "", (bad, proc.stdout, proc.stderr)
        assert proc.stderr.count("\n") == 1 and f"not '{bad}'" in proc.stderr, proc.stderr


NOT_BUILT = "no Python 3.10 or 3.11 here (python3 is 3.13.5); install python3.11 or uv\n"


def test_test_sh_says_in_one_line_why_the_mxnet_suite_did_not_run(tmp_path: Path) -> None:
    """Where setup.sh could not build .venv-mxnet (its note), test.sh runs the main suite and
    the type check, says why tests/mxnet did not run, exits 0 (a python that logs its args)."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "test.sh", tmp_path / "scripts" / "test.sh")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 0\n")
    log = tmp_path / "log"
    (tmp_path / ".venv" / "bin").mkdir(parents=True)
    (tmp_path / ".venv" / "bin" / "python").write_text(f'#!/bin/sh\necho "$*" >>{log}\n')
    (tmp_path / ".venv" / "bin" / "python").chmod(0o755)
    (tmp_path / ".venv-mxnet").mkdir()
    (tmp_path / ".venv-mxnet" / "not-built.txt").write_text(NOT_BUILT)
    env = os.environ | {"DPBENCH_TEST_WORKERS": "1", "PATH": f"{tmp_path}:{os.environ['PATH']}"}
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\nexit 9\n")  # no GPU pass, whatever the machine
    (tmp_path / "nvidia-smi").chmod(0o755)
    proc = subprocess.run(["bash", "scripts/test.sh"], cwd=tmp_path, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"[test] mxnet environment: tests/mxnet did not run: {NOT_BUILT}" in proc.stdout
    assert log.read_text().splitlines() == ["-m pytest tests --ignore=tests/mxnet", "-m mypy"]


def test_compare_gives_setups_reason_for_skipping_mxnet(tmp_path: Path, monkeypatch) -> None:
    """harness.unavailable (asked by every runner): mxnet-gluon's reason is setup.sh's note
    where it left one, else the missing interpreter and its install command."""
    from benchmarks import harness

    monkeypatch.setattr(harness, "ROOT", tmp_path)
    monkeypatch.delenv("DPBENCH_PYTHON_MXNET_GLUON", raising=False)
    (tmp_path / "frameworks").mkdir()
    (tmp_path / "frameworks" / "mxnet_gluon.py").touch()
    assert harness.unavailable(["mxnet-gluon"]) == {
        "mxnet-gluon": f"interpreter {tmp_path}/.venv-mxnet/bin/python not found; install with: "
        "bash scripts/setup.sh mxnet"
    }
    (tmp_path / ".venv-mxnet").mkdir()
    (tmp_path / ".venv-mxnet" / "not-built.txt").write_text(NOT_BUILT)
    assert harness.unavailable(["mxnet-gluon"]) == {"mxnet-gluon": NOT_BUILT.strip()}
