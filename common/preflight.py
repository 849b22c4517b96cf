"""The checks a run passes before any work, on what the flags ask of this machine: the paths it
writes and reads (`check_outputs`) and the memory its images and simulated devices need
(`check_memory`). Each refusal is one line naming the fix (ConfigError: exit 2), given before
any process starts or file is created: by the command line (common/cli.py's `resolved`, so
every trainer and tool that checks a trainer's flags), by run_main (common/trainer.py) and by
the runners that plan runs (benchmarks/compare.py, benchmarks/tutorial_loops.py).
What the flags ask of each other and of the dataset is the config's own check
(common/config.py's `validate`).
"""

from __future__ import annotations

from pathlib import Path

from common import runtime
from common.config import DATA_SHAPES, Config, image_side, train_size
from common.errors import ConfigError
from common.runtime import unnamable, unwritable

DEVICE_BYTES = 256 << 20  # memory a simulated device (a torch-ddp process) needs at least


def check_memory(cfg: Config) -> None:
    """The images and the simulated devices of `cfg` fit this machine's physical memory."""
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


def check_outputs(cfg: Config) -> None:
    """--output, --save-state, --checkpoint-dir and --profile-dir writable, --data-dir and
    --cache-dir directories the file system can name, before anything starts (not after an
    hour of training; --tensorboard has its own check): one line naming the path, exit 2.
    Creates nothing."""
    for flag, path, kind in (
        ("--output", cfg.output, "file"),
        ("--save-state", cfg.save_state, "file"),
        ("--checkpoint-dir", cfg.checkpoint_dir, "dir"),
        ("--profile-dir", cfg.profile_dir if cfg.profile else "", "dir"),
    ):
        why = path and unwritable(path, kind)
        if why:
            raise ConfigError(f"{flag} {path}: {why}; choose another path")
    # read (and cached into) as directories: a name the file system cannot look up, or one
    # under a file, fails at the first open, after the set-up
    for flag, path in (("--data-dir", cfg.data_dir), ("--cache-dir", cfg.cache_dir)):
        why = path and unnamable(path)
        if not why and path and Path(path).expanduser().exists():
            why = None if Path(path).expanduser().is_dir() else "it is not a directory"
        if why:
            raise ConfigError(f"{flag} {path}: {why}; choose another path")
    # the JAX trainers create <cache-dir>/jax and jax-steps at start-up (JAX_COMPILATION_CACHE_DIR,
    # checked with the launch variables, wins for the first): a HOME that is read-only or on
    # /proc ended the run with "failed: FileNotFoundError", exit 1
    if cfg.framework.startswith("jax") and cfg.compile_cache:
        why = unwritable(cfg.cache_dir, "dir")
        if why:
            raise ConfigError(
                f"--cache-dir {cfg.cache_dir}: {why}; choose another path, or --no-compile-cache"
            )
