"""The GPU-check fixture: a small, real-shaped gpu_check.sh OUT_DIR for
tests/benchmarks/test_gpu_verdicts.py, cut from the H200 run of 2026-11-27
(../shared/gpu-runs/h200-20261127/gpu-steps-1-8.tar.xz):

    .venv/bin/python -m tests.make_gpu_verdicts_fixture ARCHIVE  # writes tests/fixtures/gpu_check/

- suite/gpu-tests.xml: the run's own (16 passed, 1 failed, 6 skipped);
- tests.xml: a 3-test JUnit file, all passed (that archive ran no main suite);
- suite/throughput-bf16/: three rows (torch-ddp+reduce-overhead: compiled, gains the present
  trainers' `ran`; torch-ddp: eager; jax-pmap: float32 at 0.11) and their records; each trace
  cut to its window and, per kernel dtype, its three longest kernels carrying that dtype's time.
"""

from __future__ import annotations

import gzip
import json
import shutil
import sys
import tarfile
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks.analysis.breakdowns import gpu_kernels, kernel_dtype
from common.breakdown import WINDOW, complete, load_events

OUT = Path(__file__).resolve().parent / "fixtures" / "gpu_check"
ROWS = ("torch-ddp+reduce-overhead", "torch-ddp", "jax-pmap")
TABLE = "suite/throughput-bf16"
RAN = {"activation_dtype": "bfloat16", "input_memory_format": "channels_last",
       "mode": "torch.compile(reduce-overhead)"}  # fmt: skip
TESTS_XML = """<?xml version="1.0" encoding="utf-8"?><testsuites name="pytest tests"><testsuite \
name="pytest" errors="0" failures="0" skipped="0" tests="3" time="1.0"><testcase \
classname="tests.common.test_command_line" name="test_one" time="0.1" /><testcase \
classname="tests.common.test_command_line" name="test_two" time="0.1" /><testcase \
classname="tests.benchmarks.test_ab" name="test_three" time="0.1" /></testsuite></testsuites>
"""


def trimmed(path: Path, flavour: str) -> dict[str, Any]:
    """Trace `path` cut to its window, its metadata and three kernels per dtype (module doc)."""
    events = load_events(path)
    window = [e for e in complete(events) if e.get("name") == WINDOW][-1]
    lo, hi = window["ts"], window["ts"] + window["dur"]
    time: dict[str, Counter[str]] = defaultdict(Counter)
    first: dict[str, dict[str, Any]] = {}
    for e in gpu_kernels(events, flavour):
        inside = min(e["ts"] + e["dur"], hi) - max(e["ts"], lo)
        if inside > 0:
            time[kernel_dtype(e["name"])][e["name"]] += inside
            first.setdefault(e["name"], e)
    meta = [e for e in events if e.get("ph") == "M"]
    out = [*meta, {k: window[k] for k in ("ph", "pid", "tid", "ts", "dur", "name", "cat")
                   if k in window}]  # fmt: skip
    ts = lo
    for names in time.values():
        top = names.most_common(3)
        scale = sum(names.values()) / sum(d for _, d in top)
        for name, dur in top:
            e = first[name]
            keep = {k: e[k] for k in ("ph", "pid", "tid", "name", "cat") if k in e}
            args = {k: v for k, v in (e.get("args") or {}).items() if k in ("hlo_op", "device")}
            out.append({**keep, "ts": round(ts, 3), "dur": round(dur * scale, 3), "args": args})
            ts += dur * scale
    return {"traceEvents": out}


def main(archive: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        with tarfile.open(archive, "r:xz") as tar:
            tar.extractall(tmp, filter="data")
        (src,) = Path(tmp).iterdir()
        shutil.rmtree(OUT, ignore_errors=True)
        (OUT / TABLE / "runs").mkdir(parents=True)
        shutil.copy(src / "suite" / "gpu-tests.xml", OUT / "suite" / "gpu-tests.xml")
        (OUT / "tests.xml").write_text(TESTS_XML)
        table = json.loads((src / TABLE / "throughput.json").read_text())
        table["rows"] = [r for r in table["rows"] if r["framework"] in ROWS]
        out = table["settings"]["out"]
        for row in table["rows"]:
            for real in row["real"]:
                record = json.loads((src / TABLE / real["record"]).read_text())
                if row["framework"] == "torch-ddp+reduce-overhead":
                    record["ran"] = RAN
                (OUT / TABLE / real["record"]).write_text(json.dumps(record, indent=1) + "\n")
                rel = real["trace"].removeprefix(out + "/")
                flavour = "jax" if row["framework"].startswith("jax") else "torch"
                text = json.dumps(trimmed(src / TABLE / rel, flavour))
                (OUT / TABLE / rel).parent.mkdir(parents=True, exist_ok=True)
                if rel.endswith(".gz"):
                    (OUT / TABLE / rel).write_bytes(gzip.compress(text.encode(), mtime=0))
                else:
                    (OUT / TABLE / rel).write_text(text)
        (OUT / TABLE / "throughput.json").write_text(json.dumps(table, indent=1) + "\n")


if __name__ == "__main__":
    main(sys.argv[1])
