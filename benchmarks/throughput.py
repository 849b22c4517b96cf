"""`python -m benchmarks.throughput`: how much of the bare step's speed each training loop keeps.

For every framework x device count, on synthetic CIFAR-shaped data (preset "throughput"): the
real loop (the framework module itself, in a process of its own: its record's images/s after the
first epoch, its first epoch and the process tree's peak RSS), the compute-only loop
(`benchmarks.compute_only` in the same interpreter) and ratio = real / (devices x compute-only);
mode = the execution mode the real loop's record says ran. Definitions: docs/performance.md. A
framework variant in --frameworks (torch-ddp+reduce-overhead: harness.VARIANTS) is a row of its
own, both loops in its mode; a framework whose interpreter lacks its packages is skipped.
Outputs in --out DIR: throughput.json (config, host, every measurement, commands),
throughput.md, runs/*.json (trainer records), logs/*.log. Exit 0 when every measurement
succeeded, 1 when any failed, 2 on bad input (nothing ran), 128 + the signal when interrupted.
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import sys
from typing import Any

from benchmarks import harness
from benchmarks.harness import UsageError
from common.config import FRAMEWORKS, ConfigError, per_device, preset, train_size
from common.results import host_info, write_json_atomic

PROG = "python -m benchmarks.throughput"
TRAIN_IMAGES = train_size(preset("throughput"))  # the synthetic training set's size


def build_parser() -> argparse.ArgumentParser:
    p = harness.Parser("throughput", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    harness.add_flags(p, frameworks=",".join(FRAMEWORKS), gpus="1", variants=True)
    harness.add_workload_flags(
        p, 256, "GLOBAL batch (strong scaling); per device with --scaling weak (default 256)"
    )
    p.add_argument("--scaling", choices=("strong", "weak"), default="strong",
                   help="strong: a fixed global batch; weak: a fixed per-device batch")  # fmt: skip
    harness.add_numbers(
        p,
        ("--steps", int, 10, "training steps per epoch of the real loop (default 10; at most "
         f"{TRAIN_IMAGES} / global batch)", "K"),
        ("--epochs", int, 3, "epochs of the real loop; the first (compile, warm-up) is not timed",
         "E"),
        ("--compute-steps", int, 0, "timed compute-only steps (default: the real loop's timed "
         "steps, steps x (epochs - 1))", "K"),
        ("--warmup", int, 3, "untimed compute-only steps (>= 1; default 3)"),
        ("--lr", float, 0.01, "learning rate of both loops (default 0.01: speed does not depend "
         "on it, and a small one keeps training on random labels finite; a diverged run stops "
         "early)"),
    )  # fmt: skip
    p.add_argument(
        "--pipeline", choices=("auto", "host", "device"), default="auto",
        help="the real loop's input pipeline (the trainers' --pipeline: host, device, or auto = "
        "device on GPUs); the compute-only loop has none (one resident batch)",
    )  # fmt: skip
    harness.add_flags(p, repeat=1)
    p.add_argument(
        "--phases", action="store_true",
        help="one extra real-loop run per cell with --phase-timing (its syncs slow "
        "the step, so it never feeds the images/s columns)",
    )  # fmt: skip
    harness.add_numbers(
        p,
        ("--profile", int, 0, "profile STEPS steps of each real loop's first (untimed) epoch "
         "with the framework's profiler: the step's breakdown joins the cell "
         "(docs/profiling.md)", "STEPS"),
    )  # fmt: skip
    harness.add_flags(p, python=True, out="results/throughput-", timeout=900.0, wait_load=True)
    return p


# -- the plan -----------------------------------------------------------------------------------


class Plan(harness.SweepPlan):
    def global_batch(self, n: int) -> int:
        return self.ns.batch_size * n if self.ns.scaling == "weak" else self.ns.batch_size


def make_plan(argv: list[str]) -> Plan:
    ns = build_parser().parse_args(argv)
    harness.check_options(ns)
    frameworks = harness.parse_frameworks(ns.frameworks, variants=True)
    counts = harness.parse_gpus(ns.gpus)
    harness.check_positive(steps=ns.steps)  # --profile < 0: refused by check_options
    if ns.epochs < 2:
        raise UsageError(f"--epochs must be >= 2 (the first epoch is not timed) (got {ns.epochs})")
    harness.check_positive(
        warmup=ns.warmup, repeat=ns.repeat, batch_size=ns.batch_size, timeout=ns.timeout
    )
    if ns.python is not None:
        harness.use_interpreter(ns.python)
    gpus = harness.machine_gpus(ns.devices)
    harness.check_counts(counts, gpus)
    for n in counts:
        try:
            per_device(ns.batch_size * (n if ns.scaling == "weak" else 1), n)
            harness.workload_config(ns, gpus=1)
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
        if ns.batch_size * (n if ns.scaling == "weak" else 1) > TRAIN_IMAGES:
            raise UsageError(f"global batch larger than the {TRAIN_IMAGES} synthetic training "
                             "images; use a smaller --batch-size")  # fmt: skip
    skipped = harness.unavailable(frameworks)
    chosen = harness.choose_devices(ns.devices, [f for f in frameworks if f not in skipped])
    skipped.update(chosen.skipped)
    ns.devices = chosen.choice  # what workload() gives every child
    not_applicable = {
        f"{fw} x{n}": why
        for fw in frameworks
        if fw not in skipped
        for n in counts
        if (why := harness.not_applicable(fw, n, gpus))  # type: ignore[assignment]
    }
    if len(not_applicable) == len(counts) * len([f for f in frameworks if f not in skipped]):
        why = "; ".join(f"{k}: {v}" for k, v in {**skipped, **not_applicable}.items())
        raise UsageError(f"nothing can run ({why})")  # as compare: a sweep of nothing is no run
    out = harness.output_dir(ns.out, "throughput-", "throughput.json")
    return Plan(ns, frameworks, counts, gpus, skipped, out, [*PROG.split(), *argv], chosen)


# -- running one measurement ----------------------------------------------------------------------


def measure(plan: Plan, command: list[str], tag: str) -> tuple[harness.Child, dict[str, Any]]:
    """One measurement process; the facts every measurement keeps."""
    log = plan.out / "logs" / f"{tag}.log"
    child = harness.run_child(
        command, log, plan.ns.timeout, tag="throughput", wait_load=plan.ns.wait_load, reraise=True
    )
    facts = {"command": command, "log": str(log.relative_to(plan.out)),
             "load_before": child.load_avg[0]}  # fmt: skip
    return child, facts


def settings(plan: Plan, fw: str) -> argparse.Namespace:
    """The command line's settings for `fw`'s row: a variant's mode over --compile's."""
    return argparse.Namespace(**{**vars(plan.ns), **harness.variant_settings(fw)})


def workload(ns: Any, batch: int) -> list[str]:
    """The flags both loops get alike: the same model, images, batch, LR and fast paths."""
    return [
        *("--model", ns.model, "--width", f"{ns.width:g}", "--image-size", str(ns.image_size)),
        *("--batch-size", str(batch), "--lr", f"{ns.lr:g}", "--precision", ns.precision),
        *harness.flag("channels_last", ns.channels_last),  # None: the trainer's own default
        *harness.flag("xla_cpu_ynn", ns.xla_cpu_ynn),
        *harness.flag("compile", ns.compile),
        *(("--compile-mode", ns.compile_mode) if ns.compile else ()),
        *(("--devices", ns.devices) if ns.devices else ()),
    ]


def real_loop(plan: Plan, fw: str, n: int, rep: int, phases: bool = False) -> dict[str, Any]:
    """One run of the framework module; its record's throughput figures."""
    ns = settings(plan, fw)
    framework = harness.framework(fw)
    tag = f"{fw}-{n}dev" + (f"-r{rep}" if ns.repeat > 1 else "") + ("-phases" if phases else "")
    output = plan.out / "runs" / f"{tag}.json"
    command = [
        *(str(framework.python), "-m", framework.module),
        *("--preset", "throughput", "--dataset", "synthetic"),
        *workload(ns, plan.global_batch(n)),
        *("--gpus", str(n), "--epochs", str(ns.epochs), "--max-steps-per-epoch", str(ns.steps)),
        *("--pipeline", ns.pipeline, "--output", str(output)),
    ]
    if phases:
        command.append("--phase-timing")
    elif ns.profile:  # in the untimed first epoch: the images/s columns stay unprofiled
        command += ["--profile", str(ns.profile)]
    child, out = measure(plan, command, tag)
    out["peak_rss_bytes"] = child.peak_rss_bytes
    record = harness.read_record(output) or {}
    if not child.ok or record.get("status") != "ok":
        why = child.error() if child.ended != "exited" else record.get("error") or child.error()
        return {**out, "status": "failed", "error": why}
    out.update(
        status="ok",
        **{k: record[k] for k in ("images_per_sec", "first_epoch_sec", "device_kind")},
        **{k: record.get(k) for k in ("execution", "pipeline")},
        timed_epochs=record["timed_epochs"],
        steps_per_epoch=record["epochs"][0]["images"] // record["global_batch_size"],
        record=str(output.relative_to(plan.out)),
    )
    if "peak_memory_bytes" in record:  # a trainer that reports its device's allocator peak
        out["peak_memory_bytes"] = record["peak_memory_bytes"]
    if "breakdown" in record:  # --profile: where the step's time went (common/breakdown.py)
        out["breakdown"] = {k: v for k, v in record["breakdown"].items() if k != "devices"}
        out["trace"] = record["profile"]["trace"]
    if phases:
        out["phases_ms_per_step"] = record.get("phases_ms_per_step", {})
        out["phase_note"] = record.get("phase_note", "")
    return out


