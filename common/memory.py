"""Sizes held against memory before a run trains: the run's peak memory estimated from its config
alone, and a config that cannot fit refused in one line with the size that would (a user's
mistake: exit 2 before the data loads). The estimate counts the model (float32 weights,
gradients and optimiser state per replica), the activations each image keeps for the backward
pass (every conv's output, SAVED times, in the compute dtype) times the images a replica holds
at once, and the data (uint8 images, the prefetch queue, a training set resident on the
device). Calibrated against measured peaks (docs/results/h100-20261123; peak RSS on a 2-core
CPU), it is a floor: a run is refused only where the floor already exceeds the memory there is
(psutil's available host memory; on a GPU, the smallest GPU's total from nvidia-smi)."""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass

import psutil

from common import runtime
from common.config import DATA_SHAPES, Config, data_dims, image_side, train_size
from common.errors import ConfigError
from common.init import parameter_spec
from common.pipeline import DEVICE_DATA_LIMIT

# Feature maps per conv kept for the backward pass: its output (for its BatchNorm) and the
# normalised, rectified output (for the next conv), less where a framework frees or fuses:
# 7/4 keeps the estimate under every peak measured (torch's eager CPU step held 1.85-2.1).
SAVED = 1.75
GIB = 2**30
PROCESS_PER_DEVICE = ("torch-ddp", "torch-fsdp")  # the trainers that run one process per device


@dataclass(frozen=True)
class Need:
    """A run's estimated peak in bytes: `fixed` + `per_image` x the images of `batch`, where
    `batch` is what grows with --batch-size there (a replica's share on a GPU, every image a
    process holds at once on the CPU), and `host` what the host holds besides on a GPU run."""

    fixed: int
    per_image: int
    batch: int
    devices: int  # over which the global batch is split (a suggested batch divides by it)
    host: int = 0  # a GPU run's host memory: the data (0 on a CPU run: in `fixed`)

    @property
    def total(self) -> int:
        return self.fixed + self.per_image * self.batch


