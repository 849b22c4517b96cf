"""mxnet-gluon: synchronous data parallelism in one process with Gluon's `split_and_load`.

Each step loads one global batch, splits it into equal per-device slices
(`gluon.utils.split_and_load`), runs forward and backward on every context under one
`autograd.record()`, and `Trainer.step(global_batch)` sums the per-context gradients through the
kvstore ("device": reduced on a device, then broadcast back) and applies the same update on every
replica, rescaled by 1/global_batch. Contexts are the visible GPUs where an MXNet CUDA build is
installed, otherwise `[mx.cpu(0), ..., mx.cpu(N-1)]`: N CPU contexts, each with its own engine
worker thread, sharing the host's cores ("cpu-simulated").

MXNet is a retired project. 1.9.1 (May 2022) is its final release; Apache moved MXNet to the
Attic in 2023, so there will be no fixes, no new CUDA support and no wheels for new Pythons. It
runs here only with numpy 1.23.5 (1.9.1 breaks on numpy >= 1.24), in its own environment
(.venv-mxnet, requirements/mxnet.txt), and it cannot share a process with torch or JAX.
GPU wheels: `mxnet-cu112==1.9.1` (CUDA 11.2; cu101/cu102/cu110 builds also exist), the newest
CUDA it was ever built for. The wheel bundles its CUDA 11 runtime, cuDNN and NCCL, so it needs an
NVIDIA driver that still runs CUDA 11 code (any R450+ driver, newer ones included, thanks to
CUDA's forward compatibility). Its kernels are compiled for GPU architectures up to Ampere
(sm_80); on Hopper (H100/H200, sm_90) or newer, MXNet runs only through the driver's JIT
compilation of the embedded PTX at start-up (minutes on the first run), cannot use any
Hopper-specific feature (FP8, TMA, wgmma, the newer cuDNN/NCCL paths), and so is not a fair
speed comparison against torch/JAX built for CUDA 12+. This CPU wheel (`mxnet==1.9.1`) is what
the tests use.

Where MXNet differs from the torch module (all stated, none hidden):
- OpenMP threads are set explicitly before mxnet is imported: unset, MXNet used one core here.
- SGD is `TorchSGD` (torch's update rule, see frameworks/mxnet_models.py), not MXNet's built-in
  "sgd", which multiplies the LR into the momentum buffer and so differs whenever the LR changes
  (warm-up, cosine). NovoGrad, which MXNet 1.9.1 does not have, is implemented there too.
- Per-context BatchNorm (`--bn local`) updates each replica's running statistics from its own
  slice; at the end of every epoch they are averaged over the replicas (what Gluon's own
  `save_parameters` would store), so evaluation and checkpoints do not depend on the device
  count's assignment of images to contexts. torch-ddp instead broadcasts rank 0's buffers.
  MXNet updates running_var with the biased batch variance (torch: unbiased), and updates the
  running statistics in the backward pass.
- `--bn sync` is Gluon's contrib SyncBatchNorm, GPU only: on CPU contexts it hangs in 1.9.1, so
  it is rejected up front.
- Mixed precision is not offered (MXNet's AMP is a separate contrib path); `--precision` must be
  fp32 on GPUs. `--channels-last` and `--compile` are torch options and are ignored.

Multi-node is out of scope. MXNet's only multi-node path is the parameter-server kvstore
("dist_sync"): a scheduler, server and worker processes started by
`python -m mxnet.tools.launch -n NODES -H hostfile --launcher ssh python -m <module> ...`
(the DMLC_* environment), with each worker reading its own data shard by `kv.rank`, updates on
the servers, and evaluation counts gathered by hand. Building and testing that topology for a
retired framework, whose launcher and ps-lite transport no longer receive fixes, is not worth it
here: the torch and JAX modules cover multi-node (torchrun, jax.distributed).

Run: `.venv-mxnet/bin/python -m frameworks.mxnet_gluon --preset digits --gpus 2`.
"""

from __future__ import annotations

