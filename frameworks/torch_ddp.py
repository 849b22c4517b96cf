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
`--bn local` keeps DDP's default: rank 0's BN buffers are broadcast at every forward, and once
more before evaluation so that every rank evaluates (and rank 0 checkpoints) the same model.

Known differences from the other frameworks: running_var uses the unbiased batch variance (torch);
the test loss uses the training loss (label smoothing included).
"""

from __future__ import annotations

import datetime
import io
import json
import os
import re
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from common import cli
from common.config import Config, ConfigError, check_same_run, resolve
from common.datasets import DatasetError, check_available, load_for
from common.pipeline import EvalLoader, TrainLoader
from common.results import RunRecorder, write_json_atomic
from common.runtime import atomic_write_bytes, cpu_threads, free_port, injected_failure, printer
from common.schedule import lr_table_for
from common.timing import PhaseTimer, Timer
from frameworks.torch_models import NovoGrad, count_params, create_model, decay_parameters

FRAMEWORK = "torch-ddp"


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


@dataclass
class TrainState:
    """Everything a step changes or reads. torch updates in place; the step returns it anyway."""

    model: nn.Module  # the DDP wrapper (no_sync, train/eval); the bare model in a world of one
    forward: Any  # what the step calls: the DDP wrapper, or torch.compile of it
    module: nn.Module  # the bare model: evaluation and checkpoints
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    lr: np.ndarray  # LR of every step (common.schedule)
    step: int
    cfg: Config
    device: torch.device
    world: int
    phases: PhaseTimer


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


def create_train_state(
    cfg: Config, model: nn.Module, device: torch.device, steps_per_epoch: int
) -> TrainState:
    """Create the parameters, optimiser state and step counter; place them on the devices."""
    cuda = device.type == "cuda"
    model = model.to(device)
    if cuda and cfg.channels_last:
        model = model.to(memory_format=torch.channels_last)
    decay, no_decay = decay_parameters(model)  # weight decay: conv and linear weights only
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.optimizer == "sgd":  # buf = m * buf + (g + wd * w); w -= lr * buf
        optimizer = torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    else:
        optimizer = NovoGrad(groups, lr=cfg.lr, betas=cfg.novograd_betas)
    # DDP broadcasts rank 0's parameters now and averages gradients bucket by bucket during
    # backward(), overlapping the all-reduce with the rest of the backward pass. A world of one
    # has nothing to average: the bare model trains identically without DDP's per-step bucket
    # bookkeeping (about 4% of a ResNet-18 step on CPU, measured).
    world = dist.get_world_size()
    if world > 1:
        ddp = DDP(model, device_ids=[device.index] if cuda else None, gradient_as_bucket_view=True)
    else:
        ddp = model
    forward = torch.compile(ddp) if cuda and cfg.compile else ddp
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
    separate = state.phases.enabled  # time the all-reduce on its own (no overlap)
    with (
        state.phases.phase("forward_backward"),
        state.model.no_sync() if separate and state.world > 1 else nullcontext(),
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
    x, y, w = batch
    with autocast(state):
        logits = state.module(x)  # the bare model: no DDP buffer broadcast, no gradients
    return {
        "loss_sum": (loss_fn(state.cfg, logits, y) * w).sum(),
        "correct": ((logits.argmax(1) == y).float() * w).sum(),
        "count": w.sum(),
    }


def loss_fn(cfg: Config, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example softmax cross-entropy with label smoothing, in float32."""
    return F.cross_entropy(logits.float(), y, reduction="none", label_smoothing=cfg.label_smoothing)


def autocast(state: TrainState) -> torch.autocast:
    """Mixed precision on CUDA (--precision bf16/fp16); fp32 elsewhere."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(state.cfg.precision)
    return torch.autocast(
        state.device.type, dtype=dtype, enabled=state.device.type == "cuda" and dtype is not None
    )


def allreduce_gradients(module: nn.Module, world: int) -> None:
    """Average gradients over ranks in one flat all-reduce (what DDP does in buckets)."""
    grads = [p.grad for p in module.parameters() if p.grad is not None]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    flat.div_(world)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def to_device(batch: tuple[np.ndarray, ...], state: TrainState) -> tuple[torch.Tensor, ...]:
    """numpy batch -> device tensors, once: pinned host memory and an asynchronous copy on CUDA
    (no sync); labels as int64, images channels-last where enabled."""
    cuda = state.device.type == "cuda"
    out = []
    for i, a in enumerate(batch):
        t = torch.from_numpy(a)
        if cuda:
            t = t.pin_memory().to(state.device, non_blocking=True)
        if i == 0 and cuda and state.cfg.channels_last:
            t = t.contiguous(memory_format=torch.channels_last)
        out.append(t.long() if i == 1 else t)
    return tuple(out)


def evaluate(state: TrainState, loader: EvalLoader) -> dict[str, torch.Tensor]:
    """This rank's test sums (every test image is on exactly one rank), left on the device."""
    state.model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch in loader:
        for k, v in eval_step(state, to_device(batch, state)).items():
            totals[k] = totals[k] + v if k in totals else v
    state.model.train()
    return totals


