"""Hostile and careless flags and variables (issues 15 and 29): every value range-checked
before anything starts, the tools' own options, conflicting or empty flags, launcher and XLA
variables that are no integers or no flags, an entry point started by the wrong interpreter.

Every case asserts the exit code (2 = bad input), the one-line message naming the problem, and
that nothing ran or was written. Most run in-process (the parser, the tools' main()); the few
that need a real trainer start it and it exits before any work. Paths, files and full disks:
tests/trainers/test_output_files.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import compare, compute_only, parity, throughput, tutorial_loops
from benchmarks.analysis import ab, comm_probe
from common import cli, runtime
from common.config import ConfigError, preset
from common.datasets import load_for
from common.pipeline import EvalLoader
from common.runtime import ENTRY_POINTS
from tests.conftest import (
    MAIN_PYTHON,
    MXNET_PYTHON,
    SMOKE,
    one_line_error,
    run_module,
    run_trainer,
)

# ---- values: every one range-checked before anything starts ----------------------------------

# (flags, a fragment of the one-line error). Each of these was accepted before (issue 15 item 7)
# and ended in a traceback, a MemoryError, a silent wrong run or 1000 started processes.
BAD_VALUES = [
    (("--seed", "-1"), "--seed must be in [0,"),
    (("--seed", str(2**32)), "--seed must be in [0,"),
    (("--width", "nan"), "--width must be in (0, 8]"),
    (("--width", "inf"), "--width must be in (0, 8]"),
    (("--width", "0"), "--width must be in (0, 8]"),
    (("--width", "1e4"), "--width must be in (0, 8]"),
    (("--warmup-epochs", "nan"), "--warmup-epochs"),
    (("--warmup-epochs", "-1"), "--warmup-epochs"),
    (("--warmup-start-factor", "-1"), "--warmup-start-factor"),
    (("--max-steps-per-epoch", "-1"), "--max-steps-per-epoch must be >= 0"),
    (("--lr-base-batch", "0"), "--lr-base-batch must be >= 1"),
    (("--label-smoothing", "5"), "--label-smoothing must be in [0, 1)"),
    (("--label-smoothing", "-0.1"), "--label-smoothing must be in [0, 1)"),
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
    (("--lr", "nan"), "--lr must be a positive number"),
    (("--lr", "inf"), "--lr must be a positive number"),
    (("--lr", "0"), "--lr must be a positive number"),
    (("--lr-step-factor", "0"), "--lr-step-factor"),
    (("--lr-step-epochs", "0,3"), "--lr-step-epochs"),
    (("--momentum", "1.5"), "--momentum must be in [0, 1)"),
    (("--momentum", "nan"), "--momentum must be in [0, 1)"),
    (("--weight-decay", "-1"), "--weight-decay must be in [0, 1)"),
    (("--weight-decay", "inf"), "--weight-decay must be in [0, 1)"),
    (("--dropout", "1"), "--dropout must be in [0, 1)"),
    (("--bn-eps", "0"), "--bn-eps must be in (0, 1)"),
    (("--bn-momentum", "2"), "--bn-momentum must be in [0, 1]"),
    (("--target-accuracy", "2"), "--target-accuracy must be in [0, 1]"),
    (("--patience", "0"), "--patience must be >= 1"),
    (("--epochs", "0"), "--epochs must be in [1,"),
    (("--epochs", "10000000"), "--epochs must be in [1,"),
    (("--log-every", "-1"), "--log-every must be >= 0"),
    (("--prefetch", "-1"), "--prefetch must be in [0, 64]"),
    (("--batch-per-device", "-2"), "--batch-per-device must be >= 0"),
]


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
    ("--eval-batch-size", "1000000000"),  # allowed: the eval padding is sized by the test set
]


@pytest.mark.parametrize("flags", GOOD_VALUES, ids=[" ".join(f) for f in GOOD_VALUES])
def test_the_edges_of_every_range_are_still_accepted(flags) -> None:
    cli.parse_args([*SMOKE, *flags], "torch-ddp")


def test_devices_and_images_are_capped_by_the_machines_memory(monkeypatch, capsys) -> None:
    monkeypatch.setattr(runtime, "physical_memory", lambda: 1 << 30)  # a 1 GiB machine
    cli.parse_args([*SMOKE, "--gpus", "4"], "torch-ddp")  # 4 x 256 MiB fits
    for flags, fragment in (
        (("--gpus", "8"), "this machine allows --gpus 4"),
        (("--image-size", "512", "--width", "0.125"), "smaller --image-size"),
    ):
        monkeypatch.setattr(runtime, "physical_memory", lambda: 1 << 30)
        if "--image-size" in flags:
            monkeypatch.setattr(runtime, "physical_memory", lambda: 256 << 20)
        with pytest.raises(SystemExit):
            cli.parse_args([*SMOKE, *flags], "torch-ddp")
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and fragment in lines[0], lines


def test_a_refused_value_starts_no_process_and_writes_nothing(tmp_path: Path) -> None:
    """The issue's case: torch-ddp --gpus 16 --batch-size 1600 started 16 processes (4.5 GB)."""
    out = tmp_path / "run.json"
    proc = run_trainer(
        "torch-ddp", *SMOKE, "--gpus", "16", "--batch-size", "1600", "--output", str(out)
    )
    one_line_error(proc, "global batch 1600 is larger than the synthetic training set")
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_eval_padding_is_sized_by_the_test_set_not_the_eval_batch() -> None:
    """JAX and MXNet pad every test batch to the eval batch: --eval-batch-size 1e9 asked for
    2.79 TiB of zeros. The batch is now capped at the largest rank's part of the test set."""
    ds = load_for(preset("smoke"))
    n = len(ds.test_x)
    for world, pad_to in ((1, 3), (2, 2)):
        loaders = [EvalLoader(ds, 10**9, r, world, pad_to=pad_to) for r in range(world)]
        shapes = {x.shape[0] for loader in loaders for x, _, _ in loader}
        largest = -(-n // world)
        assert shapes == {-(-largest // pad_to) * pad_to}, shapes  # same on every rank
        assert sum(int(w.sum()) for loader in loaders for _, _, w in loader) == n


# ---- the tools' own options -----------------------------------------------------------------

TOOL_CASES = [
    (compare, ("--repeat", "100000000"), "--repeat must be <= 1000"),
    (compare, ("--timeout", "nan"), "--timeout must be a finite number"),
    (compare, ("--lr", "nan"), "--lr must be a positive number"),
    (compare, ("--seed", "-1"), "--seed must be in [0,"),
    (throughput, ("--lr", "nan"), "--lr must be a finite number"),
    (throughput, ("--repeat", "5000"), "--repeat must be <= 1000"),
    (throughput, ("--width", "1e4"), "--width must be <= 8"),
    (comm_probe, ("--width", "0"), "--width must be a finite number > 0"),
    (comm_probe, ("--width", "inf"), "--width must be a finite number"),
    (comm_probe, ("--reps", "100000000"), "--reps must be <= 100000"),
    (tutorial_loops, ("--repeat", "100000"), "--repeat must be <= 1000"),
    (tutorial_loops, ("--timeout", "inf"), "--timeout must be a finite number"),
    (parity, ("--jobs", "1000"), "--jobs must be <= 64"),
    (parity, ("--tolerance", "nan"), "--tolerance must be a finite number"),
    (ab, ("--framework", "torch-dp", "--a", "--lr nan", "--b", ""), "--a: --lr must be"),
    (ab, ("--framework", "torch-dp", "--b", "--seed -3"), "--b: --seed must be"),
    (ab, ("--framework", "torch-dp", "--b", "--lr 1", "--repeat", "99999"), "--repeat must be"),
]


@pytest.mark.parametrize(
    "tool,flags,fragment",
    TOOL_CASES,
    ids=[f"{t.__name__.split('.')[-1]} {' '.join(f)}" for t, f, _ in TOOL_CASES],
)
def test_a_tool_refuses_a_bad_option_in_one_line(tool, flags, fragment, tmp_path, capsys):
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


# ---- integer launcher variables (WORLD_SIZE=abc) --------------------------------------------

# ---- a tool that ran nothing does not exit 0 -----------------------------------------------


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


# ---- a malformed XLA_FLAGS -----------------------------------------------------------------


def test_xla_flags_that_are_no_flags_are_one_line(monkeypatch):
    from common.runtime import check_xla_flags

    monkeypatch.setenv("XLA_FLAGS", "garbage --xla_force_host_platform_device_count=2")
    with pytest.raises(ConfigError, match="'garbage' is not an XLA flag"):
        check_xla_flags()
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    check_xla_flags()


# ---- an entry point run by the wrong interpreter --------------------------------------------


@pytest.mark.parametrize("module", sorted(ENTRY_POINTS))
def test_an_entry_point_run_by_the_wrong_interpreter_is_one_line_and_exit_2(module: str) -> None:
    """MXNet lives in .venv-mxnet, torch and JAX in .venv: each entry point run by the other
    environment's interpreter names the one to use, instead of an ImportError's traceback (the
    traceback is what a module without the package check gives: the run with the right
    interpreter, below, shows the check does not refuse it)."""
    if not MXNET_PYTHON.exists():
        pytest.skip("needs .venv-mxnet (bash scripts/setup.sh mxnet)")
    mxnet = "mxnet" in ENTRY_POINTS[module]
    wrong, right = (MAIN_PYTHON, MXNET_PYTHON) if mxnet else (MXNET_PYTHON, MAIN_PYTHON)
    proc = run_module(module, "--help", python=wrong, timeout=60)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert (
        lines[0].startswith(f"python -m {module}: error: ")
        and f"{right.parent.parent.name}/bin/python -m {module}" in lines[0]
    )
    ok = run_module(module, "--help", python=right, timeout=120)
    assert ok.returncode == 0 and "usage" in ok.stdout, ok.stderr[-2000:]
