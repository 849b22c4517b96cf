"""jax-shardmap: `jax.shard_map` + `lax.pmean` over a 1-D mesh (what JAX asks for instead of pmap).

    python -m frameworks.jax_shardmap --preset digits --gpus 2  # 2 GPUs or 2 simulated CPU devices
    srun --ntasks-per-node=8 python -m frameworks.jax_shardmap --gpus 1 ...   # one process per GPU
        # (or JAX_COORDINATOR_ADDRESS=...: one per host; docs/usage.md, multi-node)

The step is written for one device's shard, as under pmap; `jax.shard_map` maps it over a 1-D mesh
with one axis, "batch": the state goes in replicated (P()), the global batch split along the axis
(P("batch")), and the step averages the gradients with `lax.pmean` over it. Unlike pmap's, the
arrays have no device axis: as in jax-shard, the state is one replicated array per leaf and the
batch one (B, ...) array. JAX 0.8 reimplemented `jax.pmap` with `jax.jit` and `jax.shard_map` and
asks new code to use shard_map. With several processes (`jax.distributed`), `--gpus` counts the
devices PER PROCESS, each feeds its part of every global batch, and process 0 alone prints, records
and checkpoints.

`--bn sync` passes the axis name to BatchNorm (statistics pmean'd over the global batch).
`--bn local` normalises with each device's own statistics; the running statistics are pmean'd
after every step, so the state stays replicated. The running average is linear, so this equals
jax-pmap's averaging once per epoch.

Known differences from the other frameworks (BN variance, test loss): docs/fairness.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.config import Config
from common.interrupts import exit_after
from common.trainer import run_main, should_log
from frameworks.jax_models import create_model, initial_variables
from frameworks.jax_support import (
    PHASE_NOTE,
    CompileMeter,
    DevicePlan,
    TrainState,
    canonical_state,
    check_config,
    cross_entropy,
    evaluate,
    make_optimizer,
    prefetch_to_devices,
    select_devices,
    setup_process,
    start_run,
)

FRAMEWORK = "jax-shardmap"
PACKAGES = ("jax", "jaxlib", "flax", "optax")
AXIS = "batch"  # the mesh axis: gradients, metrics and (--bn sync) BN statistics reduce over it


# ---- model ---------------------------------------------------------------------------------


def build_model(cfg: Config, in_channels: int, num_classes: int, dtype: Any) -> nn.Module:
    """Build `cfg.model` for `in_channels`-channel images and `num_classes` classes."""
    del in_channels  # Flax infers the input channels at init (create_train_state)
    bn_axis_name = AXIS if cfg.bn == "sync" else None  # --bn sync: BN statistics pmean'd
    return create_model(
        cfg.model, num_classes, cfg.width, cfg.dropout, cfg.bn_momentum, cfg.bn_eps, bn_axis_name,
        dtype=dtype,
    )  # fmt: skip


# ---- state ---------------------------------------------------------------------------------


def create_train_state(
    cfg: Config,
    model: nn.Module,
    image_shape: tuple[int, int, int],
    mesh: Mesh,
    steps_per_epoch: int,
) -> TrainState:
    """Create the parameters, optimiser state and step counter; place them on the devices."""
    variables = initial_variables(cfg, model, image_shape)  # same at any device count
    state = TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        batch_stats=variables["batch_stats"],
        tx=make_optimizer(cfg, variables["params"], steps_per_epoch),
        key=jax.random.PRNGKey(cfg.seed),  # dropout; raw uint32[2]: checkpoints as is
        label_smoothing=cfg.label_smoothing,
    )
    return replicate(state, mesh)


# ---- step: where gradients are averaged ----------------------------------------------------


def train_step(
    state: TrainState, batch: tuple[jax.Array, jax.Array]
) -> tuple[TrainState, dict[str, jax.Array]]:
    """One synchronous data-parallel SGD step on a global batch.

    Returns the new state and metrics {"loss_sum", "correct", "count"} summed over the global
    batch and left on the device (read only at log points: no per-step host sync)."""
    x, y = batch  # this device's shard (shard_map splits the batch): (B/N, H, W, C), (B/N,)
    # Dropout masks differ per step and per device, and depend on (seed, step) only: resumable.
    key = jax.random.fold_in(jax.random.fold_in(state.key, state.step), lax.axis_index(AXIS))

    def loss_fn(params: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array, Any]]:
        variables = {"params": params, "batch_stats": state.batch_stats}
        logits, updates = state.apply_fn(
            variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
        )
        losses = cross_entropy(logits, y, state.label_smoothing)  # (B/N,)
        return losses.mean(), (logits, losses, updates["batch_stats"])

    grads, (logits, losses, batch_stats) = jax.grad(loss_fn, has_aux=True)(state.params)
    # The all-reduce, over the mesh axis named AXIS ("batch"): the mean of the per-device mean
    # gradients is the gradient of the global-batch mean loss (the shards are equal in size).
    grads = lax.pmean(grads, axis_name=AXIS)
    # --bn local: each device's running statistics -> their mean (sync: already equal).
    batch_stats = lax.pmean(batch_stats, axis_name=AXIS)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    metrics = {
        "loss_sum": losses.sum(),
        "correct": (jnp.argmax(logits, -1) == y).sum().astype(jnp.float32),
        "count": jnp.asarray(y.shape[0], jnp.float32),
    }
    return state, lax.psum(metrics, axis_name=AXIS)  # global-batch sums, on every device


def eval_step(
    state: TrainState, batch: tuple[jax.Array, jax.Array, jax.Array]
) -> dict[str, jax.Array]:
    """Metrics {"loss_sum", "correct", "count"} of a test batch; rows of weight 0 (padding) do
    not count."""
    x, y, w = batch  # this device's shard: (B/N, H, W, C), (B/N,), (B/N,)
    logits = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats}, x, train=False
    )
    metrics = {
        "loss_sum": (cross_entropy(logits, y, state.label_smoothing) * w).sum(),
        "correct": ((jnp.argmax(logits, -1) == y) * w).sum(),
        "count": w.sum(),
    }
    return lax.psum(metrics, axis_name=AXIS)


# ---- devices: processes, replicas and shards -----------------------------------------------


def parallelize(plan: DevicePlan, mesh: Mesh) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The parallel transform, applied once: one program per device of the mesh, collectives
    over AXIS; a step is one fused XLA program. (`plan`: the run's jax_support.device_plan.)
    check_vma=False, pmap's meaning: a replicated input's gradient is this device's own, for
    lax.pmean to average (check_vma=True sums it over devices first: N times it; tested)."""
    per_device = lambda f, out: jax.shard_map(
        f, mesh=mesh, in_specs=(P(), P(AXIS)), out_specs=out, check_vma=False
    )
    p_train_step = jax.jit(per_device(train_step, (P(), P())), donate_argnums=plan.donate)
    p_eval_step = jax.jit(per_device(eval_step, P()))
    return p_train_step, p_eval_step


