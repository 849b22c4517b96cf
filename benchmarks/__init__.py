"""The runners (compare, throughput, parity, tutorial_loops, compute_only, report) and, in
analysis/, the tools that read what they measured. A module here that is a library of theirs,
run as a command, says so in one line (exit 2) instead of doing nothing and exiting 0."""

import sys

LIBRARIES = ("benchmarks.harness", "benchmarks.progress", "benchmarks.tutorials.record",
             "benchmarks.analysis.breakdowns")  # fmt: skip
_argv = getattr(sys, "orig_argv", [])
if "-m" in _argv[:-1] and _argv[_argv.index("-m") + 1] in LIBRARIES:
    print(f"python -m {_argv[_argv.index('-m') + 1]}: a library of the tools, not a command: "
          "`python -m benchmarks.compare --help` and docs/usage.md list the commands",
          file=sys.stderr)  # fmt: skip
    raise SystemExit(2)