def compute_only(plan: Plan, fw: str, batch: int, rep: int) -> dict[str, Any]:
    """One run of benchmarks.compute_only for `fw`'s family (and variant) at per-device batch
    `batch`."""
    ns = settings(plan, fw)
    tag = f"compute-{compute_key(fw)}-b{batch}" + (f"-r{rep}" if ns.repeat > 1 else "")
    command = [
        *(str(harness.framework(fw).python), "-m", "benchmarks.compute_only"),
        *("--framework", harness.framework(fw).family),
        *workload(ns, batch),
        *("--steps", str(ns.compute_steps or ns.steps * (ns.epochs - 1))),
        *("--warmup", str(ns.warmup)),
    ]
    child, out = measure(plan, command, tag)
    result = child.json_line() if child.ok else None
    if result is None:
        return {**out, "status": "failed", "error": child.error() or "no result line"}
    return {**out, "status": "ok", **result}


def compute_key(fw: str) -> str:
    """What one compute-only measurement serves: a family, in a variant's mode ("torch+compile")."""
    variant = fw.partition("+")[2]
    return harness.framework(fw).family + (f"+{variant}" if variant else "")


def median_of(runs: list[dict[str, Any]], key: str) -> float | None:
    values = [r[key] for r in runs if r.get("status") == "ok" and r.get(key) is not None]
    return statistics.median(values) if values else None


