"""compare's report on `--profile` runs: where each framework's step went, per device count.

Every record made with --profile holds a "breakdown" (common/breakdown.py): per step, compute,
exposed communication, input wait and host gaps, which add up to the profiled step, and all
communication (hidden or not) beside them. This module turns a sweep's records into a table
(`section`) and a stacked bar per framework and device count (`plot`). `kernel_dtype_shares`
reads a GPU trace's kernels for the dtype they compute in (gpu_verdicts.py's precision check).
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from benchmarks.harness import mode_label, row_key
from common.breakdown import WINDOW, complete, load_events
from common.profiling import WARMUP

TITLE = "Where the step's time goes (--profile)"
PARTS = (  # (record key, label, colour): stacked bottom to top
    ("compute_ms", "compute", "C0"),
    ("exposed_comm_ms", "exposed communication", "C3"),
    ("input_wait_ms", "input wait", "C2"),
    ("host_gap_ms", "host gap", "C7"),
)


KEYS = ("step_ms", "compute_ms", "exposed_comm_ms", "input_wait_ms", "host_gap_ms", "comm_ms",
        "measured_step_ms", "parts_vs_measured")  # fmt: skip


def profiled(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (framework, devices) with a profiled ok run: each figure the median over its
    runs (seeds), by framework then device count."""
    cells: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for r in records:
        if r.get("status") == "ok" and r.get("breakdown"):
            cells.setdefault((row_key(r), int(r.get("devices", 0))), []).append(r)
    rows = []
    for (name, devices), runs in sorted(cells.items()):
        b = {}
        for key in KEYS:
            values = [r["breakdown"][key] for r in runs if r["breakdown"].get(key) is not None]
            if values:
                b[key] = statistics.median(values)
        rows.append({"framework": name, "devices": devices, "runs": len(runs),
                     "execution": runs[0].get("execution"), "breakdown": b})  # fmt: skip
    return rows


def _ms(x: Any) -> str:
    return f"{x:.2f}" if isinstance(x, (int, float)) else "-"


