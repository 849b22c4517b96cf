"""--profile STEPS on real runs: each framework's own profiler writes a trace that a viewer
opens, its path and the step's breakdown are in the record (off: test_contract.py's digits runs).
The arithmetic: tests/common/test_breakdown.py; MXNet: tests/mxnet/test_mxnet_profile.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from common.breakdown import PARTS, WINDOW, load_events
from tests.conftest import ok, read_json, run_trainer

# window: steps 4-7; at 1/8 width (the preset's is 1/4): the profilers' traces and the breakdown
# are the same events whatever the width, at a quarter of the arithmetic
TINY = ("--preset", "digits", "--width", "0.125", "--epochs", "2", "--max-steps-per-epoch", "9")


def profiled_run(framework: str, tmp_path: Path, *extra: str) -> dict:
    out = tmp_path / "run.json"
    ok(run_trainer(framework, *TINY, "--gpus", "2", "--profile", "4", "--output", str(out),
                   *extra))  # fmt: skip
    return read_json(out)


def check_profiled(record: dict, flavour: str, tmp_path: Path) -> dict:
    prof, b = record["profile"], record["breakdown"]
    assert prof["profiler"] == flavour and prof["steps"] == 4 and prof["first_step"] == 4
    trace = Path(prof["trace"])
    assert trace.is_file() and trace.is_relative_to(tmp_path / "run.profile" / "rank0")
    assert any(e.get("name") == WINDOW for e in load_events(trace))  # this run's window
    assert sum(b[k] for k in PARTS) == pytest.approx(b["step_ms"], rel=1e-9)
    assert b["compute_ms"] > 0 and b["comm_ms"] > 0  # two devices: an all-reduce every step
    assert 0 <= b["exposed_comm_ms"] <= b["comm_ms"] + 1e-9
    assert len(b["devices"]) == (1 if flavour == "torch" else 2)  # torch: rank 0's process
    assert b["measured_step_ms"] > 0 and "overhead" in prof
    # the profiled first epoch is untimed: the record's speed is the unprofiled epoch's
    assert [e["timed"] for e in record["epochs"]] == [False, True]
    return b


def test_torch_ddp_profile_has_both_ranks_traces_and_a_breakdown(tmp_path: Path) -> None:
    record = profiled_run("torch-ddp", tmp_path)
    check_profiled(record, "torch", tmp_path)
    rank1 = list((tmp_path / "run.profile" / "rank1").glob("*.pt.trace.json"))
    assert len(rank1) == 1  # every rank writes its own trace; rank 0 reads its own
    names = {e.get("name") for e in json.loads(rank1[0].read_text())["traceEvents"]}
    assert "gloo:all_reduce" in names and "forward_backward" in names  # the phases, as ranges


def test_jax_pmap_profile_reads_xla_s_all_reduce_on_each_device(tmp_path: Path) -> None:
    record = profiled_run("jax-pmap", tmp_path)
    b = check_profiled(record, "jax", tmp_path)
    assert sorted(b["devices"]) == ["device:0", "device:1"]
    assert list((tmp_path / "run.profile" / "rank0").glob("plugins/profile/*/*.xplane.pb"))
