"""torch-ddp's processes: where this process stands in the job (`launch_env`, `join_world`),
the arguments of its `init_process_group` (`Launch.rendezvous`), and, without a launcher,
`spawn`: one process per device on this node, started by torch.multiprocessing.

    python -m frameworks.torch_ddp --preset digits --gpus 2        # spawn: 2 processes
    torchrun --nproc-per-node=4 -m frameworks.torch_ddp --preset cifar10-resnet18
    torchrun --nnodes=2 --nproc-per-node=8 --node-rank=R --rdzv-endpoint=HOST:PORT \
        -m frameworks.torch_ddp ...                                  # R = 0 on HOST, 1 elsewhere
    srun --ntasks=16 --ntasks-per-node=8 python -m frameworks.torch_ddp ...
        # SLURM: MASTER_ADDR (first node) and MASTER_PORT exported by the batch script

Under a launcher (torchrun's RANK/WORLD_SIZE/LOCAL_RANK, or SLURM's SLURM_PROCID/SLURM_NTASKS/
SLURM_LOCALID with MASTER_ADDR/MASTER_PORT) the launcher's world size replaces --gpus; resuming
a multi-node run needs --checkpoint-dir on a filesystem every node sees.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

from common.config import Config, ConfigError, resolve
from common.errors import RunFailed
from common.interrupts import Interrupted, interruptible, shield_interrupts
from common.results import write_json_atomic
from common.runtime import die_with_parent, env_int, free_port
from common.trainer import describe


@dataclass(frozen=True)
class Launch:
    """This process's place in the job, from the launcher's environment."""

    rank: int
    world: int
    local_rank: int
    local_world: int

    def rendezvous(self, backend: str, timeout: float) -> dict[str, Any]:
        """The arguments of this rank's `dist.init_process_group`: env:// (MASTER_ADDR and
        MASTER_PORT), and `timeout` (--collective-timeout), which bounds the rendezvous and
        every collective: a rank that stops answering fails the run instead of holding it."""
        return dict(backend=backend, init_method="env://", rank=self.rank,
                    world_size=self.world, timeout=datetime.timedelta(seconds=timeout))  # fmt: skip


def launch_env() -> Launch | None:
    """torchrun (or our own spawn) sets RANK/WORLD_SIZE/LOCAL_RANK; srun sets SLURM_PROCID/
    SLURM_NTASKS/SLURM_LOCALID (a 1-task SLURM job is not a launch: --gpus spawns as usual).
    A value that is no integer: one line naming it (ConfigError, exit 2)."""
    env = os.environ
    if env.get("RANK", "").strip() and env.get("WORLD_SIZE", "").strip():  # empty: unset
        world = env_int("WORLD_SIZE", 1, minimum=1)
        return Launch(env_int("RANK", 0), world, env_int("LOCAL_RANK", 0),
                      env_int("LOCAL_WORLD_SIZE", world, minimum=1))  # fmt: skip
    if "SLURM_PROCID" in env and env_int("SLURM_NTASKS", 1) > 1:
        if not ("MASTER_ADDR" in env and "MASTER_PORT" in env):
            raise ConfigError(
                "under srun, export MASTER_ADDR (the first node's host name) and "
                "MASTER_PORT (a free port) in the batch script"
            )
        world, rank = env_int("SLURM_NTASKS", 1), env_int("SLURM_PROCID", 0)
        local_rank = env_int("SLURM_LOCALID", 0)
        per_node = re.match(r"\d+", env.get("SLURM_NTASKS_PER_NODE", ""))  # "8" or "8(x2)"
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(local_rank))
        return Launch(rank, world, local_rank, int(per_node.group()) if per_node else world)
    return None


def join_world(launch: Launch | None, cfg: Config) -> tuple[Launch, Config]:
    """This process's place: the launcher's (`launch`), or without one a world of one on a free
    loopback port; and `cfg` with the world's size as --gpus (the launcher decides it)."""
    if launch is None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        launch = Launch(0, 1, 0, 1)
    if cfg.gpus != launch.world:
        cfg = resolve(cfg.replace(gpus=launch.world))
    return launch, cfg


RANKS_IGNORE = {signal.SIGINT, signal.SIGHUP}  # a spawned rank's: its parent stops it


