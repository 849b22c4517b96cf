"""`python -m benchmarks.tutorial_loops`: our training loops against the seed tutorials' loops.

Each trainer is timed against the tutorial loop it grew out of (TUTORIALS; each module of
tutorials/ says what its loop costs) on the same work: the same Config and flags, the same arrays
and model; only the loop differs. Both sides run in their own processes, alternately (ours first
in even repeats), with augmentation off and a constant LR (the tutorials have neither). Compared:
the records' `images_per_sec`, the per-repeat ratio ours / tutorial, `epoch_sec` (with
evaluation). Results: docs/performance.md, "Against the seed tutorials' loops".

outputs (in --out DIR): tutorial_loops.json (every run and the summary), tutorial_loops.md,
runs/*.json (each run's record), logs/*.log.
exit code: 0 every run ok, 1 a run failed or timed out, 2 bad input (nothing ran), 128 + the
signal interrupted.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import REGISTRY, UsageError
from common import cli
from common.config import ConfigError, preset
from common.memory import check_machine
from common.results import host_info, write_json_atomic

PROG = "python -m benchmarks.tutorial_loops"


@dataclass(frozen=True)
class Tutorial:
    name: str
    framework: str  # the trainer it is compared with
    title: str
    mode: str  # its loop's execution mode (harness.mode_label's words), where its record has none

    @property
    def module(self) -> str:  # run with the compared framework's interpreter
        return "tutorials." + self.name.replace("-", "_")


TUTORIALS: dict[str, Tutorial] = {
    t.name: t
    for t in (
        Tutorial("d2l-torch", "torch-dp", "d2l 13.6 (PyTorch)", "eager"),
        Tutorial("nvidia-course", "torch-ddp", "NVIDIA DLI data-parallel course (DDP)", "eager"),
        Tutorial("d2l-mxnet", "mxnet-gluon", "d2l 13.6 (MXNet)", "imperative (not hybridized)"),
        Tutorial("d2l-jax", "jax-pmap", "d2l 13.6 (JAX)", "XLA (pmap)"),
        Tutorial("flax-imagenet", "jax-pmap", "Flax examples/imagenet (pmap)", "XLA (pmap)"),
    )
}

# The work both sides do unless flags say otherwise: ResNet-18 at a quarter width on 4096
# CIFAR-shaped synthetic images, global batch 256, 3 epochs (the first is warm-up).
DEFAULT_WORK = dict(preset="throughput", width=0.25, train_limit=4096, epochs=3)
# Flags the runner sets itself, and values forced on both sides (the tutorials have no
# augmentation and a constant LR, and run NCHW on CUDA: channels-last is a layout choice, not a
# loop one, so it stays off; cuDNN autotuning stays on in ours, part of its loop). No
# --tensorboard: every timed run would write into the one directory.
RUNNER_OWNED = ("gpus", "devices", "output", "checkpoint_dir", "resume", "log_every",
                "phase_timing", "tensorboard")  # fmt: skip
FORCED: dict[str, Any] = dict(augment=False, lr_schedule="constant", warmup_epochs=0.0,
                              channels_last=False)  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    shared = cli.build_parser(PROG, exclude=RUNNER_OWNED)
    p = harness.Parser(
        "tutorial_loops",
        description=__doc__.split("\n\n")[0].split(": ", 1)[1],
        parents=[shared],
        conflict_handler="resolve",
        epilog="Shared training flags (--model, --width, --batch-size, ...) go to both sides. "
        "Without --preset the work is: "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in DEFAULT_WORK.items())
        + ". Both sides always run with --no-augment --lr-schedule constant --warmup-epochs 0 "
        "--no-channels-last.",
    )
    p.add_argument("--preset", help="named preset for both sides (default: the work below)")
    p.add_argument("--tutorials", default=",".join(TUTORIALS), metavar="LIST",
                   help=f"comma-separated, from: {', '.join(TUTORIALS)} "
                   "(default: all)")  # fmt: skip
    harness.add_flags(p, gpus="2", repeat=2, timeout=900.0, wait_load=True, python=True,
                      out="results/tutorials-", devices=True)  # fmt: skip
    return p


@dataclass
class Plan:
    tutorials: list[Tutorial]
    counts: list[int]
    gpus: list[str]
    skipped: dict[str, str]  # tutorial name -> why it cannot run here
    flags: list[str]  # the shared flags given to both sides
    repeat: int
    timeout: float
    wait_load: float
    out: Path
    argv: list[str]
    devices: harness.Devices


def plan_from(argv: list[str]) -> Plan:
    ns = build_parser().parse_args(argv)
    harness.check_options(ns)
    hint = " (e.g. --tutorials d2l-torch,flax-imagenet)"
    names = harness.pick(ns.tutorials, list(TUTORIALS), "tutorial", hint)
    harness.check_positive(repeat=ns.repeat, timeout=ns.timeout)
    epochs = getattr(ns, "epochs", None)
    if epochs is not None and epochs < 2:
        raise UsageError(
            f"--epochs {epochs}: the first epoch (compilation, warm-up) is never timed, so a "
            "comparison needs --epochs 2 or more"
        )
    counts = harness.parse_gpus(ns.gpus)
    gpus = harness.machine_gpus(ns.devices)
    harness.check_counts(counts, gpus)
    own = ("preset", "tutorials", "gpus", "devices", "repeat", "timeout", "wait_load", "python",
           "out")  # fmt: skip
    if ns.python:
        harness.use_interpreter(ns.python)
    given = {k: v for k, v in vars(ns).items() if k not in own}  # shared flags actually given
    if given.get("compile"):  # ours would compile, the tutorials cannot: not the same loop
        raise UsageError(
            "--compile: the tutorials' loops have no torch.compile (they run eager); leave it "
            "out to compare the loops (benchmarks.throughput compares compiled steps)"
        )
    work = dict(DEFAULT_WORK) if ns.preset is None else {"preset": ns.preset}
    work = {**work, **given, **FORCED}
    name = work.pop("preset")
    try:  # the same resolution both sides will do, at every device count: fail before any run
        for n in counts:
            cfg = preset(name, framework=TUTORIALS[names[0]].framework, gpus=n, **work)  # type: ignore[arg-type]
            check_machine(cfg)
    except ConfigError as exc:
        raise UsageError(str(exc)) from None
    flags = ["--preset", name]
    for key, value in work.items():
        flags += harness.flag(key, value)
    tutorials = [TUTORIALS[t] for t in names]
    missing = harness.unavailable(sorted({t.framework for t in tutorials}))
    chosen = harness.choose_devices(
        ns.devices, sorted({t.framework for t in tutorials if t.framework not in missing})
    )
    missing.update(chosen.skipped)
    skipped = {t.name: missing[t.framework] for t in tutorials if t.framework in missing}
    flags += chosen.flags  # both sides on the kind of device chosen for all
    out = harness.output_dir(ns.out, "tutorials-", "tutorial_loops.json")
    return Plan(
        tutorials, counts, gpus, skipped, flags, ns.repeat, ns.timeout, ns.wait_load, out,  # type: ignore[arg-type]
        [*PROG.split(), *argv], chosen,
    )  # fmt: skip


# -- running ------------------------------------------------------------------------------------


KEPT = "first_epoch_sec wall_sec test_examples test_accuracy device_kind deviations execution"
KEPT_KEYS = KEPT.split()  # from each run's record into its row


def run_side(plan: Plan, tut: Tutorial, side: str, n: int, rep: int) -> dict[str, Any]:
    """One run of our trainer (side "ours") or of the tutorial loop (side "tutorial")."""
    fw = REGISTRY[tut.framework]
    module = fw.module if side == "ours" else tut.module
    tag = f"{tut.name}-{n}dev-{side}-r{rep}"
    output = plan.out / "runs" / f"{tag}.json"
    command = [str(fw.python), "-m", module, *plan.flags, "--gpus", str(n), "--output", str(output)]
    log = plan.out / "logs" / f"{tag}.log"
    child = harness.run_child(
        command, log, plan.timeout, tag="tutorial_loops", wait_load=plan.wait_load, reraise=True
    )
    row = dict(tutorial=tut.name, framework=tut.framework, side=side, devices=n, repeat=rep,
               command=command, log=str(log.relative_to(plan.out)),
               load_before=child.load_avg[0], exit_code=child.returncode)  # fmt: skip
    record = harness.read_record(output) or {}
    status = record.get("status", "failed")
    if child.ended == "timeout":
        status, why = "timeout", child.error()
    elif not child.ok or status != "ok":
        status = "failed" if status == "ok" else status
        why = record.get("error") or child.last_line() or child.error()
    else:
        why = ""
    epochs = record.get("epochs", [])
    walls = [e["wall_sec"] for e in epochs]
    epoch_secs = [b - a for a, b in zip(walls, walls[1:])]  # whole epochs after the first
    row.update(
        status=status,
        error=why,
        record=str(output.relative_to(plan.out)) if output.exists() else None,
        images_per_sec=record.get("images_per_sec") if status == "ok" else None,
        epoch_sec=statistics.median(epoch_secs) if status == "ok" and epoch_secs else None,
        **{k: record.get(k) for k in KEPT_KEYS},
        # what ran: its record's word, else (a tutorial loop that does not say) the loop's own
        mode=harness.mode_label(record.get("execution"))
        or (tut.mode if side == "tutorial" else ""),
    )
    got = f"images/s={row['images_per_sec']:.1f}" if row["images_per_sec"] else why
    print(f"{tut.name:<14} {n} dev  {side:<8} r{rep}  {status:<7} {got}", flush=True)
    return row


def summarise(plan: Plan, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per tutorial x device count: medians over repeats and the median per-repeat
    ratio ours / tutorial (a repeat counts only when both of its runs are ok)."""
    rows = []
    for tut in plan.tutorials:
        for n in plan.counts:
            cell = [r for r in runs if r["tutorial"] == tut.name and r["devices"] == n]
            if not cell:
                continue
            side = {s: [r for r in cell if r["side"] == s] for s in SIDES}
            ratios, epoch_ratios = [], []
            for rep in range(plan.repeat):
                pair = {r["side"]: r for r in cell if r["repeat"] == rep}
                ours, theirs = pair.get("ours"), pair.get("tutorial")
                if ours and theirs and ours["images_per_sec"] and theirs["images_per_sec"]:
                    ratios.append(ours["images_per_sec"] / theirs["images_per_sec"])
                    if ours["epoch_sec"] and theirs["epoch_sec"]:
                        epoch_ratios.append(theirs["epoch_sec"] / ours["epoch_sec"])

            def med(key: str, s: str, side: dict[str, list[dict[str, Any]]] = side) -> float | None:
                vals = [r[key] for r in side[s] if r.get(key) is not None and r["status"] == "ok"]
                return statistics.median(vals) if vals else None

            def mode(s: str, side: dict[str, list[dict[str, Any]]] = side) -> str:
                return ", ".join(dict.fromkeys(r["mode"] for r in side[s] if r.get("mode")))

            rows.append(dict(
                tutorial=tut.name, framework=tut.framework, devices=n,
                ours_mode=mode("ours"), tutorial_mode=mode("tutorial"),
                ours_images_per_sec=med("images_per_sec", "ours"),
                tutorial_images_per_sec=med("images_per_sec", "tutorial"),
                ratio=statistics.median(ratios) if ratios else None, ratios=ratios,
                epoch_speedup=statistics.median(epoch_ratios) if epoch_ratios else None,
                ours_test_examples=med("test_examples", "ours"),
                tutorial_test_examples=med("test_examples", "tutorial"),
                status="ok" if all(r["status"] == "ok" for r in cell) else "failed",
            ))  # fmt: skip
    return rows


