"""Hostile and careless input, round two (issue 29): launcher variables that are no integers,
tools that ran nothing, conflicting batch flags, empty harness flags, a checkpoint directory
that cannot be written, damaged run records, trainers started as scripts, malformed XLA_FLAGS.

Same style as tests/test_hostile_inputs.py: exit 2 and one line naming the problem for bad
input, checked in-process where the parser or plan decides it."""

from __future__ import annotations

import os

import pytest

from common.config import ConfigError
from tests.conftest import SMOKE, one_line_error, run_trainer

# ---- integer launcher variables (WORLD_SIZE=abc) --------------------------------------------

LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@pytest.mark.parametrize(
    "bad",
    [
        {"RANK": "0", "WORLD_SIZE": "abc"},
        {"RANK": "x", "WORLD_SIZE": "2"},
        {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "q"},
        {"RANK": "0", "WORLD_SIZE": "0"},
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "abc"},
        {"SLURM_PROCID": "zz", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"},
    ],
)  # fmt: skip
def test_launcher_integer_variables_are_named(monkeypatch, bad):
    from frameworks.torch_launch import launch_env

    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    for var in LAUNCH_VARS:
        env.pop(var, None)
    env.update(bad)
    monkeypatch.setattr(os, "environ", env)
    name = next(k for k, v in bad.items() if not v.isdigit() or v == "0" and k == "WORLD_SIZE")
    with pytest.raises(ConfigError, match=f"environment variable {name}=.* must be an integer"):
        launch_env()


def test_jax_slurm_ntasks_not_an_integer_is_named(monkeypatch):
    from frameworks.jax_support import init_distributed

    for var in [v for v in os.environ if v.startswith(("SLURM_", "JAX_COORDINATOR"))]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("SLURM_NTASKS", "abc")
    with pytest.raises(ConfigError, match="SLURM_NTASKS='abc' must be an integer"):
        init_distributed()


def test_world_size_not_an_integer_refused_by_a_trainer(tmp_path):
    out = tmp_path / "r.json"
    env = {"RANK": "0", "WORLD_SIZE": "abc"}
    bad = run_trainer("torch-ddp", *SMOKE, "--output", str(out), env=env)
    one_line_error(bad, "WORLD_SIZE='abc' must be an integer", "unset WORLD_SIZE")
    assert not out.exists()


# ---- a tool that ran nothing does not exit 0 -----------------------------------------------


@pytest.fixture
def no_probe(monkeypatch) -> None:
    from benchmarks import harness

    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    monkeypatch.setattr(harness, "detect_gpus", lambda: [])