import os
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from common.cli import parse_args
from common.config import Config, ConfigError, per_device
from common.datasets import DatasetError, load_for
from common.pipeline import EvalLoader, TrainLoader
from common.results import RunRecorder, host_info, write_json_atomic
from common.runtime import cpu_threads, injected_failure, set_omp_threads
from common.schedule import lr_table_for
from common.timing import PhaseTimer, Timer

FRAMEWORK = "mxnet-gluon"
PACKAGES = ("mxnet",)
# A checkpoint must come from the same run definition to be resumed.
RESUME_MUST_MATCH = ("model", "width", "dataset", "image_size", "batch_size", "seed", "optimizer")


def sync() -> None:
    """Wait for all queued MXNet work (the engine is asynchronous): the timer's sync."""
    import mxnet as mx

    mx.nd.waitall()


def contexts(n: int) -> tuple[list[Any], str]:
    """`n` contexts and the device kind: GPUs where this MXNet build has CUDA and GPUs are
    visible, otherwise n CPU contexts carved out of the host ("cpu-simulated")."""
    import mxnet as mx

    if mx.runtime.Features().is_enabled("CUDA") and mx.context.num_gpus() > 0:
        visible = mx.context.num_gpus()
        if n > visible:
            raise ConfigError(f"--gpus {n} but only {visible} GPUs are visible; use --gpus "
                              f"{visible} or fewer")
        names = host_info().get("gpus") or ["GPU"]
        return [mx.gpu(i) for i in range(n)], f"cuda:{names[0]}"
    return [mx.cpu(i) for i in range(n)], "cpu-simulated"


@dataclass
class TrainState:
    net: Any  # gluon.HybridBlock, parameters replicated on every context
    trainer: Any  # gluon.Trainer: kvstore + one optimiser state per context
    ctx: list[Any]  # the devices
    host: Any  # where batches are assembled before split_and_load (pinned memory on GPU)
    loss_fn: Any  # per-example softmax cross-entropy with label smoothing
    lr_table: np.ndarray  # LR of every step of the run (common.schedule)
    global_batch: int
    step: int = 0
    phases: Any = field(default=None)  # common.timing.PhaseTimer


def build_model(cfg: Config, in_channels: int, num_classes: int):  # -> gluon.HybridBlock
    """Build `cfg.model` for `in_channels`-channel images and `num_classes` classes."""
    from frameworks import mxnet_models

    sync_devices = cfg.gpus if cfg.bn == "sync" else 0
    return mxnet_models.build(cfg.model, in_channels, num_classes, cfg.width, cfg.dropout,
                              cfg.bn_momentum, cfg.bn_eps, sync_devices)


def create_train_state(cfg: Config, model, ctx: list[Any], steps_per_epoch: int) -> TrainState:
    """Create the parameters, optimiser state and step counter; place them on the devices."""
    import mxnet as mx
    from mxnet import gluon

    from frameworks import mxnet_models

    # Initialised once on the CPU from mx.random's seeded generator and copied to every context,
    # so the replicas start identical and the weights do not depend on the device count.
    mx.random.seed(cfg.seed)
    model.initialize(ctx=ctx)
    # One cached graph per context; static_alloc/static_shape reuse buffers across steps.
    model.hybridize(static_alloc=True, static_shape=True)
    if cfg.optimizer == "sgd":
        optimizer = mxnet_models.TorchSGD(momentum=cfg.momentum, nesterov=cfg.nesterov,
                                          wd=cfg.weight_decay, learning_rate=cfg.lr)
    else:
        b1, b2 = cfg.novograd_betas
        optimizer = mxnet_models.NovoGrad(beta1=b1, beta2=b2, wd=cfg.weight_decay,
                                          learning_rate=cfg.lr)
    # kvstore "device": gradients of the N contexts are summed on a device and the sum is copied
    # back to every context (pushpull in Trainer.allreduce_grads). update_on_kvstore=False keeps
    # the update on each context (replicated, identical), as DDP does, and lets the phase timer
    # separate the all-reduce from the update. With one context there is no kvstore at all.
    trainer = gluon.Trainer(model.collect_params(), optimizer, kvstore="device",
                            update_on_kvstore=False)
    on_gpu = ctx[0].device_type == "gpu"
    return TrainState(
        net=model, trainer=trainer, ctx=ctx, host=mx.cpu_pinned() if on_gpu else mx.cpu(),
        loss_fn=mxnet_models.SoftmaxCrossEntropy(cfg.label_smoothing),
        lr_table=lr_table_for(cfg, steps_per_epoch), global_batch=cfg.batch_size,
    )


