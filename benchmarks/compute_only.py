"""`python -m benchmarks.compute_only --framework torch|jax|mxnet ...`: the bare training step.

The same model and optimiser as the framework's trainers (built by their own functions), stepping
on ONE device-resident batch of the per-device size, on one device: no data pipeline, no
host-to-device copy, no data-parallel wrapper, no per-step metrics; warm-up steps excluded, the
timed steps bracketed by the framework's own sync (docs/performance.md, "Definitions").

`--interleave R` (with a framework name, e.g. `--framework torch-ddp`) also builds that
trainer's own loop in the same process (its train_step fed by the real input pipeline) and times
R alternating rounds of bare steps and loop steps: on a shared machine, the ratio to trust.

Prints one JSON line: images_per_sec, step_ms, first_step_sec, peak_memory_bytes and
memory_source, device_kind, precision_note, params, and with --interleave "interleaved" (per-round
step times of both loops, the median per-round ratio loop / bare). Framework imports are lazy.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from benchmarks import harness
from common import devices
from common.config import FRAMEWORKS, Config, ConfigError, image_side
from common.runtime import (
    cpu_threads,
    free_port,
    set_omp_threads,
    simulate_host_devices,
    use_xla_cpu_ynn,
    xla_cpu_execution,
    xla_cpu_ynn_wanted,
)

FAMILIES = ("torch", "jax", "mxnet")


def family_of(framework: str) -> str:
    """ "torch-ddp" -> "torch"; a family name maps to itself."""
    family = framework.split("-")[0]
    if family not in FAMILIES:
        raise ConfigError(
            f"unknown framework {framework!r}; use one of {', '.join(FAMILIES)} or a framework "
            "name such as torch-ddp"
        )
    return family


def check_installed(family: str) -> None:
    """One line naming the interpreter to use when this one lacks the family's packages (MXNet
    lives in .venv-mxnet, torch and JAX in .venv), instead of an ImportError's traceback."""
    fw = next(f for f in harness.REGISTRY.values() if f.family == family)
    missing = [p for p in fw.packages if importlib.util.find_spec(p) is None]
    if missing:
        raise ConfigError(
            f"{', '.join(missing)} not installed in {sys.executable}; run it with {family}'s "
            f"interpreter: {fw.venv}/bin/python -m benchmarks.compute_only --framework {family} ..."
        )


def peak_rss(why: str = "") -> dict[str, Any]:
    """This process's peak resident set size (Linux reports ru_maxrss in KiB) and its source."""
    rss = int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
    return {"peak_memory_bytes": rss, "memory_source": f"peak RSS (resource.getrusage{why})"}


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


def interleaved(bare: Callable[[], None], loop: Callable[[], None], sync: Callable[[], None],
                rounds: int, per_round: int) -> dict[str, Any]:  # fmt: skip
    """The bare step against the trainer's own step fed by the real input pipeline, in ONE
    process, alternating rounds of `per_round` steps: a slow spell of a shared machine hits both
    alike, so their ratio is robust where separate processes minutes apart are not."""
    for f in (bare, loop, bare, loop):  # the loop's own compilation / warm-up
        f()
    bare_ms: list[float] = []
    loop_ms: list[float] = []
    for _ in range(rounds):
        for f, times in ((bare, bare_ms), (loop, loop_ms)):
            sync()
            t0 = time.perf_counter()
            for _ in range(per_round):
                f()
            sync()
            times.append(1000 * (time.perf_counter() - t0) / per_round)
    return {
        "rounds": rounds, "steps_per_round": per_round, "bare_step_ms": bare_ms,
        "loop_step_ms": loop_ms,
        # median over rounds of (loop images/s) / (bare images/s) of the same round
        "ratio": statistics.median(b / lp for b, lp in zip(bare_ms, loop_ms)),
    }  # fmt: skip


@dataclass
class Bare:
    """One family's bare step on one device, ready to time (`timed`)."""

    step: Callable[[], None]
    sync: Callable[[], None]
    facts: Callable[[], dict[str, Any]]  # read right after the timed steps (the peak memory)
    # with --interleave: the trainer's loop for that many steps -> (its step, a sync of both)
    loop: Callable[[int], tuple[Callable[[], None], Callable[[], None]]]