def test_throughput_with_every_framework_skipped_is_refused(tmp_path, monkeypatch, capsys):
    from benchmarks import harness, throughput

    monkeypatch.setattr(harness, "detect_gpus", lambda: [])
    monkeypatch.setattr(harness, "unavailable", lambda names: {n: "not installed" for n in names})
    out = tmp_path / "out"
    rc = throughput.main(["--frameworks", "torch-dp,jax-pmap", "--gpus", "1", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert "nothing can run (torch-dp: not installed; jax-pmap: not installed)" in err[0]
    assert not out.exists()


# ---- --batch-size and --batch-per-device both given -----------------------------------------


def test_batch_size_and_batch_per_device_that_disagree_are_refused(capsys):
    from common import cli

    flags = ["--preset", "smoke", "--gpus", "2", "--batch-per-device", "8"]
    with pytest.raises(SystemExit) as exit_:
        cli.parse_args([*flags, "--batch-size", "64"], "torch-dp")
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(err) == 1, err
    assert "--batch-size 64 disagrees with --batch-per-device 8 x --gpus 2 = 16" in err[0]
    assert cli.parse_args([*flags, "--batch-size", "16"], "torch-dp").batch_size == 16  # agree
    assert cli.parse_args(flags, "torch-dp").batch_size == 16
    # A preset's per-device batch is no conflict: an explicit --batch-size wins over it.
    wrn = cli.parse_args(["--preset", "cifar10-wrn-nvidia", "--batch-size", "64"], "torch-dp")
    assert (wrn.batch_size, wrn.batch_per_device) == (64, 0)


def test_compare_refuses_disagreeing_batch_flags(tmp_path, no_probe, capsys):
    from benchmarks import compare

    out = tmp_path / "out"
    rc = compare.main(["--frameworks", "torch-dp", "--gpus", "1,2", "--preset", "smoke",
                       "--scaling", "weak", "--batch-size", "64", "--batch-per-device", "8",
                       "--out", str(out)])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "--batch-size 64 disagrees with" in err[0], err
    assert not out.exists()


# ---- empty harness flags are no defaults ---------------------------------------------------


@pytest.mark.parametrize("tool", ["compare", "throughput", "parity"])
@pytest.mark.parametrize(
    "flag,fragment",
    [("--gpus=", "--gpus is empty; give a count"), ("--out=", "--out is empty; give a directory")],
)
def test_empty_gpus_or_out_is_refused(tool, flag, fragment, no_probe, monkeypatch, capsys):
    import importlib

    module = importlib.import_module(f"benchmarks.{tool}")
    monkeypatch.setattr(module, "execute", lambda plan: pytest.fail("the tool started"))
    rc = module.main(["--frameworks", "torch-dp", flag])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and fragment in err[0], err


@pytest.mark.parametrize("tool", ["compare", "throughput", "parity"])
def test_an_out_the_file_system_cannot_name_is_one_line(
    tool, tmp_path, no_probe, monkeypatch, capsys
):
    import importlib

    module = importlib.import_module(f"benchmarks.{tool}")
    monkeypatch.setattr(module, "execute", lambda plan: pytest.fail("the tool started"))
    rc = module.main(["--frameworks", "torch-dp", "--out", str(tmp_path / ("a" * 300))])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "File name too long; choose another --out" in err[0], err


# ---- a small disk: the refusal says the bytes needed and free --------------------------------


def test_compare_small_disk_says_bytes_needed_and_free(tmp_path, no_probe, monkeypatch, capsys):
    from benchmarks import compare
    from common.runtime import MIN_FREE_BYTES

    frsize = os.statvfs(tmp_path).f_frsize

    class Small:  # 1.5 MiB free: enough for a trainer's --output, not for compare's reserve
        f_blocks, f_bavail, f_frsize = 1000, (3 << 19) // frsize, frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Small())
    monkeypatch.setattr(compare, "execute", lambda plan: pytest.fail("compare started"))
    rc = compare.main(["--frameworks", "torch-dp", "--gpus", "1", "--preset", "smoke",
                       "--out", str(tmp_path / "out")])  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    free, need = Small.f_bavail * frsize, MIN_FREE_BYTES + compare.RESERVE_BYTES
    assert rc == 2 and len(err) == 1, err
    assert f"is full ({free} bytes free, {need} needed)" in err[0], err


# ---- the report: a damaged run record is "damaged", not "not run" ---------------------------


def test_report_shows_a_truncated_record_as_damaged(tmp_path, no_probe, capsys):
    import csv
    import json

    from benchmarks import report
    from tests.hostile_helpers import a_comparison

    out = tmp_path / "out"
    a_comparison(out, "torch-ddp", "1,2")
    (out / "runs" / "torch-ddp-1dev.json").write_text('{"framework": "torch-ddp", "stat')  # cut
    assert report.main([str(out)]) == 0
    capsys.readouterr()
    with open(out / "results.csv") as f:
        rows = {r["devices"]: r for r in csv.DictReader(f)}
    assert rows["1"]["status"] == "damaged", rows["1"]
    assert "runs/torch-ddp-1dev.json is damaged" in rows["1"]["note"], rows["1"]
    assert rows["2"]["status"] == "not run"  # no file at all: still "not run"
    assert json.loads((out / "config.json").read_text())["runs"]


# ---- a trainer started as a script ---------------------------------------------------------


def test_a_trainer_started_as_a_script_says_use_dash_m(tmp_path):
    from tests.conftest import MAIN_PYTHON, run_python

    out = tmp_path / "r.json"
    args = ("frameworks/torch_dp.py", *SMOKE, "--output", str(out))
    bad = run_python(MAIN_PYTHON, *args, env={"PYTHONPATH": None})  # was: No module 'common'
    one_line_error(bad, "python -m frameworks.torch_dp", "not python frameworks/torch_dp.py")
    bad = run_python(MAIN_PYTHON, *args)  # with the root on PYTHONPATH: the same one rule
    one_line_error(bad, "python -m frameworks.torch_dp", "not python frameworks/torch_dp.py")
    assert not out.exists()


# ---- a malformed XLA_FLAGS -----------------------------------------------------------------


def test_xla_flags_that_are_no_flags_are_one_line(monkeypatch):
    from common.runtime import check_xla_flags

    monkeypatch.setenv("XLA_FLAGS", "garbage --xla_force_host_platform_device_count=2")
    with pytest.raises(ConfigError, match="'garbage' is not an XLA flag"):
        check_xla_flags()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    check_xla_flags()  # the project's own flags: no probe, no error


def test_unknown_xla_flag_refused_by_a_trainer(tmp_path):
    out = tmp_path / "r.json"
    env = {"XLA_FLAGS": "--xla_bogus_flag=1"}  # XLA aborted the process: exit 1, no record
    bad = run_trainer("jax-pmap", *SMOKE, "--output", str(out), env=env)
    one_line_error(bad, "XLA does not know --xla_bogus_flag=1", "unset XLA_FLAGS")
    assert not out.exists()
