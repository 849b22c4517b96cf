"""Process-level helpers that need no framework: simulated devices, threads, ports, logging.

Anything that must happen before a framework is imported (XLA's host-device count, OpenMP
threads) is set here, by `main()`, never at import time.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import signal
import socket
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import psutil

from common.errors import ConfigError

ROOT = Path(__file__).resolve().parent.parent


# `python -m <module>` entry points -> the packages each imports (MXNet lives in .venv-mxnet,
# torch and JAX in .venv).
_JAX = ("jax", "flax", "optax")
ENTRY_POINTS: dict[str, tuple[str, ...]] = {
    "frameworks.torch_ddp": ("torch",),
    "frameworks.torch_dp": ("torch",),
    "frameworks.torch_fsdp": ("torch",),
    "frameworks.jax_pmap": _JAX,
    "frameworks.jax_shard": _JAX,
    "frameworks.jax_shardmap": _JAX,
    "frameworks.jax_fsdp": _JAX,
    "frameworks.mxnet_gluon": ("mxnet",),
    "tutorials.d2l_torch": ("torch",),
    "tutorials.nvidia_course": ("torch",),
    "tutorials.d2l_jax": _JAX,
    "tutorials.flax_imagenet": _JAX,
    "tutorials.d2l_mxnet": ("mxnet",),
}


def module_command(argv: Sequence[str] | None = None) -> tuple[str, list[str]] | None:
    """`python -m <module> args...` -> (module, args); None for any other command (a script,
    `-c`, pytest). Read from the interpreter's own command line (`sys.orig_argv`) by default:
    in the packages' `__init__`, which runs before the module, `sys.argv[0]` is still "-m"
    and the module's name is nowhere else."""
    argv = list(getattr(sys, "orig_argv", [])) if argv is None else list(argv)
    if "-m" not in argv[:-1]:
        return None
    at = argv.index("-m") + 1
    return argv[at], argv[at + 1 :]


def check_interpreter(argv: list[str] | None = None) -> None:
    """`python -m <entry point>` in an interpreter without its framework: one line naming the
    interpreter to use and exit 2, instead of an ImportError's traceback from inside the module.
    The packages' `__init__` calls it, before the module imports its framework; for any other
    command (tests, imports, the runners' own checked interpreters) it does nothing."""
    command = module_command(argv)
    if command is None:
        return
    module = command[0]
    missing = [p for p in ENTRY_POINTS.get(module, ()) if importlib.util.find_spec(p) is None]
    if missing:
        mxnet = "mxnet" in ENTRY_POINTS[module]
        env, setup = (".venv-mxnet", "mxnet") if mxnet else (".venv", "main")
        print(
            f"python -m {module}: error: {', '.join(missing)} not installed in {sys.executable}; "
            f"run it with {env}/bin/python -m {module} (`bash scripts/setup.sh {setup}` builds it)",
            file=sys.stderr,
        )
        raise SystemExit(2)