NUMBERS = (("ours_images_per_sec", ".1f"), ("tutorial_images_per_sec", ".1f"), ("ratio", ".3f"),
           ("epoch_speedup", ".3f"))  # fmt: skip
SIDES = ("ours", "tutorial")


def markdown(plan: Plan, rows: list[dict[str, Any]], host: dict[str, Any]) -> str:
    lines = [
        "# Our training loops vs the seed tutorials' loops",
        "",
        f"Command: `{' '.join(plan.argv)}`  ",
        f"Machine: {host.get('cpu', '?')}, {host.get('cpu_count', '?')} CPU threads"
        + (f", GPUs: {', '.join(plan.gpus)}" if plan.gpus else " (devices simulated on the CPU)")
        + "  ",
        f"Work (both sides): `{' '.join(plan.flags)}`; {plan.repeat} alternating run(s) per side.",
        "",
        "ratio = ours / tutorial training images/s (median of per-repeat ratios; > 1: ours is "
        "faster); epoch speed-up = tutorial / ours whole-epoch seconds (training + evaluation).",
        "",
    ]
    head = ["tutorial", "vs", "mode ours / tutorial", "devices", "ours images/s",
            "tutorial images/s", "ratio", "epoch speed-up", "test images ours / tutorial",
            "status"]  # fmt: skip
    body = []
    for r in rows:
        modes = f"{r.get('ours_mode') or '—'} / {r.get('tutorial_mode') or '—'}"
        numbers = [harness.cell(r[key], spec, "—") for key, spec in NUMBERS]
        tests = [harness.cell(r[f"{side}_test_examples"], ".0f", "—") for side in SIDES]
        body.append([r["tutorial"], r["framework"], modes, str(r["devices"]), *numbers,
                     " / ".join(tests), r["status"]])  # fmt: skip
    for name, why in plan.skipped.items():
        body.append(
            [name, TUTORIALS[name].framework, "", "—", "", "", "", "", "", f"skipped: {why}"]
        )
    lines.append(harness.markdown_table(head, body, "lllrrrrrrl"))
    note = mode_note(plan, rows)
    return "\n".join(lines + ([f"\n- {note}"] if note else [])) + "\n"


