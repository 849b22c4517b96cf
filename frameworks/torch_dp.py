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

Everything else (model, optimiser, loss, checkpoints, mixed precision) is torch-ddp's; see there.
"""

from __future__ import annotations

import sys

import torch
from torch import nn

from common import cli
from common.config import Config, ConfigError
from common.datasets import DatasetError, check_available, load_for
from common.pipeline import EvalLoader, TrainLoader
from common.results import RunRecorder
from common.runtime import cpu_threads, injected_failure, printer
from common.schedule import lr_table_for
from common.timing import PhaseTimer, Timer
from frameworks.torch_ddp import (
    TrainState,
    autocast,
    check_resume,
    checkpoint_path,
    load_checkpoint,
    loss_fn,
    save_checkpoint,
    seed_for,
    sync,
    to_device,
)
from frameworks.torch_models import NovoGrad, count_params, create_model, decay_parameters

FRAMEWORK = "torch-dp"


def build_model(cfg: Config, in_channels: int, num_classes: int) -> nn.Module:
    """Build `cfg.model` for `in_channels`-channel images and `num_classes` classes."""
    return create_model(
        cfg.model, in_channels, num_classes, cfg.width, cfg.dropout, cfg.bn_momentum, cfg.bn_eps
    )


def create_train_state(
    cfg: Config, model: nn.Module, device_ids: list[int], steps_per_epoch: int
) -> TrainState:
    """Create the parameters, optimiser state and step counter; place them on the devices."""
    cuda = bool(device_ids)
    device = torch.device("cuda", device_ids[0]) if cuda else torch.device("cpu")
    model = model.to(device)  # GPU 0 holds the master copy; replicas are made every step
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
    # Scatter / replicate / gather every step; gradients are summed onto GPU 0 in backward().
    dp = nn.DataParallel(model, device_ids=device_ids or None)
    # torch.compile cannot trace DataParallel's replicas: compile only the single-GPU case.
    forward = torch.compile(model) if cuda and cfg.compile and len(device_ids) == 1 else dp
    scaler = torch.amp.GradScaler(device.type, enabled=cuda and cfg.precision == "fp16")
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
        phases=PhaseTimer(sync, False),
    )


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
    x, y, w = batch
    with autocast(state):
        logits = state.model(x)  # scattered over the GPUs like a training batch
    return {
        "loss_sum": (loss_fn(state.cfg, logits, y) * w).sum(),
        "correct": ((logits.argmax(1) == y).float() * w).sum(),
        "count": w.sum(),
    }


def evaluate(state: TrainState, loader: EvalLoader) -> dict[str, torch.Tensor]:
    """Test sums over the whole test set (one process sees every image once), on the device."""
    state.model.eval()
    totals: dict[str, torch.Tensor] = {}
    for batch in loader:
        for k, v in eval_step(state, to_device(batch, state)).items():
            totals[k] = totals[k] + v if k in totals else v
    state.model.train()
    return totals


def train(cfg: Config) -> dict:
    """Train `cfg.model` on `cfg.dataset` over `cfg.gpus` devices; return the run-result record."""
    injected_failure(FRAMEWORK)
    log = printer(True)
    cuda = torch.cuda.is_available()
    if cuda:
        device_ids = list(range(cfg.gpus))  # check_config: that many are visible
        kind = f"cuda:{torch.cuda.get_device_name(0)}"
        torch.backends.cudnn.benchmark = True  # fixed shapes: pick the fastest conv algorithms
    else:
        device_ids, kind = [], "cpu"
        torch.set_num_threads(cpu_threads(1))
        asked = f" (--gpus {cfg.gpus} was asked)" if cfg.gpus > 1 else ""
        print(
            "warning: no CUDA device: nn.DataParallel runs a single replica on the CPU; "
            f"this run used 1 device{asked}",
            file=sys.stderr,
            flush=True,
        )
    ds = load_for(cfg)
    torch.manual_seed(cfg.seed)
    model = build_model(cfg, ds.channels, ds.num_classes)
    loader = TrainLoader(
        ds,
        cfg.batch_size,
        cfg.seed,
        0,
        1,
        augment=cfg.augment,
        layout="NCHW",
        max_steps=cfg.max_steps_per_epoch,
        prefetch=cfg.prefetch,
    )
    evals = EvalLoader(ds, cfg.eval_batch_size, 0, 1, layout="NCHW")
    state = create_train_state(cfg, model, device_ids, len(loader))
    recorder = RunRecorder(
        cfg,
        devices=state.world,
        device_kind=kind,
        params=count_params(model),
        is_main=True,
        packages=("torch",),
        bn_mode=cfg.bn,
        n_test=len(ds.test_x),
    )
    if not cuda and (cfg.precision != "fp32" or cfg.compile):
        log("note: --precision and --compile apply on CUDA only; this run is fp32 eager")
    if cuda and cfg.compile and len(device_ids) > 1:
        log("note: --compile is not applied: torch.compile cannot trace nn.DataParallel")
    start = 0
    if cfg.resume and checkpoint_path(cfg).exists():
        start = load_checkpoint(state, recorder)
        log(f"resumed from {checkpoint_path(cfg)} after epoch {start}")
    elif cfg.resume:
        log(f"no checkpoint at {checkpoint_path(cfg)}: starting from scratch")
    timer = Timer(sync)
    state.phases = PhaseTimer(sync, cfg.phase_timing)
    for epoch in range(start, cfg.epochs):
        torch.manual_seed(seed_for(cfg.seed, epoch, 0))  # dropout masks
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
                log(f"step {state.step} train_loss={running:.4f}")
        sec = timer.stop()
        state.phases.add("data_wait", batches.wait_sec)
        test = evaluate(state, evals)
        sums = torch.stack(
            [totals["loss_sum"], totals["count"], test["correct"], test["count"], test["loss_sum"]]
        )
        loss_sum, count, correct, n_test, test_loss = sums.double().tolist()  # the sync point
        stop = recorder.end_epoch(
            epoch, sec, len(loader) * cfg.batch_size, loss_sum / count, correct, n_test, test_loss
        )
        if cfg.checkpoint_dir:
            save_checkpoint(state, recorder, epoch)
        injected_failure(FRAMEWORK, epoch + 1)
        if stop:
            break
        if epoch == start and epoch + 1 < cfg.epochs:  # phase times exclude the warm-up
            state.phases = PhaseTimer(sync, cfg.phase_timing)
    if cfg.phase_timing:
        recorder.phases = state.phases.per_step_ms()
    return recorder.finish()


def check_config(cfg: Config) -> None:
    """torch-specific checks before training starts (ConfigError / DatasetError)."""
    if torch.cuda.is_available():
        if cfg.gpus > torch.cuda.device_count():
            raise ConfigError(
                f"--gpus {cfg.gpus} but only {torch.cuda.device_count()} CUDA devices are "
                f"visible; use --gpus {torch.cuda.device_count()} or fewer"
            )
        if cfg.bn == "sync" and cfg.gpus > 1:
            raise ConfigError(
                "--bn sync is not possible with nn.DataParallel (each replica normalises its "
                "own slice); use --bn local, or torch-ddp for synchronised BatchNorm"
            )
    if cfg.nesterov and cfg.momentum <= 0 and cfg.optimizer == "sgd":
        raise ConfigError("--nesterov needs --momentum > 0")
    check_available(cfg)
    check_resume(cfg)


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m frameworks.<module> --help`. Exit 0 ok, 1 failed/diverged, 2 bad input."""  # noqa: E501
    cfg = cli.parse_args(argv, FRAMEWORK)
    prog = f"python -m frameworks.{FRAMEWORK.replace('-', '_')}"
    try:
        check_config(cfg)
    except (ConfigError, DatasetError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    try:
        record = train(cfg)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        print(f"{prog}: failed: {error}", file=sys.stderr)
        rec = RunRecorder(
            cfg,
            devices=min(cfg.gpus, max(1, torch.cuda.device_count())),
            device_kind="cuda" if torch.cuda.is_available() else "cpu",
            params=0,
            is_main=True,
            packages=("torch",),
        )
        rec.fail(error)
        rec.finish()
        return 1
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
