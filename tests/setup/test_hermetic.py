"""The suite is hermetic: a test that compiles with JAX, in pytest's process and in a child
with a trainer's default cache folder, passes under a read-only HOME holding a cache of its own
and leaves every byte of it as it was (conftest.py gives the session a folder of its own)."""

from __future__ import annotations

import hashlib
import stat
import sys
from pathlib import Path

from tests.conftest import run_module

# Run by a pytest that loads tests/conftest.py as a plugin, as the suite's own files do.
INNER = '''
import os, subprocess, sys
import jax

CHILD = """
import jax
from common.config import preset
from frameworks.jax_support import use_compile_cache
print(use_compile_cache(preset("smoke")))
jax.jit(lambda x: x + 1)(1)
"""


def test_compiles_here_and_in_a_trainer_like_child():
    jax.jit(lambda x: x * 2)(1)
    proc = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith(os.environ["DPBENCH_TEST_HOME"]), proc.stdout
'''


def snapshot(folder: Path) -> dict[str, str]:
    """Every path under `folder` with its content's digest ("dir" for a folder)."""
    return {
        str(p.relative_to(folder)): "dir"
        if p.is_dir()
        else hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
    }


def set_writable(folder: Path, writable: bool) -> None:
    for p in [folder, *folder.rglob("*")]:
        mode = p.stat().st_mode
        bits = stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH
        p.chmod(mode | stat.S_IWUSR if writable else mode & ~bits)


def test_the_suite_never_touches_the_users_cache(tmp_path: Path) -> None:
    home = tmp_path / "home"
    cache = home / ".cache" / "dp-bench" / "jax"
    cache.mkdir(parents=True)
    (cache / "jit_train_step-0123-cache").write_bytes(b"an entry cut short")
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "test_inner.py").write_text(INNER)
    env = {"HOME": str(home), "XDG_CACHE_HOME": None, "JAX_COMPILATION_CACHE_DIR": None,
           "DPBENCH_TEST_CPU_LOG": None}  # fmt: skip
    # HOME read-only (root writes anyway: the digests decide), no session folder of the caller's
    before = snapshot(home)
    temp = tmp_path / "temp"
    temp.mkdir()
    set_writable(home, False)
    try:
        proc = run_module(
            "pytest", str(tmp_path / "inner"), "-q", "-p", "tests.conftest",
            "-p", "no:cacheprovider", "-p", "no:xdist", "-p", "no:randomly",
            env={**env, "DPBENCH_TEST_HOME": None, "TMPDIR": str(temp),
                 "MPLCONFIGDIR": None, "TORCHINDUCTOR_CACHE_DIR": None},
            python=sys.executable,
        )  # fmt: skip
    finally:
        set_writable(home, True)
    assert "1 passed" in proc.stdout and proc.returncode == 0, proc.stdout[-3000:]
    assert snapshot(home) == before
    # and the session's own folder went with it
    assert not [p for p in temp.iterdir() if p.name.startswith("dp-bench-test-home-")]