def mode_note(plan: Plan, rows: list[dict[str, Any]]) -> str:
    """Under the table, where its rows (or a row's two sides) differ in execution mode."""
    modes = []
    for r in rows:
        same = r["ours_mode"] == r["tutorial_mode"]
        modes.append((r["tutorial"] if same else f"{r['tutorial']} ours", r["ours_mode"]))
        if not same:
            modes.append((f"{r['tutorial']} tutorial", r["tutorial_mode"]))
    fix = (
        "read each row's ratio (the same mode on both sides unless the row says otherwise), not "
        "images/s across rows; the tutorials' loops run as written (--compile is refused here), "
        f"so for compiled PyTorch against JAX use benchmarks.throughput --frameworks "
        f"{harness.VARIANT_EXAMPLE}"
    )
    return harness.mode_note(modes, bool(plan.gpus), fix)


def execute(plan: Plan) -> int:
    plan.out.mkdir(parents=True, exist_ok=True)
    host = host_info()
    runs: list[dict[str, Any]] = []

    def save() -> list[dict[str, Any]]:  # after every run: an interrupted sweep keeps its runs
        rows = summarise(plan, runs)
        write_json_atomic(
            plan.out / "tutorial_loops.json",
            {"command": plan.argv, "flags": plan.flags, "host": host, "gpus": plan.gpus,
             "skipped": plan.skipped, "summary": rows, "runs": runs},
        )  # fmt: skip
        harness.write_atomic(plan.out / "tutorial_loops.md", markdown(plan, rows, host))
        return rows

    for name, why in plan.skipped.items():
        print(f"{name}: skipped: {why}", flush=True)
    for tut in plan.tutorials:
        if tut.name in plan.skipped:
            continue
        counts = plan.counts
        if not plan.gpus and REGISTRY[tut.framework].multi_device_needs_cuda:
            counts = [1]  # both sides would run one replica: nothing more to compare
        for n in counts:
            for rep in range(plan.repeat):
                order = ("ours", "tutorial") if rep % 2 == 0 else ("tutorial", "ours")
                for side in order:
                    try:
                        runs.append(run_side(plan, tut, side, n, rep))
                    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: keep the finished runs
                        save()
                        print(f"interrupted; finished runs are in {plan.out}", flush=True)
                        return harness.interrupted()
                    save()
    rows = save()
    print("\n" + markdown(plan, rows, host))
    print(f"results in {plan.out}")
    return 0 if runs and all(r["status"] == "ok" for r in runs) else 1


def main(argv: list[str] | None = None) -> int:
    return harness.run_tool("tutorial_loops", argv, plan_from, execute)


if __name__ == "__main__":
    sys.exit(main())
