"""Hostile and careless input (issue 15: values, output paths, full disks, checkpoints, tools).

Every case asserts the exit code (2 = bad input, 1 = failed run), the one-line message naming
the problem, and that nothing ran, was written or was left behind. Most run in-process (the
parser, `run_main` with a train() that fails the test if it is ever called, the tools' main());
the few that need a real trainer start it and it exits before any work. A full disk is
simulated by making os.replace / os.fsync raise ENOSPC, a read-only file system by os.access,
a full one by os.statvfs. The MXNet optimiser-state format has its own tests in tests/mxnet.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import (
    ab,
    comm_probe,
    compare,
    compute_only,
    harness,
    parity,
    throughput,
    tutorial_loops,
)
from common import cli, runtime
from common.config import preset
from common.datasets import load_for
from common.pipeline import EvalLoader
from common.results import write_json_atomic
from common.runtime import ENTRY_POINTS
from common.trainer import run_main
from tests.conftest import (
    MAIN_PYTHON,
    MXNET_PYTHON,
    SMOKE,
    one_line_error,
    reseal_index,
    run_module,
    run_trainer,
    skip_without_interpreter,
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


# ---- output paths: checked before any work ----------------------------------------------------


def never_train(cfg: Any) -> dict[str, Any]:
    raise AssertionError("train() started although an output path was bad")


def run_stub(*flags: str, capsys) -> tuple[int, list[str]]:
    rc = run_main([*SMOKE, *flags], "torch-dp", check=lambda cfg: None, train=never_train)
    return rc, capsys.readouterr().err.strip().splitlines()


def test_an_output_that_is_a_directory_is_refused_before_training(tmp_path, capsys) -> None:
    rc, err = run_stub("--output", str(tmp_path), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "exists and is not a file" in err[0], err


def test_a_checkpoint_dir_that_is_a_file_is_refused(tmp_path, capsys) -> None:
    (tmp_path / "f").write_text("x")
    rc, err = run_stub("--checkpoint-dir", str(tmp_path / "f"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "--checkpoint-dir" in err[0], err
    rc, err = run_stub("--save-state", str(tmp_path / "f" / "state.npz"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "is not a directory" in err[0], err


def test_a_read_only_output_directory_is_refused(tmp_path, monkeypatch, capsys) -> None:
    ro = tmp_path / "ro"
    ro.mkdir()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, m: Path(p) != ro and real_access(p, m))
    rc, err = run_stub("--output", str(ro / "sub" / "run.json"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "is not writable" in err[0], err
    assert list(ro.iterdir()) == []  # nothing created, not even the missing sub-directory


def test_a_full_file_system_is_refused(tmp_path, monkeypatch, capsys) -> None:
    full = os.statvfs(tmp_path)

    class Full:
        f_bavail, f_frsize = 0, full.f_frsize

    monkeypatch.setattr(os, "statvfs", lambda p: Full())
    rc, err = run_stub("--output", str(tmp_path / "run.json"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "is full" in err[0], err


def test_a_virtual_file_system_is_refused_for_what_it_is(tmp_path, monkeypatch, capsys) -> None:
    """A file system with no storage at all (/proc, /sys: no blocks; root passes os.access
    there) is refused as such, not as "full"."""
    real = os.statvfs(tmp_path)

    class Virtual:
        f_blocks, f_bavail, f_frsize = 0, 0, real.f_frsize

    statvfs = os.statvfs  # virtual where the output goes; the session's cache folders stay real
    monkeypatch.setattr(
        os, "statvfs", lambda p: Virtual() if str(p).startswith(str(tmp_path)) else statvfs(p)
    )
    rc, err = run_stub("--output", str(tmp_path / "run.json"), capsys=capsys)
    assert rc == 2 and len(err) == 1 and "virtual file system" in err[0], err


def test_a_real_trainer_refuses_a_bad_output_before_it_loads_anything(tmp_path, capsys) -> None:
    from frameworks import torch_dp

    rc = torch_dp.main([*SMOKE, "--output", str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("python -m frameworks.torch_dp: error")


# ---- writes that fail: no temp file left, same mode as the logs ------------------------------


def enospc(*args: Any, **kwargs: Any) -> None:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("where", ["fsync", "replace"])
def test_a_failed_write_leaves_the_old_file_and_no_temp_file(tmp_path, monkeypatch, where):
    target = tmp_path / "ckpt.pt"
    target.write_bytes(b"old")
    monkeypatch.setattr(os, where, enospc)
    with pytest.raises(OSError, match="No space left"):
        runtime.atomic_write_bytes(target, b"new" * 1000)
    with pytest.raises(OSError):
        write_json_atomic(tmp_path / "run.json", {"status": "ok"})
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt.pt"]
    assert target.read_bytes() == b"old"


def test_a_writer_that_fails_half_way_leaves_nothing(tmp_path) -> None:
    def half(tmp: str) -> None:  # mx.nd.save running out of space half-way
        Path(tmp).write_bytes(b"partial")
        enospc()

    with pytest.raises(OSError):
        runtime.atomic_write_with(tmp_path / "x.states", half)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_results_and_checkpoints_get_the_same_mode_as_logs(tmp_path, umask) -> None:
    old = os.umask(umask)
    try:
        with open(tmp_path / "run.log", "w") as f:  # how the harness writes a log
            f.write("log\n")
        write_json_atomic(tmp_path / "run.json", {"status": "ok"})
        runtime.atomic_write_bytes(tmp_path / "ckpt.pt", b"x")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in tmp_path.iterdir()}
    assert set(modes.values()) == {0o666 & ~umask}, modes


def test_a_failure_record_that_cannot_be_written_is_one_more_line_not_a_traceback(
    tmp_path, monkeypatch, capsys
) -> None:
    def crash(cfg: Any) -> dict[str, Any]:
        monkeypatch.setattr(os, "replace", enospc)  # the disk fills up during the run
        raise RuntimeError("boom")

    out = tmp_path / "run.json"
    rc = run_main([*SMOKE, "--output", str(out)], "torch-dp", check=lambda c: None, train=crash)
    monkeypatch.undo()
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 1 and len(err) == 2, err
    assert "failed: RuntimeError: boom" in err[0] and "could not write the failure record" in err[1]
    assert list(tmp_path.iterdir()) == []  # no half-written record, no temp file


# ---- checkpoints: corrupt or foreign, one line, exit 2, nothing trained ------------------------

CHECKPOINT_FILES = {
    "torch-dp": "torch-dp.pt",
    "jax-pmap": "jax-pmap.msgpack",
    "mxnet-gluon": "mxnet-gluon.json",
}


@pytest.mark.parametrize("framework", list(CHECKPOINT_FILES))
def test_a_corrupt_checkpoint_is_one_line_and_exit_2(framework, tmp_path) -> None:
    skip_without_interpreter(framework)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    rng = np.random.default_rng(0)
    (ckpt / CHECKPOINT_FILES[framework]).write_bytes(rng.bytes(4096))
    out = tmp_path / "run.json"
    args = (*SMOKE, "--checkpoint-dir", str(ckpt), "--resume", "--output", str(out))
    line = one_line_error(run_trainer(framework, *args), "cannot read checkpoint", "--resume")
    assert "weights_only" not in line  # torch's advice to unpickle anyway is not repeated
    assert not out.exists()


def test_an_mxnet_index_naming_a_corrupt_states_file_is_refused_before_training(tmp_path):
    """The index is valid JSON of this run, the weights file is garbage: refused by the check
    before the run (it used to fail at load time with MXNet's C++ text, exit 1)."""
    skip_without_interpreter("mxnet-gluon")
    cfg = cli.parse_args([*SMOKE, "--checkpoint-dir", str(tmp_path)], "mxnet-gluon")
    index = {"params": "w.params", "states": "w.states", "epoch": 1, "step": 4}
    (tmp_path / "w.params").write_bytes(b"\x12\x01" * 100)
    (tmp_path / "w.states").write_bytes(b"\x12\x01" * 100)
    (tmp_path / "mxnet-gluon.json").write_text("{}")
    reseal_index(tmp_path / "mxnet-gluon.json", **index, config=cfg.to_dict())  # digests match
    args = (*SMOKE, "--checkpoint-dir", str(tmp_path), "--resume")
    line = one_line_error(run_trainer("mxnet-gluon", *args), "cannot read checkpoint")
    assert "Invalid NDArray file format" in line and "Traceback" not in line


# ---- the tools: their own options, their --out ------------------------------------------------

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


@pytest.fixture
def no_probe(monkeypatch) -> None:
    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    monkeypatch.setattr(harness, "detect_gpus", lambda: [])


COMPARE = ["--frameworks", "torch-dp", "--gpus", "1", "--preset", "smoke"]


def test_compare_out_that_is_a_file_or_full_is_refused(tmp_path, monkeypatch, no_probe, capsys):
    (tmp_path / "f").write_text("x")
    assert compare.main([*COMPARE, "--out", str(tmp_path / "f")]) == 2
    assert "exists and is not a directory" in capsys.readouterr().err
    monkeypatch.setattr(os, "access", lambda p, m: False)
    assert compare.main([*COMPARE, "--out", str(tmp_path / "new")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not writable" in err[0], err
    assert not (tmp_path / "new").exists()


def test_two_compares_on_one_out_cannot_both_start(tmp_path, no_probe, monkeypatch, capsys):
    """'already holds a comparison' was check-then-write: two runs started together both
    passed. The second now finds the first's lock (and, after it, the first's config.json)."""
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


def fake_record(cmd: list[str]) -> dict[str, Any]:
    n = int(cmd[cmd.index("--gpus") + 1])
    fw = cmd[cmd.index("-m") + 1].split(".")[-1].replace("_", "-")
    return {
        "framework": fw, "devices": n, "status": "ok", "device_kind": "cpu-simulated",
        "bn_mode": "local", "global_batch_size": 24, "test_accuracy": 0.5, "sec_per_epoch": 1.0,
        "first_epoch_sec": 2.0, "images_per_sec": 96.0, "test_examples": 10, "test_set_size": 10,
        "time_to_target_sec": None, "epochs_to_target": None,
        "epochs": [{"epoch": 1, "wall_sec": 1.0, "test_accuracy": 0.5}],
        "load_avg": {"start": 0.5, "end": 0.5, "cores": 2}, "error": "",
    }  # fmt: skip


@pytest.mark.parametrize("full_from", ["plots", "the end"])
def test_compare_on_a_full_disk_finishes_and_never_leaves_config_running(
    full_from, tmp_path, no_probe, monkeypatch, capsys
) -> None:
    """The runs' records are kept; a file that cannot be written is named in one line; the
    exit code is 1; config.json says "finished" (never "running"); no temp file is left."""
    out = tmp_path / "out"

    def run_child(cmd, log, timeout, **kwargs):  # a finished run, no process started
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("done\n")
        write_json_atomic(cmd[cmd.index("--output") + 1], fake_record(cmd))
        return harness.Child(list(cmd), log, timeout, returncode=0)

    real_replace, real_plots = os.replace, compare.report.write_plots

    def full_replace(src, dst):
        if full_from == "the end" or str(dst).endswith(".png"):
            enospc()
        real_replace(src, dst)

    def plots(*args):  # the disk fills up when the sweep ends
        monkeypatch.setattr(os, "replace", full_replace)
        return real_plots(*args)

    monkeypatch.setattr(harness, "run_child", run_child)
    monkeypatch.setattr(compare.report, "write_plots", plots)
    if full_from == "the end":
        monkeypatch.setattr(compare, "write_json_atomic", _fail_config_json(compare))
    rc = compare.main(["--frameworks", "torch-ddp,jax-pmap", "--gpus", "2", "--preset", "smoke",
                       "--out", str(out)])  # fmt: skip
    monkeypatch.undo()
    text = capsys.readouterr().out
    assert rc == 1, text
    assert "compare: could not write the plots: No space left on device" in text
    assert "compare: NOT written (disk full?)" in text
    config = json.loads((out / "config.json").read_text())
    assert config["status"] == "finished"
    assert len(list((out / "runs").glob("*.json"))) == 4  # every run kept
    assert (out / "results.csv").exists()
    left = [p.name for p in out.rglob("*") if ".tmp" in p.name or p.name.startswith(".")]
    assert left == [], left


def _fail_config_json(module: Any) -> Any:
    """write_json_atomic that fails for the final config.json (the disk is full at the end)."""
    real = module.write_json_atomic

    def write(path: Any, obj: Any) -> None:
        if Path(path).name == "config.json" and obj.get("status") != "running":
            enospc()
        real(path, obj)

    return write


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
