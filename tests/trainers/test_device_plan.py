"""One device plan per run (jax_support / torch_support.device_plan): `--precision bf16` runs
bf16 on the CPU as on a GPU, the record says what ran (read from the run, not the flag), and
every JAX trainer's CUDA program, built here on the CPU, computes in the dtype asked."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import numpy as np
import pytest

from common.config import preset
from common.runtime import simulate_host_devices
from tests.conftest import MAIN_PYTHON, SMOKE, ok, read_json, run_python, run_trainer

simulate_host_devices(4)  # as test_jax_pmap.py: whichever module a worker imports first

import jax  # noqa: E402  (after the device count)
from jax.sharding import Mesh  # noqa: E402

from common.datasets import load_for  # noqa: E402
from frameworks import jax_fsdp, jax_pmap, jax_shard, jax_shardmap, jax_support, torch_support  # noqa: E402

TRAINERS = ("torch-ddp", "jax-pmap")  # one per family: the plan is the family's support code
ONE_STEP = (*SMOKE, "--epochs", "1", "--max-steps-per-epoch", "1")


def test_a_bool_or_a_device_for_a_platform_is_refused() -> None:
    cfg = preset("smoke", precision="bf16")
    for bad in (True, False, "cuda", "tpu"):
        with pytest.raises(TypeError, match="platform must be one of"):
            jax_support.device_plan(cfg, bad)  # type: ignore[arg-type]
    for bad in (True, "gpu"):
        with pytest.raises(TypeError, match="device_type must be one of"):
            torch_support.device_plan(cfg, bad)  # type: ignore[arg-type]
    # the same precision rule on every platform: bf16 is bf16 on a CPU too
    for platform in jax_support.PLATFORMS:
        plan = jax_support.device_plan(cfg, platform)
        assert np.dtype(plan.compute_dtype).name == "bfloat16"
    assert str(torch_support.device_plan(cfg, "cpu").autocast_dtype) == "torch.bfloat16"
    gpu = jax_support.device_plan(cfg, "gpu")
    assert gpu.donate == (0,) and gpu.matmul_precision == "highest"
    assert jax_support.device_plan(cfg, "cpu").donate == ()
    cuda = torch_support.device_plan(preset("smoke", compile=True), "cuda")
    assert cuda.compile_mode == "default" and cuda.process_group == "nccl"
    assert torch_support.device_plan(preset("smoke", compile=True), "cpu").compile_mode is None


@pytest.mark.parametrize("framework", TRAINERS)
def test_bf16_runs_on_the_cpu_and_the_record_says_what_ran(framework: str, tmp_path: Path) -> None:
    out = tmp_path / "bf16.json"  # (fp32: test_contract.py's digits runs record float32)
    args = ("--gpus", "2", "--precision", "bf16", "--output", str(out))
    ok(run_trainer(framework, *ONE_STEP, *args))
    ran = read_json(out)["ran"]
    assert ran["activation_dtype"] == "bfloat16", ran
    layout = "NHWC" if framework.startswith("jax") else "NCHW"  # torch: NCHW on a CPU
    assert ran["input_memory_format"] == layout and ran["mode"], ran


def test_channels_last_is_cudas_default_and_a_cpus_only_when_asked() -> None:
    # oneDNN's channels-last crashed torch 2.11 on the H200 machine's Xeon (4 runs of 4, "double
    # free or corruption"; 0 of 4 with --no-channels-last: docs/results/h200-20261128).
    default = preset("smoke")
    assert default.channels_last is None  # "auto": decided by the device plan
    assert torch_support.device_plan(default, "cuda").channels_last is True
    assert torch_support.device_plan(default, "cpu").channels_last is False
    for asked in (True, False):
        cfg = preset("smoke", channels_last=asked)
        assert torch_support.device_plan(cfg, "cpu").channels_last is asked
        assert torch_support.device_plan(cfg, "cuda").channels_last is asked


# A run whose step computes in float32 although --precision bf16 was asked: the bug injected
# where each family decides the dtype. The record must say float32.
FORCED_FLOAT32 = {
    "jax-pmap": "import jax.numpy as jnp, frameworks.jax_support as s; "
    "s.compute_dtype = lambda cfg: jnp.float32",
    "torch-ddp": "import dataclasses, frameworks.torch_support as s; plan = s.device_plan; "
    "s.device_plan = lambda cfg, t: dataclasses.replace(plan(cfg, t), autocast_dtype=None)",
}


@pytest.mark.parametrize("framework", sorted(FORCED_FLOAT32))
def test_a_step_that_ignores_bf16_is_recorded_as_float32(framework: str, tmp_path: Path) -> None:
    out = tmp_path / "run.json"
    module = f"frameworks.{framework.replace('-', '_')}"
    code = f"{FORCED_FLOAT32[framework]}; import sys, {module} as m; sys.exit(m.main(sys.argv[1:]))"
    args = (*ONE_STEP, "--precision", "bf16", "--output", str(out))
    ok(run_python(MAIN_PYTHON, "-c", code, *args))
    rec = read_json(out)
    assert rec["config"]["precision"] == "bf16"
    assert rec["ran"]["activation_dtype"] == "float32", rec["ran"]


# ---- the GPU program, built on the CPU ----------------------------------------------------

JAX_TRAINERS = {"jax-pmap": jax_pmap, "jax-shard": jax_shard, "jax-shardmap": jax_shardmap,
                "jax-fsdp": jax_fsdp}  # fmt: skip


def cuda_program(framework: str, precision: str, devices: int = 2) -> jax.export.Exported:
    """The train step a JAX trainer runs on `devices` GPUs, exported for CUDA from the trainer's
    own plan (jax_support.device_plan with the "gpu" platform), model, state and transform, as
    train() builds them, wrapped in jit."""
    mod = JAX_TRAINERS[framework]
    cfg = preset("smoke", precision=precision, gpus=devices)
    ds = load_for(cfg)
    mesh = Mesh(np.array(jax.devices()[:devices]), ("batch",))
    plan = jax_support.device_plan(cfg, "gpu")
    model = mod.build_model(cfg, ds.channels, ds.num_classes, plan.compute_dtype)
    state = mod.create_train_state(cfg, model, ds.image_shape, mesh, 1)
    train, _ = mod.parallelize(plan, mesh)
    x = np.zeros((cfg.batch_size, *ds.image_shape), np.float32)
    batch = mod.to_device((x, np.zeros(cfg.batch_size, np.int32)), mesh)
    return jax.export.export(jax.jit(train), platforms=("cuda",))(state, batch)


def conv_result_types(text: str) -> set[str]:
    """The element types of every convolution's result in a StableHLO module's text."""
    return set(re.findall(r"stablehlo\.convolution.*?-> tensor<[^>]*x(\w+)>", text))


@pytest.mark.parametrize("framework", sorted(JAX_TRAINERS))
def test_the_cuda_program_computes_in_the_dtype_asked(framework: str) -> None:
    for precision, want in (("bf16", {"bf16"}), ("fp32", {"f32"})):
        exported = cuda_program(framework, precision)
        text = exported.mlir_module()
        assert exported.platforms == ("cuda",) and exported.nr_devices == 2
        assert conv_result_types(text) == want, (precision, conv_result_types(text))
        assert "all_reduce" in text  # the cross-device reduction is in the program


def test_the_cuda_plan_runs_through_torchs_own_code_on_the_cpu() -> None:
    # The CUDA plan's autocast dtype and layout, through torch-dp's create_train_state,
    # to_device, train_step and what_ran, on the CPU (torch.compile: its mode is in the plan; it
    # is not run here, inductor's CPU compile is slow and measures nothing of CUDA's).
    import torch

    from frameworks import torch_dp

    cfg = preset("smoke", precision="bf16", compile=True, compile_mode="reduce-overhead")
    cuda = torch_support.device_plan(cfg, "cuda")
    assert cuda.compile_mode == "reduce-overhead" and cuda.grad_scaling is False
    plan = dataclasses.replace(cuda, compile_mode=None)  # everything else as on CUDA
    torch.manual_seed(0)
    state = torch_dp.create_train_state(cfg, torch_dp.build_model(cfg, 3, 10), [], 2, plan)
    assert torch_support.what_ran(state) == {"activation_dtype": "bfloat16", "mode": "eager",
                                             "input_memory_format": "channels_last"}  # fmt: skip
    rng = np.random.default_rng(0)
    batch = (rng.standard_normal((8, 3, 16, 16)).astype(np.float32), rng.integers(0, 10, 8))
    before = state.module.conv1.weight.detach().clone()
    state, metrics = torch_dp.train_step(state, torch_support.to_device(batch, state))
    assert torch.isfinite(metrics["loss_sum"]) and state.step == 1
    assert not torch.equal(before, state.module.conv1.weight)
