"""An output path that names a directory is refused (issue 41, item 8): --output and
--save-state with a trailing slash (or a last component '.' or '..'), or naming a directory that
exists, are one line and exit 2 before any work, in every trainer (common/trainer.py's
check_outputs) and in the tools that pass them on (compare). Before, "out/" wrote the file "out":
pathlib drops the trailing slash (common/runtime.py's unwritable)."""

from __future__ import annotations

import pytest

from common.runtime import unwritable
from tests.conftest import SMOKE, one_line_error, run_trainer


@pytest.mark.parametrize("tail", ["/", "/.", "/.."])
def test_a_file_path_that_ends_as_a_directory_is_unwritable(tail, tmp_path):
    path = f"{tmp_path}/out{tail}"
    assert "names a directory" in str(unwritable(path, "file"))
    assert unwritable(path, "dir") is None  # as a directory it is fine
    assert unwritable(tmp_path / "out", "file") is None
    assert "exists and is not a file" in str(unwritable(tmp_path, "file"))


@pytest.mark.parametrize("framework", ["torch-dp", "jax-pmap"])
def test_a_trainer_refuses_an_output_with_a_trailing_slash(framework, tmp_path):
    out = tmp_path / "out"
    bad = run_trainer(framework, *SMOKE, "--output", f"{out}/", timeout=120)
    one_line_error(bad, f"--output {out}/", "names a directory")  # was: exit 0, the file "out"
    assert not out.exists()


def test_a_trainer_refuses_an_output_that_is_a_directory(tmp_path):
    bad = run_trainer("torch-dp", *SMOKE, "--save-state", str(tmp_path), timeout=120)
    one_line_error(bad, f"--save-state {tmp_path}", "exists and is not a file")


def test_compare_refuses_a_save_state_with_a_trailing_slash(tmp_path, monkeypatch, capsys):
    from benchmarks import compare, harness

    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    monkeypatch.setattr(harness, "detect_gpus", lambda: [])
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    out = tmp_path / "out"
    rc = compare.main(["--frameworks", "torch-dp", "--gpus", "1", "--preset", "smoke",
                       "--save-state", f"{tmp_path}/s/", "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "names a directory" in err[0], err
    assert not out.exists() and not (tmp_path / "s").exists()


def test_a_jax_cache_dir_that_cannot_be_created_is_refused_before_the_run(tmp_path):
    """HOME on /proc (or read-only): the default --cache-dir ~/.cache/dp-bench cannot be
    created. It ended a JAX run with "failed: FileNotFoundError: '/proc/.cache'", exit 1
    (independent battery for #41); now one line naming --cache-dir and the way out, exit 2,
    before any work. Torch does not use it; --no-compile-cache needs none."""
    from common.config import preset
    from common.errors import ConfigError
    from common.preflight import check_outputs

    for framework in ("jax-pmap", "jax-shard", "jax-shardmap"):
        cfg = preset("smoke", framework=framework, cache_dir="/proc/nope/dp-bench")
        with pytest.raises(ConfigError, match=r"--cache-dir /proc/nope/dp-bench: .*--no-compile"):
            check_outputs(cfg)
        check_outputs(cfg.replace(compile_cache=False))
    check_outputs(preset("smoke", framework="torch-dp", cache_dir="/proc/nope/dp-bench"))
    check_outputs(preset("smoke", framework="jax-pmap", cache_dir=str(tmp_path / "c")))
    assert not (tmp_path / "c").exists()  # checked, not created
