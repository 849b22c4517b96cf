"""--profile's arithmetic and window without a framework (common/breakdown.py, profiling.py,
benchmarks/analysis/breakdowns.py): traces worked out by hand, a fake profiler in the window."""

from __future__ import annotations

import gc
import gzip
import json
import weakref
from contextlib import contextmanager
from pathlib import Path

import pytest

from common import breakdown as bd
from common.breakdown import INPUT_WAIT, WINDOW, TraceError, read_trace
from common.config import ConfigError, preset
from common.profiling import MARGIN, WARMUP, ProfileWindow, trace_dir, window_of


def x(name, ts, dur, pid=1, tid=1, **kw):
    return {"ph": "X", "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, **kw}


def write(tmp_path: Path, events, name="trace.json") -> Path:
    path = tmp_path / name
    data = json.dumps({"traceEvents": events}).encode()
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    return path


# One trace per flavour, worked out by hand (nested, hidden and clipped intervals).
# Window [0, 25000) us, 1 step: compute [0,10) and [12,20) ms; communication [8,15) ms, of which
# only [10,12) is not hidden by compute; the host waits for input [20,22) ms, then idles to 25.
HAND = {"step_ms": 25.0, "compute_ms": 18.0, "comm_ms": 7.0, "exposed_comm_ms": 2.0,
        "overlapped_comm_ms": 5.0, "input_wait_ms": 2.0, "host_gap_ms": 3.0}  # fmt: skip


def host(pid=1, tid=1):
    return [x(WINDOW, 0, 25000, pid, tid), x(INPUT_WAIT, 20000, 2000, pid, tid)]


def pair(name, ts, dur, pid, tid=3, ph="B", cat="operator"):
    return [{"ph": ph, "name": name, "ts": ts, "pid": pid, "tid": tid, "cat": cat},
            {"ph": "e" if ph == "b" else "E", "name": name, "ts": ts + dur, "pid": pid,
             "tid": tid, "cat": cat}]  # fmt: skip


def meta(ph_name, pid, name, tid=0):
    return {"ph": "M", "name": ph_name, "pid": pid, "tid": tid, "args": {"name": name}}


TRACES = {  # flavour: (reader, file name, events, the devices read or None)
    "torch-cpu": ("torch", "trace.json", host(7, 7) + [
        x("aten::conv2d", 0, 10000, 7, 7, cat="cpu_op"),
        x("aten::addmm", 2000, 3000, 7, 7, cat="cpu_op"),  # nested: counted once
        x("aten::add_", 12000, 8000, 7, 7, cat="cpu_op"),
        x("c10d::allreduce_", 10000, 1000, 7, 7, cat="cpu_op"),  # the enqueue: not compute
        x("gloo:all_reduce", 8000, 7000, 7, 99, cat="user_annotation"),  # gloo's thread
        x("aten::mul", 0, 30000, 7, 55, cat="cpu_op"),  # another thread: not the device
    ], None),
    "torch-cuda": ("torch", "trace.json", host(7, 7) + [
        x("volta_sgemm", 0, 10000, 0, 7, cat="kernel", args={"device": 0}),
        x("elementwise_kernel", 12000, 8000, 0, 7, cat="kernel", args={"device": 0}),
        x("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 8000, 7000, 0, 20, cat="kernel",
          args={"device": 0}),
        x("aten::conv2d", 0, 25000, 7, 7, cat="cpu_op"),  # host side: not the GPU's time
    ], ["gpu:0"]),
    "jax-two-devices": ("jax", "t.trace.json.gz", host() + [
        x("PjitFunction(step)", 0, 25000),  # no hlo_op: host dispatch
        *[x(op, ts, dur, 1, 10 + d, args={"hlo_op": op, "device_ordinal": d}) for d in (0, 1)
          for op, ts, dur in (("convolution.3", 0, 10000), ("fusion.7", 12000, 8000),
                              ("all-reduce.1", 8000, 7000))],
    ], ["device:0", "device:1"]),
    "jax-gpu-streams-not-summary-lines": ("jax", "t.trace.json.gz", [
        meta("process_name", 1, "/device:GPU:0"), meta("process_name", 701, "/host:CPU"),
        meta("thread_name", 1, "Stream #13(Compute)", 13), meta("thread_name", 1, "XLA Ops", 2),
        meta("thread_name", 1, "Stream #14(Nccl)", 14), *host(701, 5),
        x("loop_convolution_kernel", 0, 10000, 1, 13, args={"hlo_op": "convolution.3"}),
        x("loop_add_fusion", 12000, 8000, 1, 13, args={"hlo_op": "fusion.7"}),
        *[x(name, 8000, dur, 1, tid, args={"hlo_op": "all-reduce-start.1"}) for name, dur, tid in
          (("ncclDevKernel_AllReduce_Sum_f32_RING_LL", 7000, 14),
           ("all-reduce-start.1", 17000, 2))],  # the kernel; the summary line
    ], ["/device:GPU:0"]),
    "mxnet-begin-end-pairs": ("mxnet", "trace.json", [
        meta("process_name", 0, "cpu/0"), meta("process_name", 9, "dpbench"),
        *pair(WINDOW, 0, 25000, 9, ph="b", cat="dpbench"),  # MXNet's Task: async b/e
        *pair(INPUT_WAIT, 20000, 2000, 9, ph="b", cat="dpbench"),
        *pair("Convolution", 0, 10000, 0), *pair("sgd_mom_update", 12000, 8000, 0),
        *pair("CopyCPU2CPU", 8000, 3000, 0, 4), *pair("ElementwiseSum", 11000, 4000, 0, 4),
        *pair("DeleteVariable", 20000, 5000, 0),  # engine bookkeeping, not work
    ], None),
}  # fmt: skip


@pytest.mark.parametrize("case", TRACES)
def test_every_trace_flavour_gives_the_hand_worked_breakdown(tmp_path: Path, case: str) -> None:
    """The hand-worked figures, whose parts add up to the step, over the steps profiled."""
    flavour, name, events, devices = TRACES[case]
    path = write(tmp_path, events, name)
    result = read_trace(path, flavour, 1)
    assert {k: result[k] for k in HAND} == pytest.approx(HAND), result
    assert sum(result[k] for k in bd.PARTS) == pytest.approx(result["step_ms"])
    assert devices is None or sorted(result["devices"]) == devices, result["devices"]
    assert read_trace(path, flavour, 5)["compute_ms"] == pytest.approx(18 / 5)


def test_a_trace_without_the_window_or_cut_short_is_one_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no dpbench_window"):
        read_trace(write(tmp_path, [x("aten::add", 0, 5, cat="cpu_op")]), "torch", 1)
    (tmp_path / "bad.json").write_text('{"traceEvents": [{"ph": "X", "ts": 1')  # cut short
    with pytest.raises(TraceError, match="not Chrome trace JSON"):
        read_trace(tmp_path / "bad.json", "torch", 1)


class FakeProfiler:
    flavour, viewer = "torch", "a test"
    log: list[str] = []

    def start(self, trace_dir: Path) -> None:
        self.dir = trace_dir
        self.log.append("start")

    def stop(self) -> Path:
        self.log.append("stop")
        return write(self.dir, [])

    @contextmanager
    def annotate(self, name):
        self.log.append(f"<{name}")
        yield
        self.log.append(f"{name}>")


class Batches:
    def __init__(self, n: int, fail_at: int = -1):
        self.it, self.wait_sec, self.fail_at = iter(range(n)), 0.25, fail_at

    def __iter__(self):
        return self

    def __next__(self):
        b = next(self.it)
        if b == self.fail_at:
            raise OSError("the data went away")
        return b


def window(tmp_path: Path, profile: int, profiler=FakeProfiler, say=print, sync=lambda: None):
    FakeProfiler.log = []
    cfg = preset("digits", framework="torch-ddp", profile=profile, profile_dir=str(tmp_path))
    return ProfileWindow(cfg, profiler, sync, 0, True, say)


def test_the_window_profiles_the_steps_after_warm_up(tmp_path: Path) -> None:
    syncs: list[int] = []
    win = window(tmp_path, 5, sync=lambda: syncs.append(1))
    batches = win.wrap(Batches(20), 20, 0)  # (the phases annotated: tests/trainers/test_profile)
    assert list(batches) == list(range(20))  # every batch still reaches the loop, in order
    assert win.wrap(Batches(3), 3, 0).__class__ is Batches  # only the first epoch
    assert (win.first, win.count) == (3, 5)  # after 3 warm-up steps, as --help says
    log = FakeProfiler.log
    assert log[:2] == ["start", f"<{WINDOW}"] and log[-2:] == [f"{WINDOW}>", "stop"]
    assert log.count(f"<{INPUT_WAIT}") == 5
    assert len(syncs) == 2  # one host sync at each end of the window, none in between
    assert batches.wait_sec == 0.25  # the loader's input wait still reaches the record
    assert win.record(0.01)["profile"]["steps"] == 5
    assert window_of(10, 50) == (WARMUP, 10 - WARMUP - MARGIN)  # cut to the epoch
    assert window_of(WARMUP + MARGIN, 5)[1] == 0  # none fits: skipped


class CyclicProfiler(FakeProfiler):
    """Events that refer to each other, as torch.profiler's do: freed only by the cycle GC."""

    made: list[weakref.ref] = []

    def __init__(self) -> None:
        self.events = [{"name": f"op{i}"} for i in range(1000)]
        for parent, child in zip(self.events, self.events[1:]):
            parent["child"], child["parent"] = child, parent
        self.events[0]["profiler"] = self  # the cycle through the profiler itself
        CyclicProfiler.made.append(weakref.ref(self))


def test_the_profiler_is_freed_when_the_window_ends_not_in_a_timed_epoch(tmp_path: Path) -> None:
    """Left to Python's cycle collection, torch.profiler's events made the timed epochs after
    a profiled one 5% slower (benchmarks.analysis.ab)."""
    CyclicProfiler.made = []
    win = window(tmp_path, 4, CyclicProfiler)
    gc.disable()  # no collection by chance: only the window's own can free it
    try:
        for b in win.wrap(Batches(12), 12, 0):
            if b == WARMUP + 4 + 1:  # the window has ended
                (made,) = CyclicProfiler.made
                assert made() is None, "the profiler's events are still alive"
    finally:
        gc.enable()
    assert win.trace is not None


class BrokenProfiler(FakeProfiler):
    def start(self, trace_dir: Path) -> None:
        raise RuntimeError("CUPTI not found")


def test_a_failure_in_the_window_stops_the_profiler_and_costs_the_trace_not_the_run(
    tmp_path: Path,
) -> None:
    win = window(tmp_path, 10)
    with pytest.raises(RuntimeError):
        for b in win.wrap(Batches(20), 20, 0):
            if b == 6:
                raise RuntimeError("a step failed")
    assert FakeProfiler.log[-1] != "stop"
    win.close()  # what Run.measured does on the way out
    win.close()  # once only
    assert FakeProfiler.log.count("stop") == 1 and win.count == 6 - WARMUP + 1
    win = window(tmp_path, 5)
    with pytest.raises(OSError):  # the loader fails in the fetch that opens the window
        list(win.wrap(Batches(20, fail_at=WARMUP), 20, 0))
    assert win.record(0.01)["profile"]["steps"] == 0
    win = window(tmp_path, 5)  # after a resume: the first epoch this process trains
    list(win.wrap(Batches(20), 20, 2))
    assert win.record(0.01)["profile"]["epoch"] == 3
    lines: list[str] = []  # a profiler that cannot start: one line, the run goes on
    win = window(tmp_path, 5, BrokenProfiler, lines.append)
    assert list(win.wrap(Batches(20), 20, 0)) == list(range(20))
    assert len(lines) == 1 and "(RuntimeError: CUPTI not found)" in lines[0]
    note = win.record(0.01)["profile"]
    assert note["steps"] == 0 and note["note"].startswith("the profiler did not start")


def test_trace_dirs_are_per_run_and_rank_and_the_flags_are_checked(tmp_path: Path) -> None:
    cfg = preset("digits", framework="jax-pmap", output=str(tmp_path / "runs" / "a.json"))
    assert trace_dir(cfg, 1) == tmp_path / "runs" / "a.profile" / "rank1"
    assert trace_dir(cfg.replace(output=""), 0) == Path("profile/jax-pmap-1gpu/rank0")
    with pytest.raises(ConfigError, match="--profile must be"):
        preset("digits", framework="torch-ddp", profile=-1)
    with pytest.raises(ConfigError, match="contradict"):
        preset("digits", framework="torch-ddp", profile=5, phase_timing=True)


def record(framework: str, devices: int, compute: float, status: str = "ok") -> dict:
    step = compute + 2.0  # + exposed communication 1, input wait 0.5, host gap 0.5
    got = dict(compute_ms=compute, exposed_comm_ms=1.0, input_wait_ms=0.5, host_gap_ms=0.5,
               step_ms=step, comm_ms=4.0, measured_step_ms=step, parts_vs_measured=1)  # fmt: skip
    return {"status": status, "devices": devices, "execution": "eager", "breakdown": got,
            "runner": {"framework": framework}}  # fmt: skip


def test_the_report_shows_the_median_over_a_cells_runs_and_a_stacked_bar_per_cell() -> None:
    import matplotlib.pyplot as plt

    from benchmarks.analysis import breakdowns

    records = [record("torch-ddp", 2, c) for c in (10.0, 30.0, 12.0)]
    records += [record("jax-pmap", 1, 5.0), record("jax-pmap", 1, 99.0, status="failed")]
    records.append({"status": "ok", "devices": 1, "runner": {"framework": "mxnet-gluon"}})
    lines = breakdowns.section(records)
    rows = [line for line in lines if line.startswith("| torch-ddp") or line.startswith("| jax")]
    assert [row.replace(" ", "") for row in rows] == [
        "|jax-pmap|eager|1|1|7.00|5.00|1.00|0.50|0.50|4.00|75%|7.00|1.00|",
        "|torch-ddp|eager|2|3|14.00|12.00|1.00|0.50|0.50|4.00|75%|14.00|1.00|",
    ]  # medians over the three torch-ddp runs; the failed and unprofiled runs are left out
    assert breakdowns.section([records[-1]]) == []  # nothing profiled: no section
    fig = breakdowns.plot(plt, [record("torch-ddp", 2, 10.0), record("jax-pmap", 2, 6.0)], "t")
    tops: dict[float, float] = {}  # two cells x four parts, each stack up to its step
    for p in fig.axes[0].patches:
        tops[p.get_x()] = max(tops.get(p.get_x(), 0.0), p.get_y() + p.get_height())
    assert len(fig.axes[0].patches) == 8 and sorted(tops.values()) == pytest.approx([8.0, 12.0])
    plt.close(fig)
    assert breakdowns.plot(plt, [], "t") is None
