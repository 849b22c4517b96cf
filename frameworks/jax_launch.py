"""The JAX trainers' processes: joining a multi-process run (`init_distributed`) from the launch
environment, and the watchdog that ends a process whose peers never join, with its failed record
and one line, before XLA's own timeout would abort it with none.

    srun --ntasks-per-node=8 python -m frameworks.jax_pmap --gpus 1 ...    # one process per GPU
    JAX_COORDINATOR_ADDRESS=host:port JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=R \
        python -m frameworks.jax_shard --gpus 8 ...                         # one process per host

jax_support.setup_process calls `init_distributed` before JAX starts. Nothing in this module is
data parallelism: it is the plumbing that lets the JAX trainers run as one process or many, as
frameworks/torch_launch.py is torch-ddp's.
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator

import jax

from common.config import Config, ConfigError
from common.errors import first_line
from common.runtime import env_int, stale_launch_env
from common.trainer import failure_record, prog_name


def init_distributed(timeout: float = 300.0, give_up: Callable[[str], None] | None = None) -> None:
    """Join a multi-process run when the launch environment asks for one; a no-op otherwise.

    Explicit: JAX_COORDINATOR_ADDRESS=host:port, JAX_NUM_PROCESSES, JAX_PROCESS_ID (typically
    one process per host, with all its devices). SLURM (SLURM_NTASKS > 1):
    jax.distributed.initialize() reads SLURM's variables and gives each task the one GPU of its
    SLURM_LOCALID (one task per GPU; JAX_LOCAL_DEVICE_IDS overrides). Must run before the first
    device query. On CPU the collectives go through Gloo. The processes wait `timeout` seconds
    (--collective-timeout) for each other at start-up; SLURM variables that no srun set (a
    salloc shell) are refused with one line rather than waited on. Processes that do not all
    join within `timeout`: `give_up(why)` (a failed record, one line, exit 1), before XLA's own
    timeout would abort the process (SIGABRT, rc 134) with no record.
    """
    explicit = os.environ.get("JAX_COORDINATOR_ADDRESS")
    stale = None if explicit else stale_launch_env()
    if stale:
        raise ConfigError(stale)
    slurm = env_int("SLURM_NTASKS", 1) > 1
    if not (explicit or slurm):
        return
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if explicit:
        try:
            n, rank = int(os.environ["JAX_NUM_PROCESSES"]), int(os.environ["JAX_PROCESS_ID"])
        except (KeyError, ValueError):
            raise ConfigError(
                "JAX_COORDINATOR_ADDRESS is set: also set JAX_NUM_PROCESSES and "
                "JAX_PROCESS_ID (integers) for every process"
            ) from None
        why = (f"the {n} JAX processes did not all join JAX_COORDINATOR_ADDRESS={explicit} "
               f"within {timeout:g} s (--collective-timeout): start all JAX_NUM_PROCESSES={n} "
               "of them, or raise --collective-timeout")  # fmt: skip
        # XLA aborts (SIGABRT, no record) when the coordinator never answers
        left = timeout
        if rank != 0:
            left = wait_for_coordinator(explicit, timeout)
        else:
            check_coordinator_here(explicit)
        with joined_within(left, why, give_up):
            jax.distributed.initialize(explicit, num_processes=n, process_id=rank,
                                       initialization_timeout=int(left) + XLA_GRACE)  # fmt: skip
    else:
        why = (
            f"the SLURM_NTASKS={os.environ.get('SLURM_NTASKS')} tasks did not all join within "
            f"{timeout:g} s (--collective-timeout): check srun, or raise --collective-timeout"
        )
        with joined_within(timeout, why, give_up):
            jax.distributed.initialize(initialization_timeout=int(timeout) + XLA_GRACE)


XLA_GRACE = 30  # s: XLA's own join timeout comes this long after ours (joined_within) fires


@contextlib.contextmanager
def joined_within(timeout: float, why: str, give_up: Callable[[str], None] | None) -> Iterator:
    """Around jax.distributed.initialize, which waits for the other processes in C++ with the
    GIL released: if it has not returned after `timeout` s, `give_up(why)` runs on a timer
    thread (it must end the process: the main thread is still blocked in XLA). A join that
    returns first wins: the lock keeps a late timer from ending a process that joined."""
    if give_up is None:
        yield
        return
    lock, joined = threading.Lock(), list[bool]()

    def fire() -> None:
        with lock:
            if not joined:
                give_up(why)

    timer = threading.Timer(max(1.0, timeout), fire)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        with lock:
            joined.append(True)
        timer.cancel()


def gave_up_joining(cfg: Config, why: str) -> None:
    """The processes did not all join: one line, this process's failed record (it never joined
    the others, so it writes its own), exit 1, now (XLA holds the main thread)."""
    print(f"{prog_name(cfg.framework)}: failed: {why}", file=sys.stderr, flush=True)
    try:
        failure_record(cfg, why, ("jax", "jaxlib", "flax", "optax"), alone=True)
    except Exception as exc:  # a full disk: the line above still says what happened
        print(f"could not write the failure record: {first_line(exc)}", file=sys.stderr)
    sys.stderr.flush()
    os._exit(1)


class CoordinatorUnreachable(RuntimeError):
    """JAX_COORDINATOR_ADDRESS did not accept a connection within --collective-timeout. This
    process never joined the job, so it writes its failed record itself, whatever its rank."""

    alone = True


def coordinator_host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    if not (host and port.isdigit() and 0 < int(port) < 65536):
        raise ConfigError(f"JAX_COORDINATOR_ADDRESS={address!r} is not host:port; fix it")
    return host, int(port)


def check_coordinator_here(address: str) -> None:
    """Process 0 serves the coordination service at `address`: its host must be this machine
    and its port free (else XLA's own client, unable to reach it, aborts the process after
    the timeout with no record). ConfigError, one line, as torch's MASTER_ADDR check."""
    host, port = coordinator_host_port(address)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise ConfigError(
            f"JAX_COORDINATOR_ADDRESS={address}: {host} does not resolve; give process 0's host"
        ) from None
    why = ""
    for family, kind, proto, _, where in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(where)
                return
            except OSError as exc:
                why = exc.strerror or str(exc)
    raise ConfigError(
        f"JAX_COORDINATOR_ADDRESS={address}: process 0 serves the coordinator there, but this "
        f"host ({socket.gethostname()}) cannot listen on it ({why}): start process 0 on {host}, "
        "or choose a free port"
    )


def wait_for_coordinator(address: str, timeout: float) -> float:
    """Wait up to `timeout` seconds until `address` (host:port, [v6]:port) accepts a TCP
    connection, as process 0's coordination service does once it runs; return the seconds
    left. Otherwise CoordinatorUnreachable: a failed run with its record and one line, where
    jax.distributed.initialize would abort the process (SIGABRT, rc 134) with no record."""
    host, port = coordinator_host_port(address)
    deadline = time.monotonic() + timeout
    why = "no answer"
    while True:
        left = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.1, min(1.0, left))):
                return max(1.0, deadline - time.monotonic())
        except OSError as exc:  # refused (nothing listens yet), unreachable, unknown host
            why = exc.strerror or str(exc) or type(exc).__name__
        if left <= 0:
            raise CoordinatorUnreachable(
                f"the JAX coordinator at JAX_COORDINATOR_ADDRESS={address} did not answer within "
                f"{timeout:g} s (--collective-timeout; last: {why}): start process 0 there "
                "first, or fix the address"
            )
        time.sleep(min(0.25, max(0.0, left)))
