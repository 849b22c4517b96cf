"""The suite is hermetic: it never reads or writes the user's folders. A test that runs a JAX
trainer with the default cache folder (~/.cache/dp-bench) passes under a HOME that holds a
cache of its own, read-only, and leaves every byte of it as it was (conftest.py gives the
session a folder of its own).
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path

from tests.conftest import ROOT, run_module


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
    env = {"HOME": str(home), "XDG_CACHE_HOME": None, "JAX_COMPILATION_CACHE_DIR": None}
    # The suite under that HOME, read-only (root writes anyway: the digests decide), and no
    # session folder of the caller's: a trainer run with the default cache folder passes, and
    # nothing under HOME changed.
    before = snapshot(home)
    temp = tmp_path / "temp"
    temp.mkdir()
    set_writable(home, False)
    try:
        test = "tests/common/test_devices.py::test_the_record_says_what_was_asked_and_the_users_variables"  # noqa: E501
        proc = run_module(
            "pytest", test, "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
            env={**env, "DPBENCH_TEST_HOME": None, "TMPDIR": str(temp),
                 "MPLCONFIGDIR": None, "TORCHINDUCTOR_CACHE_DIR": None},
            python=sys.executable,
        )  # fmt: skip
    finally:
        set_writable(home, True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "1 passed" in proc.stdout, proc.stdout[-2000:]
    assert snapshot(home) == before
    # and the session's own folder went with it
    assert not [p for p in temp.iterdir() if p.name.startswith("dp-bench-test-home-")]
    assert ROOT.is_dir() and os.environ["HOME"] != str(home)