def set_xla_flag(name: str, value: str) -> None:
    """Set `--name=value` in XLA_FLAGS, replacing any earlier value of that flag. XLA reads the
    variable when a backend starts (JAX's first device query): call it before that."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(f"--{name}=")]
    flags.append(f"--{name}={value}")
    os.environ["XLA_FLAGS"] = " ".join(flags)


def check_xla_flags() -> None:
    """XLA_FLAGS as the user set it, before a JAX backend starts: XLA takes a word that is no
    `--flag` for the name of a file of flags and aborts the process; here it is one ConfigError.
    (A flag XLA does not know: XLA's own one line names it.)"""
    raw = os.environ.get("XLA_FLAGS", "")
    bad = next((w for w in raw.split() if not re.fullmatch(r"--\w+(=\S*)?", w)), None)
    if bad is not None:
        raise ConfigError(
            f"XLA_FLAGS={raw!r}: {bad!r} is not an XLA flag (each word must be --name or "
            "--name=value): fix it or `unset XLA_FLAGS`"
        )


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


def xla_cpu_ynn_wanted(setting: bool | None, image_size: int, devices: int) -> bool:
    """--xla-cpu-ynn / --no-xla-cpu-ynn as given, else (None) the faster path as measured on 2
    cores, alternating runs (docs/performance.md): YNNPACK at 1 device (ResNet-18 x 0.25 at
    32x32 1.68x, the WideResNet on 16x16 digits 1.44x, ResNet-18 on digits 0.99x) and at 32x32
    on 2 devices (1.31x); XLA's own code for images under 32x32 on several simulated devices
    (YNNPACK 0.96x for ResNet-18 with pmap, 0.96x with jit, 0.90x for the WideResNet)."""
    if setting is not None:
        return setting
    return devices <= 1 or image_size >= 32


def use_xla_cpu_ynn(enabled: bool) -> None:
    """`--xla-cpu-ynn`: XLA:CPU compiles its dot, elementwise and reduction fusions to YNNPACK
    kernels instead of its own LLVM code (where it is faster: `xla_cpu_ynn_wanted`). JAX's CPU
    backend only; a YNN_FLAG already in XLA_FLAGS (the user's own choice) is left as it is."""
    if xla_flag(YNN_FLAG) is None and enabled:
        set_xla_flag(YNN_FLAG, YNN_FUSIONS)


def xla_cpu_execution() -> str:
    """How XLA:CPU runs this process's programs, for the record's `execution`."""
    fusions = xla_flag(YNN_FLAG)
    return f"XLA:CPU, YNNPACK fusions ({fusions})" if fusions else "XLA:CPU (its own code)"


def available_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a Slurm allocation, a
    container's cpuset), which its children inherit; not the machine's count (os.cpu_count),
    which torch's and OpenMP's own defaults do not use either. Threads beyond these cores wait
    for each other: two torch processes of 2 threads each on 2 cores (OpenMP spinning, as by
    default) took 84 s together where one alone takes 7 s."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):  # no affinity call (macOS, Windows)
        return os.cpu_count() or 1


def cpu_threads(workers: int = 1) -> int:
    """Threads each of `workers` processes should use so that together they fill the cores
    this process may run on (`available_cores`)."""
    return max(1, available_cores() // max(1, workers))


def threads_record(total: int, per_device: int | None, how: str) -> dict[str, object]:
    """The run record's `threads` entry. THREADS RULE: a CPU run on C cores (those it may run
    on: `available_cores`) uses C threads in all, however many devices it simulates, split
    evenly over the devices where the framework lets us, and at least one per device
    (torch-ddp: C/N per process; mxnet-gluon: C/N OpenMP threads per context; torch-dp: one
    process, C threads; JAX: XLA:CPU's one intra-op pool, shared by the devices, of max(C, N)
    threads: XLA's own size)."""
    return {"total": total, "per_device": per_device, "cores": available_cores(), "how": how}


def set_omp_threads(n: int) -> None:
    """Set the OpenMP/MKL thread count explicitly (MXNet used one core when it was unset)."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)


def free_port() -> int:
    """A free TCP port on the loopback interface for a rendezvous (never a hard-coded one)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """In a child process: get `sig` as soon as the parent `parent_pid` dies (kill -9, the OOM
    killer), so that a cancelled run leaves no orphan training on. The kernel's parent-death
    signal (Linux prctl; it fires when the parent THREAD that started this process ends)."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent_pid:  # the parent died before the signal was armed
        os.kill(os.getpid(), sig)


def env_int(name: str, default: int, minimum: int = 0) -> int:
    """The integer environment variable `name` (`default` when unset or empty): a value that is
    no integer >= `minimum` (WORLD_SIZE=abc) is one ConfigError naming the variable, not a bare
    int() error from deep inside a launch."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = None
    if value is None or value < minimum:
        raise ConfigError(
            f"environment variable {name}={raw!r} must be an integer >= {minimum}: "
            f"fix it or `unset {name}`"
        )
    return value


def process_rank() -> int:
    """This process's rank from the launcher's environment (torchrun, jax.distributed, SLURM);
    0 when none is set. Used where the framework has not started yet (failure records)."""
    for var in ("RANK", "JAX_PROCESS_ID", "SLURM_PROCID"):
        if os.environ.get(var, "").isdigit():
            return int(os.environ[var])
    return 0


def printer(is_main: bool) -> Callable[..., None]:
    """`print` on rank 0, a no-op elsewhere (only rank 0 prints)."""

    def _print(*args: object) -> None:
        if is_main:
            print(*args, flush=True)

    return _print


def atomic_write_with(path: str | os.PathLike[str], write: Callable[[str], None]) -> None:
    """`write(tmp)` fills a temporary file beside `path`, synced and renamed onto `path`: a
    reader sees the old complete file or the new one. A write that fails (a full disk) removes
    its temporary file and re-raises."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = str(path.with_name(f"{path.name}.tmp{os.getpid()}"))  # a plain file's mode (umask)
    try:
        write(tmp)
        with open(tmp, "rb+") as f:  # the data on disk before the rename points at it
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def process_alive(pid: int) -> bool:
    """True while process `pid` runs (a zombie, which writes nothing, does not)."""
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.Error:  # gone
        return False


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` to `path` atomically (see `atomic_write_with`): checkpoints, results."""

    def write(tmp: str) -> None:
        with open(tmp, "wb") as f:
            f.write(data)

    atomic_write_with(path, write)


def physical_memory() -> int:
    """Bytes of physical memory."""
    return int(psutil.virtual_memory().total)


MIN_FREE_BYTES = 1 << 20  # an output file system with less free space than this is "full"


def unwritable(
    path: str | os.PathLike[str], kind: str = "file", need: int = MIN_FREE_BYTES
) -> str | None:
    """Why `path` (a file, or a directory with kind="dir") cannot be written, or None: the
    wrong kind of thing, its nearest existing directory not writable, a file system with less
    than `need` bytes free, a name the file system cannot hold. Checked before a run starts (a
    run must not train for an hour and then lose its result); creates nothing."""
    last = os.fspath(path).replace(os.sep, "/").rpartition("/")[2]
    if kind == "file" and last in ("", ".", ".."):  # Path() would drop a trailing slash
        return f"{os.fspath(path)} names a directory (a trailing '/', '.' or '..'), not a file"
    path = Path(path).expanduser().absolute()
    try:
        os.stat(path)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        pass
    except OSError as exc:  # ENAMETOOLONG, ELOOP: stat itself fails, not only the write
        return f"{path} cannot be named on this file system ({exc.strerror or exc})"
    if path.exists() and path.is_dir() != (kind == "dir"):
        return f"{path} exists and is not a {'directory' if kind == 'dir' else 'file'}"
    parent = path if kind == "dir" else path.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"{parent} is not a directory, so {path} cannot be created"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{parent} is not writable (permissions or a read-only file system)"
    st = os.statvfs(parent)
    free = st.f_bavail * st.f_frsize
    if free < need:
        return f"the file system of {parent} is full ({free} bytes free, {need} needed)"
    return None


def unnamable(path: str | os.PathLike[str]) -> str | None:
    """Why the file system cannot even look `path` up (a component over 255 bytes, a loop of
    links, a component that is a file), or None: missing is fine."""
    try:
        os.stat(Path(path).expanduser())
    except (FileNotFoundError, PermissionError):
        return None
    except NotADirectoryError:
        return f"a component of {path} is a file, not a directory"
    except OSError as exc:
        return f"{path} cannot be named on this file system ({exc.strerror or exc})"
    return None


PARENT_ENV = "DPBENCH_PARENT_PID"


def stop_with_harness() -> None:
    """A trainer started by benchmarks.harness (its pid in DPBENCH_PARENT_PID) gets SIGTERM when
    the harness dies, even by kill -9: it then stops its workers and writes an "interrupted"
    record."""
    parent = os.environ.get(PARENT_ENV, "")
    if parent.isdigit() and int(parent) == os.getppid():
        die_with_parent(int(parent), signal.SIGTERM)


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
