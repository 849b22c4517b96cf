"""flax-imagenet: the training loop of the Flax ImageNet example (pmap era), on our work.

    python -m tutorials.flax_imagenet --preset throughput --gpus 2 --no-augment

Source: google/flax, examples/imagenet/train.py as of commit 594b4529 (2022; the last layout
with `jax.pmap`, `flax.jax_utils.replicate` and `prefetch_to_device`, Optax and a Flax
TrainState), with its input_pipeline.py (`create_split`) and configs/default.py
(`log_every_steps = 100`, `steps_per_eval = -1`). Compared with jax-pmap, which grew out of it.

The example's loop, kept here in its order (the lines that cost time are marked):
- Input: tf.data reads, shuffles through a 16 x batch buffer, decodes and normalises on its own
  threads, batches with `drop_remainder=True` and prefetches 10 batches; `prepare_tf_data`
  reshapes every host batch to (devices, B / devices, ...), and
  `jax_utils.prefetch_to_device(it, 2)` puts it on the devices two steps ahead [cost: an
  `np.stack` host copy of every batch in the main thread, then the transfer]. Here a numpy
  generator (the trainers' per-epoch permutation, normalised with the dataset constants) runs
  on a background thread 10 batches ahead in place of tf.data.
- State: a TrainState with `batch_stats`, `jax_utils.replicate`d to every device. The pmapped
  step is not donated [cost: fresh buffers for the whole state every step].
- Step (module-level `train_step`, pmapped over the axis 'batch'): the loss with
  `mutable=['batch_stats']` plus an L2 penalty over every kernel in the loss [cost: a sum of
  squares over the weights, forward and backward], `lax.pmean` of the gradients,
  `compute_metrics` (loss and accuracy recomputed from the logits and `lax.pmean`'d: two more
  collectives per step), `apply_gradients`.
- Per step `train_metrics.append(metrics)`; every `log_every_steps` (100, global steps)
  `common_utils.get_metrics` [cost: a device_get, the host sync that drains the queue] and a
  log line.
- Every `steps_per_epoch` steps: `sync_batch_stats` (a pmapped pmean of the BN statistics,
  done even when BN is synchronised; its axis is named 'batch' here, see DEVIATIONS), then
  `steps_per_eval = n_test // batch_size` steps of the pmapped `eval_step` over a repeated
  test iterator batched like training (the global TRAINING batch, `drop_remainder=True`: the
  last n_test % batch_size test images are never evaluated, and `test_examples` in the record
  says how many were), then `get_metrics` [one device_get].

Timing, as for every tutorial loop (tutorials/record.py): an epoch's clock starts
before its first step and stops after `jax.block_until_ready(state)` that follows
`sync_batch_stats` (our jax-pmap also averages the statistics inside its epoch clock); the
evaluation is timed separately and ends at `get_metrics`' device_get.
"""

from __future__ import annotations

import functools
import itertools
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import jax_utils
from flax.training import common_utils, train_state
from jax import lax

from common.config import Config, ConfigError
from common.datasets import Dataset, load_for
from common.pipeline import Normalizer, Prefetcher, epoch_permutation
from common.runtime import printer
from common.schedule import scaled_lr
from common.trainer import keep_measured_epochs, run_main
from frameworks.jax_models import initial_variables
from frameworks.jax_pmap import build_model
from frameworks.jax_support import (
    device_plan,
    execution,
    select_devices,
    setup_xla,  # simulated devices and XLA:CPU's kernels, as jax-pmap's setup_process
    use_device_plan,
)
from tutorials.record import (
    Tutorial,
    TutorialRecorder,
    failure_recorder,
    refuse_options,
    tutorial_steps,
)

