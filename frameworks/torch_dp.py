"""torch-dp: PyTorch nn.DataParallel, one process driving every visible GPU.

    python -m frameworks.torch_dp --preset digits --gpus 2

Each step, DataParallel scatters the global batch over the GPUs (equal contiguous slices),
replicates the model from GPU 0 (parameters and BN buffers broadcast), runs the replicas in
threads, and gathers the logits on GPU 0, where the loss is the mean over the global batch; the
backward pass sums the replicas' gradients onto GPU 0's parameters, where the optimiser runs.
Its gradient reduction is part of backward(), so with --phase-timing the "allreduce" phase stays
0 and the communication is inside "forward_backward".

BatchNorm is per replica (each GPU normalises its own slice; the running statistics are GPU 0's):
`--bn sync` is refused with more than one GPU (use torch-ddp). Without CUDA, DataParallel runs
the module directly on the CPU: the run records devices 1, device_kind "cpu", and says so once.

Everything else (model, optimiser, loss, checkpoints, mixed precision) is shared with torch-ddp
in frameworks/torch_models.py and frameworks/torch_support.py.
"""

from __future__ import annotations

import torch
from torch import nn

from common.config import Config, ConfigError
from common.interrupts import exit_after
from common.run import Run
from common.schedule import lr_table_for
from common.trainer import run_main, should_log
from frameworks.profilers import TorchProfiler
from frameworks.torch_models import create_model
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

FRAMEWORK = "torch-dp"
PACKAGES = ("torch",)


# ---- model ---------------------------------------------------------------------------------


def build_model(cfg: Config, in_channels: int, num_classes: int) -> nn.Module:
    """Build `cfg.model` for `in_channels`-channel images and `num_classes` classes."""
    norm = None  # nn.BatchNorm2d: each replica normalises its own slice of the batch
    return create_model(
        cfg.model, in_channels, num_classes, cfg.width, cfg.dropout, cfg.bn_momentum, cfg.bn_eps,
        norm,
    )  # fmt: skip


# ---- state ---------------------------------------------------------------------------------


def create_train_state(
    cfg: Config, model: nn.Module, device_ids: list[int], steps_per_epoch: int, plan: DevicePlan
) -> TrainState:
    """Create the parameters, optimiser state and step counter; place them on the devices
    (`plan`: the run's torch_support.device_plan)."""
    device = torch.device("cuda", device_ids[0]) if device_ids else torch.device("cpu")
    initialize(cfg, model)  # --init shared: the arrays every framework starts from
    model = model.to(device)  # GPU 0 holds the master copy; replicas are made every step
    if plan.channels_last:  # NHWC convolutions: cuDNN's and oneDNN's fast path (measured)
        model = model.to(memory_format=torch.channels_last)
    optimizer = make_optimizer(cfg, model)
    # Scatter / replicate / gather every step; gradients are summed onto GPU 0 in backward().
    dp = nn.DataParallel(model, device_ids=device_ids or None)
    # torch.compile cannot trace DataParallel's replicas: compile only the single-GPU case.
    compiled = plan.compile_mode is not None and len(device_ids) <= 1
    forward = torch.compile(model, mode=plan.compile_mode) if compiled else dp
    scaler = torch.amp.GradScaler(device.type, enabled=plan.grad_scaling)
    return TrainState(
        model=dp,
        forward=forward,
        module=model,
        optimizer=optimizer,
        scaler=scaler,
        lr=lr_table_for(cfg, steps_per_epoch),
        step=0,
        cfg=cfg,
        device=device,
        world=max(1, len(device_ids)),
        plan=plan,
    )


# ---- step: where gradients are averaged ----------------------------------------------------