def sync() -> None:
    """Wait for queued device work (CUDA kernels run asynchronously; CPU ops do not)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def checkpoint_path(cfg: Config) -> Path:
    return Path(cfg.checkpoint_dir) / f"{cfg.framework}.pt"


def save_checkpoint(state: TrainState, recorder: RunRecorder, epoch: int) -> None:
    """Write the state after `epoch` (0-based) atomically: temp file, then rename."""
    buf = io.BytesIO()
    torch.save(
        {
            "epoch": epoch + 1,
            "step": state.step,
            "model": state.module.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scaler": state.scaler.state_dict(),
            "recorder": recorder.state(),
            "config": state.cfg.to_dict(),
        },
        buf,
    )
    atomic_write_bytes(checkpoint_path(state.cfg), buf.getvalue())


def load_checkpoint(state: TrainState, recorder: RunRecorder) -> int:
    """Restore the latest checkpoint (tensors and plain containers only: weights_only=True);
    return the epoch to continue from."""
    ckpt = torch.load(checkpoint_path(state.cfg), map_location=state.device, weights_only=True)
    state.module.load_state_dict(ckpt["model"])
    state.optimizer.load_state_dict(ckpt["optimizer"])
    state.scaler.load_state_dict(ckpt["scaler"])
    state.step = int(ckpt["step"])
    recorder.load_state(ckpt["recorder"])
    return int(ckpt["epoch"])


def check_resume(cfg: Config) -> None:
    """Refuse to resume from a checkpoint of a different run (one clear error)."""
    path = checkpoint_path(cfg)
    if not (cfg.resume and path.exists()):
        return
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)["config"]
    except Exception as exc:
        raise ConfigError(
            f"cannot read checkpoint {path} ({exc}); delete it or drop --resume"
        ) from None
    check_same_run(saved, cfg, str(path))


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


def spawn(cfg: Config) -> dict:
    """Start `cfg.gpus` processes on this node, each running train(cfg) as one rank with the
    environment torchrun would give it (rendezvous on a free loopback port)."""
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        result = Path(tmp) / "record.json"
        mp.start_processes(
            _spawned, args=(cfg, port, str(result), sys.argv), nprocs=cfg.gpus, start_method="spawn"
        )
        with open(result) as f:
            return json.load(f)


def _spawned(local_rank: int, cfg: Config, port: int, result: str, argv: list[str]) -> None:
    sys.argv = argv  # the record's "command"
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(cfg.gpus),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(cfg.gpus),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    record = train(cfg)
    if local_rank == 0:
        write_json_atomic(result, record)


def seed_for(seed: int, epoch: int, rank: int) -> int:
    """Torch RNG seed (dropout) of one rank's epoch: reproducible after --resume."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