def timed(bare: Bare, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """The bare step timed, its facts, and with `rounds` the interleaved rounds with the loop."""
    first, per_step = timed_loop(bare.step, bare.sync, steps, warmup)
    out = bare.facts()
    if rounds:
        loop, sync = bare.loop(4 + rounds * steps)
        out["interleaved"] = interleaved(bare.step, loop, sync, rounds, steps)
    return {**out, "first_step_sec": first, "step_ms": per_step * 1000}


def trainer_loop(
    cfg: Config, batch: int, layout: str, step: Callable[[Any], Any], put: Any = None
) -> Callable[[], None]:
    """One iteration of a trainer's training loop: the next batch of its input pipeline on the
    synthetic throughput data (one rank of one; `put`: the trainer's device prefetch of an
    epoch's batches), then `step(batch) -> metrics`, their sums kept on the device."""
    from common.datasets import load_for
    from common.pipeline import TrainLoader

    loader = TrainLoader(load_for(cfg), batch, cfg.seed, 0, 1, augment=cfg.augment,
                         layout=layout, prefetch=cfg.prefetch)  # fmt: skip

    def epochs() -> Iterator[Any]:  # epoch 0, 1, 2, ... as the trainers iterate them
        for epoch in itertools.count():
            yield from put(loader.epoch(epoch)) if put else loader.epoch(epoch)

    batches = epochs()
    totals: dict[str, Any] = {}

    def one() -> None:
        for k, v in step(next(batches)).items():
            totals[k] = totals[k] + v if k in totals else v

    return one


# -- torch --------------------------------------------------------------------------------------


def torch_loop(framework: str, cfg: Config, batch: int, n_steps: int, plan: Any) -> Any:
    """torch-ddp's / torch-dp's training loop: next prefetched batch, to_device, train_step."""
    import torch
    import torch.distributed as dist

    from frameworks import torch_ddp, torch_dp
    from frameworks.torch_support import to_device

    cuda = torch.cuda.is_available()
    torch.manual_seed(cfg.seed)
    if framework == "torch-ddp":  # a world of one process, as `--gpus 1` runs it
        if not dist.is_initialized():
            os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
            dist.init_process_group(plan.process_group, rank=0, world_size=1)
        device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        model = torch_ddp.build_model(cfg, cfg.synthetic_channels, cfg.synthetic_classes)
        state = torch_ddp.create_train_state(cfg, model, device, n_steps, plan)
        train_step: Any = torch_ddp.train_step
    else:
        model = torch_dp.build_model(cfg, cfg.synthetic_channels, cfg.synthetic_classes)
        state = torch_dp.create_train_state(cfg, model, [0] if cuda else [], n_steps, plan)
        train_step = torch_dp.train_step
    state.model.train()

    def step(host: Any) -> Any:
        nonlocal state
        state, metrics = train_step(state, to_device(host, state))
        return metrics

    return trainer_loop(cfg, batch, "NCHW", step)


def run_torch(cfg: Config, batch: int, framework: str) -> Bare:
    import torch

    from frameworks.torch_dp import build_model, create_train_state
    from frameworks.torch_models import count_params
    from frameworks.torch_support import (
        autocast,
        device_plan,
        execution,
        loss_fn,
        to_device,
        use_device_plan,
        what_ran,
    )

    cuda = torch.cuda.is_available()
    plan = device_plan(cfg, "cuda" if cuda else "cpu")  # the trainers' own plan
    fp32 = use_device_plan(plan)  # TF32 only with --tf32, cuDNN's autotuning on CUDA
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        torch.set_num_threads(cpu_threads())
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, cfg.synthetic_channels, cfg.synthetic_classes)
    # torch-dp's builder on ONE device: channels-last, the optimiser (weight decay on conv and
    # linear weights only), the GradScaler and torch.compile exactly as the trainers set them up.
    # The DataParallel wrapper it also builds is not used: `module` is the bare model.
    state = create_train_state(cfg, model, [0] if cuda else [], 1, plan)
    ran = what_ran(state)
    forward = state.forward if ran["mode"] != "eager" else state.module
    x, y = synthetic_batch(cfg, batch, "NCHW")
    xt, yt = to_device((x, y), state)  # as the trainers: (B, C, H, W), resident for every step
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

    def facts() -> dict[str, Any]:
        mode = execution(plan, compiled=ran["mode"] != "eager")  # "eager, channels_last, oneDNN"
        memory = peak_rss()
        if cuda:
            memory = {"peak_memory_bytes": int(torch.cuda.max_memory_allocated()),
                      "memory_source": "torch.cuda.max_memory_allocated"}  # fmt: skip
        return {
            "device_kind": f"cuda:{torch.cuda.get_device_name()}" if cuda else "cpu-simulated",
            "params": count_params(state.module),
            "packages": {"torch": torch.__version__},
            "ran": ran,
            "precision_note": f"{ran['activation_dtype']} activations, {mode}, float32 {fp32}",
            **memory,
        }

    return Bare(step, sync, facts, lambda n: (torch_loop(framework, cfg, batch, n, plan), sync))


# -- JAX ----------------------------------------------------------------------------------------


