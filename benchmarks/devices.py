"""Which devices each framework sees here, and what the runners would run on: `python -m
benchmarks.devices [--frameworks LIST] [--devices auto|cpu|cuda]`. One line per framework (its
interpreter, its build, the GPUs it sees), then the runners' decision (harness.choose_devices)
or the line they would stop with. `bash scripts/setup.sh` prints it after installing CUDA builds.
Exit 0 when the runners would start, 1 when they would refuse, 2 on bad input."""

from __future__ import annotations

import sys

from benchmarks import harness
from benchmarks.harness import REGISTRY, UsageError


def main(argv: list[str] | None = None) -> int:
    p = harness.Parser("devices", description=__doc__.split("\n\n")[0])
    harness.add_flags(p, frameworks=",".join(REGISTRY), devices=True)
    ns = p.parse_args(sys.argv[1:] if argv is None else argv)
    try:
        names = harness.parse_frameworks(ns.frameworks)
        missing = harness.unavailable(names)
        present = [n for n in names if n not in missing]
        gpus = harness.detect_gpus()
        print(f"nvidia-smi -L: {len(gpus)} GPU(s)" + (f" ({gpus[0]})" if gpus else ""))
        seen = harness.probe_devices(present)
        for name, what in seen.items():
            where = f"{len(what.gpus)} GPU(s) ({what.gpus[0]})" if what.gpus else "no GPU"
            print(f"  {name:12s} sees {where}: {what.detail}")
        for name, why in missing.items():
            print(f"  {name:12s} not installed: {why}")
        if not present:
            raise UsageError("no framework is installed; run bash scripts/setup.sh")
    except UsageError as exc:
        print(f"devices: error: {exc}", file=sys.stderr)
        return 2
    try:
        print(harness.choose_devices(ns.devices, present, seen).line())
    except UsageError as exc:
        print(f"the runners would stop: {exc}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
