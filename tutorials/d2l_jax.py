"""d2l-jax: the training loop of Dive into Deep Learning 13.6, "Concise Implementation for
Multiple GPUs" (JAX), on this project's data, model and config; compared with jax-pmap.

    python -m tutorials.d2l_jax --preset throughput --no-augment --gpus 2

The tutorial's loop, and what each part costs:
- Input: `d2l.FashionMNIST(batch_size).get_dataloader(train)`: tf.data batches the arrays,
  scales them and hands numpy batches to the loop through `tfds.as_numpy`, one at a time, in
  the training thread (no prefetch). Every batch then goes through `np.array(X)` and
  `reshape_batch` [cost: a host copy of the batch, a view to (devices, B / devices, ...)], and
  is passed to the pmapped step as numpy [cost: pmap shards and transfers it inside the call,
  on the training thread, before the step is dispatched].
- State: a Flax TrainState with `batch_stats`, replicated by stacking every leaf
  `num_devices` times (`jnp.stack([x] * num_devices)`, on the default device; the first step
  spreads it over the devices). The step is not donated [cost: fresh buffers for the whole
  state every step].
- Step (`jax.pmap(train_step, axis_name='batch')`): the loss with `mutable=['batch_stats']`,
  `jax.value_and_grad`, `jax.lax.pmean` of the gradients, `apply_gradients`, the new
  statistics. It returns the per-device loss, which the loop never reads: no per-step host
  sync, no metric accumulation.
- BN: every device keeps its own running statistics (updated from its own shard, never
  averaged), and evaluates its shard of each test batch with them.
- Evaluation: every test batch (the training batch size, the last one partial) is reshaped the
  same way (rows beyond a multiple of the device count dropped) and goes through a pmapped
  `eval_step`; `int(c.sum())` per batch [one host sync per test batch].
Timed as every tutorial loop (tutorials/record.py): the first epoch is warm-up.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training import train_state

from common.config import Config
from common.datasets import Dataset, load_for
from common.pipeline import Normalizer, epoch_permutation
from common.trainer import keep_measured_epochs, run_main
from frameworks.jax_models import initial_variables
from frameworks.jax_pmap import build_model
from frameworks.jax_support import (
    device_plan,
    execution,
    make_optimizer,
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
    "Dive into Deep Learning, 13.6 Concise Implementation for Multiple GPUs (JAX), "
    "https://d2l.ai/chapter_computational-performance/multiple-gpus-concise.html"
)
DEVIATIONS: tuple[str, ...] = (
    "float32 precision by the benchmark's rule, as the compared trainer (TF32 off unless "
    "--tf32); JAX's default lets GPU matmuls and convolutions use TF32",
    "data come from common.datasets arrays instead of d2l.FashionMNIST's tf.data pipeline (no "
    "download here); a numpy generator in the training thread stands in for tfds.as_numpy: "
    "the trainers' per-epoch permutation cut into full batches (d2l batches first and shuffles "
    "the batches, keeping the last partial one), normalised with the dataset mean/std (d2l "
    "scales by 1/255)",
    "the model is the compared trainer's (jax-pmap build_model: our ResNet-18/WideResNet, "
    "'train' passed explicitly, BN honouring --bn) with the trainers' initial weights "
    "(--init shared) instead of d2l's ResNet18 initialised from PRNGKey(0)",
    "evaluation uses the running statistics (train=False) like our trainers; d2l's model is "
    "built with training=True and evaluates with the test batch's statistics",
    "the optimiser is jax-pmap's make_optimizer (SGD with the config's momentum and weight "
    "decay on kernels only, the LR from common.schedule: the driver forces it constant); d2l "
    "uses plain optax.sgd(lr)",
    "WideResNet only: a dropout key folded from (seed, step, device) as in jax-pmap (d2l's "
    "ResNet has no dropout)",
    "--gpus N pmaps over the first N local devices; d2l uses every local device",
    "jax.block_until_ready(state) ends each epoch's clock; d2l blocks on an unrelated "
    "jax.random.normal, which does not wait for the queued steps",
)
AXIS = "batch"  # d2l's pmap axis name
PACKAGES = ("jax", "jaxlib", "flax", "optax")
TUTORIAL = Tutorial("d2l-jax", SOURCE, DEVIATIONS, PACKAGES)
COMPARED = "jax-pmap"
PROG = "python -m tutorials.d2l_jax"


class TrainState(train_state.TrainState):
    batch_stats: Any
    dropout_rng: Any = None  # WideResNet only; None leaves the ResNet's step as d2l's


def train_step(
    state: TrainState, images: jax.Array, labels: jax.Array
) -> tuple[TrainState, jax.Array]:
    """A single training step on one device (d2l's, under jax.pmap)."""
    rngs = None
    if state.dropout_rng is not None:  # the same masks as jax-pmap: (seed, step, device)
        key = jax.random.fold_in(state.dropout_rng, state.step)
        rngs = {"dropout": jax.random.fold_in(key, jax.lax.axis_index(AXIS))}

    def loss_fn(params: Any) -> tuple[jax.Array, Any]:
        logits, updates = state.apply_fn(
            {"params": params, "batch_stats": state.batch_stats},
            images,  # (B / N, H, W, C): this device's shard
            train=True,
            rngs=rngs,
            mutable=["batch_stats"],
        )
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
        return loss, updates

    (loss, updates), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    # Average gradients across devices (the axis of the jax.pmap in train()).
    grads = jax.lax.pmean(grads, axis_name=AXIS)
    state = state.apply_gradients(grads=grads)
    state = state.replace(batch_stats=updates["batch_stats"])
    return state, loss


def eval_step(state: TrainState, images: jax.Array, labels: jax.Array) -> tuple[Any, Any]:
    """Evaluate accuracy on one device: (correct, count) of its shard."""
    logits = state.apply_fn(
        {"params": state.params, "batch_stats": state.batch_stats}, images, train=False
    )
    return (logits.argmax(axis=-1) == labels).sum(), labels.shape[0]


def reshape_batch(X: np.ndarray, y: np.ndarray, num_devices: int) -> tuple[Any, Any]:
    """Reshape a batch for pmap: (batch, ...) -> (num_devices, per_device, ...)."""
    per_device = X.shape[0] // num_devices
    X = X[: per_device * num_devices].reshape(num_devices, per_device, *X.shape[1:])
    y = y[: per_device * num_devices].reshape(num_devices, per_device)
    return X, y


def get_dataloader(
    ds: Dataset, batch_size: int, train: bool, seed: int, epoch: int, steps: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """One pass of the tutorial's loader: (B, H, W, C) float32 images and (B,) int32 labels,
    assembled in the calling (training) thread when the loop asks for them. Training: the
    trainers' order of this epoch, `steps` full batches; test: in order, the last batch
    partial."""
    x, y = (ds.train_x, ds.train_y) if train else (ds.test_x, ds.test_y)
    norm = Normalizer(ds.mean, ds.std, "NHWC")
    order = epoch_permutation(seed, epoch, len(x)) if train else np.arange(len(x))
    n_batches = steps if train else -(-len(x) // batch_size)
    for i in range(n_batches):
        idx = order[i * batch_size : (i + 1) * batch_size]
        yield norm(x[idx]), y[idx]


def create_train_state(cfg: Config, model: Any, image_shape: tuple[int, int, int]) -> TrainState:
    """Parameters, BN statistics and the optimiser, on the host (train() replicates them)."""
    variables = initial_variables(cfg, model, image_shape)  # jax-pmap's initial weights
    return TrainState.create(
        apply_fn=model.apply,
        params=variables["params"],
        tx=make_optimizer(cfg, variables["params"], steps_per_epoch=1),  # constant LR
        batch_stats=variables["batch_stats"],
        dropout_rng=jax.random.PRNGKey(cfg.seed) if cfg.model == "wideresnet" else None,
    )


def replicate(state: TrainState, num_devices: int) -> TrainState:
    """d2l's replication: every leaf stacked `num_devices` times on the default device."""
    return jax.tree.map(lambda x: jnp.stack([x] * num_devices), state)


def check_supported(cfg: Config) -> None:
    """Refuse what d2l's loop has no equivalent for (ConfigError: one line, exit 2)."""
    refuse_options(
        cfg,
        "the d2l JAX loop",
        (cfg.label_smoothing > 0, "--label-smoothing", "--label-smoothing 0"),
    )


def train(cfg: Config) -> dict:
    """The tutorial's train(num_devices, batch_size, lr) on our data, model and config."""
    ds = load_for(cfg)
    steps = tutorial_steps(cfg, len(ds.train_x))  # a batch larger than the data: one line
    devices, kind, platform = select_devices(cfg.gpus)  # the first device query: JAX starts
    plan = device_plan(cfg, platform)  # as jax-pmap's (fp32 only: refuse_options)
    use_device_plan(plan)
    num_devices = len(devices)
    net = build_model(cfg, ds.channels, ds.num_classes, plan.compute_dtype)
    state = replicate(create_train_state(cfg, net, ds.image_shape), num_devices)
    p_train_step = jax.pmap(train_step, axis_name=AXIS, devices=devices)
    p_eval_step = jax.pmap(eval_step, axis_name=AXIS, devices=devices)
    recorder = TutorialRecorder(cfg, TUTORIAL, ds, devices=num_devices, device_kind=kind)
    recorder.execution = execution("pmap (one XLA program per device)", devices)
    with keep_measured_epochs(recorder):
        for epoch in range(cfg.epochs):
            t0 = time.perf_counter()
            images = 0
            for X, y in get_dataloader(ds, cfg.batch_size, True, cfg.seed, epoch, steps):
                X, y = np.array(X), np.array(y)
                X, y = reshape_batch(X, y, num_devices)
                state, loss = p_train_step(state, X, y)
                images += X.shape[0] * X.shape[1]  # host-side shape: no sync
            jax.block_until_ready(state)  # added: d2l's block does not wait for the steps
            sec = time.perf_counter() - t0
            # Evaluate accuracy
            t1 = time.perf_counter()
            correct, total = 0, 0
            for X, y in get_dataloader(ds, cfg.batch_size, False, cfg.seed, epoch, steps):
                X, y = np.array(X), np.array(y)
                X, y = reshape_batch(X, y, num_devices)
                c, t = p_eval_step(state, X, y)
                correct += int(c.sum())  # host sync, per test batch
                total += int(t.sum())
            recorder.end_epoch(sec, images, time.perf_counter() - t1, correct, total)
    return recorder.finish()


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m tutorials.d2l_jax --help` (the trainers' flags).
    Exit 0 ok, 1 failed, 2 bad input."""
    fail = failure_recorder(TUTORIAL)
    setup = setup_xla  # before JAX starts, as jax-pmap
    return run_main(argv, COMPARED, prog=PROG, setup=setup, check=check_supported, train=train,
                    on_failure=fail)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
