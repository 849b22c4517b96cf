"""One run's bookkeeping, the same in every trainer: `Run`.

A trainer keeps what the reader came to compare: its model, its step, its data-parallel
transform and the epoch loop with its sync points. `Run` holds the rest, written once:

    run = Run(cfg, FRAMEWORK, PACKAGES, rank=rank, world=world, layout="NCHW", gpu=cuda,
              sync=sync, profiler=TorchProfiler)  # the data: run.ds, run.loader, run.evals
    state = create_train_state(cfg, model, ..., len(run.loader))
    run.record(devices=..., kind=..., params=..., execution=..., precision=..., ran=...,
               state_bytes=...)
    state, start = run.resume(state, CHECKPOINTS)
    with run.measured():                     # a crash keeps the epochs measured so far
        for epoch in range(start, cfg.epochs):
            run.timer.start()
            batches = run.batches(epoch)     # the loader's, profiled under --profile
            ...                              # the framework's steps, their metric sums
            sec = run.timer.stop()
            ...                              # host copies of the sums: the sync point
            if run.end_epoch(epoch, state, sec, batches.wait_sec, train_sums, test):
                break                        # the target held, or diverged
    return run.finish(lambda: canonical_state(state), **extra)

Framework-neutral (numpy and the standard library): the framework's own calls come in as
functions (`sync`, `barrier`), its checkpoint I/O as one `Checkpoints` (common/checkpoints.py)
and its profiler as a class (`profiler`, frameworks/profilers.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from common.checkpoints import Checkpoints, save_final_state
from common.config import Config
from common.datasets import load_for
from common.footprint import collective_bytes
from common.init import init_record
from common.memory import check_memory
from common.pipeline import (
    DEVICE_DATA_LIMIT,
    EvalLoader,
    TrainLoader,
    crops_on_device,
    pipeline_record,
)
from common.profiling import Profiler, ProfileWindow
from common.results import RunRecorder, timing_summary
from common.runtime import injected_failure, printer
from common.timing import PhaseTimer, Timer
from common.trainer import keep_measured_epochs

S = TypeVar("S")  # a framework's train state


class Run:
    """Everything around a trainer's epoch loop (see the module docstring).

    `rank` / `world`: this process and the number of processes; each reads only its contiguous
    part of every global batch (the sharding DistributedSampler + set_epoch gives, minus
    padding), and its share of the test set. `layout`: the batches' NCHW or NHWC. `gpu`: the
    devices are GPUs (--pipeline auto then keeps the training set on them). `sync`: waits for
    the framework's queued device work (the timers' boundaries). `pad_to`: test batches padded
    to a multiple of it (static shapes). `device_bytes`: the most training-set bytes the
    framework's device arrays hold. torch-ddp's spawned ranks give the parent's `report` pipe
    (rank 0's record after every epoch) and a `barrier` (rank 0's checkpoint on disk before any
    rank goes on). `profiler`: the framework's (frameworks/profilers.py), for --profile.
    `sharded`: the state is sharded over the processes (torch-fsdp): gathering it for the
    checkpoint and --save-state is a collective, so every process calls the checkpoint's save
    and `final_state` (which write on process 0 only)."""

    def __init__(
        self,
        cfg: Config,
        framework: str,
        packages: tuple[str, ...],
        *,
        layout: str,
        gpu: bool,
        sync: Callable[[], None],
        rank: int = 0,
        world: int = 1,
        pad_to: int = 0,
        device_bytes: int = DEVICE_DATA_LIMIT,
        report: Connection | None = None,
        barrier: Callable[[], Any] | None = None,
        profiler: Callable[[], Profiler] | None = None,
        sharded: bool = False,
    ):
        injected_failure(framework)  # DPBENCH_FAIL=<framework>: a start-up failure (tests)
        check_memory(cfg, gpu, world)  # sizes against memory, before the data and the model
        self.cfg, self.framework, self.packages = cfg, framework, packages
        self.rank, self.world, self.is_main = rank, world, rank == 0
        self.report, self.barrier, self.sharded = report, barrier, sharded
        self.recorder: RunRecorder | None = None
        self.log = printer(self.is_main)  # only process 0 prints
        self.ds = load_for(cfg)
        self.loader = TrainLoader(
            self.ds,
            cfg.batch_size,
            cfg.seed,
            rank,
            world,
            augment=cfg.augment,
            layout=layout,
            max_steps=cfg.max_steps_per_epoch,
            prefetch=cfg.prefetch,
            on_device=crops_on_device(cfg.pipeline, gpu, self.ds.train_x.nbytes, device_bytes),
        )
        self.eval_batch = max(1, cfg.eval_batch_size // world)
        self.evals = EvalLoader(self.ds, self.eval_batch, rank, world, layout=layout, pad_to=pad_to)
        # Test batches of the process with the most (each process must run as many).
        self.eval_steps = max(
            len(EvalLoader(self.ds, self.eval_batch, r, world)) for r in range(world)
        )
        self.timer = Timer(sync)  # the epoch's time (common/timing.py, TIMING_RULE)
        self.profile: ProfileWindow | None = None  # --profile STEPS: the framework's profiler
        if cfg.profile:
            assert profiler is not None, f"{framework} gives Run no profiler for --profile"
            self.profile = ProfileWindow(cfg, profiler, sync, rank, self.is_main, self.log)
        annotate = None if self.profile is None else self.profile.annotate  # phases as ranges
        self.phases = PhaseTimer(sync, cfg.phase_timing, annotate)  # --phase-timing
        self.start = 0  # the first epoch this process trains (after --resume: the next one)
        self._save: Callable[[Any, int], None] = lambda state, epoch: None  # see resume()

    def record(
        self,
        *,
        devices: int,
        kind: str,
        params: int,
        threads: dict[str, Any],
        execution: str,
        precision: str,
        ran: dict[str, str],
        state_bytes: dict[str, int],
        reshard: bool | None = None,
    ) -> RunRecorder:
        """Start the run record: how the run executes (device kind, threads, execution mode,
        float32 precision, and `ran`, what the step runs as read from the run: activation_dtype,
        input_memory_format, mode), what one device keeps (`state_bytes`, common.footprint's
        `state_record`, read from the framework's arrays) and so sends per step (`reshard`:
        FSDP's reshard after forward; common.footprint.collective_bytes), and what every record
        holds alike (the shared start, the BN mode, the test set, where the batches are made)."""
        cfg = self.cfg
        rec = RunRecorder(
            cfg,
            devices=devices,
            device_kind=kind,
            params=params,
            is_main=self.is_main,
            packages=self.packages,
            bn_mode=cfg.bn,
            n_test=len(self.ds.test_x),
            init=init_record(cfg, self.ds.channels, self.ds.num_classes),
        )
        rec.threads, rec.execution, rec.float32_precision = threads, execution, precision
        rec.ran = dict(ran)
        rec.pipeline = pipeline_record(self.loader.on_device)
        rec.state_bytes = state_bytes
        rec.collective_bytes = collective_bytes(cfg.framework, state_bytes, devices, reshard)
        self.recorder = rec
        return rec

    def resume(
        self,
        state: S,
        checkpoints: Checkpoints,
        to_host: Callable[[S], Any] = lambda s: s,
        to_device: Callable[[Any], S] = lambda s: s,
    ) -> tuple[S, int]:
        """The framework's `checkpoints` (its support module's CHECKPOINTS): one is saved after
        every epoch (end_epoch); --resume loads one where it exists, which gives the recorder
        the checkpoint's epochs. Both see the host state `to_host` gives; `to_device` puts a
        loaded one back. Returns the state to train and the epochs done (the state given and 0
        without a checkpoint)."""
        assert self.recorder is not None, "record() first: the checkpoint holds its epochs"
        recorder, path = self.recorder, checkpoints.path(self.cfg)
        save = checkpoints.save
        self._save = lambda state, epoch: save(self.cfg, to_host(state), recorder, epoch)
        if self.cfg.resume and path.exists():
            host_state, self.start = checkpoints.load(self.cfg, to_host(state), self.recorder)
            self.log(f"resumed from {path} after epoch {self.start}")
            return to_device(host_state), self.start
        if self.cfg.resume:
            self.log(f"no checkpoint at {path}: starting from scratch")
        return state, 0

    def batches(self, epoch: int) -> Any:
        """This process's training batches of `epoch` (0-based; the loader's, with `wait_sec`),
        the first epoch of the process profiled under --profile (common/profiling.py)."""
        batches = self.loader.epoch(epoch)
        if self.profile is None:
            return batches
        return self.profile.wrap(batches, len(self.loader), epoch)

    @contextmanager
    def measured(self) -> Iterator[None]:
        """Around the epoch loop: a crash keeps the epochs measured so far in a "failed"
        record; a rank of a multi-process run then exits, so that the others are stopped."""
        assert self.recorder is not None
        # One line per rank of several (no traceback): a rank's crash is often another's echo
        quiet = None if self.world == 1 else lambda traceback: None
        with keep_measured_epochs(self.recorder, reraise=self.world > 1, on_traceback=quiet):
            try:
                yield
            finally:
                if self.profile is not None:  # a step failed inside the window: stop there
                    self.profile.close()

    def end_epoch(
        self,
        epoch: int,
        state: Any,
        sec: float,
        wait_sec: float,
        train: Mapping[str, float],
        test: Mapping[str, float],
    ) -> bool:
        """After epoch `epoch` (0-based), outside its timed region: its row in the record (every
        step's global batch counted), the input wait in the phase times, `state`'s checkpoint
        (on process 0 where --checkpoint-dir is set; see `resume`), the failure hook. `train` and
        `test` are the epoch's metric sums on the host, {"loss_sum", "correct", "count"} as every
        step returns them. True when training should stop (the target held, or diverged). The
        phase times restart after the first epoch of the process (warm-up)."""
        cfg, rec = self.cfg, self.recorder
        assert rec is not None
        self.phases.add("data_wait", wait_sec)
        images = len(self.loader) * cfg.batch_size
        train_loss = float(train["loss_sum"]) / float(train["count"])
        stop = rec.end_epoch(epoch, sec, images, train_loss, float(test["correct"]),
                             float(test["count"]), float(test["loss_sum"]))  # fmt: skip
        if self.is_main and self.report is not None:  # to the parent: the epochs so far
            self.report.send(rec.result())
        if cfg.checkpoint_dir:
            if self.is_main or self.sharded:
                self._save(state, epoch)
            if self.barrier is not None:  # the checkpoint on disk before any rank may be killed
                self.barrier()
        injected_failure(self.framework, epoch + 1)  # DPBENCH_FAIL=<framework>@<epoch> (tests)
        if not stop and epoch == self.start and epoch + 1 < cfg.epochs:
            self.phases.reset()  # phase times exclude the warm-up epoch
        return stop

    def finish(self, final_state: Callable[[], dict[str, Any]], **extra: Any) -> dict[str, Any]:
        """The record (written by process 0 to --output) with the phase times and `extra`;
        `final_state()` (numpy, torch's names) to --save-state."""
        assert self.recorder is not None
        if self.cfg.phase_timing:
            self.recorder.phases = self.phases.per_step_ms()
        if self.profile is not None:  # the trace read into a breakdown, beside the timed step
            timed = timing_summary(self.recorder.epochs)
            per_epoch = timed["sec_per_epoch"] if timed["timed_epochs"] else None
            self.recorder.extra.update(
                self.profile.record(per_epoch / len(self.loader) if per_epoch else None)
            )
        self.recorder.extra.update(extra)
        if self.cfg.save_state and (self.is_main or self.sharded):
            state = final_state()  # sharded: a collective
            if self.is_main:
                save_final_state(self.cfg, state)  # --save-state
        return self.recorder.finish()
