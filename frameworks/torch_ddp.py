"""torch-ddp: PyTorch DistributedDataParallel, one process per device.

    python -m frameworks.torch_ddp --preset digits --gpus 2        # starts 2 processes itself
    torchrun --nproc-per-node=4 -m frameworks.torch_ddp --preset cifar10-resnet18
    torchrun --nnodes=2 --nproc-per-node=8 --node-rank=R --rdzv-endpoint=HOST:PORT \
        -m frameworks.torch_ddp ...                                  # R = 0 on HOST, 1 elsewhere
    srun --ntasks=16 --ntasks-per-node=8 python -m frameworks.torch_ddp ...
        # SLURM: MASTER_ADDR (first node) and MASTER_PORT exported by the batch script

Every process is one rank: it reads its shard of every global batch (common.pipeline, the
sharding DistributedSampler + set_epoch gives, minus padding), DDP averages the gradients during
backward(), and every rank applies the same update. NCCL on CUDA, gloo on CPU (N CPU processes
then stand in for N devices). Under a launcher (torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or SLURM's
SLURM_PROCID/SLURM_NTASKS/SLURM_LOCALID with MASTER_ADDR/MASTER_PORT) the launcher's world size
replaces --gpus. Only rank 0 prints, checkpoints and writes the record; resuming a multi-node run
needs --checkpoint-dir on a filesystem every node sees.

`--bn sync`: torch's SyncBatchNorm on CUDA; it refuses CPU tensors, so on CPU `CpuSyncBatchNorm`
all-reduces (sum, sum of squares, count) per layer with a differentiable all-reduce instead.
`--bn local`: each rank normalises with its shard's statistics and keeps its own running
statistics (DDP's buffer broadcast is off); they are averaged over the ranks at the end of every
epoch (`sync_batch_stats`), as jax-pmap and mxnet-gluon do, so every rank evaluates (and rank 0
checkpoints) the same model.

Known differences from the other frameworks: running_var uses the unbiased batch variance (torch);
the test loss uses the training loss (label smoothing included).
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common.config import CUDA_GRAPH_MODES, Config, ConfigError, resolve
from common.datasets import check_available, load_for
from common.init import init_record
from common.pipeline import EvalLoader, TrainLoader, crops_on_device, pipeline_record
from common.results import RunRecorder, write_json_atomic
from common.runtime import (
    cpu_threads,
    die_with_parent,
    free_port,
    injected_failure,
    printer,
    process_state,
    stale_launch_env,
    threads_record,
)
from common.schedule import lr_table_for
from common.timing import PhaseTimer, Timer
from common.trainer import (
    BAD_INPUT,
    Interrupted,
    RunFailed,
    check_resume,
    describe,
    keep_measured_epochs,
    run_main,
    save_final_state,
    shield_interrupts,
    should_log,
)
from frameworks.torch_models import (
    CompileMeter,
    TrainState,
    autocast,
    canonical_state,
    check_devices,
    checkpoint_meta_of,
    checkpoint_path,
    count_params,
    create_model,
    evaluate,
    execution,
    initialize,
    load_checkpoint,
    loss_fn,
    make_optimizer,
    no_forward_buffer_sync,
    save_checkpoint,
    seed_for,
    set_float32_precision,
    sync,
    train_put,
)

FRAMEWORK = "torch-ddp"
PACKAGES = ("torch",)


# ---- model ---------------------------------------------------------------------------------


class AllReduceSum(torch.autograd.Function):
    """Differentiable all-reduce (sum): the gradient of a global sum with respect to each rank's
    part is the global sum of the gradients (what the deprecated torch.distributed.nn does)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class CpuSyncBatchNorm(nn.BatchNorm2d):
    """BatchNorm over the global batch for CPU tensors (torch's SyncBatchNorm is CUDA-only).

    One differentiable all-reduce of (sum, sum of squares, count) per layer: its backward
    all-reduces the gradient of the statistics, so every rank's input gets its share of the
    global-batch gradient, as in SyncBatchNorm. Plain BatchNorm2d in eval mode or alone.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (N, C, H, W), this rank's shard
        if not (self.training and dist.is_initialized() and dist.get_world_size() > 1):
            return super().forward(x)
        c = x.shape[1]
        local = torch.cat(
            [x.sum((0, 2, 3)), (x * x).sum((0, 2, 3)), x.new_full((1,), x.numel() / c)]
        )
        stats = AllReduceSum.apply(local)  # (2C + 1,) summed over ranks; a sync point
        n = stats[-1]
        mean = stats[:c] / n
        var = (stats[c : 2 * c] / n - mean * mean).clamp_min(0)  # biased: normalises the batch
        with torch.no_grad():  # running = (1 - momentum) * running + momentum * batch (unbiased)
            self.running_mean.lerp_(mean, self.momentum)
            self.running_var.lerp_(var * n / (n - 1), self.momentum)
            self.num_batches_tracked.add_(1)
        scale = self.weight * torch.rsqrt(var + self.eps)
        return x * scale[None, :, None, None] + (self.bias - mean * scale)[None, :, None, None]


def build_model(cfg: Config, in_channels: int, num_classes: int) -> nn.Module:
    """Build `cfg.model` for `in_channels`-channel images and `num_classes` classes."""
    norm = None
    if cfg.bn == "sync":
        bn = nn.SyncBatchNorm if torch.cuda.is_available() else CpuSyncBatchNorm
        norm = lambda c: bn(c, eps=cfg.bn_eps, momentum=cfg.bn_momentum)
    return create_model(
        cfg.model,
        in_channels,
        num_classes,
        cfg.width,
        cfg.dropout,
        cfg.bn_momentum,
        cfg.bn_eps,
        norm,
    )


# ---- state ---------------------------------------------------------------------------------


def create_train_state(
    cfg: Config, model: nn.Module, device: torch.device, steps_per_epoch: int
) -> TrainState:
    """Create the parameters, optimiser state and step counter; place them on the devices."""
    cuda = device.type == "cuda"
    initialize(cfg, model)  # --init shared: the arrays every framework starts from
    model = model.to(device)
    if cfg.channels_last:  # NHWC convolutions: cuDNN's and oneDNN's fast path (measured)
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(cfg, model)
    # DDP broadcasts rank 0's parameters now and averages gradients bucket by bucket during
    # backward(), overlapping the all-reduce with the rest of the backward pass. Its default
    # also broadcasts rank 0's BN buffers at every forward; no_forward_buffer_sync keeps each
    # rank's running statistics of its own shard instead, averaged at the end of every epoch
    # (sync_batch_stats), as jax-pmap and mxnet-gluon do. A world of one
    # has nothing to average: the bare model trains identically without DDP's per-step bucket
    # bookkeeping (about 4% of a ResNet-18 step on CPU, measured).
    world = dist.get_world_size()
    if world > 1:
        ddp = DDP(
            model,
            device_ids=[device.index] if cuda else None,
            gradient_as_bucket_view=True,
            **no_forward_buffer_sync(),
        )
    else:
        ddp = model
    forward = torch.compile(ddp, mode=cfg.compile_mode) if cuda and cfg.compile else ddp
    scaler = torch.amp.GradScaler(device.type, enabled=cuda and cfg.precision == "fp16")
    return TrainState(
        model=ddp,
        forward=forward,
        module=model,
        optimizer=optimizer,
        scaler=scaler,
        lr=lr_table_for(cfg, steps_per_epoch),
        step=0,
        cfg=cfg,
        device=device,
        world=world,
        phases=PhaseTimer(sync, False),
    )


# ---- step: where gradients are averaged ----------------------------------------------------


def train_step(
    state: TrainState, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """One synchronous data-parallel SGD step on a global batch.

    Returns the new state and metrics {"loss_sum", "correct", "count"} summed over the global
    batch and left on the device (read only at log points: no per-step host sync)."""
    x, y = batch  # this rank's shard, on the device: (B/N, C, H, W), (B/N,)
    for group in state.optimizer.param_groups:
        group["lr"] = float(state.lr[state.step])  # a host array: no sync
    state.optimizer.zero_grad(set_to_none=True)
    # time the all-reduce on its own (no overlap); a world of one has none (the bare model)
    separate = state.phases.enabled and state.world > 1
    with (
        state.phases.phase("forward_backward"),
        state.model.no_sync() if separate else nullcontext(),
    ):
        with autocast(state):
            logits = state.forward(x)
            loss = loss_fn(state.cfg, logits, y).mean()  # mean over this rank's shard
        state.scaler.scale(loss).backward()  # DDP: gradients averaged over ranks in here
    if separate:
        with state.phases.phase("allreduce"):
            allreduce_gradients(state.module, state.world)
    with state.phases.phase("optimizer"):
        state.scaler.step(state.optimizer)
        state.scaler.update()
    state.step += 1
    # Sums over this rank's shard; train() sums them over ranks once per epoch (one all-reduce).
    metrics = {
        "loss_sum": loss.detach().float() * y.shape[0],
        "correct": (logits.detach().argmax(1) == y).sum().float(),
        "count": torch.full((), float(y.shape[0]), device=y.device),
    }
    return state, metrics


@torch.no_grad()
def eval_step(state: TrainState, batch: tuple[torch.Tensor, ...]) -> dict[str, torch.Tensor]:
    """Metrics {"loss_sum", "correct", "count"} of a test batch; rows of weight 0 (padding) do
    not count."""
    x, y, w = batch  # this rank's part of the test set
    with autocast(state):
        logits = state.module(x)  # the bare model: no DDP buffer broadcast, no gradients
    return {
        "loss_sum": (loss_fn(state.cfg, logits, y) * w).sum(),
        "correct": ((logits.argmax(1) == y).float() * w).sum(),
        "count": w.sum(),
    }


def allreduce_gradients(module: nn.Module, world: int) -> None:
    """Average gradients over ranks in one flat all-reduce (what DDP does in buckets); used
    under --phase-timing only, to time the all-reduce apart from backward()."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def sync_batch_stats(state: TrainState) -> None:
    """--bn local: every rank's BN running statistics -> their mean over the ranks (as jax-pmap
    and mxnet-gluon do), so that every rank evaluates, and rank 0 checkpoints, the same model.
    The running average is linear, so this equals averaging them after every step. A no-op in
    a world of one; num_batches_tracked is the same on every rank."""
    if state.world > 1:
        for buf in state.module.buffers():
            if buf.is_floating_point():
                dist.all_reduce(buf)  # a sync point, once per epoch
                buf.div_(state.world)


