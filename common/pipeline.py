"""Data order, sharding, augmentation and batching: identical for every framework.

- One permutation of the training set per (seed, epoch); training steps take consecutive global
  batches of it (the last partial batch is dropped, like `drop_last=True` on the TRAIN set only).
- A global batch is split into contiguous per-device shards, so a k-device run sees exactly the
  global batches of the 1-device run (what DistributedSampler + set_epoch gives, minus padding).
- Augmentation (pad-and-random-crop, horizontal flip where label-preserving) is drawn per
  (seed, epoch, image index), so it does not depend on the device count or the framework.
- Evaluation visits every test image exactly once at any device count; padded positions carry
  weight 0 so frameworks that need static shapes (JAX) can pad without double counting.
- `Prefetcher` prepares batches on a background thread so the step never waits for data.
- `--pipeline device` (the default on GPUs) moves only the pixel work: the training set is copied
  to every device once, and each step's images are gathered there (`gather_crops`, in each
  framework's ops) from the indices, crop rows and columns this module draws on the host for the
  host pipeline too: the same order and the same augmentation, minus the per-step host copy.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from common.config import per_device
from common.datasets import Dataset
from common.errors import ConfigError
from common.runtime import injected


def epoch_permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """The training order of epoch `epoch` (same for every framework and device count)."""
    return np.random.default_rng([seed, epoch, 0]).permutation(n)


def steps_per_epoch(n_train: int, global_batch: int, max_steps: int = 0) -> int:
    """Full global batches per epoch (at least one: common.config refuses a larger batch)."""
    steps = n_train // global_batch
    return min(steps, max_steps) if max_steps else steps


def augmentation_params(
    seed: int, epoch: int, n: int, pad: int, flip: bool
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-image crop offsets (dy, dx in [0, 2*pad]) and flip flags for one epoch."""
    rng = np.random.default_rng([seed, epoch, 1])
    dy = rng.integers(0, 2 * pad + 1, size=n)
    dx = rng.integers(0, 2 * pad + 1, size=n)
    fl = rng.random(n) < 0.5 if flip else np.zeros(n, dtype=bool)
    return dy, dx, fl


