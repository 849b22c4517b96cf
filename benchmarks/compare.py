"""`python -m benchmarks.compare`: the same training in every framework at 1..N devices.

Every (framework, device count, seed) runs as `<python> -m frameworks.<module> ...` in a process
of its own, with the framework's own interpreter (the MXNet environment for mxnet-gluon), a
timeout and a captured log; its result JSON is kept as soon as it ends, so a failed, hung or
diverged run costs only itself. Everything is validated before the first run starts: bad input
gives one line, `compare: error: <problem>; <fix>`, and exit code 2.

The runner imports no framework (it starts fast and runs in either environment): GPUs are
counted with `nvidia-smi -L`; without GPUs every framework simulates its devices on the CPU and
every table, file and plot says "cpu-simulated".

Exit code: 0 when every run finished with status "ok", 1 when any failed, diverged or timed out,
2 on bad input (nothing started), 128 + the signal when interrupted (130 Ctrl-C, 143 SIGTERM).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from benchmarks import harness, report
from benchmarks.harness import UsageError
from benchmarks.progress import make_progress, parse_epoch_line
from common import cli
from common.config import FRAMEWORKS, Config, ConfigError, preset, resolve, train_size
from common.datasets import DatasetError, check_available
from common.memory import check_machine
from common.preflight import check_outputs
from common.results import host_info, write_json_atomic
from common.runtime import MIN_FREE_BYTES, ROOT
from common.schedule import scaled_lr

PROG = "python -m benchmarks.compare"
DEFAULT_TIMEOUT = 900.0
DEFAULT_GPUS = "2"
RUNNER_OWNED = ("gpus", "devices", "output", "tensorboard")  # set per run by the runner
PER_RUN = ("batch_size", "batch_per_device", "seed")  # derived per run from the scaling mode

EPILOG = f"""\
examples:
  {PROG}                       # offline default: 1 and 2 devices
  {PROG} --frameworks torch-ddp,jax-pmap --gpus 4    # devices 1, 2, 4
  {PROG} --frameworks {harness.VARIANT_EXAMPLE} --gpus 1
                               # torch-ddp eager and with CUDA graphs beside JAX (on CUDA)
  {PROG} --gpus 1,2,3 --preset smoke --repeat 3      # 3 seeds: median (min-max)
  {PROG} --scaling weak --lr-scaling linear          # per-device batch fixed
  {PROG} --target-accuracy 0.95                      # time-to-accuracy columns