def section(records: list[dict[str, Any]]) -> list[str]:
    """Markdown lines: the breakdown table and how to read it (none without profiled runs)."""
    rows = profiled(records)
    if not rows:
        return []
    lines = [
        "",
        f"## {TITLE}",
        "",
        "Per step, in ms, from each run's trace (its first epoch's profiled steps, after "
        f"{WARMUP} warm-up steps; the mean over the devices; with several runs per cell, the "
        "median of each figure over them). compute + exposed comm + input wait + host "
        "gap = profiled step; comm = all communication, hidden behind compute or not; "
        "overlap = hidden / comm; measured step = the same run's timed epochs without the "
        "profiler (their ratio: the profiler's cost). Traces: `profile` in each run's record.",
        "",
        "| framework | mode | devices | runs | profiled step | compute | exposed comm "
        "| input wait | host gap | comm | overlap | measured step | parts / measured |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]  # fmt: skip
    for r in rows:
        b = r["breakdown"]
        comm = b.get("comm_ms") or 0.0
        overlap = f"{(comm - b['exposed_comm_ms']) / comm:.0%}" if comm > 0 else "-"
        ratio = b.get("parts_vs_measured")
        mode = mode_label(r.get("execution"))
        lines.append(
            f"| {r['framework']} | {mode} | {r['devices']} | {r['runs']} | {_ms(b['step_ms'])} "
            f"| {_ms(b['compute_ms'])} | {_ms(b['exposed_comm_ms'])} | {_ms(b['input_wait_ms'])} "
            f"| {_ms(b['host_gap_ms'])} | {_ms(comm)} | {overlap} "
            f"| {_ms(b.get('measured_step_ms'))} | {f'{ratio:.2f}' if ratio else '-'} |"
        )
    return lines


def plot(plt: Any, records: list[dict[str, Any]], title: str) -> Any:
    """A stacked bar per (framework, devices): the four parts of the profiled step (None
    without profiled runs)."""
    rows = profiled(records)
    if not rows:
        return None
    fig, ax = plt.subplots(figsize=(max(6.0, 0.9 * len(rows) + 2), 4.8))
    ax.set_title(f"{TITLE}: per step, the mean over the devices, median over runs\n{title}",
                 fontsize=8)  # fmt: skip
    xs = range(len(rows))
    bottom = [0.0] * len(rows)
    for key, label, colour in PARTS:
        hs = [float(r["breakdown"].get(key) or 0.0) for r in rows]
        ax.bar(xs, hs, bottom=bottom, color=colour, label=label)
        bottom = [b + h for b, h in zip(bottom, hs)]
    measured = [r["breakdown"].get("measured_step_ms") for r in rows]
    if any(m is not None for m in measured):
        ax.scatter(
            [x for x, m in zip(xs, measured) if m is not None],
            [m for m in measured if m is not None],
            marker="_", s=400, color="k", zorder=3, label="measured step (unprofiled)",
        )  # fmt: skip
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{r['framework']}\nx{r['devices']}" for r in rows], fontsize=7)
    ax.set_ylabel("ms per step")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


# ---- the dtype of a trace's GPU kernels ---------------------------------------------------------

# A GPU kernel's dtype, from its name: first match wins (a bf16 convolution's name also holds
# "f32", its accumulator). Seen on an H200 (docs/setup.md): cuDNN/cuBLAS xmma kernels name their
# operands (sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_..., sm80_xmma_gemm_f32f32_...),
# cutlass its element type (cutlass_tensorop_bf16_s16816fprop_..., cutlass::bfloat16_t), torch's
# ATen kernels their template type (c10::BFloat16, float, __nv_bfloat16); XLA's fusions
# (loop_add_fusion_20) and Inductor's Triton kernels (triton_poi_fused_...) name none.
KERNEL_DTYPES = (
    ("bfloat16", re.compile(r"bf16|bfloat16", re.IGNORECASE)),
    ("float16", re.compile(r"(?<!b)f16|fp16|\bhalf\b|c10::Half|__half", re.IGNORECASE)),
    ("float32", re.compile(r"(?<![a-z0-9])c?f32|\bfloat\b|tf32", re.IGNORECASE)),
)


def kernel_dtype(name: str) -> str:
    """The dtype a GPU kernel's name says it computes in ("bfloat16", "float16", "float32"), ""
    where the name says none."""
    return next((dtype for dtype, pattern in KERNEL_DTYPES if pattern.search(name)), "")


def gpu_kernels(events: list[dict[str, Any]], flavour: str) -> list[dict[str, Any]]:
    """The GPU kernels of a trace, as complete events: what common/breakdown.py counts as a
    GPU's work, less memory copies (torch: category "kernel"; jax: the hlo ops of a /device:
    process's "Stream" threads; mxnet: the operators of the gpu/N lanes)."""
    meta = [e for e in events if e.get("ph") == "M"]
    procs = {e.get("pid"): str((e.get("args") or {}).get("name", ""))
             for e in meta if e.get("name") == "process_name"}  # fmt: skip
    threads = {(e.get("pid"), e.get("tid")): str((e.get("args") or {}).get("name", ""))
               for e in meta if e.get("name") == "thread_name"}  # fmt: skip

    def is_kernel(e: dict[str, Any]) -> bool:
        if flavour == "torch":
            return e.get("cat") == "kernel"
        if flavour == "jax":
            return bool((e.get("args") or {}).get("hlo_op")) and (
                procs.get(e.get("pid"), "").startswith("/device:")
                and threads.get((e.get("pid"), e.get("tid")), "").startswith("Stream")
            )
        return e.get("cat") == "operator" and procs.get(e.get("pid"), "").startswith("gpu/")

    return [e for e in complete(events) if is_kernel(e)]


def kernel_dtype_shares(path: str | Path, flavour: str) -> dict[str, Any]:
    """How a trace's GPU kernel time divides by the dtype the kernels' names say (`kernel_dtype`),
    within the profiled window (the whole trace if it has none): {"kernel_ms": total, "kernels":
    how many, "bfloat16"/"float16"/"float32"/"unnamed": share of kernel_ms, "named": 1 -
    unnamed}. TraceError (common/breakdown.py) when the trace cannot be read."""
    events = load_events(path)
    windows = [e for e in complete(events) if e.get("name") == WINDOW]
    lo, hi = (windows[-1]["ts"], windows[-1]["ts"] + windows[-1]["dur"]) if windows else (
        float("-inf"), float("inf"))  # fmt: skip
    time = {dtype: 0.0 for dtype, _ in KERNEL_DTYPES} | {"unnamed": 0.0}
    count = 0
    for e in gpu_kernels(events, flavour):
        inside = min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)
        if inside > 0:
            time[kernel_dtype(str(e.get("name", ""))) or "unnamed"] += inside
            count += 1
    total = sum(time.values())
    shares: dict[str, Any] = {k: (v / total if total else 0.0) for k, v in time.items()}
    shares["named"] = 1.0 - shares["unnamed"] if total else 0.0
    return {"kernel_ms": total / 1000.0, "kernels": count, **shares}
