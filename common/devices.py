"""`--devices auto|cpu|cuda`: where a run's devices are, chosen once for the process and its
children, and stated in every record. No framework is imported here.

`auto` (default): the GPUs where the run's framework sees them, else `--gpus` simulated CPU
devices; `cpu`: simulated devices even on a GPU machine (`pin` hides the GPUs from this process
and its children: CUDA_VISIBLE_DEVICES="", JAX_PLATFORMS=cpu); `cuda`: the GPUs, refused in one
line where the framework sees none (`need_gpus`). `DPBENCH_DEVICES` sets the default for a
shell (the test suite sets `cpu`). The user's own CUDA_VISIBLE_DEVICES and JAX_PLATFORMS are
recorded as they were before any pinning (`record`).
"""

from __future__ import annotations

import json
import os
from typing import Any

CHOICES = ("auto", "cpu", "cuda")
ENV = "DPBENCH_DEVICES"  # the default of --devices, for a whole shell or test session
USER_ENV = ("CUDA_VISIBLE_DEVICES", "JAX_PLATFORMS")  # recorded as the user set them
SAVED_ENV = "DPBENCH_USER_DEVICE_ENV"  # those values before `pin` changed them (JSON, inherited)
SETUP = "bash scripts/setup.sh"  # installs the CUDA builds the driver runs (scripts/setup_plan.py)


def default() -> str | None:
    """--devices from DPBENCH_DEVICES (None: unset); a bad value names the variable."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if value not in CHOICES:
        raise ValueError(
            f"{ENV}={value!r} is not one of {', '.join(CHOICES)}; "
            f"set it to one of them or unset it (e.g. `unset {ENV}`)"
        )
    return value


def user_env() -> dict[str, str | None]:
    """CUDA_VISIBLE_DEVICES and JAX_PLATFORMS as the user set them (None: unset), also in a
    process started after `pin` changed them."""
    saved = os.environ.get(SAVED_ENV)
    if saved:
        return dict(json.loads(saved))
    return {k: os.environ.get(k) for k in USER_ENV}


def pin(choice: str) -> None:
    """Make `choice` hold in this process and every process it starts (see the module doc).
    Call before the framework's first device query."""
    os.environ.setdefault(SAVED_ENV, json.dumps(user_env()))
    if choice == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
        os.environ["JAX_PLATFORMS"] = "cpu"
    elif choice == "cuda" and os.environ.get("JAX_PLATFORMS", "") in ("", "cpu"):
        os.environ["JAX_PLATFORMS"] = "cuda"  # no silent fall-back to JAX's CPU backend


def record(choice: str) -> dict[str, Any]:
    """The run record's `device_choice`: what was asked and the user's device variables."""
    return {"asked": choice, "env": user_env()}


def need_gpus(choice: str, visible: int, framework: str, seen: str) -> str | None:
    """Why `--devices cuda` cannot run (None: it can, or the choice is not cuda): `framework`
    sees `visible` GPUs; `seen` describes its build ("torch 2.14.1, a CPU build")."""
    if choice != "cuda" or visible > 0:
        return None
    hidden = {k: v for k, v in user_env().items() if v is not None}
    env = f" with {', '.join(f'{k}={v!r}' for k, v in hidden.items())}" if hidden else ""
    return (
        f"--devices cuda but {framework} sees no GPU ({seen}{env}); install its GPU build "
        f"with `{SETUP}` (it picks the CUDA builds by the driver), or use --devices cpu"
    )