# -- the sweep ----------------------------------------------------------------------------------


def plan_cells(plan: Plan) -> list[dict[str, Any]]:
    cells = []
    for fw in plan.frameworks:
        for n in plan.counts:
            why = harness.not_applicable(fw, n, plan.gpus)
            if fw in plan.skipped:
                status, note = "skipped", plan.skipped[fw]
            elif why:
                status, note = "n/a", why
            else:
                status, note = "planned", ""
            batch = plan.global_batch(n)
            asked = harness.asked_label(fw, vars(plan.ns))  # the mode the flags ask for (torch)
            cells.append(dict(framework=fw, devices=n, global_batch=batch,
                              per_device_batch=batch // n, status=status, note=note,
                              mode_asked=asked, real=[], compute=[]))  # fmt: skip
    return cells


def sweep(plan: Plan, cells: list[dict[str, Any]], say: Any, save: Any) -> None:
    """Measure every planned cell, saving the tables after each measurement. Compute-only runs
    once per (family, per-device batch) and repetition; repetitions go round the whole sweep,
    so a slow spell of a shared machine hits every cell rather than one."""
    ns = plan.ns
    todo = [c for c in cells if c["status"] == "planned"]
    compute: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for rep in range(ns.repeat):
        for cell in todo:
            fw, n, b = cell["framework"], cell["devices"], cell["per_device_batch"]
            family = compute_key(fw)
            cell["compute"] = compute.setdefault((family, b), [])
            if len(cell["compute"]) <= rep:
                say(f"compute-only {family} batch {b} (repetition {rep + 1}/{ns.repeat})")
                cell["compute"].append(compute_only(plan, fw, b, rep))
            say(f"real loop {fw} x{n} (repetition {rep + 1}/{ns.repeat})")
            cell["real"].append(real_loop(plan, fw, n, rep))
            summarise(cell)
            save()
    for cell in todo if ns.phases else []:
        say(f"phase timing {cell['framework']} x{cell['devices']}")
        cell["phases"] = real_loop(plan, cell["framework"], cell["devices"], 0, phases=True)
        save()


