"""The CPU seconds each test file costs, from a run of the suite with DPBENCH_TEST_CPU_LOG set
(tests/conftest.py writes one JSON line per test), written to tests/weights.json: the order in
which scripts/test.sh's workers take the files (heaviest first, so that no long file starts
last and runs alone at the end). Also prints the files by cost, the suite's total and what it
means for N workers.

    DPBENCH_TEST_CPU_LOG=/tmp/cpu.jsonl .venv/bin/python -m pytest tests --ignore=tests/mxnet -n 2
    .venv/bin/python scripts/test_weights.py /tmp/cpu.jsonl            # prints; --write saves
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

WEIGHTS = Path(__file__).resolve().parent.parent / "tests" / "weights.json"


def per_file(log: Path) -> tuple[dict[str, float], dict[str, float]]:
    """{file: CPU seconds}, {file: wall seconds} summed over the file's tests."""
    cpu: dict[str, float] = defaultdict(float)
    wall: dict[str, float] = defaultdict(float)
    for n, line in enumerate(log.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
            name = str(row["test"]).split("::", 1)[0]
            cpu[name] += float(row["cpu"])
            wall[name] += float(row["wall"])
        except (ValueError, KeyError, TypeError):
            sys.exit(
                f"[test_weights] {log}:{n} is not a line of DPBENCH_TEST_CPU_LOG: {line[:80]!r}"
            )
    return dict(cpu), dict(wall)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("log", type=Path, help="the DPBENCH_TEST_CPU_LOG file of one whole run")
    ap.add_argument("--write", action="store_true", help=f"save the weights to {WEIGHTS}")
    ap.add_argument("--top", type=int, default=25, help="files to print (default 25)")
    args = ap.parse_args(argv)
    if not args.log.is_file():
        print(f"[test_weights] no such file: {args.log}", file=sys.stderr)
        return 2
    cpu, wall = per_file(args.log)
    ranked = sorted(cpu, key=lambda f: -cpu[f])
    total = sum(cpu.values())
    print(f"{'cpu s':>8} {'wall s':>8}  file   ({len(cpu)} files)")
    for name in ranked[: args.top]:
        print(f"{cpu[name]:8.1f} {wall[name]:8.1f}  {name}")
    print(f"{total:8.1f} {sum(wall.values()):8.1f}  total; on 2 cores at least {total / 2:.0f} s")
    if args.write:
        WEIGHTS.write_text(json.dumps({f: round(cpu[f], 1) for f in ranked}, indent=1) + "\n")
        print(f"[test_weights] wrote {WEIGHTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