def train(cfg: Config) -> dict:
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
    cuda = torch.cuda.is_available()
    if cuda:
        # local rank k -> GPU k; modulo: srun --gpus-per-task leaves each task one visible GPU
        device = torch.device("cuda", launch.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest conv algorithms
    else:
        device = torch.device("cpu")
        torch.set_num_threads(cpu_threads(launch.local_world))  # N processes share the cores
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method="env://",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(minutes=10),
    )
    try:
        is_main = rank == 0
        log = printer(is_main)
        ds = load_for(cfg)
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = build_model(cfg, ds.channels, ds.num_classes)
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
            packages=("torch",),
            bn_mode=cfg.bn,
            n_test=len(ds.test_x),
        )
        if not cuda and (cfg.precision != "fp32" or cfg.compile):
            log("note: --precision and --compile apply on CUDA only; this run is fp32 eager")
        start = 0
        if cfg.resume and checkpoint_path(cfg).exists():
            start = load_checkpoint(state, recorder)
            log(f"resumed from {checkpoint_path(cfg)} after epoch {start}")
        elif cfg.resume:
            log(f"no checkpoint at {checkpoint_path(cfg)}: starting from scratch")
        timer = Timer(sync)
        state.phases = PhaseTimer(sync, cfg.phase_timing)
        for epoch in range(start, cfg.epochs):
            torch.manual_seed(seed_for(cfg.seed, epoch, rank))  # dropout masks
            state.model.train()
            timer.start()
            batches = loader.epoch(epoch)
            totals: dict[str, torch.Tensor] = {}
            for host_batch in batches:
                with state.phases.phase("h2d"):
                    batch = to_device(host_batch, state)
                state, metrics = train_step(state, batch)
                state.phases.steps += 1
                for k, v in metrics.items():
                    totals[k] = totals[k] + v if k in totals else v
                if cfg.log_every and state.step % cfg.log_every == 0:  # host sync: log point
                    running = float(totals["loss_sum"] / totals["count"])
                    log(f"step {state.step} train_loss={running:.4f} (rank 0's shard)")
            sec = timer.stop()
            state.phases.add("data_wait", batches.wait_sec)
            if cfg.bn == "local":  # every rank evaluates rank 0's BN statistics
                for buf in state.module.buffers():
                    dist.broadcast(buf, 0)
            test = evaluate(state, evals)
            # The epoch's only reductions (sync points): sums over ranks, and the slowest rank's
            # time (the epoch is over when the last rank is done).
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
            loss_sum, count, correct, n_test, test_loss = sums.tolist()
            stop = recorder.end_epoch(
                epoch,
                slowest.item(),
                len(loader) * cfg.batch_size,
                loss_sum / count,
                correct,
                n_test,
                test_loss,
            )
            if cfg.checkpoint_dir:
                if is_main:
                    save_checkpoint(state, recorder, epoch)
                dist.barrier()  # the checkpoint is on disk before any rank may be killed
            injected_failure(FRAMEWORK, epoch + 1)
            if stop:
                break
            if epoch == start and epoch + 1 < cfg.epochs:  # phase times exclude the warm-up
                state.phases = PhaseTimer(sync, cfg.phase_timing)
        if cfg.phase_timing:
            recorder.phases = state.phases.per_step_ms()
        dist.barrier()  # no rank tears gloo/NCCL down while another is still in a collective
        return recorder.finish()
    finally:
        dist.destroy_process_group()


def check_config(cfg: Config) -> None:
    """torch-specific checks before any process starts (ConfigError / DatasetError)."""
    if torch.cuda.is_available() and launch_env() is None and cfg.gpus > torch.cuda.device_count():
        raise ConfigError(
            f"--gpus {cfg.gpus} but only {torch.cuda.device_count()} CUDA devices "
            f"are visible; use --gpus {torch.cuda.device_count()} or fewer"
        )
    if cfg.nesterov and cfg.momentum <= 0 and cfg.optimizer == "sgd":
        raise ConfigError("--nesterov needs --momentum > 0")
    check_available(cfg)
    check_resume(cfg)


def failure_record(cfg: Config, error: str) -> None:
    """Write a 'failed' run record (rank 0 only) so the runner sees what went wrong."""
    launch = None
    try:
        launch = launch_env()
    except ConfigError:
        pass
    rec = RunRecorder(
        cfg,
        devices=launch.world if launch else cfg.gpus,
        device_kind="cuda" if torch.cuda.is_available() else "cpu-simulated",
        params=0,
        is_main=launch is None or launch.rank == 0,
        packages=("torch",),
    )
    rec.fail(error)
    rec.finish()


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m frameworks.<module> --help`. Exit 0 ok, 1 failed/diverged, 2 bad input."""  # noqa: E501
    cfg = cli.parse_args(argv, FRAMEWORK)
    prog = f"python -m frameworks.{FRAMEWORK.replace('-', '_')}"
    try:
        launch_env()
        check_config(cfg)
    except (ConfigError, DatasetError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        record = train(cfg)
    except ConfigError as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a worker's traceback ends with its exception line
        lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
        error = f"{type(exc).__name__}: {lines[-1] if lines else exc!r}"
        print(f"{prog}: failed: {error}", file=sys.stderr)
        failure_record(cfg, error)
        return 1
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