def train_step(state: TrainState, batch) -> tuple[TrainState, dict]:
    """One synchronous data-parallel SGD step on a global batch.

    Returns the new state and metrics {"loss_sum", "correct", "count"} summed over the global
    batch and left on the device (read only at log points: no per-step host sync)."""
    import mxnet as mx
    from mxnet import autograd
    from mxnet.gluon.utils import split_and_load

    phases = state.phases
    x, y = batch  # x (B, C, H, W) float32, y (B,) int32: numpy from the loader thread
    state.trainer.set_learning_rate(float(state.lr_table[state.step]))  # a host float: no sync
    with phases.phase("h2d"):
        # Each context gets its contiguous (B/N, C, H, W) slice, copied from host memory.
        xs = split_and_load(mx.nd.array(x, ctx=state.host), state.ctx)
        ys = split_and_load(mx.nd.array(y, ctx=state.host, dtype="float32"), state.ctx)
    with phases.phase("forward_backward"):
        with autograd.record():  # train mode: batch statistics, dropout on
            logits = [state.net(xi) for xi in xs]  # (B/N, K) on each context
            losses = [state.loss_fn(o, yi) for o, yi in zip(logits, ys)]  # (B/N,) per example
        # d(sum of per-example losses)/dw, separately on every context; contexts run in parallel
        # (one engine worker each).
        autograd.backward(losses)
    if phases.enabled:
        with phases.phase("allreduce"):
            state.trainer.allreduce_grads()  # kvstore pushpull: grads SUMMED over contexts
        with phases.phase("optimizer"):
            state.trainer.update(state.global_batch)  # rescale_grad = 1/global_batch
    else:
        # = allreduce_grads() + update(): sum over contexts, then every replica applies the
        # update with rescale_grad = 1/global_batch, i.e. the gradient of the global-batch mean.
        state.trainer.step(state.global_batch)
    state.step += 1
    metrics = {
        "loss_sum": [loss.sum() for loss in losses],  # one (1,) NDArray per context
        "correct": [(o.argmax(axis=1) == yi).sum() for o, yi in zip(logits, ys)],
        "count": state.global_batch,  # known on the host
    }
    return state, metrics


def eval_step(state: TrainState, batch) -> dict:
    """Metrics {"loss_sum", "correct", "count"} of a test batch; rows of weight 0 (padding) do
    not count."""
    import mxnet as mx
    from mxnet.gluon.utils import split_and_load

    x, y, w = batch  # padded to a multiple of the context count (EvalLoader pad_to)
    xs = split_and_load(mx.nd.array(x, ctx=state.host), state.ctx)
    ys = split_and_load(mx.nd.array(y, ctx=state.host, dtype="float32"), state.ctx)
    ws = split_and_load(mx.nd.array(w, ctx=state.host), state.ctx)
    out: dict[str, list[Any]] = {"loss_sum": [], "correct": [], "count": []}
    for xi, yi, wi in zip(xs, ys, ws):
        logits = state.net(xi)  # not recording: predict mode (running statistics, no dropout)
        out["loss_sum"].append((state.loss_fn(logits, yi) * wi).sum())
        out["correct"].append(((logits.argmax(axis=1) == yi) * wi).sum())
        out["count"].append(wi.sum())
    return out


def evaluate(state: TrainState, loader: EvalLoader) -> tuple[float, float, float]:
    """(correct, count, loss_sum) over the whole test set; one host read at the end."""
    sums: dict[str, list[Any]] = {}
    for batch in loader:
        sums = accumulate(sums, eval_step(state, batch))
    return read(sums["correct"]), read(sums["count"]), read(sums["loss_sum"])


def accumulate(sums: dict[str, Any], metrics: dict[str, Any]) -> dict[str, Any]:
    """Add per-context metric NDArrays without leaving the devices (asynchronous)."""
    if not sums:
        return dict(metrics)
    return {k: [a + b for a, b in zip(v, metrics[k])] if isinstance(v, list) else v + metrics[k]
            for k, v in sums.items()}