def summarise(cell: dict[str, Any]) -> None:
    """Medians over the repetitions, and the ratio."""
    real, comp = cell["real"], cell["compute"]
    failed = [r for r in real + comp if r["status"] != "ok"]
    cell["status"] = "failed" if failed else "ok"
    if failed:
        cell["note"] = failed[0]["error"]
    cell["real_images_per_sec"] = median_of(real, "images_per_sec")
    cell["compute_images_per_sec"] = median_of(comp, "images_per_sec")
    cell["first_epoch_sec"] = median_of(real, "first_epoch_sec")
    cell["first_step_sec"] = median_of(comp, "first_step_sec")
    cell["real_peak_rss_bytes"] = median_of(real, "peak_rss_bytes")
    cell["real_peak_memory_bytes"] = median_of(real, "peak_memory_bytes")
    cell["compute_peak_memory_bytes"] = median_of(comp, "peak_memory_bytes")
    ok = [r for r in comp if r["status"] == "ok"]
    cell["memory_source"] = ok[0]["memory_source"] if ok else ""
    cell["precision_note"] = ok[0]["precision_note"] if ok else ""
    cell["pipeline"] = next((r["pipeline"] for r in real if r.get("pipeline")), "")
    # What ran: the real loop's records (plan_cells has what the flags asked for).
    ran = [harness.ran_label(r) for r in real if r["status"] == "ok"]
    cell["mode"] = ", ".join(dict.fromkeys(m for m in ran if m))
    cell["real_images_per_sec_all"] = [r.get("images_per_sec") for r in real]
    cell["compute_images_per_sec_all"] = [r.get("images_per_sec") for r in comp]
    # Each repetition measures the compute-only loop and then the real loop, back to back; the
    # ratio is the median over repetitions of that pair's ratio, so a slow spell of a shared
    # machine between repetitions cancels out instead of landing on one side of the ratio.
    pairs = [
        r["images_per_sec"] / (cell["devices"] * c["images_per_sec"])
        for r, c in zip(real, comp)
        if r["status"] == c["status"] == "ok"
    ]
    cell["ratio_all"] = pairs
    cell["ratio"] = statistics.median(pairs) if pairs else None
    kinds = {x.get("device_kind") for x in real + comp if x.get("device_kind")}
    cell["device_kind"] = ", ".join(sorted(kinds))


