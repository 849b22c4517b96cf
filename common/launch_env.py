"""The launch and cache variables of the environment, checked before any work: by every trainer
(common/trainer.py's run_main) and every tool (benchmarks/harness.py's run_tool).

A value no launch could have given (RANK=abc, RANK=3 with WORLD_SIZE=2, MASTER_PORT=99999, a
torch launch without MASTER_ADDR, JAX_PROCESS_ID past JAX_NUM_PROCESSES, a cache directory that
is a file, DPBENCH_FAIL=torch-dp@x) is one ConfigError naming the variable and the fix (exit 2),
not a framework's message at exit 1 or a rendezvous that times out at "None:None". What only the
launch itself can tell (does MASTER_ADDR resolve, does the coordinator answer) stays with the
launcher: frameworks/torch_launch.py, frameworks/jax_launch.py.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from common import devices
from common.config import FRAMEWORKS
from common.errors import ConfigError
from common.runtime import FAIL_ENV, INJECT_ENV, PARENT_ENV, unwritable

MAX_PROCESSES = 1 << 20  # ranks in one job: far above any machine room
# Cache directories that the frameworks (or their compilers) read from the environment.
CACHE_DIRS = ("JAX_COMPILATION_CACHE_DIR", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")
BUGS = ("crop-shift", "lr-shift", "tensorboard-error")  # DPBENCH_INJECT's (common/runtime.py)
PYTHON_PREFIX = "DPBENCH_PYTHON_"  # DPBENCH_PYTHON_<FRAMEWORK>: its interpreter (harness.py)


def _bad(name: str, value: str, why: str, fix: str = "") -> ConfigError:
    return ConfigError(f"environment variable {name}={value!r} {why}: {fix or f'unset {name}'}")


def _int(env: Mapping[str, str], name: str, lo: int, hi: int = MAX_PROCESSES) -> int | None:
    """The integer in `name` (None: unset or empty), refused outside [lo, hi]."""
    raw = env.get(name, "").strip()
    if not raw:
        return None
    if not re.fullmatch(r"[+-]?\d{1,19}", raw) or not lo <= int(raw) <= hi:
        raise _bad(name, raw, f"must be an integer from {lo} to {hi}", f"fix it or `unset {name}`")
    return int(raw)


def _below(env: Mapping[str, str], index: str, count: str, fix: str) -> None:
    """`index` < `count` where both are set (a rank within its world)."""
    i, n = _int(env, index, 0), _int(env, count, 1)
    if i is not None and n is not None and i >= n:
        raise ConfigError(f"environment variable {index}={i} is not below {count}={n}: {fix}")


def _port(name: str, port: str, value: str) -> None:
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise _bad(name, value, "needs a port from 1 to 65535", f"fix it or `unset {name}`")


def check_torch(env: Mapping[str, str]) -> None:
    """torchrun's RANK / WORLD_SIZE / LOCAL_RANK / LOCAL_WORLD_SIZE and MASTER_ADDR /
    MASTER_PORT, and srun's SLURM_PROCID / SLURM_NTASKS / SLURM_LOCALID."""
    world = _int(env, "WORLD_SIZE", 1)
    rank = _int(env, "RANK", 0)
    _int(env, "LOCAL_WORLD_SIZE", 1)
    _int(env, "LOCAL_RANK", 0)
    fix = "launch with torchrun, or unset RANK, WORLD_SIZE and LOCAL_RANK for a run alone"
    if (world is None) != (rank is None):
        missing, given = ("WORLD_SIZE", "RANK") if world is None else ("RANK", "WORLD_SIZE")
        raise ConfigError(f"environment variable {given} is set but {missing} is not: {fix}")
    _below(env, "RANK", "WORLD_SIZE", fix)
    _below(env, "LOCAL_RANK", "LOCAL_WORLD_SIZE", fix)
    _below(env, "LOCAL_RANK", "WORLD_SIZE", fix)
    if env.get("MASTER_PORT", "").strip():
        _port("MASTER_PORT", env["MASTER_PORT"].strip(), env["MASTER_PORT"])
    addr = env.get("MASTER_ADDR")
    if addr is not None and (not addr.strip() or any(c.isspace() for c in addr)):
        raise _bad("MASTER_ADDR", addr, "is no host name", "export the first node's host name")
    if world is not None:  # a launch: env:// meets at MASTER_ADDR:MASTER_PORT (was: None:None)
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name, "").strip():
                raise ConfigError(
                    f"environment variable RANK/WORLD_SIZE set (a torchrun launch) but {name} "
                    f"is not: launch with torchrun, export {name}, or unset RANK and WORLD_SIZE"
                )
    _int(env, "SLURM_NTASKS", 1)
    _int(env, "SLURM_PROCID", 0)
    _int(env, "SLURM_LOCALID", 0)
    _below(env, "SLURM_PROCID", "SLURM_NTASKS", "start it with srun, or unset the SLURM_ variables")


