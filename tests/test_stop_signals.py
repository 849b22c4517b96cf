"""A stop is never lost (issue #41 item 2): SIGINT / SIGTERM raise `Interrupted` from the signal
handler, and where that raise lands in code whose exceptions Python ignores (a gc callback, as
JAX's _xla_gc_callback: "Exception ignored in ..."), the flag the handler set stops the run at
the next step: an "interrupted" record, exit 128 + the signal. Before the flag such a run
trained on and recorded "ok"."""

from __future__ import annotations

import gc
import os
import signal
import sys
from collections.abc import Callable, Iterator
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


def signalled_at_third_step(
    step: Callable[[Any, Any], Any], steps: list[int], armed: list[int], signum: int
) -> Callable[[Any, Any], Any]:
    """`step`, its calls counted in `steps`; the third raises `signum` during a collection."""

    def train_step(state: Any, batch: Any) -> Any:
        steps.append(len(steps) + 1)
        if len(steps) == 3:
            armed.append(signum)
            gc.collect()
        return step(state, batch)

    return train_step


def stops_interrupted(
    main: Callable[[list[str]], int], tmp_path: Path, signum: int, steps: list[int]
) -> None:
    """`main` on the smoke preset exits 128 + signum, its record says "interrupted" by that
    signal, and no step ran after the signalled one."""
    out = tmp_path / "run.json"
    argv = [*SMOKE, "--epochs", "5", "--data-dir", str(tmp_path / "data"), "--output", str(out)]
    assert main(argv) == 128 + signum
    record = read_json(out)
    assert record["status"] == "interrupted", record.get("status")
    assert signal.Signals(signum).name in record["error"]
    assert len(steps) == 3  # stopped at the next step: nothing trained after the signal
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # handlers restored


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_swallowed_in_a_gc_callback_still_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal_in_gc_callback: list[int], signum: int
) -> None:
    from frameworks import torch_dp

    steps: list[int] = []
    step = signalled_at_third_step(torch_dp.train_step, steps, signal_in_gc_callback, signum)
    monkeypatch.setattr(torch_dp, "train_step", step)
    stops_interrupted(torch_dp.main, tmp_path, signum, steps)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_swallowed_in_jax_shard_still_stops_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, signal_in_gc_callback: list[int], signum: int
) -> None:
    """The case of the report: jax-shard, where the handler's raise landed in JAX's own gc
    callback (_xla_gc_callback) and the run recorded "ok". In this process: JAX's backend is
    started first, with the devices this pytest process has (main's XLA_FLAGS for --gpus 1
    must not fix the device count of the later JAX tests here; the run takes the first)."""
    import jax

    from frameworks import jax_shard

    jax.devices()  # the backend up before main() sets XLA_FLAGS (restored by monkeypatch)
    monkeypatch.setenv("XLA_FLAGS", os.environ.get("XLA_FLAGS", ""))
    steps: list[int] = []
    cached_step = jax_shard.cached_step

    def counted(*args: Any) -> Any:  # the compiled step, its calls counted on the host
        return signalled_at_third_step(cached_step(*args), steps, signal_in_gc_callback, signum)

    monkeypatch.setattr(jax_shard, "cached_step", counted)
    stops_interrupted(jax_shard.main, tmp_path, signum, steps)
