"""What the three JAX trainers share besides the models (frameworks/jax_models.py): the train
state, the Optax optimiser, the loss, prefetching to the devices and the device pipeline,
evaluation, checkpoint I/O, the XLA and compilation-cache set-up, device selection, and a run's
set-up around the trainer's own functions (`start_run`). The trainers keep their model, state,
step, mesh, parallel transform and epoch loop: what differs between pmap, jit+sharding and
shard_map. Joining a multi-process run: `setup_process`."""

from __future__ import annotations

import collections
import dataclasses
import importlib.util
import itertools
import json
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

import jax
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
from common.footprint import state_record
from common.pipeline import EvalLoader, TrainLoader
from common.results import RunRecorder
from common.run import Run
from common.runtime import (
    available_cores,
    check_xla_flags,
    env_int,
    simulate_host_devices,
    threads_record,
    use_xla_cpu_ynn,
    xla_cpu_execution,
    xla_cpu_ynn_wanted,
)
from common.schedule import lr_table_for
from common.timing import PhaseTimer
from common.trainer import failure_record, prog_name
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
    multi-process run if the launch environment asks for one: JAX_COORDINATOR_ADDRESS=host:port
    with JAX_NUM_PROCESSES and JAX_PROCESS_ID (one process per host, all its devices), or srun's
    SLURM_NTASKS > 1 (JAX's own cluster detection: one task per GPU, its SLURM_LOCALID)."""
    setup_xla(cfg)
    use_compile_cache(cfg)
    coordinator = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not coordinator and env_int("SLURM_NTASKS", 1) <= 1:
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPU processes
    # XLA ends a process whose peers never join with SIGABRT and no record: before it does,
    # `gave_up_joining` writes this process's failed record, one line, exit 1.
    timeout = cfg.collective_timeout
    why = (f"the JAX processes did not all join within {timeout:g} s (--collective-timeout): "
           "start every one of them, with the same JAX_COORDINATOR_ADDRESS")  # fmt: skip
    watchdog = threading.Timer(timeout, gave_up_joining, (cfg, why))
    watchdog.daemon = True
    watchdog.start()
    n, i = (env_int(name, -1) for name in ("JAX_NUM_PROCESSES", "JAX_PROCESS_ID"))  # -1: unset
    jax.distributed.initialize(coordinator, num_processes=None if n < 0 else n,
                               process_id=None if i < 0 else i,
                               initialization_timeout=int(timeout) + 30)  # fmt: skip
    watchdog.cancel()


def gave_up_joining(cfg: Config, why: str) -> None:
    """The processes did not all join: one line, this process's failed record (it never joined
    the others, so it writes its own), exit 1, now (XLA holds the main thread)."""
    print(f"{prog_name(cfg.framework)}: failed: {why}", file=sys.stderr, flush=True)
    try:
        failure_record(cfg, why, ("jax", "jaxlib", "flax", "optax"), alone=True)
    finally:
        os._exit(1)


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
    return path


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


def device_bytes(tree: Any) -> int:
    """The bytes of `tree`'s arrays on this process's fullest device: each device holds its
    addressable shards (the whole array where replicated, 1/N of it where sharded N ways)."""
    per_device: collections.Counter[Any] = collections.Counter()
    for leaf in jax.tree.leaves(tree):
        for shard in getattr(leaf, "addressable_shards", ()):
            per_device[shard.device] += shard.data.nbytes
    return max(per_device.values(), default=0)


def state_bytes(state: TrainState) -> dict[str, int]:
    """What one device keeps between steps (common.footprint.state_record), read from the
    state's arrays. Grads live inside the step only, with the params' shardings (the GSPMD
    partitioner and pmap keep them so): counted as the params' bytes."""
    params = device_bytes(state.params)
    return state_record(
        params=params,
        grads=params,
        optimizer=device_bytes(state.opt_state),
        buffers=device_bytes(state.batch_stats),
    )


# -- the run: what every JAX trainer's train() does before its epoch loop ----------------------

Put = Callable[[Batch], tuple[jax.Array, ...]]  # a batch of numpy arrays -> on the devices


def start_run(
    cfg: Config,
    framework: str,
    packages: tuple[str, ...],
    mesh: Mesh,
    kind: str,
    platform: Platform,
    transform: str,
    build_model: Callable[[Config, int, int, Any], Any],
    create_train_state: Callable[[Config, Any, tuple[int, int, int], Mesh, int], TrainState],
    replicate: Callable[[Any, Mesh], Any],
    unreplicate: Callable[[Any], Any],
    to_device: Callable[[Batch, Mesh], tuple[jax.Array, ...]],
    parallel_batches: Callable[[Callable[..., Any], Mesh], Callable[..., Any]],
    sync: Callable[[], None],
) -> tuple[Run, DevicePlan, TrainState, Put, Put]:
    """A JAX trainer's run on the trainer's `mesh` (devices of `kind` and `platform`, from
    `select_devices`), set up as in all three: the device plan (dtype, float32 mode, donation:
    decided once); the data (`Run`: this process's rows of every global batch); the model and
    its state on the devices, made by the trainer's own `build_model` and `create_train_state`;
    the run record (`transform`: how the trainer's step runs); --pipeline device and --resume,
    through the trainer's `replicate`, `unreplicate`, `to_device` and `parallel_batches`. `sync`
    waits for the trainer's newest state (the timers). Returns the Run (`run.start`: the first
    epoch to train), the plan, the state, `put` (a batch onto the mesh: test batches) and
    `put_train` (training batches, made on the devices under --pipeline device)."""
    CompileMeter.get()  # from here on: compile time and cache hits, for the record
    devices = list(mesh.devices.flat)  # cfg.gpus per process, all processes'
    per_device(cfg.batch_size, len(devices))  # all processes' devices (ConfigError names a fix)
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
    rec = run.record(
        devices=len(devices),
        kind=kind,
        params=count_params(params),
        threads=jax_threads(devices),
        execution=execution(transform, devices),
        precision=fp32,
        ran=what_ran(model, params, unreplicate(state.batch_stats), run.ds.image_shape),
        state_bytes=state_bytes(state),
    )
    rec.extra["xla_flags"] = os.environ.get("XLA_FLAGS", "")  # XLA's options, as this run ran
    put: Put = lambda batch: to_device(batch, mesh)  # this run's mesh
    # --pipeline device: the training set goes to the devices here, the crops are made there.
    put_train = train_put(
        run.loader, put, lambda a: replicate(a, mesh), lambda f: parallel_batches(f, mesh)
    )
    state, _ = run.resume(state, CHECKPOINTS, unreplicate, lambda s: replicate(s, mesh))
    return run, plan, state, put, put_train