def read(values) -> float:
    """Host value of per-context NDArrays (a sync point) or of a host number."""
    if isinstance(values, list):
        return float(sum(float(v.asscalar()) for v in values))
    return float(values)


def average_running_stats(state: TrainState) -> None:
    """Make every replica's BN running statistics the mean over the replicas (per-context BN
    updates each from its own slice). Running once per epoch, before evaluation and the
    checkpoint, keeps both independent of which context saw which images."""
    import mxnet as mx

    if len(state.ctx) == 1:
        return
    for p in state.net.collect_params().values():
        if p.grad_req == "null":  # running_mean / running_var
            copies = [d.as_in_context(state.ctx[0]) for d in p.list_data()]
            p.set_data(mx.nd.add_n(*copies) / len(copies))


def epoch_seed(seed: int, epoch: int) -> int:
    """Seed of mx.random (dropout) for `epoch`: a resumed run draws the same masks."""
    return int(np.random.default_rng([seed, epoch, 2]).integers(2**31 - 1))


def save_checkpoint(directory: str, state: TrainState, recorder: RunRecorder, cfg: Config,
                    epoch: int) -> None:
    """Weights, optimiser state and progress after `epoch` (0-based), each written to a temp file
    and renamed; `checkpoint.json`, renamed last, names the complete set."""
    import mxnet as mx

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    tag = f"epoch{epoch + 1}"
    # The replicas are identical; save context 0's copy. (Gluon's save_parameters averages the
    # replicas, and (a+a+a)/3 can differ from a in the last bit, which would break an exact
    # resume at 3 devices.) The file is in save_parameters' format: load_parameters reads it.
    params = {name: p.data(state.ctx[0]).as_in_context(mx.cpu())
              for name, p in state.net._collect_params_with_prefix().items()}
    tmp = d / f"{tag}.params.tmp"
    mx.nd.save(str(tmp), params)
    os.replace(tmp, d / f"{tag}.params")
    tmp = d / f"{tag}.states.tmp"
    state.trainer.save_states(str(tmp))  # optimiser buffers of context 0 (all are identical)
    os.replace(tmp, d / f"{tag}.states")
    write_json_atomic(d / "checkpoint.json", {
        "framework": FRAMEWORK, "epoch": epoch + 1, "step": state.step,
        "params": f"{tag}.params", "states": f"{tag}.states", "recorder": recorder.state(),
        "config": {k: getattr(cfg, k) for k in RESUME_MUST_MATCH},
    })
    for old in d.glob("epoch*.*"):  # earlier epochs' files
        if not old.name.startswith(f"{tag}."):
            old.unlink(missing_ok=True)


def load_checkpoint(directory: str, state: TrainState, recorder: RunRecorder,
                    cfg: Config) -> int:
    """Restore a checkpoint into `state` and `recorder`; return the epoch to start from."""
    import json

    path = Path(directory) / "checkpoint.json"
    if not path.exists():
        print(f"no checkpoint in {directory}: starting from epoch 1", flush=True)
        return 0
    with open(path) as f:
        ckpt = json.load(f)
    saved = ckpt.get("config", {})
    for key in RESUME_MUST_MATCH:
        want = getattr(cfg, key)
        if key in saved and saved[key] != (list(want) if isinstance(want, tuple) else want):
            raise ConfigError(f"checkpoint in {directory} has {key}={saved[key]!r}, this run "
                              f"{want!r}; resume with the same settings or a new --checkpoint-dir")
    state.net.load_parameters(str(Path(directory) / ckpt["params"]), ctx=state.ctx)
    state.trainer.load_states(str(Path(directory) / ckpt["states"]))
    state.step = int(ckpt["step"])
    recorder.load_state(ckpt["recorder"])
    return int(ckpt["epoch"])