# ---- devices: processes, replicas and shards -----------------------------------------------


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, from the launcher's environment."""

    rank: int
    world: int
    local_rank: int
    local_world: int


def launch_env() -> Launch | None:
    """torchrun (or our own spawn) sets RANK/WORLD_SIZE/LOCAL_RANK; srun sets SLURM_PROCID/
    SLURM_NTASKS/SLURM_LOCALID (a 1-task SLURM job is not a launch: --gpus spawns as usual)."""
    env = os.environ
    stale = stale_launch_env()
    if stale:
        raise ConfigError(stale)
    if "RANK" in env and "WORLD_SIZE" in env:
        world = int(env["WORLD_SIZE"])
        return Launch(
            int(env["RANK"]),
            world,
            int(env.get("LOCAL_RANK", 0)),
            int(env.get("LOCAL_WORLD_SIZE", world)),
        )
    if "SLURM_PROCID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        if not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
            raise ConfigError(
                "under srun, export MASTER_ADDR (the first node's host name) and "
                "MASTER_PORT (a free port) in the batch script"
            )
        check_master_addr(env["MASTER_ADDR"], env["SLURM_PROCID"] == "0")
        world = int(env["SLURM_NTASKS"])
        per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", ""))  # "8" or "8(x2)"
        tasks_per_node = int(per_node.group()) if per_node else world
        os.environ.update(
            RANK=env["SLURM_PROCID"],
            WORLD_SIZE=str(world),
            LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        )
        return Launch(
            int(env["SLURM_PROCID"]), world, int(env.get("SLURM_LOCALID", 0)), tasks_per_node
        )
    return None