def jax_state(cfg: Config, plan: Any, device: Any) -> tuple[Any, Any, tuple[int, int, int]]:
    """(model, state, image shape) of the JAX reference on `device`: jax-pmap's builder on a
    1-device mesh (the trainers' initialisation, optimiser and dropout key), then the replica
    axis it stacks for pmap dropped: a plain state on one device. scripts/gpu_path.py builds
    the CUDA program from it."""
    import jax
    from jax.sharding import Mesh

    from frameworks.jax_pmap import build_model, create_train_state

    model = build_model(cfg, cfg.synthetic_channels, cfg.synthetic_classes, plan.compute_dtype)
    shape = (cfg.image_size, cfg.image_size, cfg.synthetic_channels)
    replicated = create_train_state(cfg, model, shape, Mesh(np.array([device]), ("batch",)), 1)
    return model, jax.tree.map(lambda a: a[0], replicated), shape


def jax_train_step(state: Any, x: Any, y: Any) -> Any:
    """The trainers' step without the pmean (one device) and without the metrics."""
    import jax

    from frameworks.jax_support import cross_entropy

    key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params: Any) -> tuple[Any, Any]:
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats}, x, train=True,
            rngs={"dropout": key}, mutable=["batch_stats"])  # fmt: skip
        return cross_entropy(logits, y, state.label_smoothing).mean(), updates

    grads, updates = jax.grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])


def run_jax(cfg: Config, batch: int, framework: str) -> Bare:
    simulate_host_devices(1)  # before JAX's CPU backend starts: one device
    # the trainers' XLA:CPU path at one device (jax_support.setup_xla)
    use_xla_cpu_ynn(xla_cpu_ynn_wanted(cfg.xla_cpu_ynn, image_side(cfg), 1))
    import jax
    import jax.numpy as jnp

    from frameworks.jax_models import count_params
    from frameworks.jax_support import (
        device_plan,
        platform_of,
        use_device_plan,
        what_ran,
    )

    device = jax.local_devices()[0]
    plan = device_plan(cfg, platform_of(device))  # the trainers' own plan: dtype, TF32, donation
    fp32 = use_device_plan(plan)
    model, state, shape = jax_state(cfg, plan, device)
    step_fn = jax.jit(jax_train_step, donate_argnums=plan.donate)  # as the trainers
    x, y = synthetic_batch(cfg, batch, "NHWC")
    xd, yd = jax.device_put(jnp.asarray(x), device), jax.device_put(jnp.asarray(y), device)
    live: list[Any] = [jax.device_put(state, device), None]  # the bare state, the loop's

    def step() -> None:
        live[0] = step_fn(live[0], xd, yd)

    def sync() -> None:
        jax.block_until_ready(live)

    def facts() -> dict[str, Any]:
        stats = device.memory_stats() or {}
        memory = peak_rss("; no JAX device memory_stats")
        if "peak_bytes_in_use" in stats:
            memory = {"peak_memory_bytes": int(stats["peak_bytes_in_use"]),
                      "memory_source": "jax device memory_stats peak_bytes_in_use"}  # fmt: skip
        ran = what_ran(model, live[0].params, live[0].batch_stats, shape)
        out = {
            "device_kind": "cpu-simulated" if device.platform == "cpu"
            else f"cuda:{device.device_kind}",
            "params": count_params(live[0].params),
            "packages": {"jax": jax.__version__},
            **memory,
            "ran": ran,
            "precision_note": f"{ran['activation_dtype']} activations, float32 {fp32}",
        }  # fmt: skip
        if device.platform == "cpu":
            out["execution"] = xla_cpu_execution()
        return out

    return Bare(
        step, sync, facts, lambda n: (jax_loop(framework, cfg, batch, plan, device, live), sync)
    )


def jax_loop(framework: str, cfg: Config, batch: int, plan: Any, device: Any, live: list) -> Any:
    """A JAX trainer's training loop on a 1-device mesh: next batch from the device prefetch,
    the trainer's compiled step; its state kept in live[1] (for the sync)."""
    from jax.sharding import Mesh

    from common.timing import PhaseTimer
    from frameworks import jax_fsdp, jax_pmap, jax_shard, jax_shardmap
    from frameworks.jax_support import prefetch_to_devices

    mesh = Mesh(np.array([device]), ("batch",))
    shape = (cfg.image_size, cfg.image_size, cfg.synthetic_channels)
    modules = {"jax-pmap": jax_pmap, "jax-shard": jax_shard, "jax-shardmap": jax_shardmap,
               "jax-fsdp": jax_fsdp}  # fmt: skip
    module: Any = modules[framework]
    model = module.build_model(
        cfg, cfg.synthetic_channels, cfg.synthetic_classes, plan.compute_dtype
    )
    live[1] = module.create_train_state(cfg, model, shape, mesh, 1)
    step_fn, _ = module.parallelize(plan, mesh)  # the trainer's own parallel transform
    off = PhaseTimer(lambda: None, False)
    put = lambda batch: module.to_device(batch, mesh)  # noqa: E731 (as the trainers write it)

    def step(device_batch: Any) -> Any:
        live[1], metrics = step_fn(live[1], device_batch)
        return metrics

    return trainer_loop(cfg, batch, "NHWC", step, lambda it: prefetch_to_devices(it, put, off))


