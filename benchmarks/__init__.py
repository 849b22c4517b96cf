"""The runners (compare, throughput, parity, tutorial_loops, compute_only, report) and, in
analysis/, the tools that read what they measured. A module here that is a library of theirs,
run as a command, says so in one line (exit 2) instead of doing nothing and exiting 0
(common/runtime.py: LIBRARIES)."""

from common.runtime import check_interpreter

check_interpreter()