def check_master_addr(host: str, rank0: bool) -> None:
    """Under srun the batch script exports MASTER_ADDR: it must resolve, and rank 0 (which
    serves the rendezvous there) must run on it. A stale value (another job's first node)
    would otherwise hold every rank until the rendezvous times out."""
    try:
        ip = socket.gethostbyname(host)
    except OSError:
        raise ConfigError(
            f"MASTER_ADDR={host} does not resolve; export the first node's host name "
            '(e.g. MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1))'
        ) from None
    if rank0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, 0))
            except OSError:
                raise ConfigError(
                    f"MASTER_ADDR={host} is not this host ({socket.gethostname()}), where rank 0 "
                    "serves the rendezvous: a stale value? export the first node's host name"
                ) from None


def spawn(cfg: Config) -> dict:
    """Start `cfg.gpus` processes on this node, each running train(cfg) as one rank with the
    environment torchrun would give it (rendezvous on a free loopback port), and wait for them.

    The workers die with this process (common.runtime.die_with_parent: a parent-death signal
    and a pipe only this process holds), so a cancelled run (kill -9, the OOM killer) leaves
    no orphan. Rank 0 sends its record after every epoch through a pipe, and only this process
    writes `--output`: a run whose rank fails keeps the epochs measured so far ("failed"), one
    stopped by SIGTERM / SIGINT stops its workers first ("interrupted"). No temporary file."""
    ctx = mp.get_context("spawn")
    port = free_port()
    workers: list = []
    lifelines: list[Connection] = []
    reports: dict[int, Connection] = {}  # rank -> its report pipe, until it closes
    record: dict = {}
    errors: dict[int, tuple[str, str]] = {}  # rank -> (kind, one line), in order of arrival

    def read(conns: dict[int, Connection]) -> None:
        nonlocal record
        for rank, conn in list(conns.items()):
            while rank in conns and conn.poll():
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    del conns[rank]  # the worker has exited: nothing more will come
                    continue
                if kind == "record":
                    record = payload
                else:
                    errors.setdefault(rank, (kind, payload))

    try:
        for rank in range(cfg.gpus):
            life_r, life_w = ctx.Pipe(duplex=False)  # this process holds life_w until the end
            report_r, report_w = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_spawned,
                args=(rank, cfg, port, os.getpid(), life_r, report_w, sys.argv),
                name=f"torch-ddp rank {rank}",
            )
            proc.start()
            life_r.close()
            report_w.close()
            workers.append(proc)
            lifelines.append(life_w)
            reports[rank] = report_r
        while any(p.exitcode is None for p in workers):
            live = [p.sentinel for p in workers if p.exitcode is None]
            wait([*reports.values(), *live], timeout=1.0)
            read(reports)
            if errors or any(p.exitcode not in (None, 0) for p in workers):
                break
        read(reports)  # what a worker sent just before it exited
        signalled = [
            -p.exitcode for p in workers if p.exitcode in (-signal.SIGTERM, -signal.SIGINT)
        ]
        if signalled and not errors:  # a scheduler signalled the whole job, workers first
            raise Interrupted(signalled[0])
        if errors or any(p.exitcode not in (None, 0) for p in workers):
            error, bad_input = _failure(cfg, workers, errors)
            _stop(workers, cfg)
            if bad_input:
                raise ConfigError(error)
            if record:
                record.update(status="failed", error=error)
                if cfg.output:
                    write_json_atomic(cfg.output, record)
                raise RunFailed(error)
            raise RuntimeError(error)
    except Interrupted as exc:
        shield_interrupts()  # this process's own SIGTERM may come after its workers'
        _stop(workers, cfg)
        read(reports)  # the last epoch rank 0 reported before it was stopped
        if record:
            record.update(status="interrupted", error=str(exc))
            if cfg.output:
                write_json_atomic(cfg.output, record)
            exc.recorded = True
        raise
    finally:
        _stop(workers, cfg)
        for conn in [*lifelines, *reports.values()]:
            conn.close()
    if cfg.output:
        write_json_atomic(cfg.output, record)
    return record


