"""The runners (compare, throughput, parity, tutorial_loops, compute_only, report) and, in
analysis/, the tools that read what they measured."""

from common.runtime import check_interpreter

check_interpreter()
