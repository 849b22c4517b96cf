"""`python -m benchmarks.compute_only --framework torch|jax|mxnet ...`: the bare training step.

The same model and optimiser as the framework's trainers (built by their own functions), stepping
on ONE device-resident batch of the per-device size, on one device: no data pipeline, no
host-to-device copy, no data-parallel wrapper, no per-step metrics. Warm-up steps (compilation,
cuDNN autotuning, MXNet's static allocation) are excluded; the timed steps are bracketed by the
framework's own sync (torch.cuda.synchronize, jax.block_until_ready, mx.nd.waitall), so queued
asynchronous work is counted when it completes. The trainer's images/s divided by this is the
share of the step's speed that the real loop keeps (benchmarks/throughput.py).

Prints one JSON line: images_per_sec, step_ms, first_step_sec, peak_memory_bytes and where that
figure comes from (memory_source), device_kind, precision (and a note where a requested fast path
does not apply), params. Framework imports are lazy: each family runs in its own interpreter.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

import numpy as np

from common.config import PRECISIONS, Config, ConfigError, preset
from common.runtime import cpu_threads, set_omp_threads, simulate_host_devices

FAMILIES = ("torch", "jax", "mxnet")
PROG = "python -m benchmarks.compute_only"


def family_of(framework: str) -> str:
    """ "torch-ddp" -> "torch"; a family name maps to itself."""
    family = framework.split("-")[0]
    if family not in FAMILIES:
        raise ConfigError(
            f"unknown framework {framework!r}; use one of {', '.join(FAMILIES)} or a framework "
            "name such as torch-ddp"
        )
    return family


def peak_rss_bytes() -> int:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def synthetic_batch(cfg: Config, batch: int, layout: str) -> tuple[np.ndarray, np.ndarray]:
    """One normalised-looking float32 batch (B, H, W, C) or (B, C, H, W) and int32 labels."""
    rng = np.random.default_rng(cfg.seed)
    s, c = cfg.image_size, cfg.synthetic_channels
    x = rng.standard_normal((batch, s, s, c), dtype=np.float32)
    if layout == "NCHW":
        x = np.ascontiguousarray(x.transpose(0, 3, 1, 2))
    y = rng.integers(0, cfg.synthetic_classes, size=batch).astype(np.int32)
    return x, y


def timed_loop(
    step: Callable[[], None], sync: Callable[[], None], steps: int, warmup: int
) -> tuple[float, float]:
    """(first-step seconds, mean seconds per timed step). The first step (compilation) and the
    other warm-up steps run before the clock starts; sync brackets the timed steps."""
    sync()
    t0 = time.perf_counter()
    step()
    sync()  # the first step's compile + run, completed
    first = time.perf_counter() - t0
    for _ in range(max(0, warmup - 1)):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()  # asynchronous frameworks queue these; no host read inside the loop
    sync()
    return first, (time.perf_counter() - t0) / steps


# -- torch --------------------------------------------------------------------------------------


def run_torch(cfg: Config, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    import torch

    from frameworks.torch_ddp import autocast, loss_fn
    from frameworks.torch_dp import build_model, create_train_state
    from frameworks.torch_models import count_params

    cuda = torch.cuda.is_available()
    if cuda:
        torch.backends.cudnn.benchmark = True  # as the trainers: fixed shapes, fastest kernels
        torch.cuda.reset_peak_memory_stats()
    else:
        torch.set_num_threads(cpu_threads())
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, cfg.synthetic_channels, cfg.synthetic_classes)
    # torch-dp's builder on ONE device: channels-last, the optimiser (weight decay on conv and
    # linear weights only), the GradScaler and torch.compile exactly as the trainers set them up.
    # The DataParallel wrapper it also builds is not used: `module` is the bare model.
    state = create_train_state(cfg, model, [0] if cuda else [], steps_per_epoch=1)
    forward = state.forward if cuda and cfg.compile else state.module
    x, y = synthetic_batch(cfg, batch, "NCHW")
    xt = torch.from_numpy(x).to(state.device)  # (B, C, H, W), resident for every step
    if cuda and cfg.channels_last:
        xt = xt.contiguous(memory_format=torch.channels_last)
    yt = torch.from_numpy(y).long().to(state.device)
    state.module.train()

    def step() -> None:
        state.optimizer.zero_grad(set_to_none=True)
        with autocast(state):
            loss = loss_fn(cfg, forward(xt), yt).mean()
        state.scaler.scale(loss).backward()
        state.scaler.step(state.optimizer)
        state.scaler.update()

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    first, per_step = timed_loop(step, sync, steps, warmup)
    out: dict[str, Any] = {
        "device_kind": f"cuda:{torch.cuda.get_device_name()}" if cuda else "cpu-simulated",
        "params": count_params(state.module),
        "packages": {"torch": torch.__version__},
    }
    if cuda:
        out["peak_memory_bytes"] = int(torch.cuda.max_memory_allocated())
        out["memory_source"] = "torch.cuda.max_memory_allocated"
        fast = [cfg.precision]
        fast += ["channels_last"] if cfg.channels_last else []
        fast += ["torch.compile"] if cfg.compile else []
        out["precision_note"] = "+".join(fast) + ", cudnn.benchmark"
    else:
        out["peak_memory_bytes"] = peak_rss_bytes()
        out["memory_source"] = "peak RSS (resource.getrusage)"
        out["precision_note"] = "fp32 eager (CUDA fast paths do not apply on CPU)"
    return {**out, "first_step_sec": first, "step_ms": per_step * 1000}


# -- JAX ----------------------------------------------------------------------------------------


def run_jax(cfg: Config, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    simulate_host_devices(1)  # before JAX's CPU backend starts: one device
    import jax
    import jax.numpy as jnp
    from jax.sharding import Mesh

    from frameworks.jax_models import TrainState, compute_dtype, count_params, cross_entropy
    from frameworks.jax_pmap import build_model, create_train_state

    device = jax.local_devices()[0]
    dtype = compute_dtype(cfg, device.platform)  # bf16 activations for --precision bf16 on GPU
    model = build_model(cfg, cfg.synthetic_channels, cfg.synthetic_classes, dtype)
    # jax-pmap's builder on a 1-device mesh (the trainers' initialisation, optimiser and dropout
    # key), then the replica axis it stacks for pmap is dropped: a plain state on one device.
    shape = (cfg.image_size, cfg.image_size, cfg.synthetic_channels)
    replicated = create_train_state(cfg, model, shape, Mesh(np.array([device]), ("batch",)), 1)
    state = jax.tree.map(lambda a: a[0], replicated)

    def train_step(state: TrainState, x: jax.Array, y: jax.Array) -> TrainState:
        # The trainers' step without the pmean (one device) and without the metrics.
        key = jax.random.fold_in(state.key, state.step)

        def loss_fn(params: Any) -> tuple[jax.Array, Any]:
            logits, updates = state.apply_fn(
                {"params": params, "batch_stats": state.batch_stats}, x, train=True,
                rngs={"dropout": key}, mutable=["batch_stats"])  # fmt: skip
            return cross_entropy(logits, y, state.label_smoothing).mean(), updates

        grads, updates = jax.grad(loss_fn, has_aux=True)(state.params)
        return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])

    step_fn = jax.jit(train_step, donate_argnums=(0,))  # in place, as the trainers donate
    x, y = synthetic_batch(cfg, batch, "NHWC")
    xd, yd = jax.device_put(jnp.asarray(x), device), jax.device_put(jnp.asarray(y), device)
    state = jax.device_put(state, device)
    holder = [state]

    def step() -> None:
        holder[0] = step_fn(holder[0], xd, yd)

    def sync() -> None:
        jax.block_until_ready(holder[0])

    first, per_step = timed_loop(step, sync, steps, warmup)
    stats = device.memory_stats() or {}
    kind = "cpu-simulated" if device.platform == "cpu" else f"cuda:{device.device_kind}"
    out: dict[str, Any] = {
        "device_kind": kind,
        "params": count_params(holder[0].params),
        "packages": {"jax": jax.__version__},
    }
    if "peak_bytes_in_use" in stats:
        out["peak_memory_bytes"] = int(stats["peak_bytes_in_use"])
        out["memory_source"] = "jax device memory_stats peak_bytes_in_use"
    else:
        out["peak_memory_bytes"] = peak_rss_bytes()
        out["memory_source"] = "peak RSS (resource.getrusage; no JAX device memory_stats)"
    if device.platform == "cpu":
        out["precision_note"] = "fp32 (CUDA fast paths do not apply on CPU)"
    else:
        out["precision_note"] = f"{jnp.dtype(dtype).name} activations, XLA defaults"
    return {**out, "first_step_sec": first, "step_ms": per_step * 1000}


# -- MXNet --------------------------------------------------------------------------------------


def run_mxnet(cfg: Config, batch: int, steps: int, warmup: int) -> dict[str, Any]:
    set_omp_threads(cpu_threads())  # before mxnet loads, as the trainer's main() does
    import mxnet as mx
    from mxnet import autograd

    from frameworks.mxnet_gluon import build_model, create_train_state, select_devices
    from frameworks.mxnet_models import count_params

    ctx, kind = select_devices(1)
    model = build_model(cfg, cfg.synthetic_channels, cfg.synthetic_classes)
    # The trainer's builder on one context: hybridize(static_alloc, static_shape), TorchSGD, and
    # a gluon.Trainer, which creates no kvstore for a single context.
    state = create_train_state(cfg, model, ctx, steps_per_epoch=1)
    x, y = synthetic_batch(cfg, batch, "NCHW")
    xd = mx.nd.array(x, ctx=ctx[0])  # (B, C, H, W), resident for every step
    yd = mx.nd.array(y, ctx=ctx[0], dtype="float32")

    def step() -> None:
        with autograd.record():
            loss = state.loss(state.model(xd), yd)  # (B,) per example
        loss.backward()  # gradient of the sum; Trainer.step rescales by 1/B
        state.trainer.step(batch)

    first, per_step = timed_loop(step, mx.nd.waitall, steps, warmup)
    return {
        "device_kind": kind,
        "params": count_params(model),
        "packages": {"mxnet": mx.__version__},
        "peak_memory_bytes": peak_rss_bytes(),
        "memory_source": "peak RSS (resource.getrusage; MXNet has no peak-allocation query)",
        "precision_note": "fp32 (mxnet-gluon trains in fp32 only)",
        "first_step_sec": first,
        "step_ms": per_step * 1000,
    }


RUNNERS = {"torch": run_torch, "jax": run_jax, "mxnet": run_mxnet}


def measure(
    framework: str,
    cfg: Config,
    batch: int,
    steps: int = 10,
    warmup: int = 3,
) -> dict[str, Any]:
    """Compute-only images/s of `framework`'s family on one device at per-device batch `batch`."""
    family = family_of(framework)
    result = RUNNERS[family](cfg, batch, steps, warmup)
    return {
        "family": family,
        "model": cfg.model,
        "width": cfg.width,
        "image_size": cfg.image_size,
        "batch_size": batch,
        "precision": cfg.precision,
        "steps": steps,
        "warmup": warmup,
        "images_per_sec": batch / (result["step_ms"] / 1000),
        **result,
    }


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, exit 2
        self.exit(2, f"{PROG}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("--framework", required=True, help="torch, jax or mxnet (or a framework name)")
    p.add_argument("--model", default="resnet18", choices=("resnet18", "wideresnet"))
    p.add_argument("--width", type=float, default=1.0, help="channel-width multiplier")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=128, help="the per-device batch")
    p.add_argument("--precision", default="fp32", choices=PRECISIONS)
    p.add_argument("--channels-last", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=False)
    p.add_argument("--steps", type=int, default=10, help="timed steps")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (>= 1)")
    p.add_argument(
        "--lr", type=float, default=0.1, help="learning rate (speed does not depend on it)"
    )
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        family_of(ns.framework)
        if ns.steps < 1 or ns.warmup < 1 or ns.batch_size < 1:
            raise ConfigError("--steps, --warmup and --batch-size must be >= 1")
        cfg = preset(
            "throughput",
            model=ns.model,
            width=ns.width,
            image_size=ns.image_size,
            batch_size=ns.batch_size,
            precision=ns.precision,
            channels_last=ns.channels_last,
            compile=ns.compile,
            seed=ns.seed,
            lr=ns.lr,
        )
    except ConfigError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    try:
        result = measure(ns.framework, cfg, ns.batch_size, ns.steps, ns.warmup)
    except ConfigError as exc:  # e.g. JAX with --precision fp16
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