def _failure(cfg: Config, workers: list, errors: dict[int, tuple[str, str]]) -> tuple[str, bool]:
    """The one line that says why a spawned run failed, and whether it is bad input. A rank
    that timed out in a collective names the ranks that never answered (stopped, or alive and
    silent); a rank that died without a word is named with its exit status."""
    if errors:
        rank, (kind, message) = next(iter(errors.items()))
        message = re.sub(r"\[[^\]]*:\d+\] ", "", message)  # gloo's source location
        if "timed out" in message.lower() or "timeout" in message.lower():
            silent = [
                f"rank {r} (pid {p.pid}{', stopped' if process_state(p.pid) == 'T' else ''})"
                for r, p in enumerate(workers)
                if r not in errors and p.exitcode is None
            ]
            if silent:
                return (
                    f"rank {rank} waited {cfg.collective_timeout:g} s (--collective-timeout) "
                    f"for {', '.join(silent)}, which did not answer: {message}",
                    False,
                )
        return (message if rank == 0 else f"rank {rank}: {message}"), kind == "bad-input"
    for rank, proc in enumerate(workers):
        if proc.exitcode not in (None, 0):
            code = proc.exitcode
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
            return f"rank {rank} (pid {proc.pid}) {how} without an error message", False
    return "a worker failed", False