# -- output -------------------------------------------------------------------------------------


def _number(key: str, spec: str) -> harness.Column:
    return lambda c: harness.cell(c.get(key), spec)


def _mib(key: str) -> harness.Column:
    return lambda c: harness.cell(c[key] / 2**20 if c.get(key) else None, ".0f")


COLUMNS: list[tuple[str, harness.Column]] = [
    ("framework", lambda c: c["framework"]),
    ("mode", lambda c: c.get("mode") or "-"),
    ("devices", lambda c: str(c["devices"])),
    ("batch", lambda c: str(c["global_batch"])),
    ("real img/s", _number("real_images_per_sec", ".1f")),
    ("compute img/s", _number("compute_images_per_sec", ".1f")),
    ("ratio", _number("ratio", ".3f")),
    ("1st epoch s", _number("first_epoch_sec", ".2f")),
    ("1st step s", _number("first_step_sec", ".2f")),
    ("mem compute MiB", _mib("compute_peak_memory_bytes")),
    ("RSS real MiB", _mib("real_peak_rss_bytes")),
    ("status", lambda c: c["status"]),
]
HEADERS = [h for h, _ in COLUMNS]


def table(cells: list[dict[str, Any]]) -> list[list[str]]:
    return [[f(c) for _, f in COLUMNS] for c in cells]


def title(plan: Plan) -> str:
    ns = plan.ns
    batch = "per-device" if ns.scaling == "weak" else "global"
    return (
        f"Throughput: {ns.model} (width {ns.width:g}) {ns.image_size}x{ns.image_size}, "
        f"{batch} batch {ns.batch_size}, {ns.precision}, {plan.device_kind}"
    )


def notes(plan: Plan, cells: list[dict[str, Any]]) -> list[str]:
    ns = plan.ns
    out = [
        *harness.mode_notes(cells),
        f"real = the framework module's training loop (`--preset throughput`, {ns.epochs} "
        f"epochs of {ns.steps} steps, the first epoch untimed); compute-only = "
        f"benchmarks.compute_only, one device, one device-resident batch of the per-device "
        f"size, {ns.warmup} warm-up steps then {ns.compute_steps or ns.steps * (ns.epochs - 1)} "
        "timed; ratio = real / (devices x compute-only), the median over repetitions of each "
        f"repetition's pair; images/s are medians of {ns.repeat} repetition(s). batch = the "
        "global batch.",
        "1st epoch s = the real loop's first epoch (compilation/warm-up + its steps); 1st "
        "step s = the compute-only loop's first step (compilation, autotuning).",
        "mem compute = peak memory of the compute-only loop; RSS real = the trainer process "
        "tree's peak resident set (its reaped children included), host memory.",
    ]
    loads = [
        m["load_before"] for c in cells for m in c["real"] + c["compute"] if "load_before" in m
    ]
    if loads:
        out.append(f"1-minute load average when the measurements started: {min(loads):.1f} to "
                   f"{max(loads):.1f} on {os.cpu_count()} CPU cores (other work on the machine "
                   "slows both loops, not always equally).")  # fmt: skip
    sources = sorted({c["memory_source"] for c in cells if c.get("memory_source")})
    if sources:
        out.append("mem compute from: " + "; ".join(sources) + ".")
    precision = sorted(
        {f"{c['framework']}: {c['precision_note']}" for c in cells if c.get("precision_note")}
    )
    if precision:
        out.append("precision: " + "; ".join(precision) + ".")
    pipelines = sorted({c["pipeline"] for c in cells if c.get("pipeline")})
    if pipelines:
        out.append("real loop's input pipeline: " + "; ".join(pipelines) + ".")
    if plan.device_kind == "cpu-simulated" and max(plan.counts) > 1:
        out.append(
            "cpu-simulated: N simulated devices share the same CPU cores, so the ratio "
            "at N > 1 is about 1/N by construction; only the 1-device ratio is meaningful."
        )
    out.append(
        "mode = the execution mode the real loop's record says ran (the compute-only loop runs "
        "the same flags)."
    )
    for c in cells:
        if c["status"] != "ok" and c["note"]:
            out.append(f"{c['framework']} x{c['devices']} {c['status']}: {c['note']}")
    for c in cells:
        if c.get("phases", {}).get("phases_ms_per_step"):
            ph = ", ".join(f"{k} {v:.1f}" for k, v in c["phases"]["phases_ms_per_step"].items())
            note = c["phases"].get("phase_note")
            out.append(
                f"phases {c['framework']} x{c['devices']} (ms/step, --phase-timing run): {ph}"
                + (f" ({note})" if note else "")
            )
    for c in cells:  # --profile: the first repetition's trace, read (common/breakdown.py)
        b = next((r["breakdown"] for r in c.get("real", []) if r.get("breakdown")), None)
        if b:
            out.append(
                f"breakdown {c['framework']} x{c['devices']} (ms/step over {b['steps']} "
                f"profiled steps of the untimed first epoch): step {b['step_ms']:.2f} = compute "
                f"{b['compute_ms']:.2f} + exposed comm {b['exposed_comm_ms']:.2f} + input wait "
                f"{b['input_wait_ms']:.2f} + host gap {b['host_gap_ms']:.2f}; comm "
                f"{b['comm_ms']:.2f}; unprofiled step "
                + (f"{b['measured_step_ms']:.2f}" if b.get("measured_step_ms") else "-")
            )
    return [line for line in out if line]


