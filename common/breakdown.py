"""Where a training step's time goes, read from a profiler's trace: the same arithmetic for
every framework (`--profile STEPS`; common/profiling.py records the trace).

A trace is Chrome trace-event JSON (what torch.profiler, jax.profiler and MXNet's profiler
write; Perfetto and chrome://tracing open it). It is read into *lanes*, one per device: the
intervals in which that device computed, and those in which it communicated (the gradient
all-reduce or its equivalent). Over the profiled window of S steps, each device's time is split
into four parts that add up to the window exactly:

    compute       the device runs compute (union of its compute intervals)
    exposed_comm  it communicates and computes nothing: communication not hidden by compute
    input_wait    it is idle while the host waits for the next batch (the loader)
    host_gap      it is idle otherwise: the host is late (Python, dispatch, launch, syncs)

and `comm` (all communication, hidden or not) is reported beside them, with `overlapped` =
comm - exposed_comm. Every figure is per step (divided by S) and is the mean over the lanes.
This is the definition Holistic Trace Analysis uses for its temporal breakdown and its
communication/computation overlap, applied to all three frameworks' traces alike.

What counts as a device and as communication in each framework's trace: docs/profiling.md
(`read_torch`, `read_jax`, `read_mxnet`). numpy and the standard library only: traces are read
without the framework that wrote them.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# The ranges common/profiling.py adds to every trace ("_", not ":": XLA keeps only what
# follows a colon).
ANNOTATION = "dpbench_"
WINDOW = ANNOTATION + "window"  # the profiled steps, from the first's batch to the last's end
INPUT_WAIT = ANNOTATION + "input_wait"  # the host blocked on the loader for the next batch
PARTS = ("compute_ms", "exposed_comm_ms", "input_wait_ms", "host_gap_ms")  # add up to step_ms

COMM_JAX = re.compile(
    r"all-reduce|all_reduce|allreduce|psum|pmean|all-gather|all_gather|reduce-scatter|"
    r"reduce_scatter|collective-permute|all-to-all|ncclDevKernel|nccl",
    re.IGNORECASE,
)
COMM_TORCH_KERNEL = re.compile(r"nccl", re.IGNORECASE)
COMM_MXNET = re.compile(r"^(Copy\w*2\w+|ElementwiseSum|_?(broadcast|reduce)_?comm\w*)$")


class TraceError(ValueError):
    """A trace that cannot be read or holds no profiled window."""


BEGIN = {"E": "B", "e": "b"}
Interval = tuple[float, float]  # (start, end), microseconds in the trace's clock


@dataclass
class Lanes:
    """A trace, read: per device, its compute and communication intervals; the host's input
    waits; the profiled window."""

    compute: dict[str, list[Interval]] = field(default_factory=lambda: defaultdict(list))
    comm: dict[str, list[Interval]] = field(default_factory=lambda: defaultdict(list))
    input_wait: list[Interval] = field(default_factory=list)
    window: Interval | None = None

    @property
    def devices(self) -> list[str]:
        return sorted(set(self.compute) | set(self.comm))


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """Sorted, disjoint intervals covering the same time."""
    out: list[list[float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def clip(intervals: Iterable[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(s, lo), min(e, hi)) for s, e in intervals if e > lo and s < hi]


def length(intervals: Iterable[Interval]) -> float:
    return sum(e - s for s, e in union(intervals))


def subtract(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The parts of disjoint sorted `a` not covered by disjoint sorted `b`."""
    out, j = [], 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                out.append((cur, b[k][0]))
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            out.append((cur, e))
    return out


def intersect(a: list[Interval], b: list[Interval]) -> list[Interval]:
    """The time covered by both disjoint sorted `a` and `b`."""
    return subtract(a, subtract(a, b))


def load_events(path: str | Path) -> list[dict[str, Any]]:
    """The trace events of a Chrome trace JSON file (.json or .json.gz); TraceError (one line
    naming the file) where it cannot be read."""
    try:
        with (gzip.open if str(path).endswith(".gz") else open)(path, "rb") as f:
            data = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        raise TraceError(f"trace {path}: not Chrome trace JSON ({exc})") from None
    events = data.get("traceEvents") if isinstance(data, dict) else data
    if not isinstance(events, list):
        raise TraceError(f"trace {path}: no traceEvents list")
    return [e for e in events if isinstance(e, dict)]


