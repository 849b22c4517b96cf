"""jax-fsdp: jax-shard's `jax.jit` over a 1-D mesh with the state sharded too (FSDP, ZeRO-3).

    python -m frameworks.jax_fsdp --preset digits --gpus 2     # 2 GPUs, or 2 simulated CPU devices

The step is written for the global batch, as on one device. The parameters and optimiser state are
split over a mesh with one axis, "batch" (`fsdp_sharding`; BN statistics too), as the batch is
(NamedSharding(mesh, P("batch"))): between steps each device keeps about 1/N of the state. XLA's
SPMD partitioner all-gathers the parameters for the step and reduce-scatters the gradients onto
their shards (XLA:CPU: an all-reduce, then each device's slice). One JAX process only: process 0
alone checkpoints, and it cannot read the other processes' shards.

BatchNorm under jit normalises over the global batch (a mean over a sharded axis is a cross-device
reduction): `--bn sync`. `--bn local` runs the forward pass under `jax.shard_map`, each device with
its own statistics (`per_device_bn`: why no pmean of the gradients may be added there).

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

from common.config import Config, ConfigError
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

FRAMEWORK = "jax-fsdp"
PACKAGES = ("jax", "jaxlib", "flax", "optax")
AXIS = "batch"  # the mesh axis the batch is split along


# ---- model ---------------------------------------------------------------------------------


def build_model(cfg: Config, in_channels: int, num_classes: int, dtype: Any) -> nn.Module:
    """Build `cfg.model` for `in_channels`-channel images and `num_classes` classes."""
    del in_channels  # Flax infers the input channels at init (create_train_state)
    bn_axis_name = None  # under jit BN spans the global batch; per device: see per_device_bn
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
        apply_fn=per_device_bn(model, mesh) if cfg.bn == "local" else model.apply,
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
    x, y = batch  # the global batch, split over the mesh: (B, H, W, C), (B,)
    # Dropout masks differ per step and depend on (seed, step) only: resumable.
    key = jax.random.fold_in(state.key, state.step)

    def loss_fn(params: Any) -> tuple[jax.Array, tuple[jax.Array, jax.Array, Any]]:
        variables = {"params": params, "batch_stats": state.batch_stats}
        logits, updates = state.apply_fn(
            variables, x, train=True, rngs={"dropout": key}, mutable=["batch_stats"]
        )
        losses = cross_entropy(logits, y, state.label_smoothing)  # (B,)
        return losses.mean(), (logits, losses, updates["batch_stats"])

    # The all-reduce is implicit: the parameters are replicated and the batch is sharded, so
    # XLA sums the per-device partial gradients over the mesh axis AXIS ("batch").
    grads, (logits, losses, batch_stats) = jax.grad(loss_fn, has_aux=True)(state.params)
    state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
    metrics = {
        "loss_sum": losses.sum(),
        "correct": (jnp.argmax(logits, -1) == y).sum().astype(jnp.float32),
        "count": jnp.asarray(y.shape[0], jnp.float32),
    }
    return state, metrics  # global-batch sums, replicated


def eval_step(
    state: TrainState, batch: tuple[jax.Array, jax.Array, jax.Array]
) -> dict[str, jax.Array]:
    """Metrics {"loss_sum", "correct", "count"} of a test batch; rows of weight 0 (padding) do
    not count."""
    x, y, w = batch  # the global test batch, split over the mesh: (B, H, W, C), (B,), (B,)
    logits = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats}, x, train=False
    )
    return {
        "loss_sum": (cross_entropy(logits, y, state.label_smoothing) * w).sum(),
        "correct": ((jnp.argmax(logits, -1) == y) * w).sum(),
        "count": w.sum(),
    }


# ---- devices: processes, replicas and shards -----------------------------------------------


def parallelize(plan: DevicePlan, mesh: Mesh) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """The parallel transform, applied once: jit with the state sharded and the batch split
    over the mesh; XLA inserts the collectives. (`plan`: the run's jax_support.device_plan.)"""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))

    def fsdp_step(state: TrainState, batch: Any) -> tuple[TrainState, dict[str, jax.Array]]:
        # All-gather the parameters for the step (not left to XLA: it splits some convolutions
        # by channel on small batches); the new state back onto its shards.
        whole = state.replace(params=lax.with_sharding_constraint(state.params, replicated))
        state, metrics = train_step(whole, batch)
        shards = jax.tree.map(lambda a: fsdp_sharding(a, mesh), state)
        return lax.with_sharding_constraint(state, shards), metrics

    p_train_step = jax.jit(
        fsdp_step,
        in_shardings=(None, split),  # None: the state's own shardings (replicate's)
        out_shardings=(None, replicated),
        donate_argnums=plan.donate,  # GPUs: the state updated in place
    )
    p_eval_step = jax.jit(eval_step, in_shardings=(None, split), out_shardings=replicated)
    return p_train_step, p_eval_step


def fsdp_sharding(a: Any, mesh: Mesh) -> NamedSharding:
    """Split along the largest dimension the device count divides; replicated where none does."""
    n, shape = mesh.shape[AXIS], np.shape(a)
    dims = sorted((-shape[d], d) for d in range(len(shape)) if shape[d] % n == 0)
    return NamedSharding(mesh, P(*[None] * dims[0][1], AXIS) if dims else P())


def per_device_bn(model: nn.Module, mesh: Mesh) -> Callable[..., Any]:
    """`model.apply` with per-device BatchNorm in training mode (`--bn local`).

    The forward pass runs under jax.shard_map: each device applies the model to its shard
    (B/N, ...) with the replicated variables, so BN normalises with that shard's statistics.
    The running statistics come back pmean'd (replicated again): this is jax-shard's
    `sync_batch_stats`, done inside every step rather than once per epoch. Gradients flow back
    through the shard_map; with check_vma=True its transpose sums the replicated parameters'
    gradient over the devices, so the caller's global-batch mean loss gets the right gradient
    unchanged: no pmean of the gradients may be added (the pmap idiom, a per-device mean loss
    plus pmean, would scale the update by the device count; a test compares with jax-pmap).
    """

    def apply(
        variables: Any, x: jax.Array, train: bool = False, rngs: Any = None, mutable: Any = False
    ) -> Any:
        if not train:  # running averages: nothing per device
            return model.apply(variables, x, train=False)

        def local(variables: Any, x: jax.Array, key: jax.Array) -> tuple[jax.Array, Any]:
            key = jax.random.fold_in(key, lax.axis_index(AXIS))  # other masks on every device
            logits, updates = model.apply(
                variables, x, train=True, rngs={"dropout": key}, mutable=mutable
            )
            return logits, lax.pmean(updates, AXIS)  # (B/N, K), replicated statistics

        return jax.shard_map(
            local, mesh=mesh, in_specs=(P(), P(AXIS), P()), out_specs=(P(AXIS), P())
        )(variables, x, rngs["dropout"])

    return apply


def cross_device_sum(mesh: Mesh) -> Callable[[Any], Any]:
    """Phase timing only: an all-reduce of a replicated tree (check_vma=False: every device's
    copy counts as its own partial sum, as the gradients inside the step do)."""
    return jax.jit(
        jax.shard_map(
            lambda t: lax.psum(t, AXIS), mesh=mesh, in_specs=P(), out_specs=P(), check_vma=False
        )
    )


def parallel_batches(make_batch: Callable[..., Any], mesh: Mesh) -> Callable[..., Any]:
    """--pipeline device: `make_batch` (jax_support.batch_maker) under jit, the training set
    replicated and the indices split over the mesh: each device gathers its own rows."""
    replicated, split = NamedSharding(mesh, P()), NamedSharding(mesh, P(AXIS))
    return jax.jit(make_batch, in_shardings=(replicated, *[split] * 4), out_shardings=split)


def replicate(tree: Any, mesh: Mesh) -> Any:
    """A TrainState split over the mesh by `fsdp_sharding`, anything else replicated (P())."""
    sharding, shard = NamedSharding(mesh, P()), isinstance(tree, TrainState)
    return jax.tree.map(
        lambda a: jax.device_put(np.asarray(a), fsdp_sharding(a, mesh) if shard else sharding), tree
    )


def unreplicate(tree: Any) -> Any:
    """Host (numpy) copy of every leaf, its shards gathered: a host sync."""
    return jax.tree.map(np.asarray, tree)


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
    if jax.process_count() > 1:  # process 0 alone checkpoints: it sees only its own shards
        raise ConfigError("jax-fsdp runs in one JAX process; use jax-shard across processes")
    mesh = Mesh(np.array(devices), (AXIS,))
    # The same in every JAX trainer, around this file's functions (jax_support.py): the device
    # plan, the data, the model and its state on the devices, the record, --pipeline device and
    # --resume (run.start: the first epoch to train).
    run, plan, state, put, put_train = start_run(
        cfg, FRAMEWORK, PACKAGES, mesh, kind, platform, "jit (XLA SPMD over the mesh)",
        build_model, create_train_state, replicate, unreplicate, to_device, parallel_batches, sync,
    )  # fmt: skip
    p_train_step, p_eval_step = parallelize(plan, mesh)
    j_allreduce = cross_device_sum(mesh)
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
                        jax.block_until_ready(j_allreduce(state.params))
                phases.steps += 1
                totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
                step = epoch * len(run.loader) + i + 1  # the global step, as in every trainer
                if should_log(cfg, step):  # host sync: log point
                    t = unreplicate(totals)
                    run.log(f"step {step} train_loss={t['loss_sum'] / t['count']:.4f}")
            # BN statistics: already reconciled (global by construction, or pmean'd per step).
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
