"""Process-level helpers that need no framework: simulated devices, threads, ports, logging.

Anything that must happen before a framework is imported (XLA's host-device count, OpenMP
threads) is set here, by `main()`, never at import time.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def set_xla_flag(name: str, value: str) -> None:
    """Set `--name=value` in XLA_FLAGS, replacing any earlier value of that flag. XLA reads the
    variable when a backend starts (JAX's first device query): call it before that."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(f"--{name}=")]
    flags.append(f"--{name}={value}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def xla_flag(name: str) -> str | None:
    """The value of `--name` in XLA_FLAGS (None: not set)."""
    for f in os.environ.get("XLA_FLAGS", "").split():
        if f.startswith(f"--{name}="):
            return f.split("=", 1)[1]
    return None


def simulate_host_devices(n: int) -> None:
    """Make JAX's CPU backend expose `n` devices. Must run before `import jax` (each run is its
    own process). Replaces any earlier count in XLA_FLAGS."""
    set_xla_flag("xla_force_host_platform_device_count", str(n))


YNN_FLAG = "xla_cpu_experimental_ynn_fusion_type"
YNN_FUSIONS = "dot,eltwise,reduce"  # every fusion kind XLA:CPU can hand to YNNPACK (jaxlib 0.10)


def use_xla_cpu_ynn(enabled: bool) -> None:
    """`--xla-cpu-ynn` (default): XLA:CPU compiles its dot, elementwise and reduction fusions to
    YNNPACK kernels instead of its own LLVM code (measured on 2 cores: a ResNet-18 step 1.3-1.5x
    faster, the same update as XLA's own code to float32 rounding; docs/performance.md).
    Affects JAX's CPU backend only. A `--xla_cpu_experimental_ynn_fusion_type` already in
    XLA_FLAGS (the user's own choice) is left as it is."""
    if xla_flag(YNN_FLAG) is None and enabled:
        set_xla_flag(YNN_FLAG, YNN_FUSIONS)


def xla_cpu_execution() -> str:
    """How XLA:CPU runs this process's programs, for the record's `execution`."""
    fusions = xla_flag(YNN_FLAG)
    return f"XLA:CPU, YNNPACK fusions ({fusions})" if fusions else "XLA:CPU (its own code)"


def cpu_threads(workers: int = 1) -> int:
    """Threads each of `workers` processes should use so that together they fill the cores."""
    return max(1, (os.cpu_count() or 1) // max(1, workers))


def threads_record(total: int, per_device: int | None, how: str) -> dict[str, object]:
    """The run record's `threads` entry. THREADS RULE: a CPU run on C cores uses C threads in all,
    however many devices it simulates, split evenly over the devices where the framework lets
    us (torch-ddp: C/N per process; mxnet-gluon: C/N OpenMP threads per context; torch-dp: one
    process, C threads; JAX: XLA:CPU's one intra-op pool of C threads, shared by the devices)."""
    return {"total": total, "per_device": per_device, "cores": os.cpu_count(), "how": how}


def set_omp_threads(n: int) -> None:
    """Set the OpenMP/MKL thread count explicitly (MXNet used one core when it was unset)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


def free_port() -> int:
    """A free TCP port on the loopback interface for a rendezvous (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def printer(is_main: bool) -> Callable[..., None]:
    """`print` on rank 0, a no-op elsewhere (only rank 0 prints)."""

    def _print(*args: object) -> None:
        if is_main:
            print(*args, flush=True)

    return _print


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` via a temporary file and rename (for checkpoints)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


FAIL_ENV = "DPBENCH_FAIL"


def injected_failure(framework: str, epoch: int | None = None) -> None:
    """Fault injection, for the tests and the runner's failure handling.

    `DPBENCH_FAIL=<framework>` makes that framework raise at start-up (epoch None);
    `DPBENCH_FAIL=<framework>@<k>` kills the process abruptly (os._exit(17), like a SIGKILL:
    nothing is flushed or written) at the end of epoch k (1-based), after its checkpoint.
    Several entries may be given, comma-separated. Unset, this does nothing.
    """
    spec = os.environ.get(FAIL_ENV, "")
    for entry in filter(None, (s.strip() for s in spec.split(","))):
        name, _, at = entry.partition("@")
        if name != framework:
            continue
        if epoch is None and not at:
            raise RuntimeError(f"failure injected by {FAIL_ENV}={spec}")
        if epoch is not None and at and int(at) == epoch:
            os._exit(17)


INJECT_ENV = "DPBENCH_INJECT"


def injected(bug: str, framework: str) -> bool:
    """Semantic-bug injection, for the tests that prove a cross-framework check can fail:
    `DPBENCH_INJECT=<bug>@<framework>[,...]` (e.g. `lr-shift@jax-pmap`: that trainer uses the
    next step's learning rate at every step). Set by tests only; unset, always False."""
    entries = {e.strip() for e in os.environ.get(INJECT_ENV, "").split(",")}
    return f"{bug}@{framework}" in entries
