"""d2l-mxnet: the training loop of Dive into Deep Learning, section 13.6 "Concise Implementation
for Multiple GPUs" (MXNet tab), rebuilt on this project's data, model and config and timed
against frameworks/mxnet_gluon.py.

Source: https://d2l.ai/chapter_computational-performance/multiple-gpus-concise.html (d2l-ai/d2l-en,
chapter_computational-performance/multiple-gpus-concise.md, with the d2l library's
`load_data_fashion_mnist`, `split_batch`, `accuracy` and `get_dataloader_workers`).

What the tutorial's loop does, in order, and what each part costs:
- Input: a Gluon dataset with `.transform_first(ToTensor())`, read by `gluon.data.DataLoader`
  with `num_workers=4` (shuffled for training, in order for testing, the SAME batch size for
  both, the final partial batch kept). Four forked worker processes run the transform image by
  image (one small MXNet operator call per image) and return every batch through shared memory.
  Gluon forks each loader's pool once, when the DataLoader is built (Linux's "fork" start
  method), and reuses it every epoch: 8 worker processes live through the run, and on a 2-core
  machine the busy ones compete with the training process for the cores. num_workers=4 works
  as in the tutorial here; nothing was reduced.
- Per batch: `split_batch` (`split_and_load` of images and labels over the contexts), then under
  one `autograd.record()` one forward and one loss per shard, `l.backward()` once per shard, and
  `trainer.step(batch_size)`: Gluon's Trainer with its defaults, kvstore "device" and (over
  several contexts) update_on_kvstore=True: per parameter the gradients are pushed and summed,
  the SGD update runs once on the kvstore's copy, and the new weights are pulled back to every
  context (our trainer instead all-reduces the gradients and updates every replica itself); no
  kvstore on one context. No per-step host sync (the tutorial keeps none).
- The network is NOT hybridized: every operator goes through the imperative front end on every
  step, per context. That is one of the costs this comparison measures (our trainer hybridizes
  with static_alloc/static_shape). The loss block is not hybridized either.
- The epoch ends with `waitall()`, then the timer stops: the same clock as ours (perf_counter
  from the first batch request to the sync after the last step).
- Evaluation (`evaluate_accuracy_gpus`, timed separately as eval_sec): every test batch is split
  over the contexts, each shard goes through the net (predict mode: each context's own running
  BatchNorm statistics, never averaged over the replicas) and `float(accuracy(...))` reads one
  number per shard per batch: a host sync each. Every test image counts exactly once.

The run record is `tutorials.record.TutorialRecorder`'s; images_per_sec excludes the
first epoch (worker start-up, first-call allocations), like the trainers' records.

Threads: exactly as the compared trainer (frameworks/mxnet_gluon.py main()): OMP_NUM_THREADS =
cores / contexts and a passive OpenMP wait policy, both set before mxnet is imported. The
DataLoader's forked workers inherit them.

Run: `.venv-mxnet/bin/python -m tutorials.d2l_mxnet --preset throughput --gpus 2`.
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import numpy as np

from common.config import Config
from common.datasets import Dataset, load_for
from common.runtime import cpu_threads, set_omp_threads
from common.schedule import scaled_lr
from common.trainer import keep_measured_epochs, run_main
from tutorials.record import Tutorial, TutorialRecorder, failure_recorder, refuse_options

# mxnet (and frameworks.mxnet_gluon's helpers that import it) is imported inside the functions:
# MXNet reads OMP_NUM_THREADS once, when it is loaded, and main() sets it first.

SOURCE = (
    "Dive into Deep Learning, 13.6 Concise Implementation for Multiple GPUs (MXNet), "
    "https://d2l.ai/chapter_computational-performance/multiple-gpus-concise.html"
)
COMPARED = "mxnet-gluon"
PACKAGES = ("mxnet",)
PROG = "python -m tutorials.d2l_mxnet"
NUM_WORKERS = 4  # d2l.get_dataloader_workers()
DEVIATIONS: tuple[str, ...] = (
    "data come from common.datasets arrays (uint8 NHWC images as an NDArray, int32 labels, as "
    "gluon.data.vision.FashionMNIST holds them) in a gluon.data.ArrayDataset instead of "
    "gluon.data.vision.FashionMNIST (no download here)",
    "images are normalised with the dataset's mean and std (transforms.Normalize after "
    "ToTensor, in the same transform_first) like our trainers; d2l feeds ToTensor's [0, 1] "
    "values",
    "the model is frameworks.mxnet_gluon.build_model's (our ResNet-18 / WideResNet with our "
    "initialisers, BN momentum and epsilon, weight decay off for BN and biases) instead of "
    "d2l's resnet18 with init.Normal(sigma=0.01); same architecture as d2l's ResNet-18 variant",
    "the nd (legacy NDArray) interface instead of d2l's np/npx (npx.set_np()): our Gluon model "
    "is written against nd",
    "contexts are frameworks.mxnet_gluon.select_devices' (N CPU contexts 'cpu-simulated' "
    "without an MXNet CUDA build) instead of d2l.try_gpu(i)",
    "OpenMP threads (cores / contexts) and a passive wait policy set before mxnet is imported, "
    "as our trainer does",
    "SGD momentum and weight decay from the config are passed to the Trainer's 'sgd' (d2l "
    "passes the learning rate only); the LR is common.schedule.scaled_lr of the config",
    "mx.random and numpy's global generator (the DataLoader's shuffle) are seeded with "
    "cfg.seed; d2l does not seed",
    "split_and_load with even_split=False: a final partial batch that does not divide over the "
    "contexts is split into slices one image apart where d2l's even split would raise "
    "(identical slices whenever it divides)",
    "test batches have the training batch size (d2l's single batch_size); --eval-batch-size "
    "is not used",
    "no plotting (d2l.Animator) and no per-epoch print of d2l's own; the recorder prints one "
    "line per epoch after evaluation",
)
TUTORIAL = Tutorial("d2l-mxnet", SOURCE, DEVIATIONS, PACKAGES)


def setup(cfg: Config) -> None:
    """As frameworks/mxnet_gluon.py, before mxnet is loaded: one OpenMP team per context sharing
    the cores, idle team threads sleeping rather than spinning."""
    set_omp_threads(cpu_threads(cfg.gpus))
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def check_supported(cfg: Config) -> None:
    """Refuse what the tutorial's loop has no way to do (one ConfigError naming the fix), then
    what the compared trainer refuses (device count, dataset)."""
    from frameworks.mxnet_gluon import check_config  # imports mxnet: after setup()

    refuse_options(
        cfg,
        "the d2l loop",
        (cfg.nesterov, "--nesterov", "--no-nesterov (the Trainer's 'sgd' has no Nesterov form)"),
        (cfg.label_smoothing > 0, "--label-smoothing", "0 (SoftmaxCrossEntropyLoss)"),
        (cfg.bn != "local", f"--bn {cfg.bn}", "--bn local (d2l's BatchNorm is per context)"),
        (
            cfg.max_steps_per_epoch > 0,
            "--max-steps-per-epoch",
            "0 (d2l steps through the whole loader; shorten the epoch with --train-limit)",
        ),
    )
    check_config(cfg)


def load_data(ds: Dataset, batch_size: int) -> tuple[Any, Any]:
    """d2l.load_data_fashion_mnist on our arrays: (train_iter, test_iter), two DataLoaders with
    4 worker processes each; ToTensor (HWC uint8 -> CHW float in [0, 1]) per image in the
    workers, then our normalisation."""
    import mxnet as mx
    from mxnet import gluon
    from mxnet.gluon.data.vision import transforms

    trans = transforms.Compose([transforms.ToTensor(), transforms.Normalize(ds.mean, ds.std)])
    # As gluon.data.vision.FashionMNIST stores them: images an NDArray (N, H, W, C) uint8,
    # labels a numpy int32 vector.
    train = gluon.data.ArrayDataset(mx.nd.array(ds.train_x, dtype="uint8"), ds.train_y)
    test = gluon.data.ArrayDataset(mx.nd.array(ds.test_x, dtype="uint8"), ds.test_y)
    # Each DataLoader forks its pool here, once; every epoch's iterator reuses it.
    return (
        gluon.data.DataLoader(
            train.transform_first(trans), batch_size, shuffle=True, num_workers=NUM_WORKERS
        ),
        gluon.data.DataLoader(
            test.transform_first(trans), batch_size, shuffle=False, num_workers=NUM_WORKERS
        ),
    )


def split_batch(x: Any, y: Any, ctx: list[Any]) -> tuple[list[Any], list[Any]]:
    """d2l.split_batch: one slice of images (B/N, C, H, W) and labels (B/N,) per context."""
    from mxnet import gluon

    assert x.shape[0] == y.shape[0]
    return (
        gluon.utils.split_and_load(x, ctx, even_split=False),
        gluon.utils.split_and_load(y, ctx, even_split=False),
    )


def accuracy(y_hat: Any, y: Any) -> float:
    """d2l.accuracy: the number of correct predictions, read to the host (a sync)."""
    if len(y_hat.shape) > 1 and y_hat.shape[1] > 1:
        y_hat = y_hat.argmax(axis=1)
    cmp = y_hat.astype(y.dtype) == y
    return float(cmp.astype(y.dtype).sum().asscalar())  # host sync


def evaluate_accuracy_gpus(net: Any, data_iter: Any) -> tuple[float, float]:
    """d2l.evaluate_accuracy_gpus, returning (correct, examples) instead of their ratio."""
    ctx = list(net.collect_params().values())[0].list_ctx()  # the contexts holding the net
    correct, examples = 0.0, 0.0  # d2l.Accumulator(2)
    for features, labels in data_iter:
        x_shards, y_shards = split_batch(features, labels, ctx)
        pred_shards = [net(x) for x in x_shards]  # not recording: predict mode
        # One float() per shard per batch: each waits for that shard's forward pass.
        correct += sum(accuracy(p, y) for p, y in zip(pred_shards, y_shards))
        examples += labels.size
    return correct, examples


def train(cfg: Config) -> dict:
    """d2l's train(num_gpus, batch_size, lr) on `cfg`; return the tutorial run record."""
    import mxnet as mx
    from mxnet import autograd, gluon

    from frameworks.mxnet_gluon import build_model, select_devices
    from frameworks.mxnet_models import initialize

    ctx, kind = select_devices(cfg.gpus)
    ds = load_for(cfg)
    # The DataLoader's RandomSampler shuffles with numpy's global generator.
    np.random.seed(cfg.seed)  # noqa: NPY002
    mx.random.seed(cfg.seed)  # initial weights (and dropout masks)
    net = build_model(cfg, ds.channels, ds.num_classes)
    recorder = TutorialRecorder(cfg, TUTORIAL, ds, devices=len(ctx), device_kind=kind)
    train_iter = test_iter = None
    with keep_measured_epochs(recorder):
        batch_size = cfg.batch_size
        train_iter, test_iter = load_data(ds, batch_size)
        net.initialize(ctx=ctx, force_reinit=True)  # our initialisers; no hybridize (as d2l)
        initialize(cfg, net)  # --init shared: mxnet-gluon's initial weights
        # wd applies where create_model left wd_mult at 1: conv and linear weights only.
        trainer = gluon.Trainer(
            net.collect_params(),
            "sgd",
            {
                "learning_rate": scaled_lr(cfg.lr, batch_size, cfg.lr_base_batch, cfg.lr_scaling),
                "momentum": cfg.momentum,
                "wd": cfg.weight_decay,
            },
        )
        loss = gluon.loss.SoftmaxCrossEntropyLoss()
        for _ in range(cfg.epochs):
            images = 0
            t0 = time.perf_counter()
            for features, labels in train_iter:
                x_shards, y_shards = split_batch(features, labels, ctx)
                with autograd.record():
                    losses = [loss(net(x), y) for x, y in zip(x_shards, y_shards)]
                for l in losses:  # noqa: E741 (d2l's name)
                    l.backward()
                # Gradients summed over the contexts by the kvstore and scaled by 1/batch_size,
                # the nominal batch, also for a final partial batch (as d2l does).
                trainer.step(batch_size)
                images += features.shape[0]  # a host-side shape: no sync
            mx.nd.waitall()  # npx.waitall(): the queued steps finish before the clock stops
            sec = time.perf_counter() - t0
            t0 = time.perf_counter()
            correct, total = evaluate_accuracy_gpus(net, test_iter)
            recorder.end_epoch(sec, images, time.perf_counter() - t0, correct, total)
    # Terminate the worker pools now rather than in DataLoader.__del__ at interpreter exit.
    del train_iter, test_iter
    return recorder.finish()


def main(argv: list[str] | None = None) -> int:
    """Command line: the trainers' flags and presets. Exit 0 ok, 1 failed, 2 bad input."""
    fail = failure_recorder(TUTORIAL)
    return run_main(
        argv, COMPARED, prog=PROG, setup=setup, check=check_supported, train=train, on_failure=fail
    )


if __name__ == "__main__":
    sys.exit(main())