def complete(events: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """Duration events as complete ('X') events: B/E pairs (also async b/e) matched per thread
    and name, nested ones innermost first; instant and metadata events dropped."""
    out: list[dict[str, Any]] = []
    open_: dict[tuple[Any, ...], list[Mapping[str, Any]]] = defaultdict(list)
    for e in sorted(events, key=lambda e: float(e.get("ts", 0))):
        ph = e.get("ph")
        if ph == "X":
            out.append({**e, "ts": float(e.get("ts", 0)), "dur": float(e.get("dur", 0))})
        elif ph in ("B", "b"):
            open_[(e.get("pid"), e.get("tid"), e.get("name"), ph)].append(e)
        elif ph in ("E", "e"):  # closes the newest B (or async b) of its thread and name
            stack = open_.get((e.get("pid"), e.get("tid"), e.get("name"), BEGIN[ph]))
            if stack:
                b = stack.pop()
                ts = float(b.get("ts", 0))
                out.append({**b, "ph": "X", "ts": ts, "dur": float(e.get("ts", 0)) - ts})
    return out


def _names(events: Iterable[Mapping[str, Any]], kind: str) -> dict[Any, str]:
    """pid (kind 'process_name') or (pid, tid) ('thread_name') -> name, from metadata events."""
    out: dict[Any, str] = {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == kind:
            key = e.get("pid") if kind == "process_name" else (e.get("pid"), e.get("tid"))
            out[key] = str((e.get("args") or {}).get("name", ""))
    return out


def _host_ranges(lanes: Lanes, events: list[dict[str, Any]]) -> None:
    """The window and input waits common/profiling.py annotated (the last window if several)."""
    for e in events:
        name, span = e.get("name"), (e["ts"], e["ts"] + e["dur"])
        if name == WINDOW:
            lanes.window = span
        elif name == INPUT_WAIT:
            lanes.input_wait.append(span)


def read_torch(events: list[dict[str, Any]]) -> Lanes:
    lanes = Lanes()
    done = complete(events)
    _host_ranges(lanes, done)
    gpu = [e for e in done if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if gpu:  # CUDA: each GPU's kernels and copies
        for e in gpu:
            args = e.get("args") or {}
            lane = f"gpu:{args.get('device', e.get('pid'))}"
            name = str(e.get("name", ""))
            is_comm = bool(COMM_TORCH_KERNEL.search(name)) or "PtoP" in name
            (lanes.comm if is_comm else lanes.compute)[lane].append(_span(e))
        return lanes
    # CPU: the main thread (tid == pid) is the device; gloo's collectives run on its threads.
    for e in done:
        name, cat = str(e.get("name", "")), e.get("cat")
        if name.startswith("gloo:"):
            lanes.comm["cpu"].append(_span(e))
        elif cat == "cpu_op" and e.get("tid") == e.get("pid") and not name.startswith("c10d::"):
            lanes.compute["cpu"].append(_span(e))
    return lanes


def read_jax(events: list[dict[str, Any]]) -> Lanes:
    lanes = Lanes()
    done = complete(events)
    _host_ranges(lanes, done)
    procs, threads = _names(events, "process_name"), _names(events, "thread_name")
    for e in done:
        args = e.get("args") or {}
        op = args.get("hlo_op")
        if not op:
            continue
        device = args.get("device_ordinal")
        pname = procs.get(e.get("pid"), "")
        if pname.startswith("/device:"):  # a GPU: its streams' kernels, not the summary lines
            if not threads.get((e.get("pid"), e.get("tid")), "").startswith("Stream"):
                continue  # ("XLA Ops", "XLA Modules", "Steps" repeat the kernels' time)
            lane = pname
        else:  # the CPU client: each device's thunks, on its own threads
            lane = f"device:{device}" if device is not None else pname or str(e.get("pid"))
        is_comm = bool(COMM_JAX.search(str(op)) or COMM_JAX.search(str(e.get("name", ""))))
        (lanes.comm if is_comm else lanes.compute)[lane].append(_span(e))
    return lanes


def read_mxnet(events: list[dict[str, Any]]) -> Lanes:
    lanes = Lanes()
    done = complete(events)
    _host_ranges(lanes, done)
    procs = _names(events, "process_name")
    device = re.compile(r"^(cpu|gpu)/\d+$")
    for e in done:
        pname = procs.get(e.get("pid"), "")
        if e.get("cat") != "operator" or not device.match(pname):
            continue
        name = str(e.get("name", ""))
        if name in ("DeleteVariable", "ImperativeBulk", "WaitForVar"):
            continue  # engine bookkeeping (ImperativeBulk wraps ops that appear themselves)
        (lanes.comm if COMM_MXNET.match(name) else lanes.compute)[pname].append(_span(e))
    return lanes


READERS = {"torch": read_torch, "jax": read_jax, "mxnet": read_mxnet}


def _span(e: Mapping[str, Any]) -> Interval:
    return (float(e["ts"]), float(e["ts"]) + float(e["dur"]))


def breakdown(lanes: Lanes, steps: int) -> dict[str, Any]:
    """Per-step ms of each part (module docstring), the mean over the devices, and each
    device's own figures under "devices". TraceError when the trace holds no window or no
    device work inside it."""
    if lanes.window is None:
        raise TraceError(f"no {WINDOW} range in the trace: not a --profile trace of this project")
    if steps <= 0:
        raise TraceError("the profiled window holds no step")
    window = lanes.window
    span = window[1] - window[0]
    waits = union(clip(lanes.input_wait, window))
    per_device = {}
    for dev in lanes.devices:
        comp = union(clip(lanes.compute.get(dev, []), window))
        comm = union(clip(lanes.comm.get(dev, []), window))
        busy = union(comp + comm)
        idle = subtract([window], busy)
        exposed = length(subtract(comm, comp))
        wait = length(intersect(idle, waits))
        parts = {
            "compute_ms": length(comp),
            "comm_ms": length(comm),
            "exposed_comm_ms": exposed,
            "input_wait_ms": wait,
            "host_gap_ms": span - length(busy) - wait,
        }
        per_device[dev] = {k: v / 1000.0 / steps for k, v in parts.items()}
    if not per_device:
        raise TraceError("the trace holds no device work in the profiled window")
    mean = {k: sum(d[k] for d in per_device.values()) / len(per_device) for k in per_device[dev]}
    mean["overlapped_comm_ms"] = mean["comm_ms"] - mean["exposed_comm_ms"]
    return {"step_ms": span / 1000.0 / steps, **mean, "steps": steps, "devices": per_device}


def read_trace(path: str | Path, flavour: str, steps: int) -> dict[str, Any]:
    """The breakdown of trace `path` written by framework family `flavour` (torch, jax,
    mxnet) over `steps` profiled steps."""
    return breakdown(READERS[flavour](load_events(path)), steps)