def parallel_batches(make_batch: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """--pipeline device: `make_batch` (jax_support.batch_maker) under this trainer's transform:
    one program per device, on its replica of the training set and its shard of the indices."""
    specs = (P(), *[P(AXIS)] * 4)
    return jax.jit(jax.shard_map(make_batch, mesh=mesh, in_specs=specs, out_specs=P(AXIS)))


def cross_replica_mean(mesh: Mesh) -> Callable[[Any], Any]:
    """pmean of a replicated tree over the devices (phase timing: a gradient-sized all-reduce)."""
    mean = lambda tree: lax.pmean(tree, AXIS)
    return jax.jit(jax.shard_map(mean, mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False))


def replicate(tree: Any, mesh: Mesh) -> Any:
    """The same value on every device of the mesh (NamedSharding(mesh, P()))."""
    sharding = NamedSharding(mesh, P())
    return jax.tree.map(
        lambda a: jax.make_array_from_process_local_data(sharding, np.asarray(a)), tree
    )


def unreplicate(tree: Any) -> Any:
    """Host (numpy) copy of every (replicated) leaf: a host sync."""
    return jax.tree.map(lambda a: np.asarray(a.addressable_shards[0].data), tree)


def to_device(batch: tuple[np.ndarray, ...], mesh: Mesh) -> tuple[jax.Array, ...]:
    """This process's rows of a global batch, (B_local, ...) numpy -> one (B, ...) array split
    over the mesh, B/N rows per device. Asynchronous: no sync."""
    sharding = NamedSharding(mesh, P(AXIS))
    return tuple(jax.make_array_from_process_local_data(sharding, a) for a in batch)


# ---- train: where time is measured ---------------------------------------------------------


def train(cfg: Config) -> dict:
    """Train `cfg.model` on `cfg.dataset` over `cfg.gpus` devices; return the run-result record."""

    def sync() -> None:  # waits for the newest state (late binding: the loop's current value)
        jax.block_until_ready(state)

    # The first cfg.gpus devices of every process, on a 1-D mesh whose one axis, AXIS, the
    # batch is split along.
    devices, kind, platform = select_devices(cfg.gpus)
    mesh = Mesh(np.array(devices), (AXIS,))
    # The same in every JAX trainer, around this file's functions (jax_support.py): the device
    # plan, the data, the model and its state on the devices, the record, --pipeline device and
    # --resume (run.start: the first epoch to train).
    run, plan, state, put, put_train = start_run(
        cfg, FRAMEWORK, PACKAGES, mesh, kind, platform, "shard_map (one XLA program per device)",
        build_model, create_train_state, replicate, unreplicate, to_device, parallel_batches, sync,
    )  # fmt: skip
    p_train_step, p_eval_step = parallelize(plan, mesh)
    p_mean = cross_replica_mean(mesh)
    phases = run.phases
    with run.measured():
        for epoch in range(run.start, cfg.epochs):
            run.timer.start()
            batches = run.batches(epoch)
            totals: dict[str, jax.Array] = {}
            for i, batch in enumerate(prefetch_to_devices(batches, put_train, phases)):
                # One fused XLA program: forward, backward, all-reduce and update cannot be
                # timed apart, so phase timing books the whole step as forward_backward and
                # times a separate all-reduce of a gradient-sized tree (an estimate of the part
                # inside the step; the optimiser stays inside it too).
                with phases.phase("forward_backward"):
                    state, metrics = p_train_step(state, batch)
                if phases.enabled:
                    with phases.phase("allreduce"):
                        jax.block_until_ready(p_mean(state.params))
                phases.steps += 1
                totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
                step = epoch * len(run.loader) + i + 1  # the global step, as in every trainer
                if should_log(cfg, step):  # host sync: log point
                    t = unreplicate(totals)
                    run.log(f"step {step} train_loss={t['loss_sum'] / t['count']:.4f}")
            # BN statistics: already replicated (pmean'd in every step).
            sec = run.timer.stop()
            train_sums = unreplicate(totals)  # host sync, once per epoch
            test = evaluate(p_eval_step, state, run.evals, run.eval_steps, put, unreplicate)
            if run.end_epoch(epoch, state, sec, batches.wait_sec, train_sums, test):
                break  # the target held, or diverged
    return run.finish(
        lambda: canonical_state(unreplicate(state)),  # --save-state
        **({"phase_note": PHASE_NOTE} if cfg.phase_timing else {}),
        **CompileMeter.get().record(),  # compile_sec, compile_cache
    )


# ---- main ----------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m frameworks.<module> --help`. Exit 0 ok, 1 failed/diverged, 2 bad input."""  # noqa: E501
    # setup_process: simulated devices and jax.distributed, before JAX starts (jax_support.py)
    return run_main(
        argv, FRAMEWORK, setup=setup_process, check=check_config, train=train, packages=PACKAGES
    )


if __name__ == "__main__":
    exit_after(main())  # after a stop: ends without finalization (common/interrupts.py)
