"""What torch-dp, torch-ddp and torch-fsdp share besides the models (frameworks/torch_models.py):
the optimiser (with NovoGrad), the loss, mixed precision and torch.compile, the train state, the
devices torch sees, host-to-device copies and the device pipeline, evaluation and checkpoint
I/O. The trainers keep only what differs between DataParallel, DDP and FSDP."""

from __future__ import annotations

import inspect
import io
import pickle
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Literal, cast

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule

from common import checkpoints
from common.config import CUDA_GRAPH_MODES, Config, ConfigError
from common.datasets import check_available
from common.devices import need_gpus
from common.footprint import state_record
from common.init import initial_state
from common.pipeline import EvalLoader, TrainLoader
from common.results import RunRecorder
from common.run import Run
from common.runtime import cpu_threads, threads_record
from common.timing import PhaseTimer
from frameworks.torch_models import count_params, decay_parameters


class NovoGrad(torch.optim.Optimizer):
    """NovoGrad (Ginsburg et al. 2019; NVIDIA's OpenSeq2Seq/Apex form, as in the NVIDIA course).

    Per parameter tensor ("layer") k: v = b2 * v + (1 - b2) * ||g||^2 (v = ||g||^2 at the first
    step); m = b1 * m + (g / (sqrt(v) + eps) + weight_decay * w); w -= lr * m. The second moment
    is one scalar per tensor, so the step is invariant to each layer's gradient scale.
    """

    def __init__(
        self,
        params,
        lr: float = 0.01,
        betas: tuple[float, float] = (0.95, 0.98),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):  # type: ignore[no-untyped-def]
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                norm_sq = p.grad.pow(2).sum()  # stays on the device: no host sync
                if not state:
                    state["exp_avg_sq"] = norm_sq.clone()
                    state["exp_avg"] = torch.zeros_like(p)
                else:
                    state["exp_avg_sq"].mul_(b2).add_(norm_sq, alpha=1 - b2)
                update = p.grad / (state["exp_avg_sq"].sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                state["exp_avg"].mul_(b1).add_(update)
                p.add_(state["exp_avg"], alpha=-group["lr"])
        return loss


# ---- the train state, optimiser, loss and precision ----------------------------------------


DeviceType = Literal["cpu", "cuda"]  # torch.device.type as the trainers run on it
DEVICE_TYPES: tuple[DeviceType, ...] = ("cpu", "cuda")


@dataclass(frozen=True)
class DevicePlan:
    """What a torch step runs on a device type, decided once per run by `device_plan` from
    (config, device type) and passed on: the trainers, benchmarks/compute_only.py and the
    tutorial loops take it from there, so that a loop and its compute-only reference cannot
    diverge."""

    device_type: DeviceType
    autocast_dtype: torch.dtype | None  # the activations under torch.autocast; None: float32
    grad_scaling: bool  # GradScaler on: fp16's loss scaling
    channels_last: bool  # images and conv weights channels-last (NHWC)
    compile_mode: str | None  # torch.compile's mode; None: eager
    tf32: bool | None  # TF32 matmuls and convolutions (CUDA); None: a CPU's full fp32
    cudnn_benchmark: bool  # fixed shapes: cuDNN picks the fastest conv algorithms
    float32: str  # the record's float32_precision
    process_group: str  # torch.distributed's backend: NCCL between GPUs, gloo between CPUs


def device_plan(cfg: Config, device_type: DeviceType) -> DevicePlan:
    """The one place a torch run's device decisions are made:
    - --precision bf16: bfloat16 autocast on every device type (a CPU runs the path a GPU runs:
      slower there, for checking); fp16 (with loss scaling) on CUDA only;
    - channels-last as --channels-last says; by default on CUDA only (on a CPU, oneDNN's
      channels-last crashed torch 2.11 on a Xeon: docs/results/h200-20261128);
    - torch.compile with --compile on CUDA; a CPU runs eager (inductor's CPU code is unmeasured);
    - float32 matmuls and convolutions in full fp32 unless --tf32 (CUDA), the same choice as
      every other framework (torch's own defaults differ: TF32 on for cuDNN convolutions);
    - NCCL between GPUs, gloo between CPU processes."""
    if device_type not in DEVICE_TYPES:  # e.g. a bool: `torch.cuda.is_available()` passed on
        raise TypeError(f"device_type must be one of {DEVICE_TYPES}, not {device_type!r}")
    cuda = device_type == "cuda"
    if cfg.precision == "fp16" and not cuda:
        raise ConfigError(
            "--precision fp16 needs a CUDA GPU (loss scaling of float16 gradients); on a CPU "
            "use --precision bf16 or fp32"
        )
    return DevicePlan(
        device_type=device_type,
        autocast_dtype={"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.precision),
        grad_scaling=cfg.precision == "fp16",
        channels_last=cuda if cfg.channels_last is None else cfg.channels_last,
        compile_mode=cfg.compile_mode if cuda and cfg.compile else None,
        tf32=cfg.tf32 if cuda else None,
        cudnn_benchmark=cuda,
        float32=("tf32" if cfg.tf32 else "fp32 (TF32 off)") if cuda else "fp32 (CPU)",
        process_group="nccl" if cuda else "gloo",
    )


def use_device_plan(plan: DevicePlan) -> str:
    """Apply what `plan` sets process-wide (TF32, cuDNN's autotuning); returns the record's
    float32_precision."""
    if plan.tf32 is not None:
        torch.backends.cuda.matmul.allow_tf32 = plan.tf32
        torch.backends.cudnn.allow_tf32 = plan.tf32
    if plan.cudnn_benchmark:
        torch.backends.cudnn.benchmark = True
    if plan.device_type == "cpu":  # oneDNN's weight gradient of a 1x1 convolution has the
        # strides of channels-last, [64, 32, 1, 1] as (32, 1, 32, 32), the same bytes as DDP's
        # bucket view (32, 1, 1, 1): DDP said so in a 4-line UserWarning per rank at the first
        # step, into every digits run's stderr (a note on speed, not an error; on CUDA it stays)
        warnings.filterwarnings("ignore", "Grad strides do not match bucket view strides")
    return plan.float32


def plan_devices(cfg: Config, device_type: DeviceType, processes: int | None) -> DevicePlan:
    """The run's `device_plan`, applied (`use_device_plan`); on a CPU, this node's cores
    shared by its `processes` (torch.set_num_threads: the THREADS RULE, common/runtime.py)."""
    plan = device_plan(cfg, device_type)
    use_device_plan(plan)
    if device_type == "cpu":
        torch.set_num_threads(cpu_threads(processes or 1))
    return plan


def what_ran(state: TrainState) -> dict[str, str]:
    """The record's `ran`, read from the run: the dtype of the logits of the run's model on one
    image put on the device by the loop's own `to_device`, under the step's `autocast` (model in
    eval mode, no gradients: nothing it holds changes), that image's memory format, and whether
    the step calls a torch.compile'd module."""
    c, _ = model_io(state.module)
    side = 8  # any size the model takes: the dtype and the layout do not depend on it
    image = np.zeros((1, c, side, side), np.float32)
    x, _ = to_device((image, np.zeros(1, np.int64)), state)
    was_training = state.module.training
    state.module.eval()
    with torch.no_grad(), autocast(state):
        logits = state.module(x)
    state.module.train(was_training)
    compiled = isinstance(state.forward, torch._dynamo.eval_frame.OptimizedModule)
    mode = state.plan.compile_mode or "default"
    return {
        "activation_dtype": str(logits.dtype).removeprefix("torch."),
        "input_memory_format": (
            "channels_last"
            if x.is_contiguous(memory_format=torch.channels_last) and not x.is_contiguous()
            else "NCHW"
        ),
        "mode": f"torch.compile({mode})" if compiled else "eager",
    }


@dataclass
class TrainState:
    """Everything a step changes or reads. torch updates in place; the step returns it anyway."""

    model: Any  # the parallel wrapper (DataParallel / DDP), or the bare model
    forward: Any  # what the step calls: the wrapper, or torch.compile of it
    module: nn.Module  # the bare model: evaluation and checkpoints
    optimizer: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    lr: np.ndarray  # LR of every step (common.schedule)
    step: int
    cfg: Config
    device: torch.device
    world: int
    plan: DevicePlan  # what the step runs on this device type (device_plan)
    phases: PhaseTimer = field(default_factory=lambda: PhaseTimer(sync, False))  # run.phases


def model_io(model: nn.Module) -> tuple[int, int]:
    """(input channels, classes) of a model built by torch_models.create_model."""
    conv1, fc = model.get_submodule("conv1"), model.get_submodule("fc")
    assert isinstance(conv1, nn.Conv2d) and isinstance(fc, nn.Linear)
    return conv1.in_channels, fc.out_features


def initialize(cfg: Config, model: nn.Module) -> None:
    """--init shared: load the arrays every framework starts from (common/init.py; torch's
    names and layouts, so by state-dict key). --init native keeps what torch's generator drew."""
    if cfg.init == "shared":
        arrays, _ = initial_state(cfg, *model_io(model))
        model.load_state_dict({k: torch.from_numpy(v) for k, v in arrays.items()})


def make_optimizer(cfg: Config, model: nn.Module) -> torch.optim.Optimizer:
    """SGD in torch's form (buf = m * buf + (g + wd * w); w -= lr * buf) or NovoGrad; weight
    decay on conv and linear weights only. The LR is set before every step (common.schedule)."""
    decay, no_decay = decay_parameters(model)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if cfg.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.nesterov)
    return NovoGrad(groups, lr=cfg.lr, betas=cfg.novograd_betas)


def no_forward_buffer_sync() -> dict[str, Any]:
    """DDP's keyword that stops it broadcasting rank 0's buffers (BN running statistics) at
    every forward. Recent torch (2.13+) deprecates `broadcast_buffers` (still accepted, with a
    FutureWarning in every process) for `forward_sync_buffers`, which still broadcasts them once,
    when DDP is built; they are equal on every rank then anyway (the same start; a checkpoint
    is loaded after)."""
    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def loss_fn(cfg: Config, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Per-example softmax cross-entropy with label smoothing, in float32."""
    return F.cross_entropy(logits.float(), y, reduction="none", label_smoothing=cfg.label_smoothing)


def autocast(state: TrainState) -> torch.autocast:
    """Mixed precision as the run's plan says (--precision bf16 on any device, fp16 on CUDA);
    float32 where it says none."""
    dtype = state.plan.autocast_dtype
    return torch.autocast(state.device.type, dtype=dtype, enabled=dtype is not None)


def execution(plan: DevicePlan, compiled: bool) -> str:
    """The record's `execution`: eager or torch.compile, and the memory layout of the convs."""
    mode = "eager"
    if compiled:  # torch.compile's default mode, or the mode named
        name = plan.compile_mode or "default"
        mode = "torch.compile" + ("" if name == "default" else f"({name})")
    layout = "channels_last" if plan.channels_last else "NCHW"
    return f"{mode}, {layout}, {'cuDNN' if plan.device_type == 'cuda' else 'oneDNN'}"


class CompileMeter:
    """What torch.compile cost this run (--compile, CUDA), for the record as the JAX trainers'
    `compile_sec` and `compile_cache`: seconds in Dynamo's compiles of the forward graphs
    (AOTAutograd and Inductor included) and of the backward graphs (compiled at their first
    call), and the hits and misses of Inductor's FX graph cache and AOTAutograd's cache (both
    persistent, on by default). From torch._dynamo's own timers and counters, counted from this
    meter's creation; they are torch internals, so a torch that lacks them records None."""

    timers = ("_compile.compile_inner", "backward._backward_impl")
    caches = {
        "fxgraph": ("inductor", "fxgraph_cache_hit", "fxgraph_cache_miss"),
        "aot_autograd": ("aot_autograd", "autograd_cache_hit", "autograd_cache_miss"),
    }

    def __init__(self, compiled: bool = True) -> None:
        self.compiled = compiled  # False: the step runs eager, and record() is empty
        self.start = self.read() if compiled else None

    def read(self) -> dict[str, float] | None:
        if "torch._dynamo" not in sys.modules:  # nothing compiled yet (its import takes ~1 s)
            zero = {f"{name}_{kind}": 0 for name in self.caches for kind in ("hits", "misses")}
            return {"sec": 0.0, **zero}
        try:
            from torch._dynamo.utils import compilation_time_metrics, counters
        except ImportError:
            return None
        now = {"sec": sum(sum(compilation_time_metrics.get(k, ())) for k in self.timers)}
        for name, (group, hit, miss) in self.caches.items():
            now[f"{name}_hits"] = counters[group][hit]
            now[f"{name}_misses"] = counters[group][miss]
        return now

    def record(self) -> dict[str, Any]:
        if not self.compiled:
            return {}
        now = self.read()
        if now is None or self.start is None:
            return {"compile_sec": None, "compile_cache": None}
        delta = {k: now[k] - self.start[k] for k in now}
        try:
            from torch._inductor.runtime.cache_dir_utils import cache_dir

            where: str | None = cache_dir()
        except ImportError:
            where = None
        return {
            "compile_sec": round(delta.pop("sec"), 3),
            "compile_cache": {"dir": where, **{k: int(v) for k, v in delta.items()}},
        }


def start_run(
    run: Run, state: TrainState, kind: str, processes: int | None
) -> tuple[TrainState, int, CompileMeter]:
    """What both torch trainers do between building the state and the epoch loop: the run
    record (`kind` of device, the threads, and what the step runs, read from the state: dtype,
    input layout, compiled or not), --compile's notes, --resume, the run's phase timer.
    `processes`: this node's, one per device (torch-ddp); None: one process drives every
    device (torch-dp). Returns the state, the first epoch to train and the meter of
    torch.compile's cost (compile_sec, compile_cache: empty where the step runs eager)."""
    cfg, cuda, n = run.cfg, state.device.type == "cuda", torch.get_num_threads()
    ran = what_ran(state)
    compiled = ran["mode"] != "eager"
    if processes is None:
        threads = threads_record(n, None, "torch.set_num_threads in the one process")
    else:
        threads = threads_record(n * processes, n, "torch.set_num_threads in each process "
                                 "(one process per device)")  # fmt: skip
    rec = run.record(
        devices=state.world,
        kind=kind,
        params=count_params(state.module),
        threads=threads,
        execution=execution(state.plan, compiled=compiled),
        precision=state.plan.float32,
        ran=ran,
        state_bytes=state_bytes(state.module, state.optimizer),
        reshard=cfg.reshard_after_forward,  # torch-fsdp: its gathers per step
    )
    if dist.is_initialized():
        rec.extra["process_group"] = dist.get_backend()  # nccl on GPUs, gloo on the CPU
    if cfg.compile and not cuda:
        run.log("note: --compile applies on CUDA only; this run is eager")
    elif cfg.compile and not compiled:
        run.log("note: --compile is not applied: torch.compile cannot trace nn.DataParallel")
    elif compiled and state.world > 1 and cfg.compile_mode in CUDA_GRAPH_MODES:
        run.log(f"note: --compile-mode {cfg.compile_mode} (CUDA graphs) with DDP over "
                f"{state.world} GPUs is unmeasured here (measured on one GPU)")  # fmt: skip
    state, start = run.resume(state, CHECKPOINTS)
    state.phases = run.phases
    return state, start, CompileMeter(compiled)


def state_bytes(module: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    """What this process's device keeps between steps (common.footprint.state_record), read
    from `module` (torch-dp: device 0's copy; the replicas are made anew every step) and its
    `optimizer`: each tensor's local shard where it is a DTensor (FSDP2), else the tensor."""
    from torch.distributed.tensor import DTensor

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if isinstance(t, DTensor) else t

    def nbytes(t: torch.Tensor) -> int:
        return local(t).numel() * t.element_size()

    trainable = [p for p in module.parameters() if p.requires_grad]
    kept = [t for s in optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
    if not kept:  # created lazily at the first step: the slots the optimiser's config makes
        for group in optimizer.param_groups:
            for p in group["params"]:
                if isinstance(optimizer, NovoGrad):  # exp_avg, and exp_avg_sq: one scalar
                    kept += [local(p), torch.zeros((), dtype=p.dtype)]
                elif group["momentum"]:  # SGD: one momentum_buffer
                    kept.append(local(p))
    return state_record(
        params=sum(nbytes(p) for p in module.parameters()),
        # Grads exist from the first backward on: FSDP2 and DDP keep them as the parameters'
        # shards (the whole tensor under DDP) in the parameters' dtype.
        grads=sum(nbytes(p) for p in trainable),
        optimizer=sum(nbytes(t) for t in kept),
        buffers=sum(nbytes(b) for b in module.buffers()),
    )


def seed_for(seed: int, epoch: int, rank: int) -> int:
    """Torch RNG seed (dropout) of one rank's epoch: reproducible after --resume."""
    return int(np.random.SeedSequence([seed, epoch, rank]).generate_state(1)[0])


# ---- device I/O and evaluation -----------------------------------------------------------


def check_inputs(cfg: Config, count: bool = True) -> int:
    """torch's checks before any process starts (ConfigError / DatasetError): the GPUs torch
    sees (0: none, or `--devices cpu` hid them), `--devices cuda` with none, or (`count`)
    `--gpus` beyond them; the dataset; --resume's checkpoint. Returns the GPUs seen."""
    visible = torch.cuda.device_count() if torch.cuda.is_available() else 0
    build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU build"
    why = need_gpus(cfg.devices, visible, cfg.framework, f"torch {torch.__version__}, {build}")
    if why:
        raise ConfigError(why)
    if count and visible and cfg.gpus > visible:
        raise ConfigError(
            f"--gpus {cfg.gpus} but only {visible} CUDA devices are visible; "
            f"use --gpus {visible} or fewer"
        )
    check_available(cfg)
    checkpoints.check_resume(cfg, CHECKPOINTS)
    return visible


def sync() -> None:
    """Wait for queued device work (CUDA kernels run asynchronously; CPU ops do not)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def host_to_device(a: np.ndarray, device: torch.device) -> torch.Tensor:
    """One numpy array on `device`: on CUDA from pinned memory, asynchronously (no sync)."""
    t = torch.from_numpy(a)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t


def to_device(batch: tuple[np.ndarray, ...], state: TrainState) -> tuple[torch.Tensor, ...]:
    """numpy batch -> device tensors, once: pinned host memory and an asynchronous copy on CUDA
    (no sync); labels as int64, images channels-last where enabled."""
    out = []
    for i, a in enumerate(batch):
        t = host_to_device(a, state.device)
        if i == 0 and state.plan.channels_last:  # the images, laid out as the weights are
            t = t.contiguous(memory_format=torch.channels_last)
        out.append(t.long() if i == 1 else t)
    return tuple(out)


def make_batch(
    images: torch.Tensor,
    idx: torch.Tensor,
    rows: torch.Tensor,
    cols: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
) -> torch.Tensor:
    """--pipeline device: common.pipeline.gather_crops in torch ops, then the host Normalizer's
    (x * scale + shift): the resident uint8 images (N, H, W, C) -> float32 (B, H, W, C)."""
    h, w = images.shape[1:3]
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
    rows, cols = rows.clamp(0, h - 1).long(), cols.clamp(0, w - 1).long()
    crops = images[idx.long()[:, None, None], rows[:, :, None], cols[:, None, :]]
    crops = crops * inside[..., None]  # 0 outside the image: the zero padding
    return crops.float() * scale + shift


def train_put(
    loader: TrainLoader, state: TrainState
) -> Callable[[tuple[np.ndarray, ...]], tuple[torch.Tensor, torch.Tensor]]:
    """The step's batch on the device, from what `loader` yields. Host pipeline: `to_device`.
    Device pipeline: the uint8 training set is copied to the device once, here, and each step
    copies only its indices (asynchronously) and gathers its crops there (`make_batch`); images
    NCHW, channels-last where enabled, as `to_device` gives them."""
    if not loader.on_device:
        return lambda batch: to_device(batch, state)  # type: ignore[return-value]  # (x, y)
    device = state.device
    images = torch.from_numpy(loader.ds.train_x).to(device)
    scale = torch.from_numpy(loader.norm.scale).to(device)
    shift = torch.from_numpy(loader.norm.shift).to(device)

    def put(batch: tuple[np.ndarray, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        idx, rows, cols, y = (host_to_device(a, device) for a in batch)
        x = make_batch(images, idx, rows, cols, scale, shift).permute(0, 3, 1, 2)  # NCHW view
        # The permuted NHWC tensor is channels-last already; plain NCHW needs a copy.
        return (x if state.plan.channels_last else x.contiguous()), y.long()

    return put


def evaluate(
    eval_step: Callable[[TrainState, tuple[torch.Tensor, ...]], dict[str, torch.Tensor]],
    state: TrainState,
    loader: EvalLoader,
    steps: int = 0,
) -> dict[str, Any]:  # tensors on the device (host_sums reads them)
    """Test sums {"loss_sum", "correct", "count"} over the loader's images (each exactly once),
    left on the device: the caller reads them once. `steps` (torch-fsdp, whose forward is a
    collective): every rank runs that many batches, those past its own of one image at weight 0."""
    state.model.eval()
    totals: dict[str, torch.Tensor] = {}
    done = 0
    for batch in loader:
        done += 1
        for k, v in eval_step(state, to_device(batch, state)).items():
            totals[k] = totals[k] + v if k in totals else v
    blank = (loader.norm(loader.ds.test_x[:1]), loader.ds.test_y[:1], np.zeros(1, np.float32))
    for _ in range(done, steps):
        eval_step(state, to_device(blank, state))
    state.model.train()
    return totals


def host_sums(
    *sums: dict[str, torch.Tensor], all_reduce: Callable[[torch.Tensor], Any] | None = None
) -> list[dict[str, Any]]:
    """Metric sums on the device -> the same dicts of host floats, in one transfer (a host
    sync). With `all_reduce` (torch-ddp: `dist.all_reduce`), first summed over the ranks, in
    one collective over all of them."""
    flat = torch.stack([v.reshape(()) for d in sums for v in d.values()]).double()
    if all_reduce is not None:
        all_reduce(flat)
    values = iter(flat.tolist())
    return [{k: next(values) for k in d} for d in sums]


# ---- checkpoints -------------------------------------------------------------------------


def checkpoint_path(cfg: Config) -> Path:
    return Path(cfg.checkpoint_dir) / f"{cfg.framework}.pt"


def save_checkpoint(cfg: Config, state: TrainState, recorder: RunRecorder, epoch: int) -> None:
    """Write the state after `epoch` (0-based) with its sha256, atomically. A sharded model
    (torch-fsdp): every rank gathers the full state (a collective), rank 0 writes it."""
    if isinstance(state.module, FSDPModule):
        model, optimizer = get_state_dict(state.module, state.optimizer, options=FULL_STATE)
        if dist.get_rank() != 0:
            return
    else:
        model, optimizer = state.module.state_dict(), state.optimizer.state_dict()
    buf = io.BytesIO()
    torch.save(
        {
            "model": model,
            "optimizer": optimizer,
            "scaler": state.scaler.state_dict(),
            **checkpoints.checkpoint_meta(cfg, recorder, epoch, state.step),
        },
        buf,
    )
    checkpoints.write_checkpoint(checkpoint_path(cfg), buf.getvalue())


def load_checkpoint(
    cfg: Config, state: TrainState, recorder: RunRecorder
) -> tuple[TrainState, int]:
    """Restore the latest checkpoint (its sha256 checked first; tensors and plain containers
    only: weights_only=True); return the state and the epoch to continue from. Another run's
    metadata is refused (one line)."""
    path = checkpoint_path(cfg)
    with checkpoints.reading_checkpoint(path):  # damaged or foreign: one line, exit 2
        ckpt = load_tensors(io.BytesIO(checkpoints.read_checkpoint(path)), state.device)
        epoch, state.step = checkpoints.restore_meta(ckpt, recorder, path)
        if isinstance(state.module, FSDPModule):  # every rank keeps its shard of the full state
            set_state_dict(state.module, state.optimizer, model_state_dict=ckpt["model"],
                           optim_state_dict=ckpt["optimizer"], options=FULL_STATE)  # fmt: skip
        else:
            state.module.load_state_dict(ckpt["model"])
            state.optimizer.load_state_dict(ckpt["optimizer"])
        state.scaler.load_state_dict(ckpt["scaler"])
    return state, epoch


def canonical_state(state: TrainState) -> dict[str, np.ndarray]:
    """Parameters and BN buffers in torch's names and layouts (--save-state), as numpy. A
    sharded model (torch-fsdp): gathered by every rank (a collective), on rank 0 only."""
    if isinstance(state.module, FSDPModule):  # tensors (its type also allows containers)
        sd = cast(dict[str, torch.Tensor], get_model_state_dict(state.module, options=FULL_STATE))
    else:
        sd = state.module.state_dict()
    return {k: v.detach().cpu().numpy() for k, v in sd.items()}


# The full (unsharded) state in torch's names, gathered onto rank 0's host memory (the other
# ranks get none); loaded, every rank takes its shard of it.
FULL_STATE = StateDictOptions(full_state_dict=True, cpu_offload=True)


def checkpoint_meta_of(path: Path) -> dict[str, Any]:
    """The metadata saved in a checkpoint: config, epoch ... (for check_resume)."""
    return load_tensors(io.BytesIO(checkpoints.read_checkpoint(path)), "cpu")


CHECKPOINTS = checkpoints.Checkpoints(
    checkpoint_path, save_checkpoint, load_checkpoint, checkpoint_meta_of
)


def load_tensors(path: Path | IO[bytes], device: Any) -> Any:
    """torch.load of tensors and plain containers only (weights_only=True: nothing in the file
    can run code). torch's refusal of anything else is several lines that end in the advice to
    load with weights_only=False; it becomes one ValueError naming what was found instead."""
    try:
        return torch.load(path, map_location=device, weights_only=True)
    except pickle.UnpicklingError as exc:
        detail = str(exc).partition("WeightsUnpickler error:")[2].strip().splitlines()
        what = detail[0].strip() if detail else "not a torch checkpoint"
        raise ValueError(f"not a checkpoint of tensors ({what})") from None
