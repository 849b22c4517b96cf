"""mxnet-gluon: synchronous data parallelism in one process with Gluon's `split_and_load`.

Each step loads one global batch, splits it into equal per-device slices
(`gluon.utils.split_and_load`), runs forward and backward on every context under one
`autograd.record()`, and `Trainer.step(global_batch)` sums the per-context gradients through the
kvstore ("device": reduced on a device, then broadcast back) and applies the same update on every
replica, rescaled by 1/global_batch. Contexts are the visible GPUs where an MXNet CUDA build is
installed, otherwise `[mx.cpu(0), ..., mx.cpu(N-1)]`: N CPU contexts, each with its own engine
worker thread, sharing the host's cores ("cpu-simulated").

Where MXNet differs from the torch trainers, each stated and none hidden: torch's SGD rule
(`TorchSGD`: MXNet's own multiplies the LR into the momentum buffer), per-context BN statistics
averaged over the contexts at the end of every epoch (biased running variance, updated in the
backward pass), `--bn sync` on GPUs only, fp32 only, OpenMP threads set before MXNet loads.
MXNet 1.9.1 is retired: its own environment (.venv-mxnet, numpy 1.23.5), CUDA wheels up to
cu117 with no code for Hopper GPUs, and no multi-node path here. All of it: docs/mxnet.md.

Run: `.venv-mxnet/bin/python -m frameworks.mxnet_gluon --preset digits --gpus 2`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from common.config import Config, ConfigError
from common.interrupts import exit_after
from common.pipeline import EvalLoader, TrainLoader
from common.results import host_info
from common.run import Run
from common.runtime import cpu_threads, set_omp_threads
from common.schedule import lr_table_for
from common.trainer import run_main, should_log
from frameworks.profilers import MxnetProfiler

if TYPE_CHECKING:
    from frameworks.mxnet_support import TrainState

# mxnet (and frameworks.mxnet_models and mxnet_support, which import it) is imported inside the
# functions: MXNet reads OMP_NUM_THREADS once, when it is loaded, and setup() sets it first.

FRAMEWORK = "mxnet-gluon"
PACKAGES = ("mxnet",)


# ---- model ---------------------------------------------------------------------------------


def build_model(cfg: Config, in_channels: int, num_classes: int) -> Any:
    """Build `cfg.model` for `in_channels`-channel images and `num_classes` classes."""
    from frameworks.mxnet_models import create_model

    # --bn sync: Gluon's SyncBatchNorm over cfg.gpus GPUs (check_config rejects it on CPU).
    return create_model(
        cfg.model,
        in_channels,
        num_classes,
        cfg.width,
        cfg.dropout,
        cfg.bn_momentum,
        cfg.bn_eps,
        sync_devices=cfg.gpus if cfg.bn == "sync" else 0,
    )


# ---- state ---------------------------------------------------------------------------------


def create_train_state(cfg: Config, model: Any, ctx: list[Any], steps_per_epoch: int) -> TrainState:
    """Create the parameters, optimiser state and step counter; place them on the devices."""
    import mxnet as mx
    from mxnet import gluon

    from frameworks.mxnet_models import initialize
    from frameworks.mxnet_support import NovoGrad, SoftmaxCrossEntropy, TorchSGD, TrainState

    # Initialised once on the CPU from mx.random's seeded generator, then copied to every
    # context: identical replicas, and the same weights at any device count.
    mx.random.seed(cfg.seed)
    model.initialize(ctx=ctx)
    initialize(cfg, model)  # --init shared: the arrays every framework starts from
    # One cached graph per context; static_alloc/static_shape reuse its buffers every step.
    model.hybridize(static_alloc=True, static_shape=True)
    # Weight decay: conv and linear weights only (create_model set wd_mult 0 on the rest).
    if cfg.optimizer == "sgd":  # buf = m * buf + (g + wd * w); w -= lr * buf
        optimizer = TorchSGD(
            momentum=cfg.momentum, nesterov=cfg.nesterov, wd=cfg.weight_decay, learning_rate=cfg.lr
        )
    else:
        b1, b2 = cfg.novograd_betas
        optimizer = NovoGrad(beta1=b1, beta2=b2, wd=cfg.weight_decay, learning_rate=cfg.lr)
    # kvstore "device": Trainer.allreduce_grads() pushes every context's gradient, sums them on a
    # device and pulls the sum back into every context (one pushpull per parameter). With
    # update_on_kvstore=False each context then applies the same update to its own replica (as
    # DDP does), and the all-reduce and the update can be timed apart. One context: no kvstore.
    # Only the trainable parameters: the Trainer sets its kvstore up lazily, at the first step(),
    # and then copies context 0's values of every parameter it holds over the other contexts.
    # Given the BN running statistics too, that overwrote each context's first update of them
    # (made in step 1's backward pass) with context 0's, or with the initial values.
    trainable = {n: p for n, p in model.collect_params().items() if p.grad_req != "null"}
    trainer = gluon.Trainer(trainable, optimizer, kvstore="device", update_on_kvstore=False)
    loss = SoftmaxCrossEntropy(cfg.label_smoothing)
    loss.hybridize(static_alloc=True, static_shape=True)
    return TrainState(
        model=model,
        trainer=trainer,
        loss=loss,
        lr=lr_table_for(cfg, steps_per_epoch),
        step=0,
        cfg=cfg,
        ctx=ctx,
        host=mx.cpu_pinned() if ctx[0].device_type == "gpu" else mx.cpu(),
    )


# ---- step: where gradients are averaged ----------------------------------------------------


def to_device(batch: tuple[np.ndarray, ...], state: TrainState) -> tuple[list[Any], ...]:
    """The data-parallel split before every step (d2l's `split_batch`): numpy global batch ->
    one contiguous slice per context (gluon.utils.split_and_load), staged in host (pinned, on
    GPUs) memory so each device gets its own host-to-device copy. Labels as float32 (compared
    with argmax, which MXNet returns as float). Asynchronous."""
    import mxnet as mx
    from mxnet.gluon.utils import split_and_load

    return tuple(
        split_and_load(
            mx.nd.array(a, ctx=state.host, dtype="float32"),
            state.ctx,
            batch_axis=0,
            even_split=True,
        )
        for a in batch
    )


def train_step(
    state: TrainState, batch: tuple[list[Any], list[Any]]
) -> tuple[TrainState, dict[str, Any]]:
    """One synchronous data-parallel SGD step on a global batch.

    Returns the new state and metrics {"loss_sum", "correct", "count"} summed over the global
    batch and left on the device (read only at log points: no per-step host sync)."""
    import mxnet as mx
    from mxnet import autograd

    xs, ys = batch  # one slice per context (split_and_load): (B/N, C, H, W), (B/N,)
    state.trainer.set_learning_rate(float(state.lr[state.step]))  # a host array: no sync
    with state.phases.phase("forward_backward"):
        with autograd.record():  # train mode: batch statistics, dropout on
            logits = [state.model(x) for x in xs]  # (B/N, K) on each context
            losses = [state.loss(o, y) for o, y in zip(logits, ys)]  # (B/N,) per example
        # Gradient of the SUM of the per-example losses, on every context; the engine runs the
        # contexts concurrently (one worker thread per device).
        autograd.backward(losses)
    global_batch = sum(x.shape[0] for x in xs)
    if state.phases.enabled:
        with state.phases.phase("allreduce"):
            state.trainer.allreduce_grads()  # kvstore pushpull: gradients SUMMED over contexts
        with state.phases.phase("optimizer"):
            state.trainer.update(global_batch)  # rescale_grad = 1 / global_batch
    else:
        # = allreduce_grads() + update(): the gradients summed over the contexts, scaled by
        # 1/global_batch (rescale_grad) inside the update: the gradient of the global-batch mean.
        state.trainer.step(global_batch)
    state.step += 1
    # Global-batch sums gathered on context 0: asynchronous copies of one number per context.
    home = state.ctx[0]
    metrics = {
        "loss_sum": mx.nd.add_n(*[loss.sum().as_in_context(home) for loss in losses]),
        "correct": mx.nd.add_n(
            *[(o.argmax(axis=1) == y).sum().as_in_context(home) for o, y in zip(logits, ys)]
        ),
        "count": mx.nd.full((1,), global_batch, ctx=home),
    }
    return state, metrics


def eval_step(state: TrainState, batch: tuple[list[Any], list[Any], list[Any]]) -> dict[str, Any]:
    """Metrics {"loss_sum", "correct", "count"} of a test batch; rows of weight 0 (padding) do
    not count."""
    import mxnet as mx

    xs, ys, ws = batch  # one slice per context: (B/N, C, H, W), (B/N,), (B/N,)
    home = state.ctx[0]
    sums: dict[str, list[Any]] = {"loss_sum": [], "correct": [], "count": []}
    for x, y, w in zip(xs, ys, ws):
        logits = state.model(x)  # not recording: predict mode (running statistics, no dropout)
        sums["loss_sum"].append((state.loss(logits, y) * w).sum().as_in_context(home))
        sums["correct"].append(((logits.argmax(axis=1) == y) * w).sum().as_in_context(home))
        sums["count"].append(w.sum().as_in_context(home))
    return {k: mx.nd.add_n(*v) for k, v in sums.items()}


def sync_batch_stats(state: TrainState) -> None:
    """Per-context BN (--bn local): every replica's running statistics -> their mean over the
    replicas (what Gluon's own save_parameters would store), so that evaluation and the
    checkpoint do not depend on which context saw which images. A no-op for sync BN, whose
    replicas already agree, and for one context."""
    import mxnet as mx

    if len(state.ctx) == 1:
        return
    # Wait for the last backward first: with static_alloc, the cached graph's writes to the
    # running statistics (made in the backward pass) are not ordered before later reads by the
    # engine in 1.9.1; without this sync the averages varied from run to run.
    mx.nd.waitall()
    for p in state.model.collect_params().values():
        if p.grad_req == "null":  # running_mean, running_var
            copies = [d.as_in_context(state.ctx[0]) for d in p.list_data()]
            p.set_data(mx.nd.add_n(*copies) / len(copies))


# ---- devices: processes, replicas and shards -----------------------------------------------


def select_devices(n: int) -> tuple[list[Any], str]:
    """`n` contexts and the device kind: GPUs where this MXNet build has CUDA and GPUs are
    visible, otherwise n CPU contexts sharing the host's cores ("cpu-simulated")."""
    import mxnet as mx

    if mx.runtime.Features().is_enabled("CUDA") and mx.context.num_gpus() > 0:
        visible = mx.context.num_gpus()
        if n > visible:
            raise ConfigError(
                f"--gpus {n} but only {visible} GPUs are visible; use --gpus {visible} or fewer"
            )
        names = host_info().get("gpus") or ["GPU"]  # MXNet has no device-name query
        return [mx.gpu(i) for i in range(n)], f"cuda:{names[0]}"
    return [mx.cpu(i) for i in range(n)], "cpu-simulated"


def train_put(loader: TrainLoader, state: TrainState) -> Callable[..., tuple[list[Any], ...]]:
    """The step's batch on the contexts, from what `loader` yields. Host pipeline: `to_device`
    (split_and_load). Device pipeline: the uint8 training set on every context, and each
    context's crops gathered there from its slice of the indices: what split_and_load would
    have given it (mxnet_support.resident_put)."""
    if not loader.on_device:
        return lambda batch: to_device(batch, state)
    from frameworks.mxnet_support import resident_put

    return resident_put(loader, state)


def evaluate(state: TrainState, loader: EvalLoader) -> dict[str, float]:
    """Test sums over every test image exactly once (batches padded with weight-0 rows to a
    multiple of the context count); one host read at the end."""
    totals: dict[str, Any] = {}
    for batch in loader:
        metrics = eval_step(state, to_device(batch, state))
        totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
    return {k: float(v.asscalar()) for k, v in totals.items()}  # host sync, once


# ---- train: where time is measured ---------------------------------------------------------


def train(cfg: Config) -> dict:
    """Train `cfg.model` on `cfg.dataset` over `cfg.gpus` devices; return the run-result record."""
    import mxnet as mx

    from frameworks.mxnet_support import MAX_ELEMENTS, canonical_state, seed_for, start_run, sync

    ctx, kind = select_devices(cfg.gpus)
    gpu = ctx[0].device_type == "gpu"
    # rank 0 of 1: this process reads every global batch and splits it over the contexts.
    run = Run(cfg, FRAMEWORK, PACKAGES, layout="NCHW", gpu=gpu, sync=sync, pad_to=len(ctx),
              device_bytes=MAX_ELEMENTS, profiler=MxnetProfiler)  # fmt: skip
    model = build_model(cfg, run.ds.channels, run.ds.num_classes)
    state = create_train_state(cfg, model, ctx, len(run.loader))
    # The record (OpenMP threads per context), --compile's note, --resume.
    state, start = start_run(run, state, kind)
    put = train_put(run.loader, state)  # --pipeline device: the training set goes over here
    with run.measured():
        for epoch in range(start, cfg.epochs):
            mx.random.seed(seed_for(cfg.seed, epoch), ctx="all")  # dropout masks
            run.timer.start()
            batches = run.batches(epoch)
            totals: dict[str, Any] = {}
            for host_batch in batches:
                with state.phases.phase("h2d"):
                    batch = put(host_batch)
                state, metrics = train_step(state, batch)
                state.phases.steps += 1
                totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
                if should_log(cfg, state.step):  # host sync: log point
                    loss = totals["loss_sum"].asscalar() / totals["count"].asscalar()  # host sync
                    run.log(f"step {state.step} train_loss={loss:.4f}")
            if cfg.bn == "local":  # replicas' running statistics -> their mean (see docstring)
                sync_batch_stats(state)
            sec = run.timer.stop()
            train_sums = {k: float(v.asscalar()) for k, v in totals.items()}  # host sync, once
            test = evaluate(state, run.evals)
            if run.end_epoch(epoch, state, sec, batches.wait_sec, train_sums, test):
                break  # the target held, or diverged
    return run.finish(lambda: canonical_state(state))  # --save-state


# ---- main ----------------------------------------------------------------------------------


def setup(cfg: Config) -> None:
    """Before mxnet is loaded (it reads the thread count once); unset, MXNet used one of the
    cores here. Every context has its own engine worker running its own OpenMP team, so the
    contexts share the cores: 2 cores, 2 contexts -> 1 thread each (2 each was up to 1.5x
    slower). MXNet runs every operator as its own OpenMP region: with the default (spinning)
    wait, a team thread that another process preempts stalls every barrier (on 2 shared cores a
    full-width ResNet-18 step took 1.9-2.9 s with 2 spinning threads, 0.54-0.80 s passive; on an
    idle machine the two measured the same, 398 vs 405 ms), hence PASSIVE unless set."""
    set_omp_threads(cpu_threads(cfg.gpus))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if not cfg.tf32:  # cuBLAS and cuDNN read it: full fp32 on GPUs, as in every framework
        os.environ["NVIDIA_TF32_OVERRIDE"] = "0"


def check_config(cfg: Config) -> None:
    """MXNet-specific checks before training starts (ConfigError / DatasetError)."""
    from frameworks.mxnet_support import check_inputs

    check_inputs(cfg)  # --devices cuda needs an MXNet that sees a GPU; the data; --resume
    ctx, _ = select_devices(cfg.gpus)
    if cfg.bn == "sync" and ctx[0].device_type != "gpu":
        raise ConfigError(
            "--bn sync needs GPUs: Gluon's SyncBatchNorm deadlocks on CPU contexts "
            "in MXNet 1.9.1; use --bn local"
        )
    if cfg.precision != "fp32":  # on every device: a CPU run checks the path a GPU runs
        raise ConfigError(
            f"mxnet-gluon trains in fp32 only (got --precision {cfg.precision}; MXNet 1.9's "
            "AMP is not wired here); use --precision fp32"
        )


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m frameworks.<module> --help`. Exit 0 ok, 1 failed/diverged, 2 bad input."""  # noqa: E501
    return run_main(
        argv, FRAMEWORK, setup=setup, check=check_config, train=train, packages=PACKAGES
    )


if __name__ == "__main__":
    exit_after(main())  # after a stop: ends without finalization (common/interrupts.py)
