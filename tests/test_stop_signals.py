"""A stop is never lost (issue #41 item 2): SIGINT / SIGTERM raise `Interrupted` from the signal
handler, and where that raise lands in code whose exceptions Python ignores (a gc callback, as
JAX's _xla_gc_callback: "Exception ignored in ..."), the flag the handler set stops the run at
the next step: an "interrupted" record, exit 128 + the signal. Before the flag such a run
trained on and recorded "ok"."""

from __future__ import annotations

import gc
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import SMOKE, read_json


@pytest.fixture
def signal_in_gc_callback(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """`arm(signum)`: the next garbage collection raises `signum` inside a gc callback, where
    the handler's exception is swallowed (reported through sys.unraisablehook)."""
    armed: list[int] = []
    swallowed: list[Any] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start" and armed:
            signal.raise_signal(armed.pop())  # the handler runs, and raises, in here

    monkeypatch.setattr(sys, "unraisablehook", swallowed.append)
    gc.callbacks.append(callback)
    try:
        yield armed
    finally:
        gc.callbacks.remove(callback)
    assert swallowed and "Interrupted" in repr(swallowed[0].exc_value)  # it was swallowed


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_swallowed_in_a_gc_callback_still_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal_in_gc_callback: list[int], signum: int
) -> None:
    from frameworks import torch_dp

    steps: list[int] = []
    step = torch_dp.train_step

    def train_step(state: Any, batch: Any) -> Any:  # the third step: a signal during a collection
        steps.append(len(steps) + 1)
        if len(steps) == 3:
            signal_in_gc_callback.append(signum)
            gc.collect()
        return step(state, batch)

    monkeypatch.setattr(torch_dp, "train_step", train_step)
    out = tmp_path / "run.json"
    argv = [*SMOKE, "--epochs", "5", "--data-dir", str(tmp_path / "data"), "--output", str(out)]
    assert torch_dp.main(argv) == 128 + signum
    record = read_json(out)
    assert record["status"] == "interrupted", record.get("status")
    assert signal.Signals(signum).name in record["error"]
    assert len(steps) == 3  # stopped at the next step: nothing trained after the signal
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored
