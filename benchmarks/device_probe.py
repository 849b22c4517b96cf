"""`python -m benchmarks.device_probe torch|jax|mxnet`: the GPUs this interpreter's framework
sees, as one JSON line `{"gpus": [names], "detail": "torch 2.14.1, CUDA 13.0 build"}`. Run by
benchmarks.harness.probe_devices in each framework's own interpreter before a tool starts any
run; it imports that framework only (a few seconds)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys


def seen(family: str) -> tuple[list[str], str]:
    if family == "torch":
        import torch

        gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU build"
        return gpus, f"torch {torch.__version__}, {build}"
    if family == "jax":
        import jax

        plugins = [
            p for p in ("jax_cuda13_plugin", "jax_cuda12_plugin") if importlib.util.find_spec(p)
        ]
        build = f"{plugins[0]} installed" if plugins else "no CUDA plugin (a CPU build)"
        try:
            gpus = [d.device_kind for d in jax.devices() if d.platform == "gpu"]
        except (RuntimeError, AssertionError) as exc:  # a platform JAX cannot start
            return [], f"jax {jax.__version__}, {build}; its backends do not start: {exc}"[:300]
        return gpus, f"jax {jax.__version__}, {build}"
    if family == "mxnet":
        import mxnet as mx

        cuda = mx.runtime.Features().is_enabled("CUDA")
        count = mx.context.num_gpus() if cuda else 0
        return ["GPU"] * count, f"mxnet {mx.__version__}, {'a CUDA' if cuda else 'a CPU'} build"
    raise SystemExit(f"device_probe: error: unknown family {family!r}; use torch, jax or mxnet")


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m benchmarks.device_probe torch|jax|mxnet", file=sys.stderr)
        return 2
    gpus, detail = seen(args[0])
    env = [f"{k}={os.environ[k]!r}" for k in ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS")
           if k in os.environ]  # fmt: skip
    print(json.dumps({"gpus": gpus, "detail": ", ".join([detail, *env])}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
