"""torch-ddp's processes: where this process stands in the job (`launch_env`), and, without a
launcher, `spawn`: one process per device on this node, started, supervised and stopped here.

    python -m frameworks.torch_ddp --preset digits --gpus 2        # spawn: 2 processes
    torchrun --nproc-per-node=4 -m frameworks.torch_ddp --preset cifar10-resnet18
    torchrun --nnodes=2 --nproc-per-node=8 --node-rank=R --rdzv-endpoint=HOST:PORT \
        -m frameworks.torch_ddp ...                                  # R = 0 on HOST, 1 elsewhere
    srun --ntasks=16 --ntasks-per-node=8 python -m frameworks.torch_ddp ...
        # SLURM: MASTER_ADDR (first node) and MASTER_PORT exported by the batch script

Under a launcher (torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or SLURM's SLURM_PROCID/SLURM_NTASKS/
SLURM_LOCALID with MASTER_ADDR/MASTER_PORT) the launcher's world size replaces --gpus; resuming
a multi-node run needs --checkpoint-dir on a filesystem every node sees.

Nothing in this module is data parallelism: it is the plumbing that lets frameworks/torch_ddp.py
read as frameworks/torch_dp.py plus the lines that make it distributed.
"""

from __future__ import annotations

import datetime
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from common.config import Config, ConfigError
from common.errors import BAD_INPUT, RunFailed
from common.interrupts import Interrupted, shield_interrupts
from common.results import write_json_atomic
from common.runtime import (
    die_with_parent,
    env_int,
    free_port,
    process_state,
    stale_launch_env,
)
from common.trainer import describe


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, from the launcher's environment."""

    rank: int
    world: int
    local_rank: int
    local_world: int


def launch_env() -> Launch | None:
    """torchrun (or our own spawn) sets RANK/WORLD_SIZE/LOCAL_RANK; srun sets SLURM_PROCID/
    SLURM_NTASKS/SLURM_LOCALID (a 1-task SLURM job is not a launch: --gpus spawns as usual)."""
    env = os.environ
    stale = stale_launch_env()
    if stale:
        raise ConfigError(stale)
    if env.get("RANK", "").strip() and env.get("WORLD_SIZE", "").strip():  # empty: unset
        world = env_int("WORLD_SIZE", 1, minimum=1)
        if world > 1 and env.get("MASTER_ADDR"):  # a name that no rank can reach: now, not
            check_master_addr(env["MASTER_ADDR"], rank0=False, hint=TORCHRUN_HINT)  # at timeout
        return Launch(
            env_int("RANK", 0),
            world,
            env_int("LOCAL_RANK", 0),
            env_int("LOCAL_WORLD_SIZE", world, minimum=1),
        )
    if "SLURM_PROCID" in env and env_int("SLURM_NTASKS", 1) > 1:
        if not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
            raise ConfigError(
                "under srun, export MASTER_ADDR (the first node's host name) and "
                "MASTER_PORT (a free port) in the batch script"
            )
        check_master_addr(env["MASTER_ADDR"], env["SLURM_PROCID"] == "0", SLURM_HINT)
        world = env_int("SLURM_NTASKS", 1)
        rank, local_rank = env_int("SLURM_PROCID", 0), env_int("SLURM_LOCALID", 0)
        per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", ""))  # "8" or "8(x2)"
        tasks_per_node = int(per_node.group()) if per_node else world
        os.environ.update(
            RANK=env["SLURM_PROCID"],
            WORLD_SIZE=str(world),
            LOCAL_RANK=env.get("SLURM_LOCALID", "0"),
        )
        return Launch(rank, world, local_rank, tasks_per_node)
    return None


