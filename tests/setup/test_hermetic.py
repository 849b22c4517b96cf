"""The suite is hermetic and a user's damaged JAX cache costs one note line (#42).

- A trainer whose compilation cache (the default --cache-dir, ~/.cache/dp-bench) holds entries
  cut short runs, compiles again and says so in one stderr line (JAX warns, two lines per entry).
- An entry JAX began to write and never finished (a full disk, a killed writer) is dropped when
  a trainer opens the cache: it made every later write in the folder fail.
- The suite never reads or writes the user's folders: a test that runs a JAX trainer with the
  default cache folder passes under a HOME that holds exactly such a damaged cache, read-only,
  and leaves every byte of it as it was (conftest.py gives the session a folder of its own).
"""

from __future__ import annotations

import hashlib
import os
import stat
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, SMOKE, ok, run_module, run_trainer


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


def test_a_damaged_user_cache_is_one_note_and_the_suite_never_touches_it(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "XDG_CACHE_HOME": None, "JAX_COMPILATION_CACHE_DIR": None}
    ok(run_trainer("jax-pmap", *SMOKE, "--epochs", "1", env=env))  # fills ~/.cache/dp-bench
    entries = [p for p in (home / ".cache" / "dp-bench" / "jax").rglob("*") if p.is_file()]
    damaged = [p for p in entries if p.stat().st_size > 64 and "lock" not in p.name]
    assert damaged, entries
    for p in damaged:  # cut short, as by a full disk or a killed writer
        p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])

    proc = run_trainer("jax-pmap", *SMOKE, "--epochs", "1", env=env)
    ok(proc)
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(
        f"note: JAX's compilation cache in {home / '.cache' / 'dp-bench' / 'jax'} has an entry "
        "it cannot read ("
    ), line
    assert line.endswith("(remove that folder, or run with --no-compile-cache)"), line

    # The suite under that HOME, read-only (root writes anyway: the digests decide), and no
    # session folder of the caller's: the test that broke on such a cache (#42) passes, and
    # nothing under HOME changed.
    for p in damaged:  # damaged again: the run above may have replaced an entry
        p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 2)])
    before = snapshot(home)
    temp = tmp_path / "temp"
    temp.mkdir()
    set_writable(home, False)
    try:
        test = "tests/common/test_devices.py::test_a_cuda_plugin_that_cannot_start_is_one_line"
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


def test_an_unfinished_cache_entry_is_dropped_and_jax_writes_again(tmp_path: Path) -> None:
    """A write cut short between JAX's two files of an entry (`<key>-cache`, then `<key>-atime`)
    leaves the first without the second. JAX's LRU cache reads every entry's -atime before each
    write, so one such file made every later write in the folder fail: the suite's full-disk
    tests once did it to the session's cache, and every JAX run after them printed a note (two
    one-line tests failed) and cached nothing. The trainers drop such entries when they open
    the cache (jax_support.drop_unfinished_cache_entries); finished entries stay. Shown with
    JAX's own cache code."""
    from jax._src.lru_cache import LRUCache

    from frameworks.jax_support import drop_unfinished_cache_entries

    cache = LRUCache(str(tmp_path), max_size=1 << 20)
    cache.put("done", b"d" * 100)
    (tmp_path / "cut-cache").write_bytes(b"c" * 40)  # the write the full disk stopped
    with pytest.raises(FileNotFoundError, match="cut-atime"):
        cache.put("next", b"n" * 10)
    assert drop_unfinished_cache_entries(str(tmp_path)) == 1
    assert not (tmp_path / "cut-cache").exists()
    cache.put("next", b"n" * 10)
    assert cache.get("done") == b"d" * 100 and cache.get("next") == b"n" * 10
    assert drop_unfinished_cache_entries(str(tmp_path)) == 0  # finished entries are kept