def spawn(cfg: Config, train: Callable[..., dict]) -> dict:
    """Start `cfg.gpus` processes on this node (torch.multiprocessing), each running `train`
    as one rank with the environment torchrun would give it, and wait for them.

    Rank 0 writes `--output`, as a run alone does, and sends its record after every epoch
    (`report`). A rank that dies ends the job: torch stops the others, and the run fails with
    one line naming the rank and how it died, which the record (the epochs rank 0 measured)
    also says. SIGTERM / SIGINT: the ranks are stopped, rank 0 records "interrupted"."""
    if cfg.output:  # rank 0 writes it: a record here after the run is this run's
        Path(cfg.output).unlink(missing_ok=True)
    reports, report = mp.get_context("spawn").Pipe(duplex=False)
    reported: list[dict] = []  # rank 0's record after each epoch

    def read() -> None:
        while reports.poll():
            try:
                reported[:] = [reports.recv()]
            except EOFError:
                return

    args = (cfg, train, report, str(free_port()), os.getpid(), sys.argv)
    logging.getLogger(mp.spawn.__module__).setLevel(logging.ERROR)  # "Terminating process": ours
    # Ctrl-C reaches every process of the group, ranks still importing torch too (a traceback
    # each): they start with SIGINT and SIGHUP blocked (a mask survives exec) until _rank
    # ignores them; this process stops them. (The resource tracker unblocks them as it starts.)
    resource_tracker.ensure_running()
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, RANKS_IGNORE)
    try:
        job = mp.start_processes(_rank, args, nprocs=cfg.gpus, join=False, start_method="spawn")
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        report.close()  # the ranks hold it
    try:
        while not job.join(1.0):
            read()
    except Interrupted as exc:
        shield_interrupts()  # a scheduler signals every process of the job
        for proc in job.processes:
            proc.terminate()  # rank 0 records "interrupted" (the epochs so far)
        for proc in job.processes:
            proc.join(30)
            proc.kill()  # (one stopped, or stuck in C++)
            proc.join()
        exc.recorded = bool(cfg.output) and os.path.exists(cfg.output)
        raise
    except (mp.ProcessExitedException, mp.ProcessRaisedException) as exc:
        # A rank killed by a signal is the cause; the others' errors (gloo's "Connection
        # closed by peer"), or their SIGTERM from torch stopping them, are only its echo.
        codes = [p.exitcode or 0 for p in job.processes]
        rank = next((r for r, c in enumerate(codes) if c < 0 and c != -signal.SIGTERM),
                    exc.error_index)  # fmt: skip
        code, pid = codes[rank], job.processes[rank].pid
        if code < 0:
            error = f"rank {rank} (pid {pid}) was killed by {signal.Signals(-code).name}"
        elif isinstance(exc, mp.ProcessRaisedException):
            if str(exc).count("Traceback") > 1:  # a crash in the loop (RunFailed from it)
                print(str(exc).strip(), file=sys.stderr)  # its traceback, as a run alone's
            error = f"rank {rank}: {describe(exc)}"
        else:
            error = f"rank {rank} (pid {pid}) exited with {code}"
        read()
        written = bool(cfg.output) and os.path.exists(cfg.output)
        if not (written or reported):  # run_main writes the record
            if code < 0 or not isinstance(exc, mp.ProcessRaisedException):
                raise RuntimeError(error) from None
            raise  # what the rank raised (bad input found in a rank: exit 2)
        record = json.loads(Path(cfg.output).read_text()) if written else reported[0]
        if not written or rank != 0 or record["status"] in ("ok", "interrupted"):  # an echo
            record.update(status="failed", error=error)
            if cfg.output:
                write_json_atomic(cfg.output, record)
        raise RunFailed(record["error"]) from None
    finally:
        reports.close()
        for name in job.error_files:  # torch's (left where a rank raised)
            Path(name).unlink(missing_ok=True)
    return json.loads(Path(cfg.output).read_text()) if cfg.output else {"status": "ok"}


def _rank(local_rank: int, cfg: Config, train: Callable[..., dict], report: Connection,
          port: str, parent: int, argv: list[str]) -> None:  # fmt: skip
    """One rank of a spawned run: dies with its parent (kill -9 leaves no orphan), stops as a
    trainer does on SIGTERM, and exits non-zero where its run did not end "ok"."""
    die_with_parent(parent)
    sys.argv = argv  # the record's "command"
    rank, world = str(local_rank), str(cfg.gpus)
    os.environ.update(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, LOCAL_WORLD_SIZE=world,
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=port)  # fmt: skip
    try:
        with interruptible():
            for s in RANKS_IGNORE:
                signal.signal(s, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_UNBLOCK, RANKS_IGNORE)
            record = train(cfg, report=report)
    except Interrupted as exc:
        sys.exit(128 + exc.signum)
    if record.get("status") != "ok":
        raise RunFailed(record.get("error") or record.get("status"))