def crop_indices(
    h: int, w: int, pad: int, dy: np.ndarray, dx: np.ndarray, fl: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each crop's rows (N, H) and columns (N, W), int32, in the unpadded image's coordinates:
    -pad..h+pad-1, where a row or column outside the image is the zero padding. Columns are
    reversed where `fl` (the flip)."""
    rows = (dy - pad)[:, None] + np.arange(h)[None, :]
    cols = (dx - pad)[:, None] + np.arange(w)[None, :]
    cols = np.where(fl[:, None], cols[:, ::-1], cols)
    return rows.astype(np.int32), cols.astype(np.int32)


def crop_and_flip(
    images: np.ndarray, pad: int, dy: np.ndarray, dx: np.ndarray, fl: np.ndarray
) -> np.ndarray:
    """Zero-pad by `pad`, crop back to the original size at (dy, dx), flip where `fl`."""
    n, h, w, c = images.shape
    padded = np.pad(images, ((0, 0), (pad, pad), (pad, pad), (0, 0)))
    rows, cols = crop_indices(h, w, pad, dy, dx, fl)
    return padded[np.arange(n)[:, None, None], rows[:, :, None] + pad, cols[:, None, :] + pad]


def gather_crops(
    images: np.ndarray, idx: np.ndarray, rows: np.ndarray, cols: np.ndarray
) -> np.ndarray:
    """What `--pipeline device` computes on the device, in numpy (the specification that the
    torch and JAX versions, `make_batch`, are tested against): image idx[i]'s pixels at rows[i] x
    cols[i], 0 outside the image. (N, H, W, C) uint8."""
    h, w = images.shape[1:3]
    inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
    rows, cols = np.clip(rows, 0, h - 1), np.clip(cols, 0, w - 1)
    out = images[idx[:, None, None], rows[:, :, None], cols[:, None, :]]
    return np.where(inside[..., None], out, 0).astype(images.dtype)


# The most training-image bytes `--pipeline device` keeps on every device (a quarter of a 16 GB
# GPU; CIFAR-10 is 0.15 GB): auto falls back to the host pipeline above it, and an explicit
# `--pipeline device` is refused with the fix instead of failing inside a framework's allocator.
DEVICE_DATA_LIMIT = 4 * 2**30


def crops_on_device(pipeline: str, gpu: bool, nbytes: int, limit: int = DEVICE_DATA_LIMIT) -> bool:
    """`--pipeline`: device (crops gathered on the devices), host, or auto = device on GPUs when
    the training set (`nbytes` of uint8 images) fits under `limit` (DEVICE_DATA_LIMIT, or less
    where the framework's arrays hold less)."""
    fits = nbytes <= limit
    if pipeline == "device" and not fits:
        raise ConfigError(
            f"--pipeline device keeps the training set ({nbytes / 2**30:.1f} GiB) on every "
            f"device, over its {limit / 2**30:.0f} GiB limit; use --pipeline host"
        )
    return pipeline == "device" or (pipeline == "auto" and gpu and fits)


def pipeline_record(on_device: bool) -> str:
    """The run record's `pipeline`: where the training batches are made."""
    if on_device:
        return "device (training set resident on every device; crops gathered there)"
    return "host (numpy crops and flips on a prefetch thread, copied every step)"


class Normalizer:
    """uint8 NHWC -> float32 (x/255 - mean)/std, optionally transposed to NCHW."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...], layout: str = "NHWC"):
        self.scale = (1.0 / (255.0 * np.asarray(std, np.float32))).astype(np.float32)
        self.shift = (-np.asarray(mean, np.float32) / np.asarray(std, np.float32)).astype(
            np.float32
        )
        self.layout = layout

    def table(self) -> np.ndarray:
        """(256, C) float32: every uint8 value in every channel, normalised by the same numpy
        operations as __call__, so bit-identical to it: a device that looks its pixels up here
        does no arithmetic that a compiler could fuse into one differently rounded multiply-add
        (XLA does: x * scale + shift becomes an FMA, 1 ulp off numpy in about half the values)."""
        values = np.broadcast_to(np.arange(256, dtype=np.uint8)[:, None], (256, len(self.scale)))
        return values.astype(np.float32) * self.scale + self.shift  # as in __call__

    def __call__(self, images: np.ndarray) -> np.ndarray:
        x = images.astype(np.float32) * self.scale + self.shift  # (N, H, W, C)
        if self.layout == "NCHW":
            x = x.transpose(0, 3, 1, 2)
        return np.ascontiguousarray(x)


class TrainLoader:
    """Training batches of one rank: `rank`'s shard of every global batch, augmented.

    A single-process data-parallel framework (pmap, jit, split_and_load, nn.DataParallel) uses
    rank=0, world=1 and splits the global batch itself; torch-ddp uses one rank per process.
    Yields (x float32 (B, H, W, C) or (B, C, H, W), y int32 (B,)); with `on_device`
    (`--pipeline device`) the same batches as (idx, rows, cols, y) int32 instead, for the
    framework's `make_batch` to gather from its resident copy of the training set (`norm` then
    holds the normalisation it must apply).
    """

    def __init__(self, ds: Dataset, global_batch: int, seed: int, rank: int = 0, world: int = 1,
                 augment: bool = True, layout: str = "NHWC", max_steps: int = 0,
                 prefetch: int = 2, on_device: bool = False):  # fmt: skip
        self.ds = ds
        self.on_device = on_device
        self.global_batch = global_batch
        self.seed = seed
        b = per_device(global_batch, world)  # `rank`'s rows: contiguous, equal sizes
        self.shard = slice(rank * b, (rank + 1) * b)
        self.augment = augment
        self.norm = Normalizer(ds.mean, ds.std, layout)
        self.steps = steps_per_epoch(len(ds.train_x), global_batch, max_steps)
        self.pad = max(1, ds.train_x.shape[1] // 8)  # 4 px at 32x32, 2 px at 16x16
        self.prefetch = prefetch

    def __len__(self) -> int:
        return self.steps

    def indices(self, epoch: int, step: int) -> np.ndarray:
        """Dataset indices of this rank's part of global batch `step` of `epoch`."""
        order = epoch_permutation(self.seed, epoch, len(self.ds.train_x))
        return order[step * self.global_batch : (step + 1) * self.global_batch][self.shard]

    def _batches(self, epoch: int, start_step: int) -> Iterator[tuple[np.ndarray, ...]]:
        n = len(self.ds.train_x)
        order = epoch_permutation(self.seed, epoch, n)
        if self.augment:
            dy, dx, fl = augmentation_params(self.seed, epoch, n, self.pad, self.ds.flip)
        else:  # the identity crop: offset `pad` into the padded image, no flip
            dy = dx = np.full(n, self.pad)
            fl = np.zeros(n, bool)
        h, w = self.ds.train_x.shape[1:3]
        for step in range(start_step, self.steps):
            idx = order[step * self.global_batch : (step + 1) * self.global_batch][self.shard]
            if self.on_device:  # (idx, rows, cols, y) int32 for gather_crops: the same draws
                rows, cols = crop_indices(h, w, self.pad, dy[idx], dx[idx], fl[idx])
                if injected("crop-shift", "device-pipeline"):  # tests only: crops a pixel lower
                    rows = rows + 1
                yield idx.astype(np.int32), rows, cols, self.ds.train_y[idx].astype(np.int32)
                continue
            images = self.ds.train_x[idx]
            if self.augment:
                images = crop_and_flip(images, self.pad, dy[idx], dx[idx], fl[idx])
            yield self.norm(images), self.ds.train_y[idx]

    def epoch(self, epoch: int, start_step: int = 0) -> Prefetcher:
        """Iterator over this rank's batches of `epoch`, prepared `prefetch` batches ahead."""
        return Prefetcher(self._batches(epoch, start_step), self.prefetch)


class EvalLoader:
    """Test batches of one rank. Every test image is visited exactly once over all ranks.

    Ranks take contiguous, near-equal parts of the test set (`np.array_split`), cut into batches
    of `batch_size`. With `pad_to` > 0 every batch is padded to `batch_size` rounded up to a
    multiple of `pad_to` (static shapes for JAX); padding rows have weight 0.
    Yields (x float32, y int32 (B,), weight float32 (B,)).
    """

    def __init__(self, ds: Dataset, batch_size: int, rank: int = 0, world: int = 1,
                 layout: str = "NHWC", pad_to: int = 0):  # fmt: skip
        self.ds = ds
        self.part = np.array_split(np.arange(len(ds.test_x)), world)[rank]
        # No batch beyond the largest rank's part: padding is sized by the test set, never by
        # an eval batch of 1e9 (the same cap on every rank, so static shapes still agree).
        largest = -(-len(ds.test_x) // max(1, world))
        self.batch_size = max(1, min(batch_size, largest))
        self.norm = Normalizer(ds.mean, ds.std, layout)
        self.padded = -(-self.batch_size // pad_to) * pad_to if pad_to else 0

    def __len__(self) -> int:
        return -(-len(self.part) // self.batch_size)

    def __iter__(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        return iter(Prefetcher(self._batches(), 2))

    def _batches(self) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        for start in range(0, len(self.part), self.batch_size):
            idx = self.part[start : start + self.batch_size]
            x, y = self.ds.test_x[idx], self.ds.test_y[idx]
            w = np.ones(len(idx), np.float32)
            if self.padded and len(idx) < self.padded:
                extra = self.padded - len(idx)
                x = np.concatenate([x, np.zeros((extra, *x.shape[1:]), x.dtype)])
                y = np.concatenate([y, np.zeros(extra, y.dtype)])
                w = np.concatenate([w, np.zeros(extra, np.float32)])
            yield self.norm(x), y, w


class Prefetcher:
    """Runs a batch generator on a background thread, `depth` batches ahead.

    numpy releases the GIL in the copies that dominate batch assembly, so this overlaps with the
    framework's (asynchronous) step. `wait_sec` accumulates the time the consumer spent blocked:
    the "data wait" phase of the per-phase timing.
    """

    _DONE = object()

    def __init__(self, source: Iterator[Any], depth: int = 2):
        self.wait_sec = 0.0
        self._exhausted = False  # the end marker is consumed once; later next() calls stop too
        if depth <= 0:
            self._it: Iterator[Any] | None = source
            return
        self._it = None
        self._q: queue.Queue[Any] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._fill, args=(source,), daemon=True)
        self._thread.start()

    def _fill(self, source: Iterator[Any]) -> None:
        try:
            for item in source:
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
            self._q.put(self._DONE)
        except BaseException as exc:  # surface loader errors in the consumer
            self._q.put(exc)

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._exhausted:  # iterator protocol: StopIteration again, never block on the queue
            raise StopIteration
        t0 = time.perf_counter()
        if self._it is not None:
            item = next(self._it)
        else:
            item = self._q.get()
        self.wait_sec += time.perf_counter() - t0
        if item is self._DONE:
            self._exhausted = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._exhausted = True
            raise item
        return item

    def close(self) -> None:
        if self._it is None:
            self._stop.set()