def single_process() -> Launch:
    """A run of one process without a launcher: a world of one, its rendezvous on a free
    loopback port."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    return Launch(0, 1, 0, 1)


@contextmanager
def native_stderr_held() -> Iterator[None]:
    """What C++ writes to stderr (fd 2) inside the block, held back: shown after it if the block
    succeeds, dropped if it raises, whose one line says it. A rank whose rendezvous never
    forms (rank 0 not started, a MASTER_ADDR that does not resolve) printed c10d's retry
    warnings and a 50-frame C++ backtrace before that line."""
    import tempfile

    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with tempfile.TemporaryFile() as held:
            os.dup2(held.fileno(), 2)
            try:
                yield
            finally:
                os.dup2(saved, 2)
            held.seek(0)
            os.write(2, held.read())  # the block succeeded: its warnings, as they were
    finally:
        os.close(saved)


@contextmanager
def process_group(backend: str, launch: Launch, timeout: float) -> Iterator[None]:
    """This rank in the job's process group (env://: MASTER_ADDR and MASTER_PORT) for the
    `with` block, destroyed however the block ends. `timeout` bounds the rendezvous and every
    collective: a rank that stops answering (stopped, hung, its node gone) fails the run
    instead of holding it; a failed rendezvous is one line naming the usual causes."""
    try:
        with native_stderr_held():
            dist.init_process_group(
                backend,
                init_method="env://",
                rank=launch.rank,
                world_size=launch.world,
                timeout=datetime.timedelta(seconds=timeout),
            )
    except Exception as exc:
        raise RuntimeError(
            f"rendezvous of {launch.world} ranks at {os.environ.get('MASTER_ADDR')}:"
            f"{os.environ.get('MASTER_PORT')} failed after at most {timeout:g} s "
            f"(--collective-timeout; {describe(exc)}): every rank must start, with the same "
            "MASTER_ADDR, MASTER_PORT and WORLD_SIZE; stale variables in the environment?"
        ) from None
    try:
        yield
    finally:
        dist.destroy_process_group()


SLURM_HINT = (
    "export the first node's host name "
    '(e.g. MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1))'
)
TORCHRUN_HINT = (
    "a stale value? launch with torchrun, which sets it, or unset RANK, WORLD_SIZE and "
    "MASTER_ADDR for a run alone"
)


def check_master_addr(host: str, rank0: bool, hint: str = SLURM_HINT) -> None:
    """MASTER_ADDR must resolve (under torchrun or srun), and under srun, whose batch script
    exports it, rank 0 (which serves the rendezvous there) must run on it. A stale value
    (another job's first node) would otherwise hold every rank until the rendezvous times out."""
    try:
        ip = socket.gethostbyname(host)
    except (OSError, UnicodeError):
        raise ConfigError(f"MASTER_ADDR={host} does not resolve; {hint}") from None
    if rank0:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((ip, 0))
            except OSError:
                raise ConfigError(
                    f"MASTER_ADDR={host} is not this host ({socket.gethostname()}), where rank 0 "
                    "serves the rendezvous: a stale value? export the first node's host name"
                ) from None


WORKERS_IGNORE = {signal.SIGINT, signal.SIGHUP}  # a spawned rank's: its parent stops it


def spawn(cfg: Config, train: Callable[..., dict]) -> dict:
    """Start `cfg.gpus` processes on this node, each running `train(cfg, report=...)` as one
    rank with the environment torchrun would give it (rendezvous on a free loopback port), and
    wait for them.

    The workers die with this process (common.runtime.die_with_parent: a parent-death signal
    and a pipe only this process holds), so a cancelled run (kill -9, the OOM killer) leaves
    no orphan. Rank 0 sends its record after every epoch through a pipe, and only this process
    writes `--output`: a run whose rank fails keeps the epochs measured so far ("failed"), one
    stopped by SIGTERM / SIGINT stops its workers first ("interrupted"). No temporary file."""
    ctx = mp.get_context("spawn")
    port = free_port()
    workers: list = []
    lifelines: list[Connection] = []
    reports: dict[int, Connection] = {}  # rank -> its report pipe, until it closes
    record: dict = {}
    errors: dict[int, tuple[str, str]] = {}  # rank -> (kind, one line), in order of arrival
    tracebacks: dict[int, str] = {}  # rank -> the traceback of its crash (printed if the cause)

    def read(conns: dict[int, Connection]) -> None:
        nonlocal record
        for rank, conn in list(conns.items()):
            while rank in conns and conn.poll():
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    del conns[rank]  # the worker has exited: nothing more will come
                    continue
                if kind == "record":
                    record = payload
                elif kind == "traceback":
                    tracebacks.setdefault(rank, payload)
                else:
                    errors.setdefault(rank, (kind, payload))

    try:
        # Ctrl-C reaches the whole process group, workers that still import torch included,
        # which died of it with a KeyboardInterrupt traceback each. They start with SIGINT and
        # SIGHUP blocked (a mask survives exec), until _spawned ignores both; here they are
        # held for the few milliseconds of the starts, not lost. (multiprocessing's resource
        # tracker, started by the first start, unblocks SIGINT after its own: started first.)
        resource_tracker.ensure_running()
        mask = signal.pthread_sigmask(signal.SIG_BLOCK, WORKERS_IGNORE)
        try:
            for rank in range(cfg.gpus):
                life_r, life_w = ctx.Pipe(duplex=False)  # this process holds life_w until the end
                report_r, report_w = ctx.Pipe(duplex=False)
                proc = ctx.Process(
                    target=_spawned,
                    args=(rank, cfg, train, port, os.getpid(), life_r, report_w, sys.argv),
                    name=f"torch-ddp rank {rank}",
                )
                proc.start()
                life_r.close()
                report_w.close()
                workers.append(proc)
                lifelines.append(life_w)
                reports[rank] = report_r
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)  # as it was
        while any(p.exitcode is None for p in workers):
            live = [p.sentinel for p in workers if p.exitcode is None]
            wait([*reports.values(), *live], timeout=1.0)
            read(reports)
            if errors or any(p.exitcode not in (None, 0) for p in workers):
                break
        read(reports)  # what a worker sent just before it exited
        signalled = [
            -p.exitcode
            for p in workers
            if p.exitcode in (-signal.SIGTERM, -signal.SIGINT, -signal.SIGHUP)
        ]
        if signalled and not errors:  # a scheduler signalled the whole job, workers first
            raise Interrupted(signalled[0])
        if errors or any(p.exitcode not in (None, 0) for p in workers):
            # a rank killed or silent is the cause, named in one line: the others' tracebacks
            # (gloo's "Connection closed by peer", its recv timeout) are only its echo
            named = _killed_rank(workers, errors) or _silent_ranks(cfg, workers, errors)
            error, bad_input = named or _failure(workers, errors)
            _stop(workers, cfg)
            read(reports)
            if not named and errors and next(iter(errors)) in tracebacks:
                print(tracebacks[next(iter(errors))], end="", file=sys.stderr)
            if bad_input:
                raise ConfigError(error)
            if record:
                record.update(status="failed", error=error)
                if cfg.output:
                    write_json_atomic(cfg.output, record)
                raise RunFailed(error)
            raise RuntimeError(error)
    except Interrupted as exc:
        shield_interrupts()  # this process's own SIGTERM may come after its workers'
        _stop(workers, cfg)
        read(reports)  # the last epoch rank 0 reported before it was stopped
        if record:
            record.update(status="interrupted", error=str(exc))
            if cfg.output:
                write_json_atomic(cfg.output, record)
            exc.recorded = True
        raise
    finally:
        _stop(workers, cfg)
        for conn in [*lifelines, *reports.values()]:
            conn.close()
    if cfg.output:
        write_json_atomic(cfg.output, record)
    return record