outputs (in --out DIR): config.json (resolved config, every run's command), runs/*.json (every
run's record, written when it ends), logs/*.log, results.csv (one row per framework x devices),
runs.csv (one row per run), results.md, throughput.png, efficiency.png, accuracy_vs_time.png,
predicted_efficiency.png (measured vs PREDICTED from the 1-device run, docs/scaling.md),
breakdown.png (with --profile: where each step's time went, docs/profiling.md),
tensorboard/<run id>/ (every run's curves: `tensorboard --logdir DIR/tensorboard` overlays them).
exit code: 0 all runs ok, 1 a run failed / diverged / timed out, 2 bad input (nothing ran).
"""


class _Help(argparse.Action):
    """--help: the runner's own flags, then the shared training flags it passes through."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, help="show this help message and exit")

    def __call__(self, parser: argparse.ArgumentParser, *args: Any) -> NoReturn:
        shared = cli.build_parser("compare", exclude=RUNNER_OWNED).format_help()
        _, _, options = shared.partition("\noptions:\n")
        options = "\n".join(
            line for line in options.splitlines() if not line.lstrip().startswith("-h, --help")
        )
        text = parser.format_help().replace(EPILOG, "")
        print(f"{text}\nshared training flags (passed to every run, same meaning as in "
              f"`python -m frameworks.<module> --help`;\n--batch-size is the global batch of the "
              f"1-device run):\n{options}\n\n{EPILOG}")  # fmt: skip
        parser.exit(0)


def runner_parser() -> harness.Parser:
    p = harness.Parser(
        "compare",
        usage=f"{PROG} [--frameworks LIST] [--gpus N|LIST] [--scaling strong|weak]\n"
        "         [--repeat K] [--out DIR] [--timeout SEC] [shared training flags ...]",
        description="Train the same model with every framework's data parallelism at 1..N "
        "devices, one\nprocess per run, and compare test accuracy, time per epoch, throughput "
        "and scaling\nefficiency.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    p.add_argument("-h", "--help", action=_Help)
    harness.add_flags(p, frameworks=",".join(FRAMEWORKS), devices=True, variants=True)
    p.add_argument(
        "--gpus", metavar="N|LIST",
        help="device counts: N runs 1, 2, 4, ... (powers of two below N) and N; a list such as "
        "1,2,3 runs exactly those (default: 2, i.e. 1 and 2; 1 on a 1-GPU machine). Without GPUs "
        "the devices are simulated on the CPU",
    )  # fmt: skip
    p.add_argument(
        "--scaling", choices=("strong", "weak"),
        help="strong: the global batch stays fixed at every device count; weak: the per-device "
        "batch stays fixed (global batch = 1-device batch x devices; the LR follows "
        "--lr-scaling relative to --lr-base-batch). Default: weak for presets that fix the "
        "per-device batch, strong otherwise",
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=int, default=1, metavar="K",
        help="runs per cell, seeds seed..seed+K-1: the table shows the median and min-max of "
        "images/s and s/epoch, the mean ± std of test accuracy, and marks images/s that are "
        "within noise of another framework's (default: 1, whose spread is not measured)",
    )  # fmt: skip
    p.add_argument(
        "--tensorboard", action=argparse.BooleanOptionalAction, default=True,
        help="write every run's TensorBoard curves to DIR/tensorboard/<run id>/, so that "
        "`tensorboard --logdir DIR/tensorboard` overlays every framework and device count "
        "(default: on)",
    )  # fmt: skip
    harness.add_flags(p, out="results/", timeout=DEFAULT_TIMEOUT)
    return p


# -- the plan -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RunSpec:
    run_id: str  # "torch-ddp-2dev" (+ "-seed1" with --repeat)
    framework: str  # its row: a name in --frameworks, e.g. "torch-ddp+reduce-overhead"
    devices: int
    seed: int
    cfg: Config  # resolved, exactly what the run will use
    command: tuple[str, ...]
    log: Path
    output: Path

    @property
    def peak_lr(self) -> float:
        c = self.cfg
        return scaled_lr(c.lr, c.batch_size, c.lr_base_batch, c.lr_scaling)


@dataclass
class Plan:
    base: Config  # the resolved configuration at 1 device
    passthrough: dict[str, Any]  # shared flags given on the command line
    frameworks: list[str]
    counts: list[int]
    scaling: str
    repeat: int
    timeout: float
    out: Path
    tensorboard: bool  # every run writes out/tensorboard/<run id>/
    gpus: list[str]  # GPU names from nvidia-smi (empty: simulated CPU devices)
    devices: harness.Devices  # --devices as decided for every run
    command: list[str]
    runs: list[RunSpec] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    not_applicable: dict[tuple[str, int], str] = field(default_factory=dict)
    unwritten: list[str] = field(default_factory=list)  # files a write failed for

    def save(self, name: str, write: Callable[[], Any]) -> Any:
        """`write()`, or on an OSError (a full disk, ENOSPC) one line naming the file and the
        cause: the sweep goes on and the exit code says a file is missing."""
        try:
            return write()
        except OSError as exc:
            print(f"compare: could not write {name}: {exc.strerror or exc}", flush=True)
            self.unwritten.append(name)
            return None

    @property
    def expected_kind(self) -> str:
        return harness.device_kind(self.gpus)


def make_plan(argv: list[str]) -> Plan:
    """Parse and validate everything; raise UsageError (argparse exits 2 itself)."""
    ns, rest = runner_parser().parse_known_args(argv)
    harness.check_options(ns)
    for token in rest:
        if token.split("=")[0] == "--output":
            raise UsageError("--output is set by the runner for each run (runs/<run>.json); "
                             "use --out DIR for the whole comparison")  # fmt: skip
    shared = vars(cli.build_parser("compare", exclude=RUNNER_OWNED).parse_args(rest))
    preset_name = shared.pop("preset")
    per_device_given = "batch_per_device" in shared
    given, per_device = shared.get("batch_size"), shared.get("batch_per_device", 0)
    if given is not None and per_device > 0 and given != per_device:  # as cli.resolved
        raise UsageError(
            f"--batch-size {given} disagrees with --batch-per-device {per_device} (the "
            "1-device batch of a weak-scaling sweep): give only one of the two flags"
        )
    if "batch_size" in shared:  # an explicit batch wins over a per-device preset (as in cli)
        shared.setdefault("batch_per_device", 0)
    for key in ("data_dir", "checkpoint_dir"):  # runs start in the project root
        if shared.get(key):
            shared[key] = str(Path(shared[key]).resolve())
    try:
        base = preset(preset_name, **shared)  # gpus=1: the 1-device configuration
        check_machine(base)
        check_outputs(base)  # --checkpoint-dir, --save-state, --data-dir: now, not in every run
    except ConfigError as exc:
        raise UsageError(str(exc)) from None

    frameworks = harness.parse_frameworks(ns.frameworks, variants=True)
    counts = harness.parse_gpus(DEFAULT_GPUS if ns.gpus is None else ns.gpus)
    harness.check_positive(repeat=ns.repeat, timeout=ns.timeout)
    gpus = harness.machine_gpus(ns.devices)
    if gpus and ns.gpus is None:  # the default must run on a 1-GPU machine too
        counts = [n for n in counts if n <= len(gpus)]
    harness.check_counts(counts, gpus)

    scaling = ns.scaling or ("weak" if base.batch_per_device > 0 else "strong")
    if scaling == "strong" and per_device_given:
        raise UsageError(
            "--batch-per-device fixes the per-device batch, which is weak scaling; "
            "use --scaling weak, or --batch-size for a fixed global batch"
        )
    batch = base.batch_size  # the 1-device (global = per-device) batch
    if scaling == "strong":
        bad = [n for n in counts if batch % n]
        if bad:
            step = math.lcm(*counts)
            raise UsageError(
                f"global batch {batch} does not divide over {bad[0]} devices (strong scaling "
                f"keeps it fixed at every count in {','.join(map(str, counts))}); use "
                f"--batch-size {max(step, batch // step * step)} (a multiple of {step}) or "
                "--scaling weak"
            )
    n_train = train_size(base)
    largest = batch * (max(counts) if scaling == "weak" else 1)
    if largest > n_train:
        raise UsageError(
            f"global batch {largest} is larger than the {base.dataset} training set ({n_train} "
            f"images), so no step could run; use a smaller --batch-size or fewer devices"
        )
    data_dir = ROOT / base.data_dir  # as the runs see it: they start in the project root
    try:
        check_available(base.replace(data_dir=str(data_dir)))
    except DatasetError as exc:
        raise UsageError(str(exc)) from None

    skipped = harness.unavailable(frameworks)
    # Last of the checks (each framework's interpreter imports its framework): the devices.
    chosen = harness.choose_devices(ns.devices, [f for f in frameworks if f not in skipped])
    skipped.update(chosen.skipped)
    base = base.replace(devices=chosen.choice)
    out = harness.output_dir(ns.out, "", "config.json", MIN_FREE_BYTES + RESERVE_BYTES)

    plan = Plan(base, shared, frameworks, counts, scaling, ns.repeat, ns.timeout, out,
                ns.tensorboard, gpus, chosen, [*PROG.split(), *argv], skipped=skipped)  # fmt: skip
    for fw in frameworks:
        if fw in plan.skipped:
            continue
        for n in counts:
            why = harness.not_applicable(fw, n, gpus)
            if why:
                plan.not_applicable[(fw, n)] = why
                continue
            global_batch = batch * n if scaling == "weak" else batch
            for seed in range(base.seed, base.seed + ns.repeat):
                plan.runs.append(make_run(plan, fw, n, seed, global_batch))
    if not plan.runs:
        why = "; ".join(f"{k}: {v}" for k, v in plan.skipped.items()) or "; ".join(
            f"{fw} x{n}: {v}" for (fw, n), v in plan.not_applicable.items()
        )
        raise UsageError(f"nothing can run ({why})")
    return plan


def make_run(plan: Plan, fw: str, n: int, seed: int, global_batch: int) -> RunSpec:
    run_id = f"{fw}-{n}dev" + (f"-seed{seed}" if plan.repeat > 1 else "")
    output = plan.out / "runs" / f"{run_id}.json"
    args = ["--preset", plan.base.preset]
    variant = harness.variant_settings(fw)  # NAME+VARIANT: its mode over the sweep's flags
    own_dirs = {  # one directory per run
        k: str(Path(plan.passthrough[k]) / run_id)
        for k in ("checkpoint_dir", "profile_dir")
        if k in plan.passthrough
    }
    for key, value in {**plan.passthrough, **own_dirs}.items():
        if key not in PER_RUN and key not in variant:
            args += harness.flag(key, value)
    for key, value in variant.items():
        args += harness.flag(key, value)
    args += ["--gpus", str(n), "--batch-size", str(global_batch), "--seed", str(seed)]
    args += plan.devices.flags  # every run on the kind of device chosen for the whole sweep
    tensorboard = str(tensorboard_dir(plan.out) / run_id) if plan.tensorboard else ""
    if tensorboard:
        args += ["--tensorboard", tensorboard]
    args += ["--output", str(output)]
    framework = harness.framework(fw)
    cfg = plan.base.replace(**variant, framework=framework.name, gpus=n, seed=seed,
                            batch_size=global_batch, batch_per_device=0, tensorboard=tensorboard,
                            **own_dirs)  # fmt: skip
    try:
        cfg = resolve(cfg.replace(output=str(output)))
        check_machine(cfg)
    except ConfigError as exc:
        raise UsageError(f"{fw} at {n} devices: {exc}") from None
    command = (str(framework.python), "-m", framework.module, *args)
    return RunSpec(run_id, fw, n, seed, cfg, command, plan.out / "logs" / f"{run_id}.log", output)


def tensorboard_dir(out: Path) -> Path:
    """Where every run's event files go, one directory per run id (TensorBoard's run name)."""
    return out / "tensorboard"


# -- running ------------------------------------------------------------------------------------


def execute_run(spec: RunSpec, plan: Plan, progress: Any) -> dict[str, Any]:
    """Run one process to completion or timeout; return its record (synthesised if missing)."""
    epochs: list[dict[str, Any]] = []
    t0 = time.monotonic()
    label = f"{spec.framework} x{spec.devices}" + (f" seed {spec.seed}" if plan.repeat > 1 else "")
    progress.start_run(label, spec.cfg.epochs, str(spec.log.relative_to(plan.out)))

    def on_line(line: str) -> None:  # the per-epoch lines feed the live display
        row = parse_epoch_line(line)
        if row:
            row["wall_sec"] = time.monotonic() - t0
            epochs.append(row)
            progress.epoch(row)

    child = harness.run_child(spec.command, spec.log, plan.timeout, tag="compare", on_line=on_line)
    record = finish_record(spec, plan, child, epochs)
    record["runner"]["wall_sec"] = child.wall_sec
    # Other work on the machine skews every timing: keep the 1-minute load average with the run.
    record["runner"]["load_avg"] = list(child.load_avg)
    # kept now, whatever happens to later runs (a full disk: said, and the sweep goes on)
    plan.save(f"runs/{spec.output.name}", lambda: write_json_atomic(spec.output, record))
    return record


def finish_record(
    spec: RunSpec, plan: Plan, child: harness.Child, epochs: list[dict[str, Any]]
) -> dict[str, Any]:
    """The run's own record, or one built from its log when it wrote none; plus runner facts."""
    returncode, ended = child.returncode, child.ended
    record = harness.read_record(spec.output)
    if record is None:
        cfg = spec.cfg
        record = {
            **{k: getattr(cfg, k) for k in ("framework", "model", "dataset")},
            "devices": spec.devices, "device_kind": plan.expected_kind, "bn_mode": cfg.bn,
            "global_batch_size": cfg.batch_size, "epochs": epochs, "test_set_size": None,
            "config": cfg.to_dict(), "status": "failed",
            "error": f"exit code {returncode}, no result file; last line: {child.last_line()}",
        }  # fmt: skip
    if ended == "timeout":  # "still running after <--timeout> s (--timeout); killed"
        record.update(status="timeout", error=child.error())
    elif ended == "interrupted":
        record["status"] = "interrupted"
        record["error"] = "the comparison was interrupted (Ctrl-C or SIGTERM); killed"
    elif returncode != 0 and record.get("status") == "ok":
        record.update(status="failed", error=f"exit code {returncode} after writing an ok record")
    record["runner"] = {
        "run_id": spec.run_id,
        "framework": spec.framework,  # the row (report.row_key): NAME or NAME+VARIANT
        "seed": spec.seed, "peak_lr": spec.peak_lr, "command": list(spec.command),
        "log": str(spec.log.relative_to(plan.out)), "returncode": returncode, "ended": ended,
    }  # fmt: skip
    if record["status"] != "ok":
        record["runner"]["log_tail"] = child.tail
    return record


def sweep_of(plan: Plan) -> report.Sweep:
    b = plan.base
    return report.Sweep(
        report.sweep_title(b.model, b.width, b.dataset, b.preset, plan.scaling),
        shlex.join(plan.command), plan.frameworks, plan.counts,
        Counter((spec.framework, spec.devices) for spec in plan.runs), plan.skipped,
        plan.not_applicable, plan.expected_kind, b.target_accuracy, host_info(), harness.utc_now(),
    )  # fmt: skip


def config_json(plan: Plan, sweep: report.Sweep, status: str) -> dict[str, Any]:
    return {
        "command": sweep.command, "status": status,
        "runner": harness.identity(),  # while "running": which process; report tells if it is gone
        "started": sweep.started, "finished": sweep.finished, "out": str(plan.out),
        "frameworks": plan.frameworks, "device_counts": plan.counts, "scaling": plan.scaling,
        "repeat": plan.repeat, "timeout_sec": plan.timeout, "device_kind": plan.expected_kind,
        "gpus": plan.gpus, "devices": {"choice": plan.devices.choice, "why": plan.devices.why},
        "host": sweep.host, "skipped": plan.skipped,
        "not_applicable": [
            {"framework": fw, "devices": n, "reason": why}
            for (fw, n), why in plan.not_applicable.items()
        ],
        "passthrough": plan.passthrough,
        "tensorboard": str(tensorboard_dir(plan.out)) if plan.tensorboard else None,
        "base_config": plan.base.to_dict(),
        "runs": [
            {
                **{k: getattr(s, k) for k in ("run_id", "framework", "devices", "seed")},
                "global_batch_size": s.cfg.batch_size,
                "peak_lr": s.peak_lr,
                "command": list(s.command),
                "command_line": shlex.join(s.command),
                "log": str(s.log.relative_to(plan.out)),
                "output": str(s.output.relative_to(plan.out)),
                "config": s.cfg.to_dict(),
            }
            for s in plan.runs
        ],
    }  # fmt: skip


RESERVE = ".space-reserve"  # freed before the final files: a full disk still gets them
RESERVE_BYTES = 2 << 20
TABLES = "results.csv, runs.csv, results.md"


def execute(plan: Plan) -> int:
    sweep = sweep_of(plan)
    plan.out.mkdir(parents=True, exist_ok=True)
    write_json_atomic(plan.out / "config.json", config_json(plan, sweep, "running"))
    with contextlib.suppress(OSError):  # best effort: a disk already this full gets no reserve
        (plan.out / RESERVE).write_bytes(bytes(RESERVE_BYTES))
    print(f"compare: {len(plan.runs)} runs -> {plan.out}", flush=True)
    for fw, why in plan.skipped.items():
        print(f"compare: {fw} skipped: {why}", flush=True)
    for (fw, n), why in plan.not_applicable.items():
        print(f"compare: {fw} x{n}: n/a ({why})", flush=True)
    records: list[dict[str, Any]] = []
    status = "finished"
    progress = make_progress([s.cfg.epochs for s in plan.runs])
    # Ctrl-C or SIGTERM (a CI job cancelled; harness.run_tool) ends the sweep: the current run's
    # process group is killed and the results so far are written.
    try:
        with progress:
            for spec in plan.runs:
                record = execute_run(spec, plan, progress)
                records.append(record)
                progress.end_run(run_summary(record))
                plan.save(TABLES, lambda: report.write_tables(plan.out, sweep, records))
                if record["status"] == "interrupted":
                    raise KeyboardInterrupt
    except KeyboardInterrupt:
        status = "interrupted"
        done = sum(r["status"] != "interrupted" for r in records)
        print(f"\ncompare: interrupted; {done} of {len(plan.runs)} runs finished", flush=True)
    finally:
        (plan.out / RESERVE).unlink(missing_ok=True)
    sweep.finished = harness.utc_now()
    # config.json first (small, and the one a reader checks for "running"), then the plots,
    # then the tables that list them; each failure is one line and the rest still go on.
    write_final_config(plan, sweep, status)
    made = plan.save("the plots", lambda: report.write_plots(plan.out, sweep, records))
    plots, plot_note = made or ([], "Plots not written: the disk is full.")
    plan.save(TABLES, lambda: report.write_tables(plan.out, sweep, records, plots, plot_note))
    report.print_table(sweep, records)
    for r in records:
        if r["status"] != "ok":
            print(f"\n{r['runner']['run_id']}: {r['status']}: {report.one_line(r)}")
            print("\n".join("    " + line for line in r["runner"].get("log_tail", [])))
    files = ", ".join(
        ["results.md", "results.csv", "runs.csv", "runs/", "logs/"] + [p.name for p in plots]
    )
    print(f"\ncompare: results in {plan.out} ({files})")
    if plan.tensorboard:
        print(
            "compare: every run's curves, overlaid: "
            f".venv/bin/tensorboard --logdir {tensorboard_dir(plan.out)}  (http://localhost:6006)"
        )
    if plan.unwritten:
        print(f"compare: NOT written (disk full?): {', '.join(dict.fromkeys(plan.unwritten))}")
    if status == "interrupted":
        return harness.interrupted()
    return 0 if all(r["status"] == "ok" for r in records) and not plan.unwritten else 1


def write_final_config(plan: Plan, sweep: report.Sweep, status: str) -> None:
    """config.json with the final status, never left saying "running": when the atomic write
    fails (a full disk), the file is rewritten in place, which frees its old blocks first."""
    path = plan.out / "config.json"
    data = config_json(plan, sweep, status)
    try:
        write_json_atomic(path, data)
    except OSError:
        text = json.dumps({"status": status, **data}, indent=2, default=str) + "\n"
        plan.save("config.json", lambda: path.write_text(text))


def run_summary(record: dict[str, Any]) -> str:
    wall = record["runner"]["wall_sec"]
    if record["status"] != "ok":
        return f"{record['status'].upper()} after {wall:.1f}s: {report.one_line(record)}"
    acc, sec, ips = (record.get(k) for k in ("test_accuracy", "sec_per_epoch", "images_per_sec"))
    return (
        f"ok in {wall:.1f}s: test_accuracy={acc:.4f}, {sec:.3g} s/epoch, {ips:.0f} images/s, "
        f"device kind {record.get('device_kind')}"
    )


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m benchmarks.compare --help`; exit codes: the module docstring."""
    return harness.run_tool("compare", argv, make_plan, execute)


if __name__ == "__main__":
    sys.exit(main())
