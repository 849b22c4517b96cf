"""The check a run passes before any work on the paths it writes and reads (`check_outputs`):
one line naming the fix (ConfigError: exit 2), given before any process starts or file is
created, by run_main (common/trainer.py) and the runners that plan runs (benchmarks/compare.py).
"""

from __future__ import annotations

from pathlib import Path

from common.config import Config
from common.errors import ConfigError
from common.runtime import unnamable, unwritable


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
    # the JAX trainers create <cache-dir>/jax at start-up (JAX_COMPILATION_CACHE_DIR, checked
    # with the launch variables, wins for the first)
    if cfg.framework.startswith("jax") and cfg.compile_cache:
        why = unwritable(cfg.cache_dir, "dir")
        if why:
            raise ConfigError(
                f"--cache-dir {cfg.cache_dir}: {why}; choose another path, or --no-compile-cache"
            )