def markdown(plan: Plan, cells: list[dict[str, Any]], host: dict[str, Any]) -> str:
    lines = [
        f"# {title(plan)}",
        "",
        f"`{shlex.join(plan.command)}`",
        "",
        f"Host: {host.get('cpu', '?')} ({host.get('cpu_count')} cores)"
        + (f"; GPUs: {', '.join(host['gpus'])}" if host.get("gpus") else ""),
        "",
        harness.markdown_table(HEADERS, table(cells)),
        "",
    ]
    lines += [f"- {n}" for n in notes(plan, cells)]
    return "\n".join(lines) + "\n"


def execute(plan: Plan) -> int:
    plan.out.mkdir(parents=True, exist_ok=True)
    host = host_info()
    started = harness.utc_now()
    cells = plan_cells(plan)

    def say(text: str) -> None:
        print(f"[throughput] {text}", flush=True)

    def save(interrupted: bool = False) -> None:  # after every measurement: nothing is lost
        result = {"title": title(plan), "command": plan.command,
                  "device_kind": plan.device_kind, "started": started, "host": host,
                  "settings": vars(plan.ns), "skipped": plan.skipped,
                  "interrupted": interrupted, "rows": cells}  # fmt: skip
        write_json_atomic(plan.out / "throughput.json", result)
        harness.write_atomic(plan.out / "throughput.md", markdown(plan, cells, host))

    for fw, why in plan.skipped.items():
        say(f"{fw}: skipped ({why})")
    save()
    try:
        sweep(plan, cells, say, save)
    except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the measurement under way was killed
        save(interrupted=True)
        say(f"interrupted; finished measurements are in {plan.out / 'throughput.json'}")
        return harness.interrupted()
    harness.print_table(
        title(plan), HEADERS, table(cells), notes(plan, cells), left=("framework", "mode", "status")
    )
    print(f"[throughput] wrote {plan.out / 'throughput.json'} and throughput.md")
    return 1 if any(c["status"] == "failed" for c in cells) else 0


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m benchmarks.throughput --help`; exit codes: the module docstring."""
    return harness.run_tool("throughput", argv, make_plan, execute)


if __name__ == "__main__":
    sys.exit(main())