SOURCE = (
    "Flax examples/imagenet (ResNet-50 on ImageNet with jax.pmap), train.py, "
    "https://github.com/google/flax/blob/594b4529fa84bbbba5d5031d12968d355d03850f/"
    "examples/imagenet/train.py"
)
DEVIATIONS: tuple[str, ...] = (
    "float32 precision by the benchmark's rule, as the compared trainer (TF32 off unless "
    "--tf32); JAX's default lets GPU matmuls and convolutions use TF32",
    "data come from common.datasets arrays instead of tensorflow_datasets' ImageNet (no "
    "download here); no JPEG decoding, no random-resized crop or flip (the driver runs "
    "--no-augment on both sides)",
    "a numpy generator on a background thread, 10 batches ahead (common.pipeline.Prefetcher), "
    "replaces tf.data's parallel map and prefetch(10); its order is the trainers' per-epoch "
    "permutation cut into full batches instead of tf.data's repeat + shuffle(16 x batch)",
    "images normalised with the dataset's constants (ds.mean, ds.std) like our trainers, "
    "instead of the example's ImageNet RGB means",
    "model: jax-pmap's build_model (the project's ResNet-18 / WideResNet, 'train' passed "
    "explicitly) instead of the example's ResNet-50; weights from the trainers' "
    "initial_variables (--init shared: the arrays every framework starts from) instead of "
    "PRNGKey(0) and a ones input",
    "BatchNorm honours --bn like jax-pmap (default local: per-device statistics); the "
    "example's BatchNorm always uses axis_name='batch' (--bn sync)",
    "constant learning rate common.schedule.scaled_lr(...) instead of the example's linear "
    "warm-up + cosine with lr x batch / 256",
    "momentum, Nesterov and weight decay from the Config (the example: momentum 0.9, "
    "nesterov=True, an L2 penalty 0.0001 / 2 x |kernel|^2 in the loss); the penalty stays in "
    "the loss as in the example, over the same kernels our trainers decay",
    "WideResNet only: a dropout key folded from (seed, step, device) as in jax-pmap (the "
    "example's ResNet has no dropout)",
    "--gpus N pmaps over the first N local devices; the example uses every local device",
    "sync_batch_stats' pmap names its axis 'batch' (the example: 'x'): since JAX 0.8 pmap is "
    "jit + shard_map and its compile cache is keyed on the input shardings, which carry the "
    "axis name, so with 'x' p_train_step compiles once more after the first sync, inside the "
    "timed epoch 2 (measured: 8.6 s instead of 1.2 s for that epoch; epoch 3 unaffected), a "
    "one-time cost JAX's pmap of the example's time did not have",
    "one process (no multi-host split of the data), fp32 only (no half_precision / "
    "DynamicScale), no checkpoints, no clu profiler hook or metric writer (log lines are "
    "printed instead)",
    "jax.block_until_ready(state) after sync_batch_stats ends each epoch's clock (the example "
    "never waits there; without it the clock would stop with steps still queued)",
)

AXIS = "batch"  # the example's pmap axis name
LOG_EVERY_STEPS = 100  # configs/default.py: config.log_every_steps
PACKAGES = ("jax", "jaxlib", "flax", "optax")
TUTORIAL = Tutorial("flax-imagenet", SOURCE, DEVIATIONS, PACKAGES)
COMPARED = "jax-pmap"
PROG = "python -m tutorials.flax_imagenet"


class TrainState(train_state.TrainState):
    batch_stats: Any
    dropout_rng: Any = None  # WideResNet only; None leaves the ResNet's step as the example's


def cross_entropy_loss(logits: jax.Array, labels: jax.Array) -> jax.Array:
    one_hot_labels = common_utils.onehot(labels, num_classes=logits.shape[-1])
    return jnp.mean(optax.softmax_cross_entropy(logits=logits, labels=one_hot_labels))


def compute_metrics(logits: jax.Array, labels: jax.Array) -> dict[str, jax.Array]:
    """Mean loss and accuracy of the device's batch, averaged over the devices (equal shards)."""
    metrics = {
        "loss": cross_entropy_loss(logits, labels),
        "accuracy": jnp.mean(jnp.argmax(logits, -1) == labels),
    }
    return lax.pmean(metrics, axis_name=AXIS)  # a collective per step, as in the example


def train_step(
    state: TrainState,
    batch: dict[str, jax.Array],
    learning_rate_fn: Callable[[jax.Array], jax.Array],
    weight_decay: float,
) -> tuple[TrainState, dict[str, jax.Array]]:
    """The example's step: loss + L2 penalty, pmean'd gradients, pmean'd metrics, update."""
    rngs = None
    if state.dropout_rng is not None:  # the same masks as jax-pmap: (seed, step, device)
        key = jax.random.fold_in(state.dropout_rng, state.step)
        rngs = {"dropout": jax.random.fold_in(key, lax.axis_index(AXIS))}

    def loss_fn(params: Any) -> tuple[jax.Array, tuple[Any, jax.Array]]:
        logits, new_model_state = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            batch["image"],  # (B / N, H, W, C): this device's shard
            train=True,
            rngs=rngs,
            mutable=["batch_stats"],
        )
        loss = cross_entropy_loss(logits, batch["label"])
        # Kernels (ndim > 1) only: conv and linear weights, as our trainers' decay mask.
        weight_l2: Any = sum(jnp.sum(x**2) for x in jax.tree_util.tree_leaves(params) if x.ndim > 1)
        return loss + weight_decay * 0.5 * weight_l2, (new_model_state, logits)

    lr = learning_rate_fn(state.step)  # type: ignore[arg-type]
    aux, grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    # The all-reduce, over the axis named in the jax.pmap(..., axis_name=AXIS) in train().
    grads = lax.pmean(grads, axis_name=AXIS)
    new_model_state, logits = aux[1]
    metrics = compute_metrics(logits, batch["label"])
    metrics["learning_rate"] = lr
    new_state = state.apply_gradients(grads=grads, batch_stats=new_model_state["batch_stats"])
    return new_state, metrics


