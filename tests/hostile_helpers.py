"""Pieces shared by the hostile-input tests (tests/test_hostile_*.py, the sweep's cases in
tests/trainers/test_hostile_cases.py), written once: a name the file system cannot make, a deadline that
fails a read that blocks, a comparison's directory with no run made, and an MXNet trainer whose
checkpoint's .states write fails after the .params."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

LONG = "x" * 300  # one component over NAME_MAX (255): ENAMETOOLONG


@contextmanager
def deadline(seconds: int) -> Iterator[None]:
    """Fail (instead of hanging the suite) when the block runs past `seconds`: the hang a test
    of a FIFO or a device guards against (a reader that opened it and blocked)."""

    def hung(*args: object) -> None:
        raise TimeoutError(f"blocked for {seconds} s: a reader opened a FIFO or a device")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


# `python -c MXNET_STATES_FAIL <trainer flags>`: frameworks.mxnet_gluon on a disk that fills up
# after the .params, during the .states
MXNET_STATES_FAIL = """
import runpy, sys
import mxnet as mx
real = mx.nd.save
def save(fname, data):  # a disk that fills up after the .params, during the .states
    if ".states." in fname:
        open(fname, "wb").write(b"half")
        raise mx.base.MXNetError("Check failed: FileStream.Write incomplete")
    return real(fname, data)
mx.nd.save = save
sys.argv = ["mxnet_gluon", *sys.argv[1:]]
runpy.run_module("frameworks.mxnet_gluon", run_name="__main__")
"""


def a_comparison(out: Path, frameworks: str = "torch-dp", gpus: str = "1") -> None:
    """A comparison's directory `out` as compare writes it (config.json, runs/), no run made.
    The caller keeps compare from probing the machine (the tests' no_probe fixture)."""
    from benchmarks import compare
    from common.results import write_json_atomic

    plan = compare.make_plan(["--frameworks", frameworks, "--gpus", gpus, "--preset", "smoke",
                              "--out", str(out)])  # fmt: skip
    out.mkdir()
    write_json_atomic(out / "config.json", compare.config_json(plan, compare.sweep_of(plan), "x"))
    (out / "runs").mkdir()
