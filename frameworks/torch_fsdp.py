"""torch-fsdp: PyTorch FSDP2 (`fully_shard`), sharded data parallelism, one process per device.

    python -m frameworks.torch_fsdp --preset digits --gpus 2       # starts 2 processes itself
    torchrun --nproc-per-node=4 -m frameworks.torch_fsdp ...       # or srun: torch_launch.py

Every process is one rank: it reads its shard of every global batch (common.pipeline, the
sharding DistributedSampler + set_epoch gives, minus padding) and holds 1/N of every parameter,
gradient and optimiser state (ZeRO-3). Each block all-gathers its parameters just before its
forward and again before its backward (`--no-reshard-after-forward` keeps them gathered in
between: ZeRO-2's traffic, more memory); backward() reduce-scatters the gradients (averaged over
the ranks) so that each rank updates its own shard. The same update as torch-ddp's. NCCL on
CUDA (untested here), gloo on CPU (N CPU processes then stand in for N devices). Only rank 0
prints and writes the record; the checkpoint and --save-state gather the full state (a
collective on every rank), which rank 0 writes.

`--precision`: torch.autocast, as torch-ddp (the same numerics); FSDP2's MixedPrecisionPolicy
(parameters all-gathered in bf16, gradients reduced in bf16 or fp32) would halve the traffic but
change the numerics, so it is not used.

`--bn sync`: torch's SyncBatchNorm on CUDA, `CpuSyncBatchNorm` on CPU (torch_models.py).
`--bn local`: each rank normalises with its shard's statistics and keeps its own running
statistics (FSDP does not shard buffers); they are averaged over the ranks at the end of every
epoch (`sync_batch_stats`), as jax-pmap and mxnet-gluon do, so every rank evaluates (and rank 0
checkpoints) the same model.

Known differences from the other frameworks (BN variance, test loss): docs/fairness.md.
"""

from __future__ import annotations

from multiprocessing.connection import Connection

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

from common.config import Config
from common.interrupts import exit_after
from common.run import Run
from common.schedule import lr_table_for
from common.trainer import run_main, should_log
from frameworks.profilers import TorchProfiler
from frameworks.torch_launch import join_world, launch_env, spawn
from frameworks.torch_models import BasicBlock, CpuSyncBatchNorm, WideBlock, create_model
from frameworks.torch_support import (
    DevicePlan,
    TrainState,
    autocast,
    canonical_state,
    check_inputs,
    evaluate,
    host_sums,
    initialize,
    loss_fn,
    make_optimizer,
    plan_devices,
    seed_for,
    start_run,
    sync,
    train_put,
)

FRAMEWORK = "torch-fsdp"
PACKAGES = ("torch",)
# What --phase-timing's phases hold here, for the record: FSDP's collectives run inside the step.
PHASE_NOTE = (
    "forward_backward = forward and backward with FSDP's all-gathers of the parameters and "
    "reduce-scatters of the gradients; allreduce: none (0)"
)


# ---- model ---------------------------------------------------------------------------------


def build_model(cfg: Config, in_channels: int, num_classes: int) -> nn.Module:
    """Build `cfg.model` for `in_channels`-channel images and `num_classes` classes."""
    norm = None
    if cfg.bn == "sync":
        bn = nn.SyncBatchNorm if torch.cuda.is_available() else CpuSyncBatchNorm
        norm = lambda c: bn(c, eps=cfg.bn_eps, momentum=cfg.bn_momentum)
    return create_model(
        cfg.model, in_channels, num_classes, cfg.width, cfg.dropout, cfg.bn_momentum, cfg.bn_eps,
        norm,
    )  # fmt: skip


# ---- state ---------------------------------------------------------------------------------


def create_train_state(
    cfg: Config, model: nn.Module, device: torch.device, steps_per_epoch: int, plan: DevicePlan
) -> TrainState:
    """Create the parameters, optimiser state and step counter; place them on the devices
    (`plan`: the run's torch_support.device_plan)."""
    initialize(cfg, model)  # --init shared: the arrays every framework starts from
    model = model.to(device)
    if plan.channels_last:  # NHWC convolutions: cuDNN's and oneDNN's fast path (measured)
        model = model.to(memory_format=torch.channels_last)
    # fully_shard keeps 1/N of each parameter on each rank (a DTensor sharded on dim 0 over the
    # mesh's one axis), one group per residual block and one for the rest (stem, head), as
    # torchtitan does: a block's parameters are all-gathered just before it runs (on CUDA in a
    # stream of their own, overlapping the previous block's compute), and its gradients
    # reduce-scattered as soon as its backward is done. The same code at every size (a world of
    # one shards nothing). BN buffers are not sharded: each rank keeps the running statistics
    # of its own shard, averaged at the end of every epoch (sync_batch_stats).
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    blocks = [m for m in model.modules() if isinstance(m, (BasicBlock, WideBlock))]
    for block in blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward)
    fully_shard(model, mesh=mesh, reshard_after_forward=cfg.reshard_after_forward)
    optimizer = make_optimizer(cfg, model)  # after sharding: its state is sharded as well
    compiled = plan.compile_mode is not None
    forward = torch.compile(model, mode=plan.compile_mode) if compiled else model
    # fp16's loss scaling: an inf in any rank's gradient shard skips the step on every rank
    scaler = ShardedGradScaler(device.type, enabled=plan.grad_scaling)
    return TrainState(
        model=model,
        forward=forward,
        module=model,
        optimizer=optimizer,
        scaler=scaler,
        lr=lr_table_for(cfg, steps_per_epoch),
        step=0,
        cfg=cfg,
        device=device,
        world=world,
        plan=plan,
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
    # FSDP's collectives run inside forward and backward, between the blocks' compute:
    # --phase-timing's forward_backward includes them (there is no separate all-reduce phase).
    with state.phases.phase("forward_backward"):
        with autocast(state):
            logits = state.forward(x)  # all-gathers each block's parameters as it runs
            loss = loss_fn(state.cfg, logits, y).mean()  # mean over this rank's shard
        # FSDP: gradients reduce-scattered (averaged over ranks) in here; each rank keeps 1/N
        state.scaler.scale(loss).backward()
    with state.phases.phase("optimizer"):  # each rank updates its own shard
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
        logits = state.module(x)  # all-gathers the parameters: every rank runs as many batches
    return {
        "loss_sum": (loss_fn(state.cfg, logits, y) * w).sum(),
        "correct": ((logits.argmax(1) == y).float() * w).sum(),
        "count": w.sum(),
    }


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


def select_device(local_rank: int) -> tuple[torch.device, str]:
    """This rank's device and the device kind: GPU `local_rank` (modulo: srun --gpus-per-task
    leaves each task one visible GPU), else the CPU, whose cores this node's processes share."""
    if torch.cuda.is_available():
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)  # cuDNN's autotuning: the run's plan (use_device_plan)
        return device, f"cuda:{torch.cuda.get_device_name(device)}"
    return torch.device("cpu"), "cpu-simulated"


