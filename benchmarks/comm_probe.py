"""`python -m benchmarks.comm_probe`: each framework's gradient collective, timed on its own.

For every framework x device count x model, the collective that averages the gradients in that
framework's trainer, run on one float32 buffer the size of the model's gradients:
- torch-ddp: `dist.all_reduce` in N processes (gloo on CPU, NCCL on CUDA; what DDP's buckets
  call), rendezvous on a free loopback port;
- torch-dp: `torch.nn.parallel.comm.reduce_add` of N per-GPU buffers onto GPU 0 (how
  nn.DataParallel sums the replicas' gradients; CUDA only);
- jax-pmap: a pmapped `lax.psum` over N devices; jax-shard: a jitted `shard_map` `lax.psum` over
  a 1-D mesh (simulated CPU devices without GPUs);
- mxnet-gluon: kvstore "device" `pushpull` of N per-context buffers (what Trainer.step does per
  parameter with update_on_kvstore=False).
Median (and min) of --reps timed repetitions after --warmup untimed ones, each bracketed by the
framework's own sync (torch.cuda.synchronize / barrier, block_until_ready, mx.nd.waitall); for
torch the slowest rank's time of each repetition. Bandwidth as nccl-tests reports it:
algbw = bytes / time, busbw = algbw x 2(N-1)/N (the per-link traffic of a ring all-reduce).

The buffer is ONE flat tensor. The trainers differ in how they cut it (DDP: 25 MB buckets
overlapped with backward; XLA: its all-reduce combiner; Gluon: one pushpull per parameter), so
this is the collective's cost for the bytes, not the step's communication time (see the
trainers' --phase-timing for that). Outputs in --out DIR: comm.json, comm.md.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

from benchmarks.devices import UsageError, detect_gpus, parse_gpus
from benchmarks.registry import REGISTRY, unavailable
from benchmarks.throughput import parse_frameworks, use_interpreter
from common.results import host_info, write_json_atomic
from common.runtime import ROOT, cpu_threads, free_port, set_omp_threads, simulate_host_devices

PROG = "python -m benchmarks.comm_probe"
COLLECTIVES = {
    "torch-ddp": "dist.all_reduce",
    "torch-dp": "comm.reduce_add",
    "jax-pmap": "pmap psum",
    "jax-shard": "shard_map psum",
    "mxnet-gluon": "kvstore pushpull",
}


def scaled(channels: int, width: float) -> int:
    return max(1, int(round(channels * width)))


def gradient_numel(model: str, width: float = 1.0, in_channels: int = 3, classes: int = 10) -> int:
    """Trainable parameters (= gradient elements) of the project's models, counted from the
    architecture (frameworks/*_models.py) without importing a framework: conv kernels, BN scale
    and offset, the linear layer's weight and bias."""
    if model == "resnet18":
        widths = [scaled(c, width) for c in (64, 128, 256, 512)]
        total = 9 * in_channels * widths[0] + 2 * widths[0]
        cin = widths[0]
        for i, cout in enumerate(widths):
            for j in range(2):
                stride = 2 if i > 0 and j == 0 else 1
                total += 9 * cin * cout + 2 * cout + 9 * cout * cout + 2 * cout
                if stride != 1 or cin != cout:  # downsample: 1x1 conv + BN
                    total += cin * cout + 2 * cout
                cin = cout
    elif model == "wideresnet":
        stem = scaled(16, width)
        total = 9 * in_channels * stem + 2 * stem
        cin = stem
        for cout in (scaled(c, width) for c in (160, 160, 320, 320, 640, 640)):
            total += 9 * cin * cout + 2 * cout + 9 * cout * cout + 2 * cout
            if cin != cout:  # shortcut: 1x1 conv, no BN
                total += cin * cout
            cin = cout
    else:
        raise ValueError(f"unknown model {model!r}; choose resnet18 or wideresnet")
    return total + cin * classes + classes


def summary(times: list[float], nbytes: int, n: int) -> dict[str, Any]:
    med = statistics.median(times)
    algbw = nbytes / med if med > 0 else 0.0
    return {
        "times_sec": times,
        "median_sec": med,
        "min_sec": min(times),
        "algbw_gbps": algbw / 1e9,
        "busbw_gbps": algbw * 2 * (n - 1) / n / 1e9,
    }


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


def _torch_rank(
    rank: int, n: int, port: int, numels: list[int], reps: int, warmup: int, result: str
) -> None:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(cpu_threads(n))  # N processes share the cores
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=n)
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")

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
    if rank == 0:
        kind = f"cuda:{torch.cuda.get_device_name()}" if cuda else "cpu-simulated"
        Path(result).write_text(
            json.dumps({"device_kind": kind, "backend": dist.get_backend(), "rows": rows})
        )
    dist.destroy_process_group()


def worker_torch_ddp(n: int, numels: list[int], reps: int, warmup: int) -> dict[str, Any]:
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        result = os.path.join(tmp, "result.json")
        mp.start_processes(
            _torch_rank,
            args=(n, free_port(), numels, reps, warmup, result),
            nprocs=n,
            start_method="spawn",
        )
        return json.loads(Path(result).read_text())


def worker_torch_dp(n: int, numels: list[int], reps: int, warmup: int) -> dict[str, Any]:
    import torch
    from torch.nn.parallel import comm

    if not torch.cuda.is_available() or n < 2:
        raise NotApplicable("nn.DataParallel sums gradients across GPUs only (CUDA, >= 2)")
    rows = []
    for numel in numels:
        bufs = [torch.ones(numel, device=f"cuda:{i}") for i in range(n)]
        times = repeat(
            lambda b=bufs: comm.reduce_add(b, destination=0), torch.cuda.synchronize, reps, warmup
        )
        rows.append(summary(times, numel * 4, n))
    return {
        "device_kind": f"cuda:{torch.cuda.get_device_name()}",
        "backend": "cuda copies",
        "rows": rows,
    }


def worker_jax(n: int, numels: list[int], reps: int, warmup: int, shard: bool) -> dict[str, Any]:
    simulate_host_devices(n)  # before JAX's CPU backend starts
    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    devices = jax.local_devices()[:n]
    if len(devices) < n:
        raise NotApplicable(f"only {len(devices)} JAX devices visible")
    rows = []
    for numel in numels:
        # (N, numel) with row i on device i: each device holds one gradient-sized buffer.
        mesh = Mesh(np.array(devices), ("batch",))
        x = jax.device_put(jnp.ones((n, numel), jnp.float32), NamedSharding(mesh, P("batch")))
        # The input is donated, so XLA reduces in place (as dist.all_reduce does, and as the
        # trainers donate their state) instead of allocating a new buffer every call.
        if shard:
            op = jax.jit(
                jax.shard_map(
                    lambda v: lax.psum(v, "batch"),
                    mesh=mesh,
                    in_specs=P("batch"),
                    out_specs=P("batch"),
                ),
                donate_argnums=0,
            )
        else:
            op = jax.pmap(
                lambda v: lax.psum(v, "batch"), axis_name="batch", devices=devices, donate_argnums=0
            )
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
    set_omp_threads(cpu_threads())  # before mxnet loads
    import mxnet as mx

    from frameworks.mxnet_gluon import select_devices

    ctx, kind = select_devices(n)
    kv = mx.kv.create("device")
    rows = []
    for key, numel in enumerate(numels):
        kv.init(key, mx.nd.zeros(numel, ctx=ctx[0]))
        bufs = [mx.nd.ones(numel, ctx=c) for c in ctx]
        times = repeat(lambda k=key, b=bufs: kv.pushpull(k, b, out=b), mx.nd.waitall, reps, warmup)
        rows.append(summary(times, numel * 4, n))
    return {"device_kind": kind, "backend": "kvstore device", "rows": rows}


class NotApplicable(Exception):
    """This framework has no collective at this device count on this machine."""


def worker(framework: str, n: int, numels: list[int], reps: int, warmup: int) -> dict[str, Any]:
    if framework == "torch-ddp":
        return worker_torch_ddp(n, numels, reps, warmup)
    if framework == "torch-dp":
        return worker_torch_dp(n, numels, reps, warmup)
    if framework in ("jax-pmap", "jax-shard"):
        return worker_jax(n, numels, reps, warmup, shard=framework == "jax-shard")
    return worker_mxnet(n, numels, reps, warmup)


# -- the driver -----------------------------------------------------------------------------------


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one clear line, exit 2
        self.exit(2, f"comm_probe: error: {message}; see {PROG} --help\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog=PROG, description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    p.add_argument("--frameworks", default=",".join(REGISTRY), metavar="LIST")
    p.add_argument(
        "--gpus",
        default="2",
        metavar="N|LIST",
        help="device counts: N runs 1, 2, 4, ... below N and N; or a list",
    )
    p.add_argument("--models", default="resnet18,wideresnet", metavar="LIST")
    p.add_argument("--width", type=float, default=1.0, help="channel-width multiplier")
    p.add_argument("--reps", type=int, default=20, help="timed repetitions (median reported)")
    p.add_argument("--warmup", type=int, default=5, help="untimed repetitions first")
    p.add_argument(
        "--python",
        default=None,
        metavar="PATH",
        help="one interpreter for every framework (default: each one's environment)",
    )
    p.add_argument(
        "--out",
        default=None,
        metavar="DIR",
        help="output directory (default results/comm-<UTC timestamp>/)",
    )
    p.add_argument("--timeout", type=float, default=600.0, metavar="SEC")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)  # internal: one framework
    p.add_argument("--devices", type=int, default=1, help=argparse.SUPPRESS)
    p.add_argument("--numels", default="", help=argparse.SUPPRESS)
    return p


def run_worker(ns: argparse.Namespace) -> int:
    numels = [int(v) for v in ns.numels.split(",")]
    try:
        out = worker(ns.worker, ns.devices, numels, ns.reps, ns.warmup)
    except NotApplicable as exc:
        out = {"not_applicable": str(exc)}
    print(json.dumps(out), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ns = build_parser().parse_args(argv)
    if ns.worker:
        return run_worker(ns)
    try:
        frameworks = parse_frameworks(ns.frameworks)
        counts = parse_gpus(ns.gpus)
        models = [m.strip() for m in ns.models.split(",") if m.strip()]
        numels = [gradient_numel(m, ns.width) for m in models]
        if ns.reps < 1 or ns.warmup < 0:
            raise UsageError("--reps must be >= 1 and --warmup >= 0")
        if ns.python is not None:
            use_interpreter(ns.python)
        gpus = detect_gpus()
        if gpus and max(counts) > len(gpus):
            raise UsageError(
                f"--gpus asks for {max(counts)} devices but this machine has "
                f"{len(gpus)} GPU(s); use --gpus {len(gpus)} or fewer"
            )
    except (UsageError, ValueError) as exc:
        print(f"comm_probe: error: {exc}", file=sys.stderr)
        return 2
    stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    out = Path(ns.out).resolve() if ns.out else ROOT / "results" / f"comm-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    skipped = unavailable(frameworks)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PYTHONUNBUFFERED": "1",
    }
    env.pop("XLA_FLAGS", None)
    rows: list[dict[str, Any]] = []
    for fw in frameworks:
        for n in counts:
            base = {"framework": fw, "collective": COLLECTIVES[fw], "devices": n}
            if fw in skipped:
                rows += [
                    {**base, "model": m, "status": "skipped", "note": skipped[fw]} for m in models
                ]
                continue
            command = [
                str(REGISTRY[fw].python),
                "-m",
                "benchmarks.comm_probe",
                "--worker",
                fw,
                "--devices",
                str(n),
                "--numels",
                ",".join(map(str, numels)),
                "--reps",
                str(ns.reps),
                "--warmup",
                str(ns.warmup),
            ]
            print(f"[comm_probe] {fw} x{n}", flush=True)
            try:
                proc = subprocess.run(
                    command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=ns.timeout
                )
                lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
                result = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
                error = "" if result else (proc.stderr.strip().splitlines() or ["?"])[-1]
            except subprocess.TimeoutExpired:
                result, error = None, f"killed after {ns.timeout:g} s"
            for i, m in enumerate(models):
                row = {
                    **base,
                    "model": m,
                    "numel": numels[i],
                    "bytes": numels[i] * 4,
                    "command": command,
                }
                if result is None:
                    row.update(status="failed", note=error)
                elif "not_applicable" in result:
                    row.update(status="n/a", note=result["not_applicable"])
                else:
                    row.update(
                        status="ok",
                        device_kind=result["device_kind"],
                        backend=result["backend"],
                        **result["rows"][i],
                    )
                rows.append(row)
    kind = next(
        (r["device_kind"] for r in rows if r.get("device_kind")),
        f"cuda:{gpus[0]}" if gpus else "cpu-simulated",
    )
    title = (
        f"Gradient all-reduce: one float32 buffer of each model's gradients (width "
        f"{ns.width:g}), {kind}"
    )
    command = [*PROG.split(), *argv]
    write_json_atomic(
        out / "comm.json",
        {
            "title": title,
            "command": command,
            "host": host_info(),
            "device_kind": kind,
            "settings": vars(ns),
            "rows": rows,
        },
    )
    headers = [
        "framework",
        "collective",
        "devices",
        "model",
        "MiB",
        "median ms",
        "min ms",
        "algbw GB/s",
        "busbw GB/s",
        "status",
    ]
    body = [
        [
            r["framework"],
            r["collective"],
            str(r["devices"]),
            r["model"],
            f"{r['bytes'] / 2**20:.1f}" if "bytes" in r else "-",
            *(
                [
                    f"{r['median_sec'] * 1e3:.2f}",
                    f"{r['min_sec'] * 1e3:.2f}",
                    *(
                        [f"{r['algbw_gbps']:.2f}", f"{r['busbw_gbps']:.2f}"]
                        if r["devices"] > 1
                        else ["-", "-"]
                    ),
                ]
                if r["status"] == "ok"
                else ["-"] * 4
            ),
            r["status"],
        ]
        for r in rows
    ]
    notes = [
        f"Median and min of {ns.reps} repetitions after {ns.warmup} warm-up ones; "
        "algbw = bytes / median time, busbw = algbw x 2(N-1)/N (nccl-tests).",
        "One flat buffer per call; the trainers cut their gradients differently (DDP "
        "buckets, XLA's combiner, Gluon per parameter).",
    ]
    if kind == "cpu-simulated":
        notes.append(
            "cpu-simulated: the devices are slices of one host, so these are memory-"
            "copy and thread-hand-off costs, not interconnect figures."
        )
    notes += [
        f"{r['framework']} x{r['devices']} {r['model']} {r['status']}: {r['note']}"
        for r in rows
        if r["status"] != "ok" and r.get("note")
    ]
    notes = list(dict.fromkeys(notes))
    md = [
        f"# {title}",
        "",
        f"`{shlex.join(command)}`",
        "",
        "| " + " | ".join(headers) + " |",
        "|" + " --- |" * len(headers),
        *("| " + " | ".join(b) + " |" for b in body),
        "",
        *(f"- {n}" for n in notes),
    ]
    (out / "comm.md").write_text("\n".join(md) + "\n")
    print_table(title, headers, body, notes)
    print(f"[comm_probe] wrote {out / 'comm.json'} and comm.md")
    return 1 if any(r["status"] == "failed" for r in rows) else 0


def print_table(title: str, headers: list[str], body: list[list[str]], notes: list[str]) -> None:
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        for row in [headers, *body]:
            print("  ".join(row))
    else:
        t = Table(title=title)
        for h in headers:
            t.add_column(h, justify="right" if "ms" in h or "GB" in h or h == "MiB" else "left")
        for row in body:
            t.add_row(*row)
        Console(width=max(120, Console().width)).print(t)
    for n in notes:
        print(f"- {n}")


if __name__ == "__main__":
    sys.exit(main())