def _message(errors: dict[int, tuple[str, str]]) -> tuple[int, str, str]:
    """The first error a rank sent: its rank, kind and message (without gloo's source place)."""
    rank, (kind, message) = next(iter(errors.items()))
    return rank, kind, re.sub(r"\[[^\]]*:\d+\] ", "", message)


def _silent_ranks(
    cfg: Config, workers: list, errors: dict[int, tuple[str, str]]
) -> tuple[str, bool] | None:
    """A rank that timed out in a collective: one line naming the ranks that never answered
    (stopped, or alive and silent). None when the first error is no timeout, or all answered."""
    if not errors:
        return None
    rank, _, message = _message(errors)
    if "timed out" not in message.lower() and "timeout" not in message.lower():
        return None
    silent = [
        f"rank {r} (pid {p.pid}{', stopped' if process_state(p.pid) == 'stopped' else ''})"
        for r, p in enumerate(workers)
        if r not in errors and p.exitcode is None
    ]
    if not silent:
        return None
    return (
        f"rank {rank} waited {cfg.collective_timeout:g} s (--collective-timeout) "
        f"for {', '.join(silent)}, which did not answer: {message}",
        False,
    )


def _failure(workers: list, errors: dict[int, tuple[str, str]]) -> tuple[str, bool]:
    """The one line that says why a spawned run failed, and whether it is bad input: the first
    error a rank sent; a rank that died without a word is named with its exit status."""
    if errors:
        rank, kind, message = _message(errors)
        return (message if rank == 0 else f"rank {rank}: {message}"), kind == "bad-input"
    for rank, proc in enumerate(workers):
        if proc.exitcode not in (None, 0):
            code = proc.exitcode
            how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited ({code})"
            return f"rank {rank} (pid {proc.pid}) {how} without an error message", False
    return "a worker failed", False