def _stop(workers: list, cfg: Config, grace: float = 3.0) -> None:
    """SIGTERM every worker still running, SIGKILL what is left after `grace` seconds, reap
    them, and remove the checkpoint temp file a killed rank 0 may have been writing."""
    alive = [p for p in workers if p.exitcode is None]
    for proc in alive:
        proc.terminate()
        if process_state(proc.pid) == "T":  # a stopped process acts on SIGTERM only once resumed
            os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    if cfg.checkpoint_dir:
        for proc in workers:  # common.runtime.atomic_write_with: <file>.<random>.tmp<pid>
            for tmp in Path(cfg.checkpoint_dir).glob(f"*.tmp{proc.pid}"):
                tmp.unlink(missing_ok=True)


def _spawned(
    local_rank: int,
    cfg: Config,
    port: int,
    parent: int,
    lifeline: Connection,
    report: Connection,
    argv: list[str],
) -> None:
    """One rank of a spawned run: dies with the parent; reports to it; never writes --output."""
    die_with_parent(parent, lifeline)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C: the parent stops the workers
    sys.argv = argv  # the record's "command"
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(cfg.gpus),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(cfg.gpus),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        record = train(cfg, report=report)
    except BAD_INPUT as exc:
        report.send(("bad-input", str(exc)))
        sys.exit(1)
    except Exception as exc:
        report.send(("error", str(exc) if isinstance(exc, RunFailed) else describe(exc)))
        sys.exit(1)
    if local_rank == 0:
        report.send(("record", record))


# ---- train: where time is measured ---------------------------------------------------------


