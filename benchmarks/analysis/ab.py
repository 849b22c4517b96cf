"""ab: one trainer, two settings, alternating runs: is B faster than A on the same work?

    python -m benchmarks.analysis.ab --framework torch-ddp --a=--no-channels-last \
        --b=--channels-last --repeat 3 -- --preset digits --gpus 1

Runs the framework's trainer (its own interpreter, one process per run, through the harness)
with the shared trainer flags after `--` plus A's extra flags, then B's, `--repeat` times,
alternating which goes first (A first in even pairs, B first in odd ones), and reports the
median of the per-pair ratios B/A of the records' `images_per_sec` (the timing rule of
common/timing.py: timed images / timed seconds, the first epoch untimed), with the pairs, the
load average around every run and every record, and each side's median first epoch over a later
one (what compilation and warm-up cost: `--a=--no-compile-cache --b=` for JAX's cache).
This is how a fast path is accepted: measured side by side on the same machine at the same
time, not against a number from another day.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import REGISTRY, UsageError
from common import cli
from common.config import ConfigError
from common.results import host_info, write_json_atomic

TOOL = "ab"
PROG = "python -m benchmarks.analysis.ab"


@dataclass
class Plan:
    framework: str
    a: list[str]
    b: list[str]
    shared: list[str]
    repeat: int
    timeout: float
    wait_load: float
    out: Path
    command: str
    where: dict[str, harness.Devices]  # "A"/"B" -> the devices that side runs on

    @property
    def devices(self) -> harness.Devices:  # the line printed before the runs
        return self.where["A"]


def build_parser() -> argparse.ArgumentParser:
    p = harness.Parser(TOOL, prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--framework", required=True, choices=list(REGISTRY), help="the trainer to run")
    p.add_argument("--a", default="", help="A's extra trainer flags, one string (the baseline)")
    p.add_argument("--b", default="", help="B's extra trainer flags, one string (the candidate)")
    harness.add_flags(p, repeat=3, out="results/ab-", timeout=900.0, wait_load=True)
    p.add_argument("shared", nargs=argparse.REMAINDER,
                   help="after --: the trainer flags both sides get "
                   "(e.g. --preset digits --gpus 1)")  # fmt: skip
    return p


def split_flags(side: str, text: str) -> list[str]:
    """One side's flags, split as a shell would; an unclosed quote is one line, not shlex's
    traceback."""
    try:
        return shlex.split(text)
    except ValueError as exc:  # "No closing quotation", "No escaped character"
        raise UsageError(f"{side} {text!r}: {str(exc).lower()}; close the quote") from None


def make_plan(argv: list[str]) -> Plan:
    ns = build_parser().parse_args(argv)
    harness.check_options(ns)
    shared = ns.shared[1:] if ns.shared[:1] == ["--"] else ns.shared
    a, b = split_flags("--a", ns.a), split_flags("--b", ns.b)
    if a == b:
        raise UsageError("--a and --b are the same settings; give B the flags to compare")
    harness.check_positive(repeat=ns.repeat)
    for flag in ("--output", "--resume", "--checkpoint-dir"):
        if any(arg.startswith(flag) for arg in [*a, *b, *shared]):
            raise UsageError(f"{flag} is set by ab itself; leave it out")
    missing = harness.unavailable([ns.framework])
    if missing:
        raise UsageError(f"{ns.framework}: {missing[ns.framework]}")
    chosen: dict[str, harness.Devices] = {}  # --devices asked -> as decided
    where: dict[str, harness.Devices] = {}  # side -> its devices
    for side, flags in (("--a", a), ("--b", b)):
        try:  # what each side's trainer would refuse, refused before the first run
            asked = cli.check_args([*shared, *flags], ns.framework).devices
        except ConfigError as exc:
            raise UsageError(f"{side}: {exc}") from None
        if asked not in chosen:  # the devices as compare would choose them, checked alike
            chosen[asked] = harness.choose_devices(asked, [ns.framework])
        if ns.framework in chosen[asked].skipped:
            raise UsageError(f"{ns.framework}: {chosen[asked].skipped[ns.framework]}")
        where[side[-1].upper()] = chosen[asked]
    out = harness.output_dir(ns.out, "ab-", "ab.json")
    command = shlex.join([*PROG.split(), *argv])
    return Plan(
        ns.framework, a, b, shared, ns.repeat, ns.timeout, ns.wait_load, out, command, where
    )


def run_side(plan: Plan, side: str, pair: int) -> dict[str, Any]:
    """One run of the trainer with one side's flags; its record's timing, or why it failed."""
    fw = REGISTRY[plan.framework]
    tag = f"{side}-{pair}"
    output = plan.out / "runs" / f"{tag}.json"
    flags = plan.a if side == "A" else plan.b
    command = [str(fw.python), "-m", fw.module, *plan.shared, *flags,
               *plan.where[side].flags, "--output", str(output)]  # fmt: skip
    log = plan.out / "logs" / f"{tag}.log"
    child = harness.run_child(  # reraise: Ctrl-C / SIGTERM stops here, not at the next run
        command, log, plan.timeout, tag=tag, wait_load=plan.wait_load, reraise=True
    )
    record = harness.read_record(output) or {}
    row: dict[str, Any] = {"side": side, "pair": pair, "load_avg": list(child.load_avg)}
    if not child.ok or record.get("status") != "ok":
        return {**row, "status": "failed", "error": record.get("error") or child.error()}
    for key in ("images_per_sec", "sec_per_epoch", "first_epoch_sec", "timed_epochs"):
        row[key] = record.get(key)
    # What the untimed first epoch (compilation, warm-up) costs over a later, timed one.
    first, later = record.get("first_epoch_sec"), record.get("sec_per_epoch_median")
    if first and later and (record.get("timed_epochs") or 0) >= 1:
        row["first_over_later"] = first / later
    return {**row, "status": "ok", "execution": record.get("execution"), "record": str(output)}


def execute(plan: Plan) -> int:
    rows: list[dict[str, Any]] = []
    ratios: list[float] = []
    interrupted = False
    try:
        for pair in range(plan.repeat):
            order = ("A", "B") if pair % 2 == 0 else ("B", "A")  # who goes first alternates
            got = {side: run_side(plan, side, pair) for side in order}
            rows += [got["A"], got["B"]]
            if got["A"]["status"] == got["B"]["status"] == "ok":
                ratios.append(got["B"]["images_per_sec"] / got["A"]["images_per_sec"])
            sides = ", ".join(side_text(s, r) for s, r in got.items())
            ratio = f", B/A {ratios[-1]:.3f}" if len(ratios) == pair + 1 else ""
            print(f"[{TOOL}] pair {pair + 1}/{plan.repeat}: {sides}{ratio}", flush=True)
    except KeyboardInterrupt:
        interrupted = True
        print(f"[{TOOL}] interrupted: the pairs measured so far are saved", flush=True)
    result = {
        **{k: getattr(plan, k) for k in ("command", "framework", "a", "b", "shared")},
        "ratios_b_over_a": ratios,
        "median_ratio": statistics.median(ratios) if ratios else None,
        "first_epoch_over_later_median": first_over_later(rows),
        "runs": rows,
        "host": host_info(),
    }
    write_json_atomic(plan.out / "ab.json", result)
    median = f"{result['median_ratio']:.3f}" if ratios else "n/a (no pair ran)"
    print(
        f"[{TOOL}] B/A images/s, median of {len(ratios)} pair(s): {median}; "
        f"pairs: {', '.join(f'{r:.3f}' for r in ratios)}",
        flush=True,
    )
    firsts = result["first_epoch_over_later_median"]
    if firsts:
        print(
            f"[{TOOL}] first epoch / a later one, median: "
            + ", ".join(f"{side} {x:.2f}x" for side, x in firsts.items()),  # type: ignore[union-attr]
            flush=True,
        )
    print(json.dumps({"ab": str(plan.out / "ab.json")}), flush=True)
    if interrupted:
        return harness.interrupted()
    return 1 if not ratios or any(r["status"] != "ok" for r in rows) else 0


def side_text(side: str, row: dict[str, Any]) -> str:
    """One side of a pair's progress line: its images/s, status and first epoch's cost."""
    first = row.get("first_over_later")
    cost = f", first epoch {first:.2f}x" if first is not None else ""
    return f"{side} {row.get('images_per_sec') or 0:.1f} images/s ({row['status']}{cost})"


def first_over_later(rows: list[dict[str, Any]]) -> dict[str, float]:
    """Each side's median of first_epoch_sec / its median later epoch (a side without one: left
    out)."""
    got = {
        s: [r["first_over_later"] for r in rows if r["side"] == s and "first_over_later" in r]
        for s in "AB"
    }
    return {s: statistics.median(x) for s, x in got.items() if x}


def main(argv: list[str] | None = None) -> int:
    return harness.run_tool(TOOL, argv, make_plan, execute)


if __name__ == "__main__":
    raise SystemExit(main())