def eval_step(state: TrainState, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    variables = {"params": state.params, "batch_stats": state.batch_stats}
    logits = state.apply_fn(variables, batch["image"], train=False, mutable=False)
    return compute_metrics(logits, batch["label"])


def host_batches(
    ds: Dataset, batch_size: int, train: bool, seed: int
) -> Iterator[dict[str, np.ndarray]]:
    """Endless full batches {'image': (B, H, W, C) float32, 'label': (B,) int32}, like the
    example's repeated tf.data splits: training reshuffles every pass (the trainers' order),
    the test set repeats in order; both drop the last partial batch of a pass."""
    x, y = (ds.train_x, ds.train_y) if train else (ds.test_x, ds.test_y)
    norm = Normalizer(ds.mean, ds.std, "NHWC")
    for epoch in itertools.count():
        order = epoch_permutation(seed, epoch, len(x)) if train else np.arange(len(x))
        for i in range(len(x) // batch_size):
            idx = order[i * batch_size : (i + 1) * batch_size]
            yield {"image": norm(x[idx]), "label": y[idx]}


def prepare_data(xs: dict[str, np.ndarray], n_devices: int) -> dict[str, np.ndarray]:
    """(B, ...) -> (devices, B / devices, ...), the example's `prepare_tf_data` (a view)."""
    return jax.tree_util.tree_map(lambda x: x.reshape((n_devices, -1) + x.shape[1:]), xs)


def create_input_iter(
    source: Iterator[dict[str, np.ndarray]], devices: list[jax.Device]
) -> Iterator[dict[str, jax.Array]]:
    it = map(functools.partial(prepare_data, n_devices=len(devices)), source)
    return jax_utils.prefetch_to_device(it, 2, devices)  # np.stack + device_put, 2 steps ahead


def sync_batch_stats(state: TrainState, cross_replica_mean: Callable[[Any], Any]) -> TrainState:
    """Every replica's running BN statistics -> their mean (the example does it before eval)."""
    return state.replace(batch_stats=cross_replica_mean(state.batch_stats))


def create_train_state(
    cfg: Config,
    model: Any,
    image_shape: tuple[int, int, int],
    learning_rate_fn: Callable[[jax.Array], jax.Array],
) -> TrainState:
    """The example's create_train_state: parameters, BN statistics and optax.sgd (on the host;
    `jax_utils.replicate` puts it on the devices)."""
    variables = initial_variables(cfg, model, image_shape)  # jax-pmap's initial weights
    tx = optax.sgd(learning_rate_fn, momentum=cfg.momentum or None, nesterov=cfg.nesterov)
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=tx,
        batch_stats=variables["batch_stats"],
        dropout_rng=jax.random.PRNGKey(cfg.seed) if cfg.model == "wideresnet" else None,
    )


def check_supported(cfg: Config) -> None:
    """Refuse what the example's loop has no equivalent for (ConfigError: one line, exit 2)."""
    refuse_options(
        cfg,
        "the Flax ImageNet example's loop",
        (cfg.label_smoothing > 0, "--label-smoothing", "--label-smoothing 0"),
    )


def train(cfg: Config) -> dict:
    """The example's train_and_evaluate on our work; returns the tutorial record."""
    ds = load_for(cfg)
    steps = tutorial_steps(cfg, len(ds.train_x))  # a batch larger than the data: one line
    steps_per_eval = len(ds.test_x) // cfg.batch_size  # the example's steps_per_eval = -1
    if steps_per_eval < 1:
        raise ConfigError(
            f"the example evaluates full test batches of the training batch size: "
            f"{len(ds.test_x)} test images < --batch-size {cfg.batch_size}; use a smaller "
            "--batch-size or more test images"
        )
    devices, kind, platform = select_devices(cfg.gpus)  # the first device query: JAX starts
    plan = device_plan(cfg, platform)  # as jax-pmap's (fp32 only: refuse_options)
    use_device_plan(plan)
    log = printer(True)
    model = build_model(cfg, ds.channels, ds.num_classes, plan.compute_dtype)
    learning_rate_fn = optax.constant_schedule(
        scaled_lr(cfg.lr, cfg.batch_size, cfg.lr_base_batch, cfg.lr_scaling)
    )
    state = create_train_state(cfg, model, ds.image_shape, learning_rate_fn)
    state = jax_utils.replicate(state, devices)
    recorder = TutorialRecorder(cfg, TUTORIAL, ds, devices=len(devices), device_kind=kind)
    recorder.execution = execution("pmap (one XLA program per device)", devices)
    # tf.data stand-ins: host batches assembled on background threads, 10 ahead.
    train_source = Prefetcher(host_batches(ds, cfg.batch_size, True, cfg.seed), depth=10)
    eval_source = Prefetcher(host_batches(ds, cfg.batch_size, False, cfg.seed), depth=10)
    train_iter = create_input_iter(train_source, devices)
    eval_iter = create_input_iter(eval_source, devices)
    p_train_step = jax.pmap(
        functools.partial(
            train_step, learning_rate_fn=learning_rate_fn, weight_decay=cfg.weight_decay
        ),
        axis_name=AXIS,
        devices=devices,
    )
    p_eval_step = jax.pmap(eval_step, axis_name=AXIS, devices=devices)
    cross_replica_mean = jax.pmap(lambda x: lax.pmean(x, AXIS), AXIS, devices=devices)
    num_steps = steps * cfg.epochs
    # Stops the prefetch threads on the way out; a failure keeps the epochs measured so far.
    with keep_measured_epochs(recorder), closing(train_source), closing(eval_source):
        train_metrics: list[dict[str, jax.Array]] = []
        train_metrics_last_t = time.time()
        t0 = time.perf_counter()
        for step, batch in zip(range(num_steps), train_iter):
            state, metrics = p_train_step(state, batch)
            if LOG_EVERY_STEPS:
                train_metrics.append(metrics)
                if (step + 1) % LOG_EVERY_STEPS == 0:
                    stacked = common_utils.get_metrics(train_metrics)  # host sync
                    summary = {
                        f"train_{k}": float(v)
                        for k, v in jax.tree_util.tree_map(lambda x: x.mean(), stacked).items()
                    }
                    summary["steps_per_second"] = LOG_EVERY_STEPS / (
                        time.time() - train_metrics_last_t
                    )
                    log(f"step {step + 1} " + " ".join(f"{k}={v:.4g}" for k, v in summary.items()))
                    train_metrics = []
                    train_metrics_last_t = time.time()
            if (step + 1) % steps == 0:
                state = sync_batch_stats(state, cross_replica_mean)
                jax.block_until_ready(state)  # the epoch's clock stops when its work is done
                sec = time.perf_counter() - t0
                t_eval = time.perf_counter()
                eval_metrics = []
                for _ in range(steps_per_eval):
                    eval_batch = next(eval_iter)
                    eval_metrics.append(p_eval_step(state, eval_batch))
                stacked = common_utils.get_metrics(eval_metrics)  # host sync, once
                summary = jax.tree_util.tree_map(lambda x: float(x.mean()), stacked)
                eval_sec = time.perf_counter() - t_eval
                total = steps_per_eval * cfg.batch_size  # the evaluated images, not n_test
                recorder.end_epoch(
                    sec, steps * cfg.batch_size, eval_sec, summary["accuracy"] * total, total
                )
                t0 = time.perf_counter()
        # The example's last line: wait until computations are done before exiting.
        jax.random.normal(jax.random.PRNGKey(0), ()).block_until_ready()
    return recorder.finish()


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m tutorials.flax_imagenet --help` (the trainers' flags).
    Exit 0 ok, 1 failed, 2 bad input."""
    fail = failure_recorder(TUTORIAL)
    setup = setup_xla  # before JAX starts, as jax-pmap
    return run_main(argv, COMPARED, prog=PROG, setup=setup, check=check_supported, train=train,
                    on_failure=fail)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