def check_jax(env: Mapping[str, str]) -> None:
    """jax.distributed's JAX_COORDINATOR_ADDRESS / JAX_NUM_PROCESSES / JAX_PROCESS_ID."""
    fix = "set all three for every process, or unset them for a run alone"
    n = _int(env, "JAX_NUM_PROCESSES", 1)
    i = _int(env, "JAX_PROCESS_ID", 0)
    _below(env, "JAX_PROCESS_ID", "JAX_NUM_PROCESSES", fix)
    address = env.get("JAX_COORDINATOR_ADDRESS")
    if address is None:
        return
    host, sep, port = address.strip().rpartition(":")
    if not sep or not host or any(c.isspace() for c in host):
        raise _bad("JAX_COORDINATOR_ADDRESS", address, "is not host:port", fix)
    _port("JAX_COORDINATOR_ADDRESS", port, address)
    if n is None or i is None:
        raise ConfigError(
            "environment variable JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES or "
            f"JAX_PROCESS_ID is not: {fix}"
        )


def check_caches(env: Mapping[str, str]) -> None:
    """A cache directory given in the environment is one, or can be made, and can be written."""
    for name in CACHE_DIRS:
        path = env.get(name, "")
        if not path:  # empty is unset, for the frameworks too (jax_support.use_compile_cache)
            continue
        why = "is blank" if not path.strip() else unwritable(path, "dir", need=0)
        if why:
            raise _bad(name, path, f"cannot be a cache directory ({why})",
                       f"point it at a writable directory or `unset {name}`")  # fmt: skip


def check_dpbench(env: Mapping[str, str]) -> None:
    """The project's own variables: DPBENCH_DEVICES, DPBENCH_FAIL, DPBENCH_INJECT,
    DPBENCH_PARENT_PID, DPBENCH_PYTHON_<FRAMEWORK>, DPBENCH_TEST_GPU, DPBENCH_USER_DEVICE_ENV."""
    chosen = env.get(devices.ENV, "").strip()
    if chosen and chosen not in devices.CHOICES:
        raise _bad(devices.ENV, chosen, f"is not one of {', '.join(devices.CHOICES)}")
    spec = env.get(FAIL_ENV, "")
    for entry in filter(None, (s.strip() for s in spec.split(","))):
        name, at, epoch = entry.partition("@")
        if not name or (at and not (epoch.isdigit() and int(epoch) >= 1)):
            raise _bad(FAIL_ENV, spec, f"has {entry!r}, not <framework> or <framework>@<epoch>")
    spec = env.get(INJECT_ENV, "")
    for entry in filter(None, (s.strip() for s in spec.split(","))):
        bug, at, name = entry.partition("@")
        if bug not in BUGS or not at or not name:
            raise _bad(INJECT_ENV, spec, f"has {entry!r}, not <bug>@<framework> with a bug of "
                       f"{', '.join(BUGS)}")  # fmt: skip
    parent = env.get(PARENT_ENV, "").strip()
    if parent and not (parent.isdigit() and 1 <= int(parent) <= 1 << 22):
        raise _bad(PARENT_ENV, parent, "is no process id")
    saved = env.get(devices.SAVED_ENV, "")
    if saved and not devices.saved_env_ok(saved):  # set by `pin` for the processes it starts
        raise _bad(devices.SAVED_ENV, saved, "is not what a dp-bench process sets there (a JSON "
                   f"object of {', '.join(devices.USER_ENV)}: a string or null each)",
                   f"`unset {devices.SAVED_ENV}`")  # fmt: skip
    if env.get("DPBENCH_TEST_GPU", "") not in ("", "0", "1"):
        raise _bad("DPBENCH_TEST_GPU", env["DPBENCH_TEST_GPU"], "must be 1 (the GPU pass) or 0")
    known = {f.upper().replace("-", "_") for f in FRAMEWORKS}
    for name, value in env.items():
        if not name.startswith(PYTHON_PREFIX):
            continue
        if name[len(PYTHON_PREFIX) :] not in known:
            raise _bad(name, value, f"names no framework (DPBENCH_PYTHON_ + one of "
                       f"{', '.join(sorted(known))})")  # fmt: skip
        # A path that is no interpreter is not refused here: the runners report that framework
        # as missing, with the reason, and run the others (tests/benchmarks/test_compare.py's end-to-end
        # test); a trainer never reads it.


def check_launch_env(env: Mapping[str, str] | None = None) -> None:
    """Every check above, on `env` (default: this process's environment); ConfigError."""
    env = os.environ if env is None else env
    check_dpbench(env)
    check_torch(env)
    check_jax(env)
    check_caches(env)


def process_rank() -> int:
    """This process's rank from the launcher's environment (torchrun, jax.distributed, SLURM);
    0 when none is set. Used where the framework has not started yet (failure records)."""
    for var in ("RANK", "JAX_PROCESS_ID", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0
