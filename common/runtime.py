"""Process-level helpers that need no framework: simulated devices, threads, ports, logging.

Anything that must happen before a framework is imported (XLA's host-device count, OpenMP
threads) is set here, by `main()`, never at import time.
"""

from __future__ import annotations

import contextlib
import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def simulate_host_devices(n: int) -> None:
    """Make JAX's CPU backend expose `n` devices. Must run before `import jax` (each run is its
    own process). Replaces any earlier count in XLA_FLAGS."""
    flags = [
        f
        for f in os.environ.get("XLA_FLAGS", "").split()
        if not f.startswith("--xla_force_host_platform_device_count")
    ]
    flags.append(f"--xla_force_host_platform_device_count={n}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


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


def file_mode() -> int:
    """The mode a plain `open(path, "w")` gives a new file (0666 less the umask): results,
    checkpoints and logs all get it (mkstemp's 0600 made results unreadable where logs were not)."""
    mask = os.umask(0o022)  # reading the umask means setting it; put it straight back
    os.umask(mask)
    return 0o666 & ~mask


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path`, which is then synced and renamed onto
    `path`: a reader sees the old complete file or the new one. A write that fails (a full disk,
    ENOSPC; a read-only file system) removes its temporary file and re-raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        os.fchmod(fd, file_mode())
        os.close(fd)
        write(tmp)
        with open(tmp, "rb+") as f:  # the data on disk before the rename points at it
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` atomically (see `atomic_write_with`): checkpoints, results."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write_with(path, write)


def physical_memory() -> int:
    """Bytes of physical memory (0 where the system does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


MIN_FREE_BYTES = 1 << 20  # an output file system with less free space than this is "full"


def unwritable(path: str | os.PathLike[str], kind: str = "file") -> str | None:
    """Why `path` (a file, or a directory with kind="dir") cannot be written, or None when it
    can: it is the wrong kind of thing, its nearest existing directory is not writable (a
    read-only file system included) or that file system is full. Checked before a run starts,
    so that a run does not train for an hour and then lose its result. Creates nothing."""
    path = Path(path).expanduser().absolute()
    if path.exists():
        if kind == "file" and not path.is_file():
            return f"{path} exists and is not a file"
        if kind == "dir" and not path.is_dir():
            return f"{path} exists and is not a directory"
        if kind == "dir":
            return _unwritable_dir(path)
    parent = path if kind == "dir" else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory, so {path} cannot be created"
    return _unwritable_dir(parent)


def _unwritable_dir(d: Path) -> str | None:
    if not os.access(d, os.W_OK | os.X_OK):
        return f"{d} is not writable (permissions or a read-only file system)"
    try:
        st = os.statvfs(d)
    except OSError:
        return None
    if st.f_bavail * st.f_frsize < MIN_FREE_BYTES:
        return f"the file system of {d} is full"
    return None


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