# ---- train: where time is measured ---------------------------------------------------------


def train(cfg: Config, report: Connection | None = None) -> dict:
    """Train `cfg.model` on `cfg.dataset` over `cfg.gpus` devices; return the run-result record."""
    launch = launch_env()
    if launch is None and cfg.gpus > 1:
        return spawn(cfg, train)  # N processes, each running this function as one rank
    # A world of one on a free port without a launcher; the launcher decides the device count.
    launch, cfg = join_world(launch, cfg)
    rank, world = launch.rank, launch.world
    device, kind = select_device(launch.local_rank)
    cuda = device.type == "cuda"
    processes = launch.local_world  # on this node, one per device: they share its cores
    plan = plan_devices(cfg, "cuda" if cuda else "cpu", processes)  # autocast, layout, compile
    # One process group per run: NCCL between GPUs, gloo between CPU processes. Its timeout
    # (--collective-timeout) bounds the rendezvous and every collective.
    dist.init_process_group(**launch.rendezvous(plan.process_group, cfg.collective_timeout))
    try:
        # The data is sharded here: this rank reads only its contiguous part of every global
        # batch (the sharding DistributedSampler + set_epoch gives, minus padding).
        run = Run(cfg, FRAMEWORK, PACKAGES, rank=rank, world=world, layout="NCHW", gpu=cuda,
                  sync=sync, report=report, barrier=dist.barrier,
                  profiler=TorchProfiler, sharded=True)  # fmt: skip
        torch.manual_seed(cfg.seed)  # the same initial weights on every rank
        model = build_model(cfg, run.ds.channels, run.ds.num_classes)
        state = create_train_state(cfg, model, device, len(run.loader), plan)
        # The record, --compile's notes, --resume; torch.compile's cost at the end.
        state, start, compiles = start_run(run, state, kind, processes)
        put = train_put(run.loader, state)  # --pipeline device: the training set goes over here
        with run.measured():
            for epoch in range(start, cfg.epochs):
                torch.manual_seed(seed_for(cfg.seed, epoch, rank))  # dropout masks
                state.model.train()
                run.timer.start()
                batches = run.batches(epoch)
                totals: dict[str, torch.Tensor] = {}
                for host_batch in batches:
                    with state.phases.phase("h2d"):
                        batch = put(host_batch)
                    state, metrics = train_step(state, batch)
                    state.phases.steps += 1
                    totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
                    if should_log(cfg, state.step):  # host sync: log point
                        running = float(totals["loss_sum"] / totals["count"])
                        run.log(f"step {state.step} train_loss={running:.4f} (rank 0's shard)")
                if cfg.bn == "local":  # ranks' running statistics -> their mean (see docstring)
                    sync_batch_stats(state)
                sec = run.timer.stop()
                test = evaluate(eval_step, state, run.evals, run.eval_steps)
                # The epoch's only reductions (sync points): sums over ranks, and the slowest
                # rank's time (the epoch is over when the last rank is done).
                train_sums, test = host_sums(totals, test, all_reduce=dist.all_reduce)
                slowest = torch.tensor([sec], dtype=torch.float64, device=device)
                dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
                sec = slowest.item()  # host sync, once per epoch (after the timed region)
                if run.end_epoch(epoch, state, sec, batches.wait_sec, train_sums, test):
                    break  # the target held, or diverged
        dist.barrier()  # no rank tears gloo/NCCL down while another is still in a collective
        return run.finish(
            lambda: canonical_state(state),  # --save-state
            **compiles.record(),  # compile_sec, compile_cache (a compiled step's)
            **({"phase_note": PHASE_NOTE} if cfg.phase_timing else {}),
        )
    finally:
        dist.destroy_process_group()


# ---- main ----------------------------------------------------------------------------------


def check_config(cfg: Config) -> None:
    """torch-specific checks before any process starts (ConfigError / DatasetError)."""
    launched = launch_env()  # under srun: MASTER_ADDR / MASTER_PORT must be set
    check_inputs(cfg, count=launched is None)  # a launcher's world sets the device count


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m frameworks.<module> --help`. Exit 0 ok, 1 failed/diverged, 2 bad input."""  # noqa: E501
    return run_main(argv, FRAMEWORK, check=check_config, train=train, packages=PACKAGES)


if __name__ == "__main__":
    exit_after(main())  # after a stop: ends without finalization (common/interrupts.py)
