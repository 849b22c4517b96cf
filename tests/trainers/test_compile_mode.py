"""--compile-mode (torch.compile's mode, with --compile on CUDA) on any machine: the flag is
checked before anything starts, reaches the benchmark tools' trainers and compute-only loops
alike, and names itself in every record's `execution`. Its steps on a GPU:
tests/gpu/test_gpu_compile.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from benchmarks.throughput import workload
from common.config import ConfigError, preset, validate
from frameworks.torch_support import device_plan, execution


def test_a_mode_is_checked():  # without --compile: tests/trainers/test_bad_input.py
    with pytest.raises(ConfigError, match="choose one of: default, reduce-overhead"):
        validate(preset("smoke", compile=True, compile_mode="fast"))
    validate(preset("smoke", compile=True, compile_mode="reduce-overhead"))  # accepted


def test_the_record_names_the_mode():
    def named(**kw):
        return execution(
            device_plan(preset("smoke", **kw), "cuda"), compiled=kw.get("compile", False)
        )

    assert named() == "eager, channels_last, cuDNN"
    assert named(compile=True) == "torch.compile, channels_last, cuDNN"
    assert named(compile=True, compile_mode="reduce-overhead").startswith(
        "torch.compile(reduce-overhead), "
    )


def test_the_throughput_tool_gives_both_loops_the_mode():
    ns = SimpleNamespace(model="resnet18", width=1.0, image_size=32, lr=0.01, precision="bf16",
                         channels_last=True, xla_cpu_ynn=True, compile=True,
                         compile_mode="reduce-overhead", devices="cuda")  # fmt: skip
    flags = workload(ns, 512)
    assert flags[flags.index("--compile-mode") + 1] == "reduce-overhead"
    assert flags[flags.index("--devices") + 1] == "cuda"  # both loops on the devices chosen
    assert "--compile-mode" not in workload(SimpleNamespace(**{**vars(ns), "compile": False}), 512)


def test_the_compile_meter_counts_torch_compiles_from_its_start():
    # The trainers record CompileMeter().record() as compile_sec / compile_cache when they
    # compile (CUDA only; tests/gpu/test_gpu_compile.py runs that). Here torch.compile on the CPU
    # with the aot_eager backend (Dynamo and AOTAutograd, no C++ compiler needed): the meter sees
    # the compile, and a meter started afterwards does not.
    import torch

    from frameworks.torch_support import CompileMeter

    meter = CompileMeter()
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(4, 8)).sum().backward()
    after = CompileMeter()
    compiled(torch.randn(4, 8)).sum().backward()  # no new compile: same shapes
    got = meter.record()
    assert got["compile_sec"] > 0.01
    assert set(got["compile_cache"]) >= {"dir", "fxgraph_hits", "aot_autograd_misses"}
    assert after.record()["compile_sec"] == 0.0
