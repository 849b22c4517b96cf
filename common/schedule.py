"""Learning-rate scaling and schedules as pure functions.

`lr_table` returns the learning rate of every training step as one float32 array; every
framework indexes it by its step counter (torch and MXNet on the host, JAX inside the jitted step
via the Optax schedule), so all frameworks follow the same schedule to the last digit.
"""

from __future__ import annotations

import math

import numpy as np

from common.runtime import injected


def scaled_lr(lr: float, global_batch: int, base_batch: int, rule: str) -> float:
    """Peak LR for `global_batch` given `lr` at `base_batch`: none / linear / sqrt scaling."""
    ratio = global_batch / base_batch
    if rule == "none":
        return lr
    if rule == "linear":
        return lr * ratio
    if rule == "sqrt":
        return lr * math.sqrt(ratio)
    raise ValueError(f"unknown LR scaling rule {rule!r}; choose none, linear or sqrt")


def lr_table(
    lr: float,
    global_batch: int,
    base_batch: int,
    scaling: str,
    schedule: str,
    epochs: int,
    steps_per_epoch: int,
    warmup_epochs: float = 0.0,
    warmup_start_factor: float | None = 0.0,
    step_epochs: tuple[int, ...] = (),
    step_factor: float = 0.1,
) -> np.ndarray:
    """LR of each of the `epochs * steps_per_epoch` steps, float32.

    Warm-up ramps linearly from `peak * warmup_start_factor` to `peak` over `warmup_epochs`
    (`None` starts at the unscaled LR `lr`, i.e. 1/N of a linearly scaled peak); then the LR is
    constant, multiplied by `step_factor` at each epoch in `step_epochs`, or cosine-decayed to 0.
    """
    peak = scaled_lr(lr, global_batch, base_batch, scaling)
    total = epochs * steps_per_epoch
    steps = np.arange(total, dtype=np.float64)
    warm = int(round(warmup_epochs * steps_per_epoch))
    start = lr / peak if warmup_start_factor is None else warmup_start_factor
    if schedule == "constant":
        after = np.full(total, peak)
    elif schedule == "step":
        epoch_of = steps // steps_per_epoch
        after = peak * step_factor ** np.searchsorted(
            np.asarray(sorted(step_epochs)), epoch_of, side="right"
        )
    elif schedule == "cosine":
        span = max(1, total - warm)
        after = peak * 0.5 * (1 + np.cos(np.pi * np.clip(steps - warm, 0, span) / span))
    else:
        raise ValueError(f"unknown LR schedule {schedule!r}; choose constant, step or cosine")
    if warm:
        ramp = peak * (start + (1 - start) * (steps + 1) / warm)
        after = np.where(steps < warm, ramp, after)
    return after.astype(np.float32)


def lr_table_for(cfg, steps_per_epoch: int) -> np.ndarray:  # type: ignore[no-untyped-def]
    """`lr_table` with the values of a Config."""
    table = lr_table(cfg.lr, cfg.batch_size, cfg.lr_base_batch, cfg.lr_scaling, cfg.lr_schedule,
                     cfg.epochs, steps_per_epoch, cfg.warmup_epochs, cfg.warmup_start_factor,
                     cfg.lr_step_epochs, cfg.lr_step_factor)  # fmt: skip
    if injected("lr-shift", cfg.framework):  # tests only: an off-by-one LR index
        table = np.concatenate([table[1:], table[-1:]])
    return table
