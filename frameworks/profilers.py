"""Each framework's own profiler, as `--profile STEPS` drives it (common/profiling.py): start,
named host ranges, stop and write a trace that a standard viewer opens and common/breakdown.py
reads. Each trainer passes its framework's class to `Run(..., profiler=...)` (common/run.py; the
JAX trainers' in jax_support.start_run); the framework's profiler module is imported only when
the profiled window opens, so every trainer imports this file at no cost.

    torch   torch.profiler (CPU ops; CUDA kernels on GPUs): rank<r>/<host>.pt.trace.json, a
            Chrome trace that Perfetto, chrome://tracing and TensorBoard's torch profiler
            plugin open; Holistic Trace Analysis reads it too.
    jax     jax.profiler (XLA's own tracer, the Python tracer off): TensorBoard's / XProf's
            profile plugin opens the folder (plugins/profile/<run>/*.xplane.pb); the same
            trace as Chrome JSON (*.trace.json.gz) for Perfetto and common/breakdown.py.
    mxnet   mx.profiler (the engine's operators per device, no C API calls): trace.json, a
            Chrome trace for Perfetto / chrome://tracing.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any


class TorchProfiler:
    flavour = "torch"
    viewer = "Perfetto (ui.perfetto.dev), chrome://tracing or TensorBoard's torch profiler plugin"

    def start(self, trace_dir: Path) -> None:
        os.environ.setdefault("KINETO_LOG_LEVEL", "5")  # not kineto's "no GPU" ERROR on CPUs
        import torch
        import torch.profiler  # the framework's profiler: imported when the window opens

        self.profiler: Any = torch.profiler
        self.dir = trace_dir
        acts = [self.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            acts.append(self.profiler.ProfilerActivity.CUDA)
        self.prof = self.profiler.profile(activities=acts)
        self.prof.start()

    def annotate(self, name: str) -> AbstractContextManager[Any]:
        return self.profiler.record_function(name)

    def stop(self) -> Path:
        self.prof.stop()
        # <worker>.pt.trace.json: the name TensorBoard's plugin and HTA look for; unique per
        # rank (the folder's name), so that every rank's trace can be gathered in one folder
        path = self.dir / f"{socket.gethostname()}_{self.dir.name}.pt.trace.json"
        self.prof.export_chrome_trace(str(path))
        return path


class JaxProfiler:
    flavour = "jax"
    viewer = "TensorBoard's profile plugin / XProf (the folder), or Perfetto (*.trace.json.gz)"

    def start(self, trace_dir: Path) -> None:
        self.dir, self.t0 = trace_dir, time.time()
        import jax.profiler  # the framework's profiler: imported when the window opens

        self.profiler: Any = jax.profiler
        options = self.profiler.ProfileOptions()
        options.python_tracer_level = 0  # XLA's events, not every Python call
        self.profiler.start_trace(str(trace_dir), profiler_options=options)

    def annotate(self, name: str) -> AbstractContextManager[Any]:
        return self.profiler.TraceAnnotation(name)

    def stop(self) -> Path:
        self.profiler.stop_trace()
        found = self.dir.glob("plugins/profile/*/*.trace.json.gz")
        traces = sorted((p for p in found if _mtime(p) >= self.t0 - 1), key=_mtime)
        if not traces:  # an older run's trace in the same folder is not this run's
            raise OSError(f"jax.profiler wrote no *.trace.json.gz under {self.dir}")
        return traces[-1]  # this run's: the newest


class MxnetProfiler:
    flavour = "mxnet"
    viewer = "Perfetto (ui.perfetto.dev) or chrome://tracing"

    def start(self, trace_dir: Path) -> None:
        self.path = trace_dir / "trace.json"
        import mxnet.profiler  # the framework's profiler: imported when the window opens

        self.profiler: Any = mxnet.profiler
        self.profiler.set_config(
            profile_symbolic=True, profile_imperative=True, profile_memory=False,
            profile_api=False, aggregate_stats=False, filename=str(self.path),
        )  # fmt: skip
        self.domain = self.profiler.Domain("dpbench")
        self.profiler.set_state("run")

    def stop(self) -> Path:
        self.profiler.set_state("stop")
        self.profiler.dump()
        return self.path

    @contextmanager
    def annotate(self, name: str) -> Iterator[None]:  # a Task: MXNet has no context manager
        task = self.profiler.Task(self.domain, name)
        task.start()
        try:
            yield
        finally:
            task.stop()


def _mtime(p: Path) -> float:
    return p.stat().st_mtime