def train(cfg: Config, report: Connection | None = None) -> dict:
    """Train `cfg.model` on `cfg.dataset` over `cfg.gpus` devices; return the run-result record."""
    launch = launch_env()
    if launch is None and cfg.gpus > 1:
        return spawn(cfg)  # N processes, each running this function as one rank
    if launch is None:  # a single process: a world of one, on a free port
        launch = Launch(0, 1, 0, 1)
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    rank, world = launch.rank, launch.world
    if cfg.gpus != world:  # the launcher decides the device count
        cfg = resolve(cfg.replace(gpus=world))
    injected_failure(FRAMEWORK)
    compiles = CompileMeter()  # torch.compile's time and cache hits, for the record
    cuda = torch.cuda.is_available()
    if cuda:
        # local rank k -> GPU k; modulo: srun --gpus-per-task leaves each task one visible GPU
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest conv algorithms
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(launch.local_world))  # N processes share the cores
    fp32 = set_float32_precision(cfg, cuda)
    # --collective-timeout bounds the rendezvous and every collective: a rank that stops
    # answering (stopped, hung, its node gone) fails the run instead of holding it for long.
    try:
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            init_method="env://",
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(seconds=cfg.collective_timeout),
        )
    except Exception as exc:
        raise RuntimeError(
            f"rendezvous of {world} ranks at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} failed after at most {cfg.collective_timeout:g} s "
            f"(--collective-timeout; {describe(exc)}): every rank must start, with the same "
            "MASTER_ADDR, MASTER_PORT and WORLD_SIZE; stale variables in the environment?"
        ) from None
    try:
        is_main = rank == 0
        log = printer(is_main)
        ds = load_for(cfg)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = build_model(cfg, ds.channels, ds.num_classes)
        # The data is sharded here: this rank reads only its contiguous part of every global
        # batch (the sharding DistributedSampler + set_epoch gives, minus padding).
        loader = TrainLoader(
            ds,
            cfg.batch_size,
            cfg.seed,
            rank,
            world,
            augment=cfg.augment,
            layout="NCHW",
            max_steps=cfg.max_steps_per_epoch,
            prefetch=cfg.prefetch,
            on_device=crops_on_device(cfg.pipeline, cuda, ds.train_x.nbytes),
        )
        evals = EvalLoader(ds, max(1, cfg.eval_batch_size // world), rank, world, layout="NCHW")
        state = create_train_state(cfg, model, device, len(loader))
        kind = f"cuda:{torch.cuda.get_device_name(device)}" if cuda else "cpu-simulated"
        recorder = RunRecorder(
            cfg,
            devices=world,
            device_kind=kind,
            params=count_params(model),
            is_main=is_main,
            packages=PACKAGES,
            bn_mode=cfg.bn,
            n_test=len(ds.test_x),
            init=init_record(cfg, ds.channels, ds.num_classes),
        )
        recorder.threads = threads_record(
            torch.get_num_threads() * launch.local_world,
            torch.get_num_threads(),
            "torch.set_num_threads in each process (one process per device)",
        )
        compiled = cuda and cfg.compile  # see create_train_state
        recorder.execution = execution(cfg, cuda, compiled=compiled)
        recorder.extra["process_group"] = dist.get_backend()  # nccl on GPUs, gloo on the CPU
        recorder.float32_precision = fp32
        recorder.pipeline = pipeline_record(loader.on_device)
        if not cuda and (cfg.precision != "fp32" or cfg.compile):
            log("note: --precision and --compile apply on CUDA only; this run is fp32 eager")
        if cuda and cfg.compile and world > 1 and cfg.compile_mode in CUDA_GRAPH_MODES:
            log(f"note: --compile-mode {cfg.compile_mode} (CUDA graphs) with DDP over {world} "
                "GPUs is unmeasured in this project (measured on one GPU)")  # fmt: skip
        start = 0
        if report is not None:  # a spawned rank: the parent writes --output
            recorder.output = ""
        if cfg.resume and checkpoint_path(cfg).exists():
            state, start = load_checkpoint(cfg, state, recorder)
            log(f"resumed from {checkpoint_path(cfg)} after epoch {start}")
        elif cfg.resume:
            log(f"no checkpoint at {checkpoint_path(cfg)}: starting from scratch")
        put = train_put(loader, state)  # --pipeline device: the training set goes over here
        timer = Timer(sync)
        state.phases = PhaseTimer(sync, cfg.phase_timing)
        with keep_measured_epochs(recorder, reraise=world > 1):
            for epoch in range(start, cfg.epochs):
                torch.manual_seed(seed_for(cfg.seed, epoch, rank))  # dropout masks
                state.model.train()
                timer.start()
                batches = loader.epoch(epoch)
                totals: dict[str, torch.Tensor] = {}
                for host_batch in batches:
                    with state.phases.phase("h2d"):
                        batch = put(host_batch)
                    state, metrics = train_step(state, batch)
                    state.phases.steps += 1
                    totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
                    if should_log(cfg, state.step):  # host sync: log point
                        running = float(totals["loss_sum"] / totals["count"])
                        log(f"step {state.step} train_loss={running:.4f} (rank 0's shard)")
                if cfg.bn == "local":  # ranks' running statistics -> their mean (see docstring)
                    sync_batch_stats(state)
                sec = timer.stop()
                state.phases.add("data_wait", batches.wait_sec)
                test = evaluate(eval_step, state, evals)
                # The epoch's only reductions (sync points): sums over ranks, and the slowest
                # rank's time (the epoch is over when the last rank is done).
                sums = torch.stack(
                    [
                        totals["loss_sum"],
                        totals["count"],
                        test["correct"],
                        test["count"],
                        test["loss_sum"],
                    ]
                ).double()
                slowest = torch.tensor([sec], dtype=torch.float64, device=device)
                dist.all_reduce(sums)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                loss_sum, count, correct, n_test, test_loss = sums.tolist()  # host sync, 1/epoch
                stop = recorder.end_epoch(
                    epoch,
                    slowest.item(),  # host sync, once per epoch (after the timed region)
                    len(loader) * cfg.batch_size,
                    loss_sum / count,
                    correct,
                    n_test,
                    test_loss,
                )
                if is_main and report is not None:  # to the parent: the epochs so far
                    report.send(("record", recorder.result()))
                if cfg.checkpoint_dir:
                    if is_main:
                        save_checkpoint(cfg, state, recorder, epoch)
                    dist.barrier()  # the checkpoint is on disk before any rank may be killed
                injected_failure(FRAMEWORK, epoch + 1)
                if stop:
                    break
                if epoch == start and epoch + 1 < cfg.epochs:  # phase times exclude the warm-up
                    state.phases = PhaseTimer(sync, cfg.phase_timing)
        if cfg.phase_timing:
            recorder.phases = state.phases.per_step_ms()
        if compiled:
            recorder.extra.update(compiles.record())  # compile_sec, compile_cache
        if is_main:
            save_final_state(cfg, canonical_state(state))  # --save-state
        dist.barrier()  # no rank tears gloo/NCCL down while another is still in a collective
        return recorder.finish()
    finally:
        dist.destroy_process_group()


# ---- main ----------------------------------------------------------------------------------


def check_config(cfg: Config) -> None:
    """torch-specific checks before any process starts (ConfigError / DatasetError)."""
    launched = launch_env()  # under srun: MASTER_ADDR / MASTER_PORT must be set
    check_devices(cfg, count=launched is None)  # a launcher's world sets the device count
    check_available(cfg)
    check_resume(cfg, checkpoint_path(cfg), checkpoint_meta_of)


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m frameworks.<module> --help`. Exit 0 ok, 1 failed/diverged, 2 bad input."""  # noqa: E501
    return run_main(argv, FRAMEWORK, check=check_config, train=train, packages=PACKAGES)


if __name__ == "__main__":
    sys.exit(main())