def train_step(
    state: TrainState, batch: tuple[torch.Tensor, torch.Tensor]
) -> tuple[TrainState, dict[str, torch.Tensor]]:
    """One synchronous data-parallel SGD step on a global batch.

    Returns the new state and metrics {"loss_sum", "correct", "count"} summed over the global
    batch and left on the device (read only at log points: no per-step host sync)."""
    x, y = batch  # the global batch on GPU 0: (B, C, H, W), (B,)
    for group in state.optimizer.param_groups:
        group["lr"] = float(state.lr[state.step])  # a host array: no sync
    state.optimizer.zero_grad(set_to_none=True)
    with state.phases.phase("forward_backward"):
        with autocast(state):
            logits = state.forward(x)  # scattered over the GPUs, gathered back on GPU 0
            loss = loss_fn(state.cfg, logits, y).mean()  # mean over the global batch
        state.scaler.scale(loss).backward()  # replicas' gradients summed onto GPU 0 in here
    with state.phases.phase("optimizer"):
        state.scaler.step(state.optimizer)
        state.scaler.update()
    state.step += 1
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
    x, y, w = batch  # a global test batch, on GPU 0
    with autocast(state):
        logits = state.model(x)  # scattered over the GPUs like a training batch
    return {
        "loss_sum": (loss_fn(state.cfg, logits, y) * w).sum(),
        "correct": ((logits.argmax(1) == y).float() * w).sum(),
        "count": w.sum(),
    }


# ---- devices: processes, replicas and shards -----------------------------------------------


def select_devices(n: int) -> tuple[list[int], str]:
    """GPU ids 0..n-1 and the device kind; no CUDA: no ids (DataParallel then runs the module
    itself on the CPU, one replica) and "cpu", said once (a note: stderr keeps the one line of
    an error)."""
    if torch.cuda.is_available():
        return list(range(n)), f"cuda:{torch.cuda.get_device_name(0)}"
    asked = f" (--gpus {n} was asked)" if n > 1 else ""
    print(
        "note: no CUDA device: nn.DataParallel runs a single replica on the CPU; "
        f"this run used 1 device{asked}",
        flush=True,
    )
    return [], "cpu"


# ---- train: where time is measured ---------------------------------------------------------


def train(cfg: Config) -> dict:
    """Train `cfg.model` on `cfg.dataset` over `cfg.gpus` devices; return the run-result record."""
    cuda = torch.cuda.is_available()
    device_ids, kind = select_devices(cfg.gpus)  # check_config: that many are visible
    processes = None  # one process drives every device (its cores: all of this node's)
    plan = plan_devices(cfg, "cuda" if cuda else "cpu", processes)  # autocast, layout, compile
    # One process reads every global batch; DataParallel shards it in the step (scatter).
    run = Run(cfg, FRAMEWORK, PACKAGES, layout="NCHW", gpu=cuda, sync=sync,
              profiler=TorchProfiler)  # fmt: skip
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, run.ds.channels, run.ds.num_classes)
    state = create_train_state(cfg, model, device_ids, len(run.loader), plan)
    # The record, --compile's notes, --resume; torch.compile's cost at the end.
    state, start, compiles = start_run(run, state, kind, processes)
    put = train_put(run.loader, state)  # --pipeline device: the training set goes over here
    with run.measured():
        for epoch in range(start, cfg.epochs):
            torch.manual_seed(seed_for(cfg.seed, epoch, 0))  # dropout masks
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
                    run.log(f"step {state.step} train_loss={running:.4f}")
            # BN statistics: GPU 0's module holds the only copy (replicas are rebuilt every step).
            sec = run.timer.stop()
            test = evaluate(eval_step, state, run.evals)
            train_sums, test = host_sums(totals, test)  # host sync, once per epoch
            if run.end_epoch(epoch, state, sec, batches.wait_sec, train_sums, test):
                break  # the target held, or diverged
    return run.finish(
        lambda: canonical_state(state),  # --save-state
        **compiles.record(),  # compile_sec, compile_cache (a compiled step's)
    )


# ---- main ----------------------------------------------------------------------------------


def check_config(cfg: Config) -> None:
    """torch-specific checks before any process starts (ConfigError / DatasetError)."""
    visible = check_inputs(cfg)  # --devices, --gpus against the GPUs torch sees, data, resume
    if visible and cfg.bn == "sync" and cfg.gpus > 1:
        raise ConfigError(
            "--bn sync is not possible with nn.DataParallel (each replica normalises its "
            "own slice); use --bn local, or torch-ddp for synchronised BatchNorm"
        )


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m frameworks.<module> --help`. Exit 0 ok, 1 failed/diverged, 2 bad input."""  # noqa: E501
    return run_main(argv, FRAMEWORK, check=check_config, train=train, packages=PACKAGES)


if __name__ == "__main__":
    exit_after(main())  # after a stop: ends without finalization (common/interrupts.py)