# -- MXNet --------------------------------------------------------------------------------------


def run_mxnet(cfg: Config, batch: int, framework: str) -> Bare:
    set_omp_threads(cpu_threads())  # before mxnet loads, as the trainer's main() does
    import mxnet as mx
    from mxnet import autograd

    from frameworks import mxnet_gluon
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

    def facts() -> dict[str, Any]:
        return {
            "device_kind": kind,
            "params": count_params(model),
            "packages": {"mxnet": mx.__version__},
            **peak_rss("; MXNet has no peak-allocation query"),
            "precision_note": "fp32 (mxnet-gluon trains in fp32 only)",
        }

    def loop(n_steps: int) -> tuple[Callable[[], None], Callable[[], None]]:
        """mxnet-gluon's loop: next batch, to_device (split_and_load), train_step."""
        loop_model = build_model(cfg, cfg.synthetic_channels, cfg.synthetic_classes)
        loop_state = create_train_state(cfg, loop_model, ctx, n_steps)

        def one(host: Any) -> Any:
            nonlocal loop_state
            device_batch = mxnet_gluon.to_device(host, loop_state)
            loop_state, metrics = mxnet_gluon.train_step(loop_state, device_batch)
            return metrics

        return trainer_loop(cfg, batch, "NCHW", one), mx.nd.waitall

    return Bare(step, mx.nd.waitall, facts, loop)


RUNNERS = {"torch": run_torch, "jax": run_jax, "mxnet": run_mxnet}


def measure(framework: str, cfg: Config, batch: int, steps: int = 10, warmup: int = 3,
            rounds: int = 0) -> dict[str, Any]:  # fmt: skip
    """Compute-only images/s of `framework`'s family on one device at per-device batch `batch`."""
    family = family_of(framework)
    if rounds and framework not in FRAMEWORKS:
        raise ConfigError(f"--interleave needs a framework name ({', '.join(FRAMEWORKS)}), "
                          f"not the family {framework!r}")  # fmt: skip
    result = timed(RUNNERS[family](cfg, batch, framework), steps, warmup, rounds)
    return {
        "family": family, **{k: getattr(cfg, k) for k in ("model", "width", "image_size")},
        "batch_size": batch, "precision": cfg.precision, "steps": steps, "warmup": warmup,
        "images_per_sec": batch / (result["step_ms"] / 1000), **result,
    }  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = harness.Parser("compute_only", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--framework", required=True,
        help="torch, jax or mxnet, or a framework name such as torch-ddp (needed by --interleave)",
    )  # fmt: skip
    harness.add_workload_flags(p, 128, "the per-device batch (default 128)")
    harness.add_numbers(
        p,
        ("--steps", int, 10, "timed steps (default 10)"),
        ("--warmup", int, 3, "untimed steps first (>= 1; default 3)"),
        ("--lr", float, 0.1, "learning rate (speed does not depend on it; default 0.1)"),
        ("--seed", int, 0, "seed of the weights and the batch (default 0)"),
        ("--interleave", int, 0, "also time the framework's own training loop (train_step fed by "
         "the real input pipeline) in this process, alternating R rounds of --steps steps with "
         "the bare step; needs a framework name, e.g. --framework torch-ddp", "R"),
    )  # fmt: skip
    return p


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        check_installed(family_of(ns.framework))
        harness.check_options(ns)
        if ns.steps < 1 or ns.warmup < 1 or ns.batch_size < 1 or ns.interleave < 0:
            raise ConfigError("--steps, --warmup and --batch-size must be >= 1, --interleave >= 0")
        cfg = harness.workload_config(
            ns,
            channels_last=ns.channels_last,
            xla_cpu_ynn=ns.xla_cpu_ynn,
            seed=ns.seed,
            devices=ns.devices or devices.default() or "auto",
        )
    except (ConfigError, harness.UsageError, ValueError) as exc:
        print(f"compute_only: error: {exc}", file=sys.stderr)
        return 2
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    devices.pin(cfg.devices)  # before the framework's first device query
    try:
        result = measure(ns.framework, cfg, ns.batch_size, ns.steps, ns.warmup, ns.interleave)
    except ConfigError as exc:  # e.g. JAX with --precision fp16
        print(f"compute_only: error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
