"""What the GPU path runs, printed on a CPU-only machine: every trainer's device plan for the GPU
platform and, for the JAX trainers, a digest of the train step exported for CUDA from the
trainer's own code (with its convolutions' dtype), at fp32 and bf16 on 2 devices, and of
benchmarks.compute_only's one-device reference step (the loop ratio's denominator).

    .venv/bin/python scripts/gpu_path.py > after.json
    git stash; .venv/bin/python scripts/gpu_path.py > before.json; git stash pop
    diff before.json after.json

A change that claims "no change of behaviour" shows this diff empty (README, Development). The
program is exported as tests/trainers/test_device_plan.py's `cuda_program` builds it; source
locations are left out of the digest.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from common.runtime import simulate_host_devices  # noqa: E402

simulate_host_devices(2)  # before JAX starts

import numpy as np  # noqa: E402

from common.config import preset  # noqa: E402


def jax_programs() -> dict[str, dict]:
    import jax
    from jax.sharding import Mesh

    from common.datasets import load_for
    from frameworks import jax_fsdp, jax_pmap, jax_shard, jax_shardmap
    from frameworks.jax_support import device_plan

    out = {}
    for mod in (jax_pmap, jax_shard, jax_shardmap, jax_fsdp):
        for precision in ("fp32", "bf16"):
            cfg = preset("smoke", precision=precision, gpus=2)
            ds = load_for(cfg)
            mesh = Mesh(np.array(jax.devices()[:2]), ("batch",))
            plan = device_plan(cfg, "gpu")
            model = mod.build_model(cfg, ds.channels, ds.num_classes, plan.compute_dtype)
            state = mod.create_train_state(cfg, model, ds.image_shape, mesh, 1)
            train, _ = mod.parallelize(plan, mesh)
            x = np.zeros((cfg.batch_size, *ds.image_shape), np.float32)
            batch = mod.to_device((x, np.zeros(cfg.batch_size, np.int32)), mesh)
            exported = jax.export.export(jax.jit(train), platforms=("cuda",))(state, batch)
            key = f"{mod.__name__.split('.')[-1]} {precision}"
            out[key] = program_facts(plan, exported.mlir_module())
    return out


def compute_only_programs() -> dict[str, dict]:
    """benchmarks.compute_only's JAX reference (the loop ratio's denominator) as the GPU would
    run it: its plan for the GPU platform and its one-device step exported for CUDA."""
    import jax

    from benchmarks.compute_only import jax_state, jax_train_step
    from frameworks.jax_support import device_plan

    out = {}
    for precision in ("fp32", "bf16"):
        cfg = preset("smoke", precision=precision, gpus=1)
        plan = device_plan(cfg, "gpu")
        _, state, shape = jax_state(cfg, plan, jax.devices()[0])
        x = np.zeros((cfg.batch_size, *shape), np.float32)
        y = np.zeros(cfg.batch_size, np.int32)
        exported = jax.export.export(jax.jit(jax_train_step), platforms=("cuda",))(state, x, y)
        out[f"compute_only jax {precision}"] = program_facts(plan, exported.mlir_module())
    return out


def program_facts(plan: Any, module: str) -> dict:
    """A plan's fields, and the digest and convolution dtypes of an exported program."""
    text = re.sub(r"loc\(.*?\)|#loc.*", "", module)
    convs = re.findall(r"stablehlo\.convolution.*?-> tensor<[^>]*x(\w+)>", text)
    return {
        "plan": {k: str(v) for k, v in dataclasses.asdict(plan).items()},
        "program_sha256": hashlib.sha256(text.encode()).hexdigest(),
        "conv_dtypes": sorted(set(convs)),
        "all_reduce": "all_reduce" in text,
    }


def torch_plans() -> dict[str, dict]:
    from frameworks.torch_support import device_plan

    out = {}
    for precision in ("fp32", "bf16", "fp16"):
        for compile_mode in (None, "reduce-overhead"):
            cfg = preset("smoke", precision=precision, compile=compile_mode is not None,
                         compile_mode=compile_mode or "default")  # fmt: skip
            plan = device_plan(cfg, "cuda")
            key = f"torch {precision} {compile_mode or 'eager'}"
            out[key] = {k: str(v) for k, v in dataclasses.asdict(plan).items()}
    return out


if __name__ == "__main__":
    jax = {**jax_programs(), **compute_only_programs()}
    print(json.dumps({"jax": jax, "torch": torch_plans()}, indent=1, sort_keys=True))