def train(cfg: Config) -> dict:
    """Train `cfg.model` on `cfg.dataset` over `cfg.gpus` devices; return the run-result record."""
    import mxnet as mx

    from frameworks import mxnet_models

    injected_failure(FRAMEWORK)
    ctx, device_kind = contexts(cfg.gpus)
    if cfg.bn == "sync" and ctx[0].device_type != "gpu":
        raise ConfigError("--bn sync needs GPUs (Gluon's SyncBatchNorm hangs on CPU contexts in "
                          "MXNet 1.9.1); use --bn local")
    if cfg.precision != "fp32" and ctx[0].device_type == "gpu":
        raise ConfigError(f"mxnet-gluon runs fp32 only (got --precision {cfg.precision}); "
                          "use --precision fp32")
    per_device(cfg.batch_size, len(ctx))
    ds = load_for(cfg)
    loader = TrainLoader(ds, cfg.batch_size, cfg.seed, 0, 1, augment=cfg.augment, layout="NCHW",
                         max_steps=cfg.max_steps_per_epoch, prefetch=cfg.prefetch)
    # Every test image once; batches padded (weight 0) to a multiple of the context count.
    evaluator = EvalLoader(ds, cfg.eval_batch_size, 0, 1, layout="NCHW", pad_to=len(ctx))
    model = build_model(cfg, ds.channels, ds.num_classes)
    state = create_train_state(cfg, model, ctx, len(loader))
    recorder = RunRecorder(cfg, devices=len(ctx), device_kind=device_kind,
                           params=mxnet_models.count_params(model), is_main=True,
                           packages=PACKAGES, bn_mode=cfg.bn, n_test=len(ds.test_x))
    recorder.extra["omp_num_threads"] = os.environ.get("OMP_NUM_THREADS", "")
    start_epoch = load_checkpoint(cfg.checkpoint_dir, state, recorder, cfg) if cfg.resume else 0
    timer = Timer(sync)
    state.phases = PhaseTimer(sync, cfg.phase_timing)
    try:
        for epoch in range(start_epoch, cfg.epochs):
            mx.random.seed(epoch_seed(cfg.seed, epoch), ctx="all")
            sums: dict[str, Any] = {}
            timer.start()
            batches = loader.epoch(epoch)
            for i, batch in enumerate(batches):
                state, metrics = train_step(state, batch)
                sums = accumulate(sums, metrics)
                state.phases.steps += 1
                if cfg.log_every and (i + 1) % cfg.log_every == 0:  # a log point: host read
                    print(f"epoch {epoch + 1} step {i + 1}/{len(loader)} "
                          f"loss={read(sums['loss_sum']) / read(sums['count']):.4f}", flush=True)
            sec = timer.stop()
            state.phases.add("data_wait", batches.wait_sec)
            train_loss = read(sums["loss_sum"]) / read(sums["count"])  # one read per epoch
            average_running_stats(state)
            correct, total, loss_sum = evaluate(state, evaluator)
            stop = recorder.end_epoch(epoch, sec, len(loader) * cfg.batch_size, train_loss,
                                      correct, total, loss_sum)
            if cfg.checkpoint_dir:
                save_checkpoint(cfg.checkpoint_dir, state, recorder, cfg, epoch)
                injected_failure(FRAMEWORK, epoch + 1)
            if stop:
                break
    except Exception as exc:  # keep what was measured; the record says what failed
        traceback.print_exc()
        recorder.fail(f"{type(exc).__name__}: {exc}")
    if cfg.phase_timing:
        recorder.phases = state.phases.per_step_ms()
    return recorder.finish()


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m frameworks.<module> --help`. Exit 0 ok, 1 failed/diverged, 2 bad input."""
    cfg = parse_args(argv, FRAMEWORK)
    # Before mxnet is imported (it reads the count once): the contexts share the host's cores.
    set_omp_threads(cpu_threads())
    prog = "python -m frameworks.mxnet_gluon"
    try:
        record = train(cfg)
    except (ConfigError, DatasetError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # set-up failed before training: still leave a record
        traceback.print_exc()
        recorder = RunRecorder(cfg, devices=cfg.gpus, device_kind="", params=0, is_main=True,
                               packages=PACKAGES)
        recorder.fail(f"{type(exc).__name__}: {exc}")
        recorder.finish()
        return 1
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
