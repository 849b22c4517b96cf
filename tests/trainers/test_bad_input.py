"""Bad input: a flag, value, variable or path that cannot work is one stderr line naming it,
exit 2, before any work and with nothing written; the trainers' checks (common/cli.py,
common/preflight.py) and the tools' own. Writes that fail: tests/trainers/test_output_files.py."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare, compute_only, harness, parity, throughput, tutorial_loops
from benchmarks.analysis import ab, comm_probe
from common import cli, runtime
from common.config import ConfigError, preset
from common.preflight import check_outputs
from common.runtime import ENTRY_POINTS
from common.trainer import run_main
from tests.conftest import (
    MAIN_PYTHON,
    MXNET_PYTHON,
    ROOT,
    SMOKE,
    one_line_error,
    run_module,
    run_trainer,
)

# ---- values: every one range-checked before anything starts ----------------------------------

BAD_VALUES = [  # (flags, a fragment of the one-line error)
    (("--seed", "-1"), "--seed must be in [0,"),
    (("--seed", str(2**32)), "--seed must be in [0,"),
    (("--width", "nan"), "--width must be in (0, 8]"),
    (("--width", "0"), "--width must be in (0, 8]"),
    (("--width", "1e4"), "--width must be in (0, 8]"),
    (("--warmup-epochs", "-1"), "--warmup-epochs"),
    (("--warmup-start-factor", "-1"), "--warmup-start-factor"),
    (("--max-steps-per-epoch", "-1"), "--max-steps-per-epoch must be >= 0"),
    (("--lr-base-batch", "0"), "--lr-base-batch must be >= 1"),
    (("--label-smoothing", "5"), "--label-smoothing must be in [0, 1)"),
    (("--label-smoothing", "nan"), "--label-smoothing must be in [0, 1)"),
    (("--train-limit", "-50"), "--train-limit must be >= 0"),
    (("--test-limit", "-1"), "--test-limit must be >= 0"),
    (("--image-size", "3000"), "--image-size must be 0 (native) or in [8, 512]"),
    (("--image-size", "4"), "--image-size must be 0 (native) or in [8, 512]"),
    (("--eval-batch-size", "0"), "--eval-batch-size must be >= 1"),
    (("--gpus", "0"), "--gpus must be >= 1"),
    (("--gpus", "1000"), "--gpus must be <= 64"),
    (("--gpus", "16", "--batch-size", "1600"), "larger than the synthetic training set"),
    (("--batch-size", "200"), "use --batch-size 96 or less"),
    (("--gpus", "5", "--batch-size", "200"), "use --batch-size 95 or less"),
    (("--gpus", "2", "--batch-size", "25"), "--batch-size 24 or 26"),
    (("--lr", "nan"), "--lr must be a positive number"),
    (("--lr", "inf"), "--lr must be a positive number"),
    (("--lr", "0"), "--lr must be a positive number"),
    (("--lr-step-factor", "0"), "--lr-step-factor"),
    (("--lr-step-epochs", "0,3"), "--lr-step-epochs"),
    (("--momentum", "1.5"), "--momentum must be in [0, 1)"),
    (("--weight-decay", "-1"), "--weight-decay must be in [0, 1)"),
    (("--dropout", "1"), "--dropout must be in [0, 1)"),
    (("--bn-eps", "0"), "--bn-eps must be in (0, 1)"),
    (("--bn-momentum", "2"), "--bn-momentum must be in [0, 1]"),
    (("--target-accuracy", "2"), "--target-accuracy must be in [0, 1]"),
    (("--patience", "0"), "--patience must be >= 1"),
    (("--epochs", "0"), "--epochs must be in [1,"),
    (("--epochs", "10000000"), "--epochs must be in [1,"),
    (("--epochs", "x"), "invalid int value"),
    (("--log-every", "-1"), "--log-every must be >= 0"),
    (("--prefetch", "-1"), "--prefetch must be in [0, 64]"),
    (("--batch-per-device", "-2"), "--batch-per-device must be >= 0"),
    (("--preset", "nope"), "unknown preset 'nope'"),
    (("--compile-mode", "reduce-overhead"), "--compile-mode reduce-overhead needs --compile"),
    (("--resume",), "--resume needs --checkpoint-dir"),
    (("--gpus", "2", "--batch-per-device", "8", "--batch-size", "64"),
     "--batch-size 64 disagrees with --batch-per-device 8 x --gpus 2 = 16"),
]  # fmt: skip


@pytest.mark.parametrize("flags,fragment", BAD_VALUES, ids=[" ".join(f) for f, _ in BAD_VALUES])
def test_a_bad_value_is_one_line_and_exit_2(flags, fragment, capsys) -> None:
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args([*SMOKE, *flags], "torch-ddp")
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and fragment in lines[0], lines


GOOD_VALUES = [
    ("--seed", "0"),
    ("--seed", str(2**32 - 1)),
    ("--width", "8"),
    ("--label-smoothing", "0.1"),
    ("--image-size", "512"),
    ("--gpus", "4"),
    ("--batch-size", "96"),
    ("--warmup-start-factor", "none"),
    ("--max-steps-per-epoch", "0"),
    ("--eval-batch-size", "1000000000"),  # the eval padding is sized by the test set
    ("--gpus", "2", "--batch-per-device", "8", "--batch-size", "16"),  # they agree
]


@pytest.mark.parametrize("flags", GOOD_VALUES, ids=[" ".join(f) for f in GOOD_VALUES])
def test_the_edges_of_every_range_are_still_accepted(flags) -> None:
    cli.parse_args([*SMOKE, *flags], "torch-ddp")


def test_devices_and_images_are_capped_by_the_machines_memory(monkeypatch, capsys) -> None:
    monkeypatch.setattr(runtime, "physical_memory", lambda: 1 << 30)  # a 1 GiB machine
    cli.parse_args([*SMOKE, "--gpus", "4"], "torch-ddp")  # 4 x 256 MiB fits
    for flags, memory, fragment in (
        (("--gpus", "8"), 1 << 30, "this machine allows --gpus 4"),
        (("--image-size", "512", "--width", "0.125"), 256 << 20, "smaller --image-size"),
    ):
        monkeypatch.setattr(runtime, "physical_memory", lambda memory=memory: memory)
        with pytest.raises(SystemExit):
            cli.parse_args([*SMOKE, *flags], "torch-ddp")
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], lines


def test_a_trainer_refuses_bad_flags_before_it_loads_its_framework(tmp_path: Path) -> None:
    """common.cli.check_command_line (from the frameworks package's __init__) refuses before
    the trainer imports torch: shown with a torch that ends the process when imported. Nothing
    is written, no rank started; --help prints; a valid command line reaches the import."""
    (tmp_path / "torch").mkdir()
    (tmp_path / "torch" / "__init__.py").write_text("raise SystemExit('torch imported (stand-in)')")
    env = {"PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    out = tmp_path / "out" / "run.json"
    big = ("--gpus", "16", "--batch-size", "1600", "--output", str(out))
    one_line_error(run_trainer("torch-ddp", *SMOKE, *big, env=env), "global batch 1600")
    assert not out.parent.exists()
    one_line_error(run_trainer("torch-ddp", "--bogus-flag", env=env), "--bogus-flag")
    shown = run_trainer("torch-ddp", "--help", env=env)
    assert shown.returncode == 0 and "usage: python -m frameworks." in shown.stdout, shown.stderr
    started = run_trainer("torch-ddp", *SMOKE, env=env)
    assert started.returncode == 1 and "torch imported (stand-in)" in started.stderr


@pytest.mark.parametrize("module", ["frameworks.jax_pmap", "frameworks.mxnet_gluon"])
def test_an_entry_point_run_by_the_wrong_interpreter_is_one_line_and_exit_2(module: str) -> None:
    """MXNet lives in .venv-mxnet, torch and JAX in .venv: the wrong one names the right one
    (common/runtime.py's ENTRY_POINTS); the right one runs."""
    if not MXNET_PYTHON.exists():
        pytest.skip("needs .venv-mxnet (bash scripts/setup.sh mxnet)")
    mxnet = "mxnet" in ENTRY_POINTS[module]
    wrong, right = (MAIN_PYTHON, MXNET_PYTHON) if mxnet else (MXNET_PYTHON, MAIN_PYTHON)
    line = one_line_error(run_module(module, "--help", python=wrong, timeout=60))
    assert line.startswith(f"python -m {module}: error: ")
    assert f"{right.parent.parent.name}/bin/python -m {module}" in line
    shown = run_module(module, "--help", python=right, timeout=120)
    assert shown.returncode == 0 and "usage" in shown.stdout, shown.stderr[-2000:]


def test_xla_flags_that_are_no_flags_are_one_line(monkeypatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "garbage --xla_force_host_platform_device_count=2")
    with pytest.raises(ConfigError, match="'garbage' is not an XLA flag"):
        runtime.check_xla_flags()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    runtime.check_xla_flags()


# ---- the tools' own options -----------------------------------------------------------------

TOOL_CASES = [
    (compare, ("--repeat", "100000000"), "--repeat must be <= 1000"),
    (compare, ("--timeout", "nan"), "--timeout must be a finite number"),
    (compare, ("--lr", "nan"), "--lr must be a positive number"),
    (throughput, ("--lr", "nan"), "--lr must be a finite number"),
    (throughput, ("--width", "1e4"), "--width must be <= 8"),
    (comm_probe, ("--width", "0"), "--width must be a finite number > 0"),
    (comm_probe, ("--reps", "100000000"), "--reps must be <= 100000"),
    (tutorial_loops, ("--repeat", "100000"), "--repeat must be <= 1000"),
    (parity, ("--jobs", "1000"), "--jobs must be <= 64"),
    (parity, ("--tolerance", "nan"), "--tolerance must be a finite number"),
    (ab, ("--framework", "torch-dp", "--a", "--lr nan", "--b", ""), "--a: --lr must be"),
    (ab, ("--framework", "torch-dp", "--b", "--lr 1", "--repeat", "99999"), "--repeat must be"),
    (compare, ("--frameworks", "torch-dp", "--gpus", "1,2", "--preset", "smoke", "--scaling",
               "weak", "--batch-size", "64", "--batch-per-device", "8"), "64 disagrees with"),
]  # fmt: skip


@pytest.mark.parametrize(
    "tool,flags,fragment",
    TOOL_CASES,
    ids=[f"{t.__name__.split('.')[-1]} {' '.join(f)}" for t, f, _ in TOOL_CASES],
)
def test_a_tool_refuses_a_bad_option_in_one_line(tool, flags, fragment, tmp_path, no_probe, capsys):
    out = tmp_path / "out"
    rc = tool.main([*flags, "--out", str(out)])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and fragment in lines[0], lines
    assert not out.exists()


@pytest.mark.parametrize("flags,fragment", [
    (("--width", "nan"), "--width must be a finite number"),
    (("--steps", "100000000"), "--steps must be <= 100000"),
    (("--lr", "-1"), "--lr must be >= 0"),
])  # fmt: skip
def test_compute_only_refuses_a_bad_option_in_one_line(flags, fragment, capsys) -> None:
    rc = compute_only.main(["--framework", "torch", *flags])
    lines = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and fragment in lines[0], lines


def test_throughput_with_every_framework_skipped_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(harness, "detect_gpus", lambda: [])
    monkeypatch.setattr(harness, "unavailable", lambda names: {n: "not installed" for n in names})
    out = tmp_path / "out"
    rc = throughput.main(["--frameworks", "torch-dp,jax-pmap", "--gpus", "1", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "nothing can run (torch-dp: not installed; jax-pmap: not installed)" in err[0]
    assert not out.exists()


@pytest.mark.parametrize("tool", [compare, throughput, parity], ids=lambda t: t.__name__)
@pytest.mark.parametrize(
    "flag,fragment",
    [("--gpus=", "--gpus is empty; give a count"), ("--out=", "--out is empty; give a directory")],
)
def test_empty_gpus_or_out_is_refused(tool, flag, fragment, no_probe, monkeypatch, capsys):
    monkeypatch.setattr(tool, "execute", lambda plan: pytest.fail("the tool started"))
    rc = tool.main(["--frameworks", "torch-dp", flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and fragment in err[0], err


# ---- paths: checked before any work (common/preflight.py) ------------------------------------

LONG = "x" * 300  # one component over NAME_MAX (255): ENAMETOOLONG
PATH_CASES = [  # (flag, a path under tmp_path, which holds "file" and "dir", the line's fragment)
    ("--output", "out/", "names a directory"),
    ("--output", "out/..", "names a directory"),
    ("--output", "dir", "exists and is not a file"),
    ("--output", f"{LONG}/r.json", "File name too long"),
    ("--save-state", "file/state.npz", "is not a directory"),
    ("--checkpoint-dir", "file", "exists and is not a directory"),
    ("--data-dir", LONG, "File name too long"),
    ("--data-dir", "file/data", "is a file, not a directory"),
    ("--data-dir", "file", "it is not a directory"),
    ("--cache-dir", "file/c", "is a file, not a directory"),
    ("--profile-dir", "file/p", "is not a directory"),
]


def never_train(cfg: Any) -> dict[str, Any]:
    raise AssertionError("train() started although a path was bad")


def run_stub(*flags: str, capsys) -> tuple[int, list[str]]:
    rc = run_main([*SMOKE, *flags], "torch-dp", check=lambda cfg: None, train=never_train)
    return rc, capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("flag,where,fragment", PATH_CASES, ids=lambda v: v[:20])
def test_a_path_that_cannot_be_written_is_one_line(flag, where, fragment, tmp_path, capsys):
    (tmp_path / "file").write_text("x")
    (tmp_path / "dir").mkdir()
    path = f"{tmp_path}/{where}"
    profile = ("--profile", "5") if flag == "--profile-dir" else ()  # only used with --profile
    rc, err = run_stub(*profile, flag, path, capsys=capsys)
    assert rc == 2 and len(err) == 1 and f"{flag} {path}" in err[0] and fragment in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir", "file"]  # nothing created


def test_a_read_only_or_full_output_directory_is_refused(tmp_path, monkeypatch, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != ro and real_access(p, m))
    rc, err = run_stub("--output", str(ro / "sub" / "run.json"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "is not writable" in err[0], err
    assert list(ro.iterdir()) == []  # nothing created, not even the missing sub-directory
    monkeypatch.undo()

    class Full:
        f_bavail, f_frsize = 0, os.statvfs(tmp_path).f_frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Full())
    rc, err = run_stub("--output", str(tmp_path / "run.json"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "is full" in err[0], err


def test_a_real_trainer_refuses_a_bad_output_in_process(tmp_path, capsys) -> None:
    from frameworks import torch_dp

    rc = torch_dp.main([*SMOKE, "--output", f"{tmp_path}/out/"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert (
        err[0].startswith("python -m frameworks.torch_dp: error: --output") and "names a" in err[0]
    )
    assert not (tmp_path / "out").exists()


def test_a_jax_cache_dir_that_cannot_be_created_is_refused_before_the_run(tmp_path) -> None:
    """A HOME on /proc or read-only: the default --cache-dir cannot be created; one line naming
    --cache-dir and --no-compile-cache. Torch does not use it."""
    for framework in ("jax-pmap", "jax-shard", "jax-shardmap"):
        cfg = preset("smoke", framework=framework, cache_dir="/proc/nope/dp-bench")
        with pytest.raises(ConfigError, match=r"--cache-dir /proc/nope/dp-bench: .*--no-compile"):
            check_outputs(cfg)
        check_outputs(cfg.replace(compile_cache=False))
    check_outputs(preset("smoke", framework="torch-dp", cache_dir="/proc/nope/dp-bench"))
    check_outputs(preset("smoke", framework="jax-pmap", cache_dir=str(tmp_path / "c")))
    assert not (tmp_path / "c").exists()  # checked, not created


# ---- compare's --out and the paths it passes on ------------------------------------------------

COMPARE = ["--frameworks", "torch-dp", "--gpus", "1", "--preset", "smoke"]


def test_compare_refuses_an_out_or_a_run_path_that_cannot_be_written(
    tmp_path, monkeypatch, no_probe, capsys
) -> None:
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    (tmp_path / "f").write_text("x")
    for flags, fragment in (
        (["--out", str(tmp_path / "f")], "exists and is not a directory"),
        (["--out", str(tmp_path / "o"), "--save-state", f"{tmp_path}/s/"], "names a directory"),
    ):
        assert compare.main([*COMPARE, *flags]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and fragment in err[0], err
    monkeypatch.setattr(os, "access", lambda p, m: False)
    assert compare.main([*COMPARE, "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not writable" in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f"]


def test_compare_small_disk_says_bytes_needed_and_free(tmp_path, no_probe, monkeypatch, capsys):
    frsize = os.statvfs(tmp_path).f_frsize

    class Small:  # 1.5 MiB free: enough for a trainer's --output, not for compare's reserve
        f_blocks, f_bavail, f_frsize = 1000, (3 << 19) // frsize, frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Small())
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    rc = compare.main([*COMPARE, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    free, need = Small.f_bavail * frsize, runtime.MIN_FREE_BYTES + compare.RESERVE_BYTES
    assert rc == 2 and len(err) == 1, err
    assert f"is full ({free} bytes free, {need} needed)" in err[0], err


def test_two_compares_on_one_out_cannot_both_start(tmp_path, no_probe, monkeypatch, capsys):
    """The second finds the first's lock (and, after it, the first's config.json)."""
    out = tmp_path / "out"
    out.mkdir()
    ran = []
    monkeypatch.setattr(compare, "execute", lambda plan: ran.append(plan) or 0)
    with open(out / harness.LOCK_NAME, "a") as first:  # the first compare, still starting
        fcntl.flock(first, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert compare.main([*COMPARE, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is in use by another run" in err[0] and not ran
    assert compare.main([*COMPARE, "--out", str(out)]) == 0 and len(ran) == 1  # free again
    assert not (out / harness.LOCK_NAME).exists()  # released and removed


# ---- a dataset directory that cannot be read -----------------------------------------------


def test_a_dataset_that_cannot_be_read_is_one_line(tmp_path, no_probe, monkeypatch, capsys):
    """cifar10's archive in place, reading it fails as without read permission (simulated:
    root reads everything): the loaders and compare's check say so in one line."""
    from common import datasets

    root = tmp_path / "data" / "cifar10"
    root.mkdir(parents=True)
    archive = root / "cifar-10-python.tar.gz"
    archive.write_bytes(b"x")

    def denied(path: Path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(datasets, "md5sum", denied)
    cfg = preset("cifar10-resnet18", data_dir=str(tmp_path / "data"))
    for load in (datasets.check_available, datasets.load_for):
        with pytest.raises(datasets.DatasetError, match=f"cannot read {archive} \\(Permission"):
            load(cfg)
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    rc = compare.main(["--frameworks", "torch-dp", "--gpus", "1", "--preset", "cifar10-resnet18",
                       "--data-dir", cfg.data_dir, "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and f"cannot read {archive}" in err[0], err