def _killed_rank(
    workers: list, errors: dict[int, tuple[str, str]], grace: float = 2.0
) -> tuple[str, bool] | None:
    """A rank killed by a signal (SIGKILL, the OOM killer, a segfault) is the cause of the
    failure, whatever the others then said (gloo's "Connection closed by peer" in the rank that
    lost it, with its traceback): one line naming it. The others' errors may arrive first, so a
    rank that has not exited yet is waited for up to `grace` seconds. None when no rank died so."""
    deadline = time.monotonic() + (grace if errors else 0.0)
    while True:
        for rank, proc in enumerate(workers):
            code = proc.exitcode
            if code is not None and code < 0 and rank not in errors:
                return (
                    f"rank {rank} (pid {proc.pid}) was killed by {signal.Signals(-code).name}; "
                    "the other ranks lost it",
                    False,
                )
        if time.monotonic() >= deadline or all(p.exitcode is not None for p in workers):
            return None
        time.sleep(0.05)


def _stop(workers: list, cfg: Config, grace: float = 3.0) -> None:
    """SIGTERM every worker still running, SIGKILL what is left after `grace` seconds, reap
    them, and remove the checkpoint temp file a killed rank 0 may have been writing."""
    alive = [p for p in workers if p.exitcode is None]
    for proc in alive:
        proc.terminate()
        if process_state(proc.pid) == "stopped":  # acts on SIGTERM only once resumed
            os.kill(proc.pid, signal.SIGCONT)
    deadline = time.monotonic() + grace
    for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
        if proc.exitcode is None:
            proc.kill()
            proc.join()
    if cfg.checkpoint_dir:
        for proc in workers:  # common.runtime.atomic_write_with: <file>.<random>.tmp<pid>
            for tmp in Path(cfg.checkpoint_dir).glob(f"*.tmp{proc.pid}"):
                tmp.unlink(missing_ok=True)


def _spawned(
    local_rank: int,
    cfg: Config,
    train: Callable[..., dict],
    port: int,
    parent: int,
    lifeline: Connection,
    report: Connection,
    argv: list[str],
) -> None:
    """One rank of a spawned run: dies with the parent; reports to it; never writes --output."""
    die_with_parent(parent)
    for s in WORKERS_IGNORE:  # Ctrl-C, the terminal closed: the parent stops the workers
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKERS_IGNORE)  # blocked since the start
    sys.argv = argv  # the record's "command"
    os.environ.update(
        RANK=str(local_rank),
        WORLD_SIZE=str(cfg.gpus),
        LOCAL_RANK=str(local_rank),
        LOCAL_WORLD_SIZE=str(cfg.gpus),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    try:
        record = train(cfg, report=report)
    except BAD_INPUT as exc:
        report.send(("bad-input", str(exc)))
        sys.exit(1)
    except Exception as exc:
        report.send(("error", str(exc) if isinstance(exc, RunFailed) else describe(exc)))
        sys.exit(1)
    if local_rank == 0:
        report.send(("record", record))