def conv_sides(model: str, side: int) -> dict[str, int]:
    """The output side of each conv block of `model` on `side`x`side` images, by the name
    prefix of its parameters (stride-1 3x3 stem; ResNet-18's stride-2 stages layer2-4, sides
    rounded up; the WideResNet's 2x2 max-pools after layer2 and layer4, rounded down)."""
    if model == "resnet18":
        sides = {f"layer{i + 1}.": math.ceil(side / 2**i) for i in range(4)}
    else:
        sides = {f"layer{i + 1}.": side // 2 ** (i // 2) for i in range(6)}
    return {"conv1.": side, **sides}


def feature_map_elements(model: str, width: float, side: int, channels: int) -> tuple[int, int]:
    """(sum over every conv of its output's elements, the largest output) for one image."""
    sides = conv_sides(model, side)
    total = largest = 0
    for name, shape, kind in parameter_spec(model, width, channels, 2):
        if kind != "conv":
            continue
        s = next(v for prefix, v in sides.items() if name.startswith(prefix))
        total += shape[0] * s * s
        largest = max(largest, shape[0] * s * s)
    return total, largest


def estimate(cfg: Config, gpu: bool, world: int = 1) -> Need:
    """The peak memory of `cfg` on GPUs (`gpu`) or simulated CPU devices, run by `world`
    processes (torch-ddp: one per device; JAX: one per host, --gpus devices each); the host's
    share is that of the processes on this machine (`processes_here`). See the module doc."""
    channels, classes = data_dims(cfg)
    side = image_side(cfg)
    spec = parameter_spec(cfg.model, cfg.width, channels, classes)
    params = sum(math.prod(shape) for _, shape, _ in spec)
    slots = 1 if (cfg.optimizer == "novograd" or cfg.momentum > 0) else 0
    model = params * 4 * (2 + slots)  # weights, gradients, optimiser state: float32
    maps, largest = feature_map_elements(cfg.model, cfg.width, side, channels)
    act_bytes = 2 if gpu and cfg.precision in ("bf16", "fp16") else 4
    image = side * side * channels
    per_image = int(SAVED * maps * act_bytes) + 4 * image  # + its float32 input
    eval_per_image = 2 * largest * act_bytes + 4 * image  # forward only: two maps live
    n_train = train_size(cfg)
    n_test_all = DATA_SHAPES.get(cfg.dataset, (cfg.synthetic_test,))[0]
    n_test = min(n_test_all, cfg.test_limit or n_test_all)
    ddp = cfg.framework in PROCESS_PER_DEVICE
    per_process = 1 if ddp else cfg.gpus  # devices each process drives
    devices = per_process * max(1, world)
    local = max(1, cfg.batch_size // devices)  # a replica's share of the global batch
    # a test batch holds at most a process's part of the test set (common/pipeline.EvalLoader)
    procs = max(1, world)
    eval_process = min(max(1, cfg.eval_batch_size // procs), -(-n_test // procs))
    eval_local = max(1, eval_process // per_process)
    data = (n_train + n_test) * image  # uint8, in every process (each loads the dataset)
    queued = (cfg.prefetch + 1) * 4 * image  # per image: the float32 batches of the prefetch
    resident = n_train * image if cfg.pipeline == "device" else 0
    if gpu and cfg.pipeline == "auto" and n_train * image <= DEVICE_DATA_LIMIT:
        resident = n_train * image
    here = processes_here(cfg, world)
    if gpu:
        evaluation = max(0, eval_local * eval_per_image - local * per_image)
        fixed = model + resident + evaluation
        host = here * (data + queued * local * per_process)
        return Need(fixed, per_image, local, devices, host=host)
    # CPU: a process's replicas run at once; torch-dp's one CPU replica takes the whole batch
    replicas = 1 if cfg.framework == "torch-dp" else per_process
    held = local * per_process  # the images a process holds at once
    evaluation = max(0, eval_local * per_process * eval_per_image - held * per_image)
    fixed = here * (data + replicas * (model + resident) + evaluation)
    return Need(fixed, per_image + queued, here * held, devices)


def processes_here(cfg: Config, world: int) -> int:
    """The run's processes on this machine: torch-ddp's and torch-fsdp's ranks (torchrun's
    LOCAL_WORLD_SIZE on several machines), one for every other trainer (a JAX process per host)."""
    if cfg.framework not in PROCESS_PER_DEVICE:
        return 1
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    return int(local) if local.isdigit() and int(local) >= 1 else max(1, world)


def host_available() -> int:
    """Bytes of host memory a run can still take (psutil: MemAvailable on Linux)."""
    return int(psutil.virtual_memory().available)


def gpu_memory() -> int:
    """Total bytes of the smallest GPU, from nvidia-smi; 0 where that cannot be said (no
    nvidia-smi, MIG instances, an answer it cannot read): the GPU check is then skipped."""
    query = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout
        return min(int(v) << 20 for v in out.split())
    except (OSError, subprocess.SubprocessError, ValueError):
        return 0


DEVICE_BYTES = 256 << 20  # memory a simulated device (a torch-ddp process) needs at least


def check_machine(cfg: Config) -> None:
    """Before any process starts (the command line, common/cli.py's `resolved`, and the runners
    that plan runs): the images and the simulated devices of `cfg` fit this machine's physical
    memory at all. The run's own estimate, against the memory left when its processes have
    started, is `check_memory`'s."""
    n_train = train_size(cfg)
    n_test, _, channels = DATA_SHAPES.get(
        cfg.dataset, (cfg.synthetic_test, 32, cfg.synthetic_channels)
    )
    side = image_side(cfg)
    n_test = min(n_test, cfg.test_limit or n_test)
    memory = runtime.physical_memory()
    # uint8 images plus the float32 copy a resize makes: 5 bytes per pixel value.
    need = (n_train + n_test) * side * side * channels * 5
    if memory and need > memory * 0.8:
        raise ConfigError(
            f"{n_train + n_test} images of {side}x{side}x{channels} need ~{need / 2**30:.1f} "
            f"GiB of memory, more than this machine's {memory / 2**30:.1f} GiB allow; use a "
            "smaller --image-size or --train-limit"
        )
    if memory and cfg.gpus * DEVICE_BYTES > memory:
        most = max(1, memory // DEVICE_BYTES)
        raise ConfigError(
            f"--gpus {cfg.gpus} needs at least {cfg.gpus * DEVICE_BYTES / 2**30:.0f} GiB of "
            f"memory ({DEVICE_BYTES >> 20} MiB per device); this machine allows --gpus {most}"
        )


def check_memory(
    cfg: Config,
    gpu: bool,
    world: int = 1,
    host_bytes: int | None = None,
    gpu_bytes: int | None = None,
) -> None:
    """Refuse `cfg` (ConfigError: one line with the size that would fit) where its estimated
    peak exceeds the memory there is: the host's available memory, and on a GPU run each GPU's
    memory as well. `host_bytes` / `gpu_bytes` stand in for the measured values (tests)."""
    need = estimate(cfg, gpu, world)
    host = host_available() if host_bytes is None else host_bytes
    if gpu:
        if host and need.host > host:
            raise ConfigError(
                f"the data of this run ({cfg.dataset} at {image_side(cfg)}x{image_side(cfg)}) "
                f"needs about {need.host / GIB:.1f} GiB of host memory, this machine has "
                f"{host / GIB:.1f} GiB available; use a smaller --image-size or --train-limit"
            )
        have = gpu_memory() if gpu_bytes is None else gpu_bytes
        where = f"on each GPU, which has {have / GIB:.1f} GiB"
    else:
        have = host
        where = f"of host memory, this machine has {have / GIB:.1f} GiB available"
    if not have or need.total <= have:
        return
    side = image_side(cfg)
    asked = f"--batch-size {cfg.batch_size} at {side}x{side} ({cfg.model}, width {cfg.width:g})"
    raise ConfigError(
        f"{asked} needs about {need.total / GIB:.1f} GiB {where}; {fix(cfg, gpu, world, have)}"
    )


def fix(cfg: Config, gpu: bool, world: int, have: int) -> str:
    """What would fit in `have` bytes: the largest global batch (a multiple of --gpus), else
    the largest image size at the smallest batch, else a narrower model."""
    need = estimate(cfg, gpu, world)
    room = (have - need.fixed) // need.per_image if have > need.fixed else 0
    batch = room * cfg.batch_size // need.batch // need.devices * need.devices
    if batch >= need.devices:
        return f"--batch-size {batch} would fit"
    smallest = cfg.replace(batch_size=need.devices, eval_batch_size=need.devices)
    for side in range(image_side(cfg) - 8 - image_side(cfg) % 8, 7, -8):
        if estimate(smallest.replace(image_size=side), gpu, world).total <= have:
            return f"--batch-size {need.devices} at --image-size {side} would fit"
    return "no batch size fits at this image size; use a smaller --width or --image-size"
