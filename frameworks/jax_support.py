"""What the three JAX trainers share besides the models (frameworks/jax_models.py): the train
state, the Optax optimiser, the loss, prefetching to the devices and the device pipeline,
evaluation, checkpoint I/O, the XLA and compilation-cache set-up, the exported-step cache,
device selection, and a run's set-up around the trainer's own functions (`start_run`). The
trainers keep their model, state, step, parallel transform and epoch loop: what differs
between pmap, jit+sharding and shard_map. Joining a multi-process run: frameworks/jax_launch.py."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import importlib.util
import itertools
import json
import logging
import os
import sys
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import jax
import jax.export
import jax.numpy as jnp
import numpy as np
import optax
from flax import serialization, struct, traverse_util
from flax.training import train_state
from jax.sharding import Mesh

from common.checkpoints import (
    Checkpoints,
    check_resume,
    checkpoint_meta,
    read_checkpoint,
    reading_checkpoint,
    restore_meta,
    write_checkpoint,
)
from common.config import Config, ConfigError, image_side, per_device
from common.datasets import check_available
from common.devices import need_gpus
from common.errors import first_line
from common.pipeline import EvalLoader, TrainLoader
from common.results import RunRecorder
from common.run import Run
from common.runtime import (
    INJECT_ENV,
    atomic_write_bytes,
    available_cores,
    check_xla_flags,
    remove_stale_temp_files,
    simulate_host_devices,
    threads_record,
    use_xla_cpu_ynn,
    xla_cpu_execution,
    xla_cpu_ynn_wanted,
)
from common.schedule import lr_table_for
from common.timing import PhaseTimer
from frameworks.jax_launch import gave_up_joining, init_distributed
from frameworks.jax_models import compute_dtype, count_params, decay_mask
from frameworks.profilers import JaxProfiler


class TrainState(train_state.TrainState):
    """Flax's TrainState (step, params, opt_state, apply_fn, tx) plus BN running statistics and
    the dropout key. Dropout keys are folded from (seed key, step), so a resumed run draws the
    same masks as an uninterrupted one."""

    batch_stats: Any = None
    key: jax.Array = None  # type: ignore[assignment]  # set by create(); None: a template
    label_smoothing: float = struct.field(pytree_node=False, default=0.0)


def make_optimizer(cfg: Config, params: Any, steps_per_epoch: int) -> optax.GradientTransformation:
    """SGD in torch's form (buf = m * buf + (g + wd * w); w -= lr * buf; Nesterov from the
    config) or NovoGrad, weight decay on conv/linear kernels only, LR from common.schedule."""
    table = jnp.asarray(lr_table_for(cfg, steps_per_epoch))  # (epochs * steps_per_epoch,)

    def schedule(count: jax.Array) -> jax.Array:  # Optax's update counter, restored on resume
        return table[jnp.minimum(count, table.shape[0] - 1)]

    mask = decay_mask(params)
    if cfg.optimizer == "sgd":
        # add_decayed_weights first: torch adds wd * w to the gradient before the momentum
        # buffer. optax.sgd = trace (buf = m * buf + g, Nesterov g + m * buf) then -lr scaling.
        return optax.chain(
            optax.add_decayed_weights(cfg.weight_decay, mask=mask),
            optax.sgd(schedule, momentum=cfg.momentum or None, nesterov=cfg.nesterov),
        )
    # NovoGrad (Ginsburg et al. 2019): the decay term sits inside the first moment,
    # m = b1 * m + g / sqrt(v) + wd * w, so it cannot be masked from outside: the decayed and
    # undecayed parameters get their own NovoGrad (both per-layer, so this changes nothing else).
    b1, b2 = cfg.novograd_betas
    labels = jax.tree.map(lambda d: "decay" if d else "no_decay", mask)
    return optax.chain(
        optax.partition(
            {
                "decay": optax.scale_by_novograd(b1, b2, eps=1e-8, weight_decay=cfg.weight_decay),
                "no_decay": optax.scale_by_novograd(b1, b2, eps=1e-8, weight_decay=0.0),
            },
            labels,
        ),
        optax.scale_by_learning_rate(schedule),
    )


def cross_entropy(logits: jax.Array, labels: jax.Array, label_smoothing: float) -> jax.Array:
    """Per-example softmax cross-entropy with torch's label smoothing ((1 - a) * onehot + a / K).
    logits: (B, K) float32, labels: (B,) int32 -> (B,)."""
    if label_smoothing == 0.0:
        return optax.softmax_cross_entropy_with_integer_labels(logits, labels)
    targets = optax.smooth_labels(jax.nn.one_hot(labels, logits.shape[-1]), label_smoothing)
    return optax.softmax_cross_entropy(logits, targets)


# -- device I/O, evaluation and checkpoints ----------------------------------------------------

Batch = tuple[np.ndarray, ...]


def prefetch_to_devices(
    batches: Iterator[Batch],
    put: Callable[[Batch], tuple[jax.Array, ...]],
    phases: PhaseTimer,
    size: int = 2,
) -> Iterator[tuple[jax.Array, ...]]:
    """Put batches on the devices `size` steps ahead with `put` (the trainer's `to_device`;
    flax's prefetch_to_device): the copy of batch k+2 overlaps step k. With phase timing each
    copy is waited for and timed as h2d."""

    def timed_put(batch: Batch) -> tuple[jax.Array, ...]:
        if not phases.enabled:
            return put(batch)
        t0 = time.perf_counter()
        out = jax.block_until_ready(put(batch))
        phases.add("h2d", time.perf_counter() - t0)
        return out

    batches = (b for b in batches)  # stays exhausted (a Prefetcher would block on a re-read)
    queue = collections.deque(timed_put(b) for b in itertools.islice(batches, size))
    while queue:
        yield queue.popleft()
        queue.extend(timed_put(b) for b in itertools.islice(batches, 1))


def batch_maker(table: np.ndarray) -> Callable[..., tuple[jax.Array, jax.Array]]:
    """--pipeline device: `make_batch(images, idx, rows, cols, y)`, common.pipeline.gather_crops
    in jnp ops, each pixel then looked up in the host Normalizer's `table()` (256, C) instead of
    computing x * scale + shift, which XLA would fuse into a multiply-add that rounds once where
    numpy rounds twice: the resident uint8 images (N, H, W, C) -> float32 (B, H, W, C), bitwise
    the host pipeline's, and the labels. The trainer applies its parallel transform to it
    (`parallel_batches`), so each device gathers its own shard."""

    def make_batch(
        images: jax.Array, idx: jax.Array, rows: jax.Array, cols: jax.Array, y: jax.Array
    ) -> tuple[jax.Array, jax.Array]:
        h, w = images.shape[1:3]
        inside = ((rows >= 0) & (rows < h))[:, :, None] & ((cols >= 0) & (cols < w))[:, None, :]
        rows, cols = jnp.clip(rows, 0, h - 1), jnp.clip(cols, 0, w - 1)
        crops = images[idx[:, None, None], rows[:, :, None], cols[:, None, :]]
        crops = jnp.where(inside[..., None], crops, jnp.zeros((), crops.dtype))  # zero padding
        return jnp.asarray(table)[crops.astype(jnp.int32), jnp.arange(table.shape[1])], y

    return make_batch


def train_put(
    loader: TrainLoader,
    put: Callable[[Batch], tuple[jax.Array, ...]],
    replicate: Callable[[Any], Any],
    parallel_batches: Callable[[Callable[..., Any]], Callable[..., Any]],
) -> Callable[[Batch], tuple[jax.Array, ...]]:
    """The step's batch on the devices, from what `loader` yields. Host pipeline: the trainer's
    `put` (to_device). Device pipeline: the uint8 training set is copied to every device once,
    here (the trainer's `replicate`), and each step puts only its indices (asynchronously) and
    gathers its crops there (`batch_maker` under the trainer's transform, `parallel_batches`)."""
    if not loader.on_device:
        return put
    images = replicate(loader.ds.train_x)
    make_batch = parallel_batches(batch_maker(loader.norm.table()))
    return lambda batch: make_batch(images, *put(batch))


def evaluate(
    eval_fn: Callable[[Any, tuple[jax.Array, ...]], dict[str, jax.Array]],
    state: Any,
    loader: EvalLoader,
    steps: int,
    put: Callable[[Batch], tuple[jax.Array, ...]],
    fetch: Callable[[Any], Any],
) -> dict[str, float]:
    """Test sums over every test image exactly once: each process its part, padded rows of
    weight 0; `steps` (the most batches any process has) keeps the processes in lockstep.
    `eval_fn` is the trainer's parallel eval step, `put` its to_device, `fetch` its unreplicate."""
    n, shape = loader.padded, loader.ds.image_shape
    padding = (np.zeros((n, *shape), np.float32), np.zeros(n, np.int32), np.zeros(n, np.float32))
    totals: dict[str, jax.Array] = {}
    for batch in itertools.islice(itertools.chain(loader, itertools.repeat(padding)), steps):
        metrics = eval_fn(state, put(batch))
        totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
    return {k: float(v) for k, v in fetch(totals).items()}  # host sync, once


def checkpoint_path(cfg: Config) -> Path:
    return Path(cfg.checkpoint_dir) / f"{cfg.framework}.msgpack"


def save_checkpoint(cfg: Config, state: TrainState, recorder: RunRecorder, epoch: int) -> None:
    """Write the state after `epoch` (0-based) with its sha256, atomically: msgpack bytes, temp
    file, rename. `state` is the host copy (the trainer's unreplicate)."""
    meta = checkpoint_meta(cfg, recorder, epoch, int(state.step))
    payload = {"state": serialization.to_state_dict(state), "meta": json.dumps(meta)}
    write_checkpoint(checkpoint_path(cfg), serialization.msgpack_serialize(payload))


def load_checkpoint(
    cfg: Config, state: TrainState, recorder: RunRecorder
) -> tuple[TrainState, int]:
    """Restore the latest checkpoint (its sha256 checked first; msgpack holds arrays and plain
    values only) into the host template `state`; return the host state (the trainer
    replicates it) and the epoch to continue from. Another run's metadata is refused (one
    line)."""
    path = checkpoint_path(cfg)
    with reading_checkpoint(path):  # damaged or foreign: one line, exit 2
        ckpt = serialization.msgpack_restore(read_checkpoint(path))
        epoch, _ = restore_meta(json.loads(ckpt["meta"]), recorder, path)
        restored = serialization.from_state_dict(state, ckpt["state"])
    return restored, epoch


def canonical_state(state: TrainState) -> dict[str, np.ndarray]:
    """Parameters and BN statistics of a host state (the trainer's unreplicate) in torch's
    names and layouts (--save-state): the inverse of from_torch_state."""
    out: dict[str, np.ndarray] = {}
    for tree in (state.params, state.batch_stats):
        for path, v in traverse_util.flatten_dict(tree).items():
            *mods, leaf = path
            name = ".".join(m.replace("_", ".") for m in mods)  # layer1_0 -> layer1.0
            v = np.asarray(v)
            if leaf == "kernel":  # conv HWIO -> OIHW, linear (in, out) -> (out, in)
                out[f"{name}.weight"] = v.transpose(3, 2, 0, 1) if v.ndim == 4 else v.T
            else:
                torch_leaf = {"scale": "weight", "mean": "running_mean", "var": "running_var"}
                out[f"{name}.{torch_leaf.get(leaf, leaf)}"] = v
    return out


def checkpoint_meta_of(path: Path) -> dict[str, Any]:
    """The metadata saved in a checkpoint: config, epoch ... (for check_resume)."""
    return json.loads(serialization.msgpack_restore(read_checkpoint(path))["meta"])


CHECKPOINTS = Checkpoints(checkpoint_path, save_checkpoint, load_checkpoint, checkpoint_meta_of)


# -- devices ------------------------------------------------------------------------------------


Platform = Literal["cpu", "gpu"]  # jax.Device.platform as the trainers run on it
PLATFORMS: tuple[Platform, ...] = ("cpu", "gpu")


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """What a JAX step runs on a platform, decided once per run by `device_plan` from (config,
    platform) and passed on: the trainers, benchmarks/compute_only.py and the tutorial loops
    take it from there, so that a loop and its compute-only reference cannot diverge."""

    platform: Platform
    compute_dtype: Any  # the activations: jnp.float32, or jnp.bfloat16 for --precision bf16
    matmul_precision: str | None  # jax_default_matmul_precision; None: the CPU's full fp32
    float32: str  # the record's float32_precision
    donate: tuple[int, ...]  # donate_argnums of a train step (argument 0: the state)
    collectives: str  # what carries the cross-device reductions (the record's process_group)


def platform_of(device: jax.Device) -> Platform:
    """The platform of a device the trainers run on ("cpu" or "gpu": CUDA or ROCm)."""
    platform = device.platform
    if platform == "cpu" or platform == "gpu":
        return platform
    raise ConfigError(f"JAX device platform {platform!r} is not supported; use --devices cpu")


def device_plan(cfg: Config, platform: Platform) -> DevicePlan:
    """The one place a JAX run's device decisions are made:
    - activations in bfloat16 for --precision bf16 on every platform (jax_models.compute_dtype);
    - float32 matmuls and convolutions in full fp32 ("highest") unless --tf32, the same choice
      as every other framework; CPUs compute float32 in full precision whatever the setting;
    - the state donated to the step on GPUs (the new state reuses the old one's memory), not on
      CPU, where memory is plentiful and a step without donation measured 1% faster (5
      alternating pairs, jax-pmap, 1 device);
    - the collectives: XLA's own (NCCL between GPUs, in-process copies between CPU devices)."""
    if platform not in PLATFORMS:  # e.g. a bool: `devices[0].platform == "gpu"` passed on
        raise TypeError(f"platform must be one of {PLATFORMS}, not {platform!r}")
    gpu = platform == "gpu"
    return DevicePlan(
        platform=platform,
        compute_dtype=compute_dtype(cfg),
        matmul_precision=("tensorfloat32" if cfg.tf32 else "highest") if gpu else None,
        float32=("tf32" if cfg.tf32 else "fp32 (TF32 off)") if gpu else "fp32 (CPU)",
        donate=(0,) if gpu else (),
        collectives="XLA (NCCL)" if gpu else "XLA (CPU devices, one process)",
    )


def use_device_plan(plan: DevicePlan) -> str:
    """Apply what `plan` sets process-wide (the float32 matmul precision); returns the record's
    float32_precision."""
    if plan.matmul_precision is not None:
        jax.config.update("jax_default_matmul_precision", plan.matmul_precision)
    return plan.float32


def what_ran(model: Any, params: Any, batch_stats: Any, image_shape: tuple[int, ...]) -> dict:
    """The record's `ran`: the convolutions' dtype read from the run's traced model
    (`activation_dtype`), the input's memory format, the execution mode (one XLA program)."""
    variables = {"params": params, "batch_stats": batch_stats}
    return {
        "activation_dtype": activation_dtype(model, variables, image_shape),
        "input_memory_format": "NHWC",
        "mode": "XLA (compiled)",
    }


def activation_dtype(model: Any, variables: Any, image_shape: tuple[int, ...]) -> str:
    """The dtype the convolutions of `model` (the run's own, as built from its plan) compute in,
    applied to `variables` (arrays or shapes, unreplicated) on one image of `image_shape`: read
    from the traced program (its conv_general_dilated results), not from the flag. Tracing
    only, nothing runs (0.1-0.2 s for ResNet-18). "a+b" where convolutions differ."""
    spec = jax.tree.map(lambda a: jax.ShapeDtypeStruct(np.shape(a), a.dtype), variables)
    x = jax.ShapeDtypeStruct((1, *image_shape), jnp.float32)
    jaxpr = jax.make_jaxpr(lambda v, x: model.apply(v, x, train=False))(spec, x)
    return "+".join(sorted(conv_dtypes(jaxpr.jaxpr))) or "none (no convolution)"


def conv_dtypes(jaxpr: Any) -> set[str]:
    """The result dtypes of every convolution in `jaxpr` and the programs nested in it."""
    found: set[str] = set()
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "conv_general_dilated":
            found |= {jnp.dtype(v.aval.dtype).name for v in eqn.outvars}
        for param in eqn.params.values():
            for sub in param if isinstance(param, (list, tuple)) else [param]:
                inner = getattr(sub, "jaxpr", sub)  # a ClosedJaxpr holds a Jaxpr
                if hasattr(inner, "eqns"):
                    found |= conv_dtypes(inner)
    return found


def jax_threads(devices: list[jax.Device]) -> dict[str, Any]:
    """The `threads` record of a JAX run: XLA:CPU runs every host device's programs on one
    intra-op thread pool per process, shared by the devices, which XLA sizes itself to the
    cores the process may run on, or to its device count where that is larger (jax 0.10 offers
    no setting for its size; counted on jax 0.10.2 from the pool's threads, tf_XLAEigen, at 1-4
    devices with 1 and 2 cores)."""
    if devices[0].platform != "cpu":
        return threads_record(0, None, "GPU run: host threads are not the compute")
    pool = max(available_cores(), len(jax.local_devices(backend="cpu")))
    return threads_record(
        pool, None, "XLA:CPU's intra-op pool, one per process, shared by the devices"
    )


def execution(transform: str, devices: list[jax.Device]) -> str:
    """The record's `execution`: the parallel transform, and on CPU how XLA runs the programs."""
    if devices[0].platform != "cpu":
        return transform
    return f"{transform}; {xla_cpu_execution()}"


def setup_xla(cfg: Config) -> None:
    """Before JAX's backends start (XLA reads XLA_FLAGS at the first device query, not the
    import): `--gpus` simulated CPU devices (on a GPU machine only the unused CPU backend sees
    them) and XLA:CPU's kernels (--xla-cpu-ynn). The JAX trainers and the JAX tutorial loops
    both start here, so the two sides of a comparison run the same XLA programs the same way."""
    check_xla_flags()  # the user's XLA_FLAGS: one line, not XLA's abort
    simulate_host_devices(cfg.gpus)
    use_xla_cpu_ynn(xla_cpu_ynn_wanted(cfg.xla_cpu_ynn, image_side(cfg), cfg.gpus))
    if cfg.devices != "auto":  # JAX read JAX_PLATFORMS when imported: devices.pin is too late
        jax.config.update("jax_platforms", "cpu" if cfg.devices == "cpu" else "cuda")


def setup_process(cfg: Config) -> None:
    """What a JAX trainer's process does before JAX starts: `setup_xla` (simulated devices,
    XLA:CPU's kernels), then the persistent compilation cache on (or off), then joining a
    multi-process run if one is configured (jax_launch.py)."""
    setup_xla(cfg)
    use_compile_cache(cfg)
    source_digest()  # the step cache's key: the sources as this process imported them
    init_distributed(cfg.collective_timeout, lambda why: gave_up_joining(cfg, why))


def use_compile_cache(cfg: Config) -> str | None:
    """--compile-cache (default): every compiled XLA program goes to <cache-dir>/jax (or
    JAX_COMPILATION_CACHE_DIR), whatever its compile time, and a later run of the same program
    loads it instead of compiling. A size limit turns on JAX's LRU eviction, which also takes a
    file lock around every read and write: several processes may share the directory. Returns
    the directory (None: off)."""
    if not cfg.compile_cache:
        jax.config.update("jax_enable_compilation_cache", False)
        return None
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(
        Path(cfg.cache_dir).expanduser() / "jax"
    )
    Path(path).mkdir(parents=True, exist_ok=True)
    jax.config.update("jax_enable_compilation_cache", True)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_compilation_cache_max_size", 4 * 1024**3)  # eviction + file lock
    drop_unfinished_cache_entries(path)
    note_damaged_cache_entries(path)
    return path


def drop_unfinished_cache_entries(path: str, wait_sec: float = 10.0) -> int:
    """Remove the compilation-cache entries that JAX began to write and never finished: a
    `<key>-cache` file without the `<key>-atime` file JAX's LRU cache writes after it
    (jax/_src/lru_cache.py), left by a full disk (the write failed part-way) or a writer killed
    between the two. Before every write JAX reads each entry's -atime, so one such file made
    every later write in the folder fail: a note in every run, nothing cached again (the suite's
    full-disk tests did this to the session's cache). Under JAX's own lock (its `.lockfile`,
    flock), so that a writer between its two writes is waited for; without the lock in
    `wait_sec`, nothing is removed. Returns how many entries went."""
    import fcntl

    folder = Path(path)
    try:
        with open(folder / ".lockfile", "a") as lock:
            deadline = time.monotonic() + wait_sec
            while True:
                try:
                    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        return 0
                    time.sleep(0.05)
            unfinished = [
                entry
                for entry in folder.glob("*-cache")
                if not entry.with_name(entry.name.removesuffix("-cache") + "-atime").exists()
            ]
            for entry in unfinished:
                entry.unlink(missing_ok=True)
            return len(unfinished)
    except OSError:  # a read-only folder, say: JAX's own note tells what it cannot do
        return 0


CACHE_WARNINGS = ("Error reading persistent compilation cache entry",
                  "Error writing persistent compilation cache entry")  # fmt: skip


def note_damaged_cache_entries(path: str) -> None:
    """JAX warns, two lines per entry, when a compilation-cache entry cannot be read (a file cut
    short, by a full disk or a killed writer) or written, then compiles the program again: one
    note line says it instead, once per process, and the run goes on. Other warnings are
    shown as before."""
    shown = warnings.showwarning
    noted = False

    def show(message: Warning | str, category: type[Warning], *args: Any, **kw: Any) -> None:
        nonlocal noted
        text = str(message)
        if not text.startswith(CACHE_WARNINGS):
            shown(message, category, *args, **kw)
            return
        if not noted and jax.process_index() == 0:
            cause = text.split("': ", 1)[-1].splitlines()[0][:160]
            print(
                f"note: JAX's compilation cache in {path} has an entry it cannot "
                f"{'read' if 'reading' in text else 'write'} ({cause}); the program is compiled "
                "again (remove that folder, or run with --no-compile-cache)",
                file=sys.stderr,
                flush=True,
            )
        noted = True

    warnings.showwarning = show


class CompileMeter:
    """Seconds this process spent turning programs into executables (tracing, lowering, XLA
    compilation or a load from the persistent cache), and the cache's hits and misses, from
    JAX's monitoring events. One meter per process; `record()` is the run record's entry."""

    _events = {
        "/jax/core/compile/jaxpr_trace_duration",
        "/jax/core/compile/jaxpr_to_mlir_module_duration",
        "/jax/core/compile/backend_compile_duration",
    }
    _instance: CompileMeter | None = None

    def __init__(self) -> None:
        self.sec = 0.0
        self.hits = 0
        self.misses = 0
        self.steps: dict[str, Any] = {"dir": None, "hits": 0, "misses": 0}

    @classmethod
    def get(cls) -> CompileMeter:
        if cls._instance is None:
            meter = cls._instance = cls()
            jax.monitoring.register_event_duration_secs_listener(meter._duration)  # type: ignore[arg-type]
            jax.monitoring.register_event_listener(meter._event)
        return cls._instance

    def _duration(self, event: str, duration: float, **kwargs: Any) -> None:
        if event in self._events:
            self.sec += duration

    def _event(self, event: str, **kwargs: Any) -> None:
        if event == "/jax/compilation_cache/cache_hits":
            self.hits += 1
        elif event == "/jax/compilation_cache/cache_misses":
            self.misses += 1

    def record(self) -> dict[str, Any]:
        on = (
            jax.config.values["jax_enable_compilation_cache"]
            and jax.config.values["jax_compilation_cache_dir"]
        )
        return {
            "pmap_lowering": pmap_lowering(),  # in every JAX record, pmap's or not
            "compile_sec": round(self.sec, 3),
            "compile_cache": {
                "dir": jax.config.values["jax_compilation_cache_dir"] if on else None,
                "hits": self.hits,
                "misses": self.misses,
                "steps": self.steps,  # the exported train steps (cached_step)
            },
        }


# What --phase-timing's phases mean in a JAX trainer, for its record: the step is one program.
PHASE_NOTE = (
    "forward_backward = the whole compiled step (forward, backward, gradient all-reduce, "
    "update: one XLA program); allreduce = a separate all-reduce of a gradient-sized tree, "
    "also contained in forward_backward; optimizer is not separable (0)"
)


def pmap_lowering() -> str:
    """How this JAX runs `jax.pmap`: since 0.8 through `jax.jit` and `jax.shard_map` (so jax-pmap
    and jax-shardmap compile through the same path); until the flag's removal after 0.9.2,
    `jax_pmap_shmap_merge=False` brought the original implementation back."""
    since = tuple(int(v) for v in jax.__version__.split(".")[:2]) >= (0, 8)
    merged = jax.config.values.get("jax_pmap_shmap_merge", since)  # flag gone: merged for good
    how = "jit + shard_map" if merged else "the original pmap (jax_pmap_shmap_merge=False)"
    return f"jax {jax.__version__}: jax.pmap runs as {how}"


# Config fields that cannot change the train step's program: where results go, when to log or
# stop, the host's loader threads, and the seed (it only picks values: the initial weights and
# the dropout key are arguments of the step, not constants in it; a test checks this). Every
# other field is part of an exported step's key.
NOT_IN_STEP = frozenset(
    {
        "output",
        "tensorboard",
        "checkpoint_dir",
        "save_state",
        "resume",
        "log_every",
        "phase_timing",
        "target_accuracy",
        "patience",
        "prefetch",
        "collective_timeout",
        "compile_cache",
        "step_cache",
        "cache_dir",
        "seed",
        "download",
        "verify",
        "devices",  # where the devices are: the key holds the devices and shardings themselves
    }
)
STEP_CACHE_FILES = 64  # exported steps kept per cache directory (100 KB-1 MB each), newest first
# An exported step's file: the magic line, the key it was stored under (a line), the sha256 of
# key and payload, the payload. The key inside binds the file to its configuration: a file
# copied under another configuration's name is intact but not that configuration's step.
STEP_FILE_MAGIC = b"dp-bench exported step 2\n"
STEP_FILE_MAX = 64 << 20  # the program (100 KB-1 MB measured) beside its LR table's bytes


def cached_step(
    cfg: Config, step: Callable[..., Any], steps_per_epoch: int, donate: tuple[int, ...] = ()
) -> Callable[..., Any]:
    """--compile-cache, the tracing half: the train step as a `jax.export`ed program, stored in
    <cache-dir>/jax-steps, so that a later run of the same configuration loads it instead of
    tracing the Python model again (the persistent compilation cache then skips XLA's compile).
    `step` is the trainer's parallel train step (pmap, or jit with shardings), unchanged: the
    program is the one it lowers to, exported on the first run and called through
    `Exported.call` on every run (the first one too, so both runs compile the same program).

    The key is everything the program depends on: the config (less NOT_IN_STEP), the LR table
    (a constant of the program), the arguments' shapes, dtypes and shardings, the devices, JAX's
    settings, the versions of JAX, Flax, Optax and numpy, and the text of every module in
    frameworks/ and common/ (any edit is a new key). Off (the step is returned as it is) with
    --no-compile-cache or --no-step-cache, in a multi-process run, under the tests' bug
    injection, and without the `flatbuffers` package that JAX's serialisation needs; a failure
    to export, load or compile it falls back to the step as it is, with a note (a damaged file
    is removed). The record's compile_cache.steps says which."""
    meter = CompileMeter.get()
    off = step_cache_off(cfg)
    if off:
        meter.steps = {"dir": None, "hits": 0, "misses": 0, "off": off}
        return step
    folder = Path(cfg.cache_dir).expanduser() / "jax-steps"
    meter.steps = {"dir": str(folder), "hits": 0, "misses": 0}
    table = lr_table_for(cfg, steps_per_epoch)  # what make_optimizer bakes into the program
    treedef: Any = None
    call: Callable[..., Any] | None = None
    loaded: Path | None = None

    def flat_step(leaves: list[jax.Array], batch: Any) -> tuple[list[jax.Array], Any]:
        new_state, metrics = step(jax.tree.unflatten(treedef, leaves), batch)
        return jax.tree.leaves(new_state), metrics

    def first_call(state: Any, batch: Any) -> Callable[..., Any]:
        nonlocal treedef, loaded
        leaves, treedef = jax.tree.flatten(state)  # the state's functions stay out of the file
        path = folder / f"train_step-{step_key(cfg, table, (leaves, batch))}.jaxexport"
        start = time.perf_counter()
        exported = load_exported(path, (leaves, batch), STEP_FILE_MAX + 2 * table.nbytes)
        meter.sec += time.perf_counter() - start  # a load is part of what compiling costs
        if exported is None:  # trace and lower once, here (the meter counts both)
            exported = jax.export.export(jax.jit(flat_step))(leaves, batch)
            store_exported(path, exported)
            meter.steps["misses"] += 1
        else:
            loaded = path
            meter.steps["hits"] += 1
        # The new state keeps the shardings the state came in with, as the traced step's does:
        # the arrays that come back from elsewhere (jax-pmap's p_mean at an epoch's end, a
        # restored checkpoint) then match the call's own outputs, and its fast path (no retrace
        # of the call, ~10 ms a time on a CPU) stays in use. The metrics' are XLA's choice.
        same_as_in = ([x.sharding for x in leaves], None)
        return jax.jit(exported.call, donate_argnums=donate, out_shardings=same_as_in)

    def run(state: Any, batch: Any) -> tuple[Any, Any]:  # no host sync
        nonlocal call
        if call is None:
            try:  # the first execution compiles: a failure there falls back too
                call = first_call(state, batch)
                return run(state, batch)
            except ConfigError:
                raise  # a cache file that is no file (a FIFO, a device) or too large: exit 2
            except Exception as exc:  # the cache must never cost a run: trace as without it
                if any(x.is_deleted() for x in jax.tree.leaves(state)):
                    raise  # the step ran on donated buffers and failed: not the cache's doing
                print(f"note: train step not exported ({first_line(exc)})", file=sys.stderr)
                meter.steps["off"] = f"failed: {first_line(exc)}"
                if loaded is not None:  # a file that loads but does not run: not again
                    with contextlib.suppress(OSError):
                        loaded.unlink(missing_ok=True)
                call = step
        if call is step:
            return step(state, batch)
        leaves, metrics = call(jax.tree.leaves(state), batch)
        return jax.tree.unflatten(treedef, leaves), metrics

    return run


def step_cache_off(cfg: Config) -> str | None:
    """Why cached_step cannot store steps in this run (None: it can)."""
    if not cfg.compile_cache:
        return "--no-compile-cache"
    if not cfg.step_cache:
        return "--no-step-cache"
    if jax.process_count() > 1:
        return "multi-process run"
    if os.environ.get(INJECT_ENV):  # a test's injected bug must neither be stored nor hidden
        return f"{INJECT_ENV} is set"
    if importlib.util.find_spec("flatbuffers") is None:
        return "the flatbuffers package is not installed (pip install flatbuffers)"
    return None


def step_key(cfg: Config, lr_table: np.ndarray, args: Any) -> str:
    """The hex digest naming an exported train step (cached_step): what its program depends on."""
    fields = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in NOT_IN_STEP}
    leaves, treedef = jax.tree.flatten(args)
    parts = {
        "config": fields,
        "lr_table": hashlib.sha256(np.ascontiguousarray(lr_table).tobytes()).hexdigest(),
        "args": [str(treedef)]
        + [f"{x.shape} {x.dtype} {getattr(x, 'sharding', None)}" for x in leaves],
        "devices": [d.device_kind for d in jax.devices()],
        # every JAX setting but the platform choice (--devices): the devices are in the key
        "jax_config": sorted(i for i in jax.config.values.items() if i[0] != "jax_platforms"),
        "versions": [
            importlib.metadata.version(p) for p in ("jax", "jaxlib", "flax", "optax", "numpy")
        ],
        "sources": source_digest(),
    }
    return hashlib.sha256(json.dumps(parts, default=repr).encode()).hexdigest()[:32]


@functools.cache
def source_digest() -> str:
    """sha256 of every module in frameworks/ and common/ (path and text). Taken once per
    process, first by setup_process: the text the process imported, not an edit made since."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("frameworks/*.py"), *root.glob("common/*.py")]):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()


def load_exported(path: Path, args: Any, limit: int = STEP_FILE_MAX) -> jax.export.Exported | None:
    """The exported step stored at `path` (`train_step-<key>.jaxexport`), or None: missing,
    damaged or stored under another key (removed: traced again and replaced), or not for
    `args`."""
    key = path.stem.removeprefix("train_step-").encode()
    try:
        data = path.read_bytes()
        head, _, rest = data.partition(b"\n")
        stored, _, rest = rest.partition(b"\n")
        digest, payload = rest[:32], rest[32:]
        if head + b"\n" != STEP_FILE_MAGIC or hashlib.sha256(stored + payload).digest() != digest:
            raise ValueError("not a dp-bench exported step, or damaged")
        if stored != key:
            raise ValueError(
                f"its key {stored[:64].decode('ascii', 'replace')} is another configuration's"
            )
        exported = jax.export.deserialize(bytearray(payload))
    except FileNotFoundError:
        return None
    except ConfigError:
        raise
    except Exception as exc:  # a damaged or foreign file: traced again and replaced
        print(f"note: ignoring the exported step {path} ({first_line(exc)})", file=sys.stderr)
        with contextlib.suppress(OSError):
            path.unlink(missing_ok=True)
        return None
    want = [(tuple(x.shape), x.dtype) for x in jax.tree.leaves(args)]
    if [(tuple(a.shape), a.dtype) for a in exported.in_avals] != want:
        return None
    with contextlib.suppress(OSError):
        os.utime(path)  # recently used: pruned last
    return exported


def store_exported(path: Path, exported: jax.export.Exported) -> None:
    """Write the exported step atomically (concurrent runs may write the same file), with its
    key and a checksum, and keep the STEP_CACHE_FILES most recently used. A failed write costs
    only the next run's trace."""
    try:
        payload = exported.serialize()
        key = path.stem.removeprefix("train_step-").encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(path.parent, "train_step-")  # writers killed mid-write
        digest = hashlib.sha256(key + payload).digest()
        atomic_write_bytes(path, STEP_FILE_MAGIC + key + b"\n" + digest + payload)
        files = sorted(path.parent.glob("*.jaxexport"), key=mtime, reverse=True)
        for old in files[STEP_CACHE_FILES:]:
            old.unlink(missing_ok=True)
    except Exception as exc:
        print(f"note: exported step not stored ({first_line(exc)})", file=sys.stderr)


def mtime(path: Path) -> float:
    """Modification time, or 0 for a file another process has just removed."""
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def check_config(cfg: Config) -> None:
    """The JAX trainers' checks before training starts (ConfigError / DatasetError)."""
    check_devices(cfg)
    check_available(cfg)
    check_resume(cfg, CHECKPOINTS)


def check_devices(cfg: Config) -> None:
    """Start JAX's backends (the first device query) and check `--devices` against them: one
    ConfigError for `--devices cuda` without a GPU and for a platform JAX cannot start (e.g.
    JAX_PLATFORMS=cuda on a machine without one), not a traceback from inside JAX."""
    # A CUDA plugin that cannot start (no driver, no GPU) logs a traceback here: one line says it
    # instead (below, or the ConfigError for --devices cuda).
    plugin_log, errors = logging.getLogger("jax._src.xla_bridge"), _Kept()
    plugin_log.addHandler(errors)
    plugin_log.propagate = False
    try:
        gpus = [d for d in jax.local_devices() if d.platform == "gpu"]
    except (RuntimeError, AssertionError) as exc:  # no such backend / no plugin for it at all
        if cfg.devices != "cuda":
            platforms = os.environ.get("JAX_PLATFORMS") or jax.config.values["jax_platforms"]
            raise ConfigError(
                f"JAX could not start its devices (JAX_PLATFORMS={platforms!r}"
                f"{': ' + str(exc).splitlines()[0][:200] if str(exc) else ''}); "
                "unset JAX_PLATFORMS or use --devices cpu"
            ) from None
        gpus = []
    finally:
        plugin_log.removeHandler(errors)
        plugin_log.propagate = True
    why = need_gpus(cfg.devices, len(gpus), cfg.framework, f"jax {jax.__version__}, {jax_build()}")
    if why:
        raise ConfigError(why)
    if errors.records and not gpus and jax.process_index() == 0:
        last = errors.records[-1]
        cause = str(last.exc_info[1]) if last.exc_info else last.getMessage()
        print(
            f"note: JAX's CUDA plugin did not start ({cause.splitlines()[0][:160]}); this run "
            "is on the CPU (--devices cpu says so up front)",
            file=sys.stderr,
            flush=True,
        )


class _Kept(logging.Handler):
    """Keeps the log records it is given (check_devices: the CUDA plugin's errors)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def jax_build() -> str:
    """Which of JAX's CUDA plugins this interpreter has, for messages and the device probe."""
    plugins = [p for p in ("jax_cuda13_plugin", "jax_cuda12_plugin") if importlib.util.find_spec(p)]
    return f"{plugins[0]} installed" if plugins else "no CUDA plugin (a CPU build)"


def select_devices(n: int) -> tuple[list[jax.Device], str, Platform]:
    """The first `n` devices of every process (GPUs where JAX sees them, else the simulated
    host devices), ordered by process, the device kind for the run record, and their platform
    (for device_plan)."""
    local = jax.local_devices()
    if len(local) < n:
        where = ("GPU" if local[0].platform == "gpu" else "device") + (
            "s" if len(local) > 1 else ""
        )
        fix = (
            f"use --gpus {len(local)} or fewer"
            if local[0].platform == "gpu"
            else "run through main(), which sets XLA_FLAGS before JAX starts"
        )
        raise ConfigError(f"--gpus {n}: only {len(local)} {where} visible to JAX; {fix}")
    devices = [
        d
        for p in range(jax.process_count())
        for d in [d for d in jax.devices() if d.process_index == p][:n]
    ]
    kind = "cpu-simulated" if local[0].platform == "cpu" else f"cuda:{local[0].device_kind}"
    return devices, kind, platform_of(local[0])


# -- the run: what every JAX trainer's train() does before its epoch loop ----------------------

Put = Callable[[Batch], tuple[jax.Array, ...]]  # a batch of numpy arrays -> on the devices


def start_run(
    cfg: Config,
    framework: str,
    packages: tuple[str, ...],
    axis: str,
    transform: str,
    build_model: Callable[[Config, int, int, Any], Any],
    create_train_state: Callable[[Config, Any, tuple[int, int, int], Mesh, int], TrainState],
    replicate: Callable[[Any, Mesh], Any],
    unreplicate: Callable[[Any], Any],
    to_device: Callable[[Batch, Mesh], tuple[jax.Array, ...]],
    parallel_batches: Callable[[Callable[..., Any], Mesh], Callable[..., Any]],
    sync: Callable[[], None],
) -> tuple[Run, Mesh, DevicePlan, TrainState, Put, Put]:
    """A JAX trainer's run, set up as in all three: the first `cfg.gpus` devices of every
    process on a 1-D mesh along `axis`; the device plan (dtype, float32 mode, donation: decided
    once); the data (`Run`: this process's rows of every global batch); the model and its state
    on the devices, made by the trainer's own `build_model` and `create_train_state`; the run
    record (`transform`: how the trainer's step runs); --pipeline device and --resume, through
    the trainer's `replicate`, `unreplicate`, `to_device` and `parallel_batches`. `sync` waits
    for the trainer's newest state (the timers). Returns the Run (`run.start`: the first epoch
    to train), the mesh, the plan, the state, `put` (a batch onto the mesh: test batches) and
    `put_train` (training batches, made on the devices under --pipeline device)."""
    CompileMeter.get()  # from here on: compile time and cache hits, for the record
    devices, kind, platform = select_devices(cfg.gpus)  # cfg.gpus per process, all processes'
    per_device(cfg.batch_size, len(devices))  # all processes' devices (ConfigError names a fix)
    mesh = Mesh(np.array(devices), (axis,))
    plan = device_plan(cfg, platform)  # dtype, float32 mode, donation: decided once
    fp32 = use_device_plan(plan)
    # This process's rows of every global batch; static shapes: every test batch is padded to
    # a multiple of this process's device count.
    run = Run(cfg, framework, packages, rank=jax.process_index(), world=jax.process_count(),
              layout="NHWC", gpu=plan.platform == "gpu", sync=sync, pad_to=cfg.gpus,
              profiler=JaxProfiler)  # fmt: skip
    model = build_model(cfg, run.ds.channels, run.ds.num_classes, plan.compute_dtype)
    state = create_train_state(cfg, model, run.ds.image_shape, mesh, len(run.loader))
    params = unreplicate(state.params)  # host copy: the size, and what the program runs
    run.record(
        devices=len(devices),
        kind=kind,
        params=count_params(params),
        threads=jax_threads(devices),
        execution=execution(transform, devices),
        precision=fp32,
        ran=what_ran(model, params, unreplicate(state.batch_stats), run.ds.image_shape),
    )
    put: Put = lambda batch: to_device(batch, mesh)  # this run's mesh
    # --pipeline device: the training set goes to the devices here, the crops are made there.
    put_train = train_put(
        run.loader, put, lambda a: replicate(a, mesh), lambda f: parallel_batches(f, mesh)
    )
    state, _ = run.resume(state, CHECKPOINTS, unreplicate, lambda s: replicate(s, mesh))
    return run, mesh, plan, state, put, put_train
