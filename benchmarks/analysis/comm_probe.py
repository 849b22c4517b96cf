"""`python -m benchmarks.analysis.comm_probe`: each framework's gradient collective, timed alone.

For every framework x device count x model, the collective that averages the gradients in that
framework's trainer (COLLECTIVES; each worker_* says how it is run), on one float32 buffer the
size of the model's gradients (its trainable parameters, from the framework's own model). Median
(and min) of --reps timed repetitions after --warmup untimed ones, each bracketed by the
framework's own sync (torch: the slowest rank's time). Bandwidth as nccl-tests reports it:
algbw = bytes / time, busbw = algbw x 2(N-1)/N. The buffer is ONE flat tensor, where the trainers
cut their gradients (DDP's buckets, XLA's combiner, Gluon per parameter): this is the collective's
cost for the bytes, not the step's communication time (the trainers' --phase-timing or --profile
measure that). Outputs in --out DIR: comm.json, comm.md, logs/*.log.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from benchmarks import harness
from benchmarks.harness import REGISTRY, UsageError
from common import devices
from common.results import host_info, write_json_atomic
from common.runtime import cpu_threads, set_omp_threads, simulate_host_devices

PROG = "python -m benchmarks.analysis.comm_probe"
COLLECTIVES = {  # what each trainer averages its gradients with
    "torch-ddp": "dist.all_reduce",  # N processes (torchrun); gloo on CPU, NCCL on CUDA
    "torch-dp": "comm.reduce_add",  # N per-GPU buffers onto GPU 0, as nn.DataParallel (CUDA)
    "jax-pmap": "pmap psum",
    "jax-shard": "shard_map psum",  # jitted shard_map over a 1-D mesh
    "jax-shardmap": "shard_map psum",
    "jax-fsdp": "shard_map psum",  # its reduce-scatter + all-gather: a ring all-reduce's bytes
    "mxnet-gluon": "kvstore pushpull",  # kvstore "device": Trainer.step's, per parameter
}


def summary(times: list[float], nbytes: int, n: int) -> dict[str, Any]:
    med = statistics.median(times)
    algbw = nbytes / med if med > 0 else 0.0
    return {"times_sec": times, "median_sec": med, "min_sec": min(times),
            "algbw_gbps": algbw / 1e9, "busbw_gbps": algbw * 2 * (n - 1) / n / 1e9}  # fmt: skip


def repeat(op: Callable[[], None], sync: Callable[[], None], reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        op()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        op()
        sync()  # the collective has completed on this device
        times.append(time.perf_counter() - t0)
    return times


# -- workers: one process (tree) per framework and device count -------------------------------


def worker_torch_ddp(n: int, numels: list[int], reps: int, warmup: int) -> dict[str, Any] | None:
    """One rank of N, started by torchrun (the harness starts `torch.distributed.run` with N
    processes, as torch-ddp runs on a cluster); rank 0 returns the result, the others None."""
    import torch
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    else:
        torch.set_num_threads(cpu_threads(n))  # N processes share the cores
    dist.init_process_group("nccl" if cuda else "gloo")  # env:// from torchrun
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    rows = []
    for numel in numels:
        buf = torch.ones(numel, dtype=torch.float32, device=device)
        for _ in range(warmup):
            dist.all_reduce(buf)
        sync()
        times = []
        for _ in range(reps):
            dist.barrier()  # every rank starts the repetition together
            sync()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            sync()
            times.append(time.perf_counter() - t0)
        # The repetition ends when the slowest rank has its result: max over ranks.
        t = torch.tensor(times, dtype=torch.float64, device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        rows.append(summary(t.tolist(), numel * 4, n))
    kind = f"cuda:{torch.cuda.get_device_name()}" if cuda else "cpu-simulated"
    result = {"device_kind": kind, "backend": dist.get_backend(), "rows": rows}
    dist.destroy_process_group()
    return result if rank == 0 else None


def gradient_numels(family: str, models: list[str], width: float) -> list[int]:
    """Trainable parameters (= gradient elements) of each model as the framework builds it, for
    CIFAR-shaped input (3 channels, 10 classes)."""
    if family == "torch":
        from frameworks.torch_models import count_params, create_model

        return [count_params(create_model(m, 3, 10, width)) for m in models]
    if family == "jax":
        import jax
        import jax.numpy as jnp

        from frameworks import jax_models

        def numel(m: str) -> int:
            model = jax_models.create_model(m, 10, width)
            x = jnp.zeros((1, 32, 32, 3), jnp.float32)
            shapes = jax.eval_shape(lambda: model.init(jax.random.key(0), x, train=False))
            return jax_models.count_params(shapes["params"])  # shapes only: nothing computed

        return [numel(m) for m in models]
    import mxnet as mx

    from frameworks import mxnet_models

    def numel_mx(m: str) -> int:
        net = mxnet_models.create_model(m, 3, 10, width)
        net.initialize()
        net(mx.nd.zeros((1, 3, 32, 32)))  # Gluon infers deferred shapes at the first call
        return mxnet_models.count_params(net)

    return [numel_mx(m) for m in models]


def worker_torch_dp(n: int, numels: list[int], reps: int, warmup: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import comm

    if not torch.cuda.is_available() or n < 2:
        raise NotApplicable("nn.DataParallel sums gradients across GPUs only (CUDA, >= 2)")
    rows = []
    for numel in numels:
        bufs = [torch.ones(numel, device=f"cuda:{i}") for i in range(n)]
        reduce = lambda b=bufs: comm.reduce_add(b, destination=0)  # type: ignore[misc]
        rows.append(summary(repeat(reduce, torch.cuda.synchronize, reps, warmup), numel * 4, n))
    kind = f"cuda:{torch.cuda.get_device_name()}"
    return {"device_kind": kind, "backend": "cuda copies", "rows": rows}


def worker_jax(n: int, numels: list[int], reps: int, warmup: int, shard: bool) -> dict[str, Any]:
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    devices = jax.local_devices()[:n]
    if len(devices) < n:
        raise NotApplicable(f"only {len(devices)} JAX devices visible")
    mesh, spec = Mesh(np.array(devices), ("batch",)), P("batch")
    psum = lambda v: lax.psum(v, "batch")
    # The input is donated, so XLA reduces in place (as dist.all_reduce does, and as the
    # trainers donate their state) instead of allocating a new buffer every call.
    if shard:
        mapped = jax.shard_map(psum, mesh=mesh, in_specs=spec, out_specs=spec)
        op = jax.jit(mapped, donate_argnums=0)
    else:
        op = jax.pmap(psum, axis_name="batch", devices=devices, donate_argnums=0)
    rows = []
    for numel in numels:
        # (N, numel) with row i on device i: each device holds one gradient-sized buffer.
        x = jax.device_put(jnp.ones((n, numel), jnp.float32), NamedSharding(mesh, spec))
        rows.append(summary(_repeat_donated(op, x, reps, warmup), numel * 4, n))
    d = devices[0]
    kind = "cpu-simulated" if d.platform == "cpu" else f"cuda:{d.device_kind}"
    return {"device_kind": kind, "backend": f"XLA {d.platform}", "rows": rows}


def _repeat_donated(op: Callable[[Any], Any], x: Any, reps: int, warmup: int) -> list[float]:
    """Time `x = op(x)` (x donated to op) with jax.block_until_ready as the sync."""
    import jax

    buf = [x]

    def step() -> None:
        buf[0] = op(buf[0])

    return repeat(step, lambda: jax.block_until_ready(buf[0]), reps, warmup)


def worker_mxnet(n: int, numels: list[int], reps: int, warmup: int) -> dict[str, Any]:
    import mxnet as mx

    from frameworks.mxnet_gluon import select_devices

    ctx, kind = select_devices(n)
    kv = mx.kv.create("device")
    rows = []
    for key, numel in enumerate(numels):
        kv.init(key, mx.nd.zeros(numel, ctx=ctx[0]))
        bufs = [mx.nd.ones(numel, ctx=c) for c in ctx]
        push = lambda k=key, b=bufs: kv.pushpull(k, b, out=b)  # type: ignore[misc]  # noqa: E731
        rows.append(summary(repeat(push, mx.nd.waitall, reps, warmup), numel * 4, n))
    return {"device_kind": kind, "backend": "kvstore device", "rows": rows}


class NotApplicable(Exception):
    """This framework has no collective at this device count on this machine."""


def worker(
    framework: str, n: int, numels: list[int], reps: int, warmup: int
) -> dict[str, Any] | None:
    if framework == "torch-ddp":
        out = worker_torch_ddp(n, numels, reps, warmup)
    elif framework == "torch-dp":
        out = worker_torch_dp(n, numels, reps, warmup)
    elif framework in ("jax-pmap", "jax-shard", "jax-shardmap", "jax-fsdp"):
        out = worker_jax(n, numels, reps, warmup, shard=framework != "jax-pmap")
    else:
        out = worker_mxnet(n, numels, reps, warmup)
    return None if out is None else {**out, "numels": numels}


# -- the driver -----------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = harness.Parser(
        "comm_probe", prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1]
    )
    harness.add_flags(p, frameworks=",".join(REGISTRY), gpus="2")
    p.add_argument(
        "--models", default="resnet18,wideresnet", metavar="LIST",
        help="comma-separated, from: resnet18, wideresnet; one buffer the size of each model's "
        "gradients (default: both)",
    )  # fmt: skip
    harness.add_numbers(
        p,
        ("--width", float, 1.0, "channel-width multiplier (default 1.0)"),
        ("--reps", int, 20, "timed repetitions (median reported; default 20)"),
        ("--warmup", int, 5, "untimed repetitions first (default 5)"),
    )
    harness.add_flags(p, python=True, out="results/comm-", timeout=600.0, devices=True)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one framework
    p.add_argument("--worker-devices", type=int, default=1, help=argparse.SUPPRESS)
    return p


@dataclass
class Plan(harness.SweepPlan):
    models: list[str]


def make_plan(argv: list[str]) -> Plan:
    ns = build_parser().parse_args(argv)
    harness.check_options(ns)
    frameworks = harness.parse_frameworks(ns.frameworks)
    counts = harness.parse_gpus(ns.gpus)
    hint = " (e.g. --models resnet18)"
    models = harness.pick(ns.models, ("resnet18", "wideresnet"), "model", hint)
    if ns.reps < 1 or ns.warmup < 0:
        raise UsageError("--reps must be >= 1 and --warmup >= 0")
    harness.check_positive(width=ns.width, timeout=ns.timeout)
    if ns.python is not None:
        harness.use_interpreter(ns.python)
    gpus = harness.machine_gpus(ns.devices)
    harness.check_counts(counts, gpus)
    skipped = harness.unavailable(frameworks)
    chosen = harness.choose_devices(ns.devices, [f for f in frameworks if f not in skipped])
    skipped.update(chosen.skipped)
    out = harness.output_dir(ns.out, "comm-", "comm.json")
    return Plan(ns, frameworks, counts, gpus, skipped, out, [*PROG.split(), *argv], chosen, models)


def probe(plan: Plan, fw: str, n: int) -> list[dict[str, Any]]:
    """One worker process: the rows of every model for `fw` at `n` devices."""
    ns = plan.ns
    base = {"framework": fw, "collective": COLLECTIVES[fw], "devices": n}
    if fw in plan.skipped:
        return [{**base, "model": m, "status": "skipped", "note": plan.skipped[fw]}
                for m in plan.models]  # fmt: skip
    python = str(REGISTRY[fw].python)
    # torch-ddp: N rank processes, started by torchrun (a free port on the loopback interface)
    launch = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
    command = [python, *(launch if fw == "torch-ddp" else []), "-m", PROG.split()[-1],
               "--worker", fw, "--worker-devices", str(n), *plan.devices.flags,
               "--models", ",".join(plan.models),
               "--width", f"{ns.width:g}", "--reps", str(ns.reps), "--warmup", str(ns.warmup),
               ]  # fmt: skip
    log = plan.out / "logs" / f"{fw}-{n}dev.log"
    child = harness.run_child(command, log, ns.timeout, tag="comm_probe", reraise=True)
    result = child.json_line() if child.ok else None
    rows = []
    for i, m in enumerate(plan.models):
        row = {**base, "model": m, "command": command, "log": str(log.relative_to(plan.out))}
        if result is None:
            row.update(status="failed", note=child.error() or "no result line")
        elif "not_applicable" in result:
            row.update(status="n/a", note=result["not_applicable"])
        else:
            numel = result["numels"][i]
            row.update(status="ok", numel=numel, bytes=numel * 4,
                       device_kind=result["device_kind"], backend=result["backend"],
                       **result["rows"][i])  # fmt: skip
        rows.append(row)
    return rows


HEADERS = ["framework", "collective", "devices", "model", "MiB", "median ms", "min ms",
           "algbw GB/s", "busbw GB/s", "status"]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> list[list[str]]:
    body = []
    for r in rows:
        cells = [r["framework"], r["collective"], str(r["devices"]), r["model"],
                 f"{r['bytes'] / 2**20:.1f}" if "bytes" in r else "-"]  # fmt: skip
        if r["status"] == "ok":
            cells += [f"{r['median_sec'] * 1e3:.2f}", f"{r['min_sec'] * 1e3:.2f}"]
            bw = r["devices"] > 1  # one device: no traffic, no bandwidth
            cells += [f"{r['algbw_gbps']:.2f}", f"{r['busbw_gbps']:.2f}"] if bw else ["-", "-"]
        else:
            cells += ["-"] * 4
        body.append([*cells, r["status"]])
    return body


def notes(plan: Plan, rows: list[dict[str, Any]], kind: str) -> list[str]:
    out = [
        f"Median and min of {plan.ns.reps} repetitions after {plan.ns.warmup} warm-up ones; "
        "algbw = bytes / median time, busbw = algbw x 2(N-1)/N (nccl-tests).",
        "One flat buffer per call; the trainers cut their gradients differently (DDP "
        "buckets, XLA's combiner, Gluon per parameter).",
    ]
    if kind == "cpu-simulated":
        out.append("cpu-simulated: the devices are slices of one host, so these are memory-"
                   "copy and thread-hand-off costs, not interconnect figures.")  # fmt: skip
    out += [
        f"{r['framework']} x{r['devices']} {r['model']} {r['status']}: {r['note']}"
        for r in rows
        if r["status"] != "ok" and r.get("note")
    ]
    return list(dict.fromkeys(out))


def execute(plan: Plan) -> int:
    plan.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    interrupted = False
    try:
        for fw in plan.frameworks:
            for n in plan.counts:
                print(f"[comm_probe] {fw} x{n}", flush=True)
                rows += probe(plan, fw, n)
    except KeyboardInterrupt:  # the rows measured so far are written below
        interrupted = True
    kind = next((r["device_kind"] for r in rows if r.get("device_kind")), plan.device_kind)
    title = (
        f"Gradient all-reduce: one float32 buffer of each model's gradients (width "
        f"{plan.ns.width:g}), {kind}"
    )
    write_json_atomic(plan.out / "comm.json", {
        "title": title, "command": plan.command, "host": host_info(), "device_kind": kind,
        "settings": vars(plan.ns), "interrupted": interrupted, "rows": rows})  # fmt: skip
    lines = notes(plan, rows, kind)
    md = [f"# {title}", "", f"`{shlex.join(plan.command)}`", "",
          harness.markdown_table(HEADERS, table(rows)), "", *(f"- {n}" for n in lines)]  # fmt: skip
    harness.write_atomic(plan.out / "comm.md", "\n".join(md) + "\n")
    if interrupted:
        print(f"[comm_probe] interrupted; finished rows are in {plan.out / 'comm.json'}")
        return harness.interrupted()
    harness.print_table(title, HEADERS, table(rows), lines, left=("framework", "collective",
                        "model", "status"))  # fmt: skip
    print(f"[comm_probe] wrote {plan.out / 'comm.json'} and comm.md")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def run_worker(ns: argparse.Namespace) -> int:
    """Inside the worker process: measure and print one JSON line."""
    family = REGISTRY[ns.worker].family
    devices.pin(ns.devices or "auto")  # as the driver chose, before the framework starts
    if family == "jax":  # before JAX's CPU backend starts (the model is built first)
        simulate_host_devices(ns.worker_devices)
    elif family == "mxnet":  # before mxnet loads
        set_omp_threads(cpu_threads())
    try:
        numels = gradient_numels(family, ns.models.split(","), ns.width)
        out = worker(ns.worker, ns.worker_devices, numels, ns.reps, ns.warmup)
    except NotApplicable as exc:
        out = {"not_applicable": str(exc)}
    if out is not None:  # torch-ddp: rank 0 only
        print(json.dumps(out), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit 0 all ok, 1 a probe failed, 2 bad input, 128 + the signal interrupted."""
    args = list(sys.argv[1:] if argv is None else argv)
    if "--worker" in args:
        return run_worker(build_parser().parse_args(args))
    return harness.run_tool("comm_probe", args, make_plan, execute)


if __name__ == "__main__":
    sys.exit(main())
