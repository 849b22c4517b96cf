"""Tables, CSV, Markdown and plots of a comparison, built from the run-result records.

One row per (framework, device count) over its successful runs (one per seed, --repeat); what
each column means: docs/usage.md, "The compare runner". `python -m benchmarks.report DIR`
rebuilds a comparison's files from its config.json and runs/*.json (after the runner was killed,
or to render old results with this version of the report).
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.analysis import breakdowns
from benchmarks.harness import UsageError, markdown_table, print_table as show, write_atomic

LEFT = ("framework", "mode", "status", "BN", "device kind")
CPU_NOTE = "cpu-simulated = logical devices carved out of one CPU, NOT GPU scaling"
NOISE_MARK = "†"  # after images/s: its min-max range overlaps another framework's at that count
UNTIMED_MARK = "‡"  # after s/epoch and images/s: a run had no timed epoch (warm-up included)
MIB = 2**20
FOOTPRINT = ("state_bytes_per_device", "collective_bytes_per_step")  # common/footprint.py
SPREAD = ("images_per_sec", "sec_per_epoch")  # median (min-max) per cell


@dataclass
class Sweep:  # what the runner planned: the report needs it for rows that have no record
    title: str  # e.g. "resnet18 (width 1.0) on digits, strong scaling"
    command: str
    frameworks: list[str]
    counts: list[int]
    planned: dict[tuple[str, int], int]  # runs (seeds) per cell
    skipped: dict[str, str] = field(default_factory=dict)  # framework -> why + install command
    not_applicable: dict[tuple[str, int], str] = field(default_factory=dict)
    expected_kind: str = "cpu-simulated"
    target_accuracy: float = 0.0
    host: dict[str, Any] = field(default_factory=dict)
    started: str = ""
    finished: str = ""


def sweep_title(model: str, width: float, dataset: str, preset: str, scaling: str) -> str:
    return f"{model} (width {width:g}) on {dataset}, preset {preset}, {scaling} scaling"


def heading(sweep: Sweep, records: list[dict[str, Any]], sep: str = " ") -> str:
    """The title of every table, file and plot: what ran, and on which kind of device."""
    kinds = sorted({r["device_kind"] for r in records if r.get("device_kind")})
    kinds = kinds or [sweep.expected_kind]
    text = f"{sweep.title}, {', '.join(kinds)}"
    if any(k.startswith("cpu-simulated") for k in kinds):
        text += f"{sep}({CPU_NOTE})"
    return text


# -- one row per (framework, device count) ----------------------------------------------------


def _stats(values: list[float | None]) -> tuple[float | None, float | None]:
    """(mean, std) of the finite values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return (statistics.fmean(xs) if xs else None), (statistics.stdev(xs) if len(xs) > 1 else None)


def _spread(values: list[float | None]) -> tuple[float | None, ...]:
    """(median, min, max) of the finite values."""
    xs = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    return (statistics.median(xs), min(xs), max(xs)) if xs else (None, None, None)


def _load(record: dict[str, Any]) -> tuple[list[float], int | None]:
    """The 1-minute loads around one run (its own at start and end, the runner's before and
    after) and the host's core count."""
    own = record.get("load_avg") or {}
    loads = [own.get("start"), own.get("end"), *record.get("runner", {}).get("load_avg", [])]
    return [float(x) for x in loads if x is not None], own.get("cores")


def _busy(record: dict[str, Any]) -> bool:  # a load around the run above the core count
    loads, cores = _load(record)
    return bool(loads and cores and max(loads) > cores)


def _status(statuses: list[str], planned: int) -> str:
    if not statuses:
        return "not run"
    counts = Counter(statuses)
    if len(counts) == 1 and len(statuses) == planned:
        return statuses[0]
    parts = [f"{s} {n}" for s, n in counts.items()]
    if len(statuses) < planned:
        parts.append(f"not run {planned - len(statuses)}")
    return ", ".join(parts)


def rows(sweep: Sweep, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The summary table, in the sweep's order (framework, then device count)."""
    out: list[dict[str, Any]] = []
    for fw in sweep.frameworks:
        one_device_ips = None
        for n in sweep.counts:
            row: dict[str, Any] = {"framework": fw, "devices": n, "note": ""}
            if fw in sweep.skipped:  # one row for the framework, whatever the device counts
                if n == sweep.counts[0]:
                    row.update(devices="-", status="skipped", note=sweep.skipped[fw])
                    out.append(row)
                continue
            if (fw, n) in sweep.not_applicable:
                row.update(status="n/a", note=sweep.not_applicable[(fw, n)])
                out.append(row)
                continue
            runs = [r for r in records if harness.row_key(r) == fw and r["devices"] == n]
            ok = [r for r in runs if r["status"] == "ok"]
            # What ran (the records' `execution`), and what the flags asked for (torch).
            row["mode"] = _joined(harness.ran_label(r) for r in ok or runs)
            row["mode_asked"] = _joined(harness.asked_label(fw, r.get("config")) for r in runs)
            row["status"] = _status([r["status"] for r in runs], sweep.planned.get((fw, n), 0))
            row["runs_ok"], row["runs"] = len(ok), len(runs)
            for key in ("global_batch_size", "bn_mode", "device_kind"):
                row[key] = ", ".join(sorted({str(r.get(key)) for r in runs if r.get(key)}))
            row["peak_lr"] = ", ".join(sorted({f"{r['runner']['peak_lr']:g}" for r in runs
                                               if "runner" in r}))  # fmt: skip
            for key in ("test_accuracy", "sec_per_epoch", "first_epoch_sec", "images_per_sec"):
                row[key], row[key + "_std"] = _stats([r.get(key) for r in ok])
            # Same start, same data: epoch 1's loss differs between frameworks only by what
            # training makes of float rounding (the first step agrees to ~1e-6: parity).
            loss = _stats([epoch1_loss(r) for r in ok])
            row["epoch1_train_loss"], row["epoch1_train_loss_std"] = loss
            # A run without a timed epoch (--epochs 1, or every epoch the first of a resumed
            # process) reports its warm-up epochs: marked, never passed off as steady state.
            row["untimed_runs"] = sum(1 for r in ok if r.get("timed_epochs") == 0)
            for key in SPREAD:  # the mean above gives way to the median
                row[key], row[key + "_min"], row[key + "_max"] = _spread([r.get(key) for r in ok])
            loads = [_load(r) for r in runs]
            if any(x for x, _ in loads):
                row["load_avg_max"] = max(x for xs, _ in loads for x in xs)
            row["cores"] = next((c for _, c in loads if c), None) or sweep.host.get("cpu_count")
            reached = [r for r in ok if r.get("time_to_target_sec") is not None]
            row["reached_target"] = len(reached)
            to_target = _stats([r["time_to_target_sec"] for r in reached])
            row["time_to_target_sec"], row["time_to_target_sec_std"] = to_target
            row["epochs_to_target"], _ = _stats([r.get("epochs_to_target") for r in reached])
            examples = {r.get("test_examples") for r in ok}
            row["test_examples"] = examples.pop() if len(examples) == 1 else None
            row["test_set_size"] = next((r.get("test_set_size") for r in ok), None)
            # What a device keeps and sends (common/footprint.py): the same in every run of a
            # cell; "-" for records older than the fields.
            kept, sent = (next((r[k] for r in ok if r.get(k)), None) for k in FOOTPRINT)
            row["state_mib"] = kept and kept["total"] / MIB
            row["comm_mib"] = sent and sent["total"] / MIB
            row["comm_source"] = sent and sent["source"].split()[0]  # computed / profile
            if n == 1 and row["images_per_sec"]:
                one_device_ips = row["images_per_sec"]
            if one_device_ips and row["images_per_sec"]:
                row["speedup"] = row["images_per_sec"] / one_device_ips
                row["efficiency"] = row["speedup"] / n
            failed = [r for r in runs if r["status"] != "ok"]
            partial = [r for r in ok if r.get("test_examples") != r.get("test_set_size")]
            if failed:
                row["note"] = f"{failed[0]['runner']['run_id']}: {one_line(failed[0])}"
            elif partial:  # every framework must evaluate every test image exactly once
                r = partial[0]
                row["note"] = (f"evaluated {r.get('test_examples')} test images of "
                               f"{r.get('test_set_size')}")  # fmt: skip
            out.append(row)
    mark_within_noise(out)
    return out


def _joined(values: Iterable[str]) -> str:
    return ", ".join(dict.fromkeys(v for v in values if v))


def epoch1_loss(record: dict[str, Any]) -> float | None:  # None: a tutorial's record
    epochs = record.get("epochs") or []
    return epochs[0].get("train_loss") if epochs else None


def start_note(records: list[dict[str, Any]]) -> str:
    """Whether every run started from the shared initial weights: one digest per seed."""
    ok = [r for r in records if r.get("status") == "ok"]
    modes = {(r.get("init") or {}).get("mode") for r in ok}
    if modes != {"shared"}:
        return f"initial weights: {', '.join(sorted(str(m) for m in modes))} (not one shared start)"
    by_seed: dict[Any, set[str]] = {}
    for r in ok:
        by_seed.setdefault(r["config"].get("seed"), set()).add(r["init"]["sha256"])
    same = all(len(d) == 1 for d in by_seed.values())
    return (
        f"initial weights: shared, one sha256 per seed for every framework and device count "
        f"({'yes' if same else 'NO'}: {len(by_seed)} seed(s))"
    )


def mark_within_noise(table: list[dict[str, Any]]) -> None:
    """row["within_noise_of"]: the frameworks whose images/s min-max range overlaps this row's
    at its device count (cells with >= 2 successful runs)."""
    ranged = [r for r in table
              if r.get("runs_ok", 0) >= 2 and r.get("images_per_sec_min") is not None]  # fmt: skip
    for r in ranged:
        r["within_noise_of"] = ", ".join(
            o["framework"] for o in ranged if o is not r and o["devices"] == r["devices"]
            and max(o["images_per_sec_min"], r["images_per_sec_min"])
            <= min(o["images_per_sec_max"], r["images_per_sec_max"])
        )  # fmt: skip


def one_line(record: dict[str, Any]) -> str:
    error = str(record.get("error") or record["status"]).strip().splitlines()
    return error[-1][:200] if error else record["status"]


# -- formatting ---------------------------------------------------------------------------------


def _num(mean: float | None, std: float | None, fmt: str) -> str:
    if mean is None:
        return "-"
    text = format(mean, fmt)
    return text if std is None else f"{text} ± {format(std, fmt)}"


def _mean_std(key: str, fmt: str) -> Callable[[dict[str, Any]], str]:
    return lambda r: _num(r.get(key), r.get(key + "_std"), fmt)


def _median(row: dict[str, Any], key: str, fmt: str) -> str:
    """A cell's median over its runs and their (min-max); the value alone for one run."""
    if row.get(key) is None:
        return "-"
    text = format(row[key], fmt)
    if row.get("runs_ok", 0) >= 2:
        text += f" ({format(row[key + '_min'], fmt)}-{format(row[key + '_max'], fmt)})"
    return text


def _untimed(row: dict[str, Any]) -> str:
    return f" {UNTIMED_MARK}" if row.get("untimed_runs") else ""


def _images_per_sec(row: dict[str, Any]) -> str:
    mark = f" {NOISE_MARK}" if row.get("within_noise_of") else ""
    return _median(row, "images_per_sec", ".0f") + mark + _untimed(row)


def _comm(row: dict[str, Any]) -> str:
    """Bytes a device sends per step, and whether computed from the shardings or profiled."""
    if row.get("comm_mib") is None:
        return "-"
    return f"{row['comm_mib']:.3g} ({row['comm_source']})"


def columns(sweep: Sweep) -> list[tuple[str, Callable[[dict[str, Any]], str]]]:
    cols: list[tuple[str, Callable[[dict[str, Any]], str]]] = [
        ("framework", lambda r: r["framework"]),
        ("mode", lambda r: r.get("mode") or "-"),
        ("devices", lambda r: str(r["devices"])),
        ("status", lambda r: r["status"]),
        ("global batch", lambda r: r.get("global_batch_size") or "-"),
        ("test acc", _mean_std("test_accuracy", ".4f")),
        ("epoch-1 loss", _mean_std("epoch1_train_loss", ".4f")),
        ("s/epoch", lambda r: _median(r, "sec_per_epoch", ".3g") + _untimed(r)),
        ("1st epoch s", _mean_std("first_epoch_sec", ".3g")),
        ("images/s", _images_per_sec),
        ("speed-up", lambda r: _num(r.get("speedup"), None, ".2f") + ("x" * ("speedup" in r))),
        ("efficiency", lambda r: f"{r['efficiency']:.0%}" if "efficiency" in r else "-"),
        ("state/device MiB", lambda r: _num(r.get("state_mib"), None, ".3g")),
        ("sent/step MiB", _comm),
        ("BN", lambda r: r.get("bn_mode") or "-"),
        ("device kind", lambda r: r.get("device_kind") or "-"),
    ]
    if (goal := sweep.target_accuracy) > 0:
        epochs = _mean_std("epochs_to_target", ".1f")  # no _std key: the mean alone
        cols += [(f"s to {goal:g}", _time_to_target), (f"epochs to {goal:g}", epochs)]
    return cols


def _time_to_target(row: dict[str, Any]) -> str:
    if "runs_ok" not in row:
        return "-"
    if not row["reached_target"]:
        return "not reached" if row["runs_ok"] else "-"
    text = _num(row["time_to_target_sec"], row["time_to_target_sec_std"], ".3g")
    if row["reached_target"] < row["runs_ok"]:
        text += f" ({row['reached_target']}/{row['runs_ok']} reached)"
    return text


def table_cells(sweep: Sweep, table: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    cols = columns(sweep)
    return [h for h, _ in cols], [[f(r) for _, f in cols] for r in table]


def spread_notes(table: list[dict[str, Any]]) -> list[str]:
    """The "within noise" pairs per device count, the cells of one run, the untimed ones."""
    lines = []
    untimed = [f"{r['framework']} x{r['devices']}" for r in table if r.get("untimed_runs")]
    if untimed:
        lines.append(
            f"{UNTIMED_MARK} no timed epoch in a run of {', '.join(untimed)} (every epoch was "
            "the first of its process: --epochs 1, or a resume after every epoch): its s/epoch "
            "and images/s include compilation and warm-up; use --epochs 2 or more"
        )
    for n in dict.fromkeys(r["devices"] for r in table):
        marked = [r for r in table if r["devices"] == n and r.get("within_noise_of")]
        pairs = [
            f"{r['framework']} ~ {other}"
            for i, r in enumerate(marked)
            for other in r["within_noise_of"].split(", ")
            if other not in [m["framework"] for m in marked[:i]]
        ]
        if pairs:
            devices = f"{n} device" + "s" * (n != 1)
            lines.append(
                f"{NOISE_MARK} images/s within noise at {devices} (min-max ranges over the "
                f"repeats overlap): {'; '.join(pairs)}"
            )
    single = [r for r in table if r.get("runs_ok") == 1]
    if single:
        every = len(single) == sum(bool(r.get("runs_ok")) for r in table)
        lines.append(
            f"{'Every cell is' if every else 'Some cells are'} one run, so the run-to-run spread "
            "is not measured: differences smaller than that spread are noise (use --repeat 3 to "
            "measure it)."
        )
    return lines


def table_notes(sweep: Sweep, table: list[dict[str, Any]], records: list[dict]) -> list[str]:
    """The lines under the summary table, on stdout and in results.md."""
    return [
        *harness.mode_notes(table),
        *(  # one per skipped framework, n/a cell and failed cell
            f"{r['framework']}{'' if r['status'] == 'skipped' else ' x' + str(r['devices'])}: "
            f"{r['status']}: {r['note']}"
            for r in table
            if r["note"]
        ),
        *spread_notes(table),
        start_note(records),
    ]


def print_table(sweep: Sweep, records: list[dict[str, Any]], stream: Any = None) -> None:
    """The summary table on stdout, coloured by status where rich is installed."""
    table = rows(sweep, records)
    headers, body = table_cells(sweep, table)
    colour = {"ok": "green", "n/a": "dim", "skipped": "yellow"}
    show(heading(sweep, records, sep="\n"), headers, body,
         [*table_notes(sweep, table, records), load_note(sweep, table)], left=LEFT,
         styles=[colour.get(r["status"], "red") for r in table], stream=stream)  # fmt: skip


# -- files ---------------------------------------------------------------------------------------


# results.csv's columns (one row per cell), in order
CSV_COLUMNS = """
    framework mode mode_asked devices status runs_ok runs global_batch_size peak_lr
    test_accuracy test_accuracy_std epoch1_train_loss epoch1_train_loss_std sec_per_epoch
    sec_per_epoch_std sec_per_epoch_min sec_per_epoch_max first_epoch_sec first_epoch_sec_std
    images_per_sec images_per_sec_std images_per_sec_min images_per_sec_max within_noise_of
    speedup efficiency state_mib comm_mib comm_source bn_mode device_kind time_to_target_sec
    time_to_target_sec_std epochs_to_target reached_target test_examples test_set_size
    load_avg_max cores note
""".split()
# runs.csv's columns (one row per run), in order
RUN_COLUMNS = """
    run_id framework mode execution devices seed status global_batch_size peak_lr test_accuracy
    epoch1_train_loss init_sha256 sec_per_epoch first_epoch_sec images_per_sec
    time_to_target_sec epochs_to_target wall_sec runner_wall_sec load_avg_before load_avg_after
    load_avg_start load_avg_end cores bn_mode device_kind test_examples test_set_size returncode
    log error
""".split()


def _csv(header: list[str], items: list[dict[str, Any]]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, header, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for item in items:
        writer.writerow({k: "" if item.get(k) is None else item.get(k) for k in header})
    return buf.getvalue()


def run_row(record: dict[str, Any]) -> dict[str, Any]:
    runner = record.get("runner", {})
    return {
        **record,
        **{k: runner.get(k) for k in ("run_id", "seed", "peak_lr", "returncode", "log")},
        "framework": harness.row_key(record),
        "mode": harness.mode_label(record.get("execution")),
        "epoch1_train_loss": epoch1_loss(record),
        "init_sha256": (record.get("init") or {}).get("sha256"),
        "runner_wall_sec": runner.get("wall_sec"),
        "load_avg_before": (runner.get("load_avg") or [None, None])[0],
        "load_avg_after": (runner.get("load_avg") or [None, None])[1],
        "load_avg_start": (record.get("load_avg") or {}).get("start"),
        "load_avg_end": (record.get("load_avg") or {}).get("end"),
        "cores": (record.get("load_avg") or {}).get("cores"),
        "error": one_line(record) if record["status"] != "ok" else "",
    }


def load_note(sweep: Sweep, table: list[dict[str, Any]]) -> str:
    """A warning naming the cells whose 1-minute load exceeded the core count (the runs' own
    processes count too: a 2-process run on 2 cores adds about 2)."""
    busy = [r for r in table if (r.get("load_avg_max") or 0) > (r.get("cores") or math.inf)]
    if not busy:
        return ""
    cells = ", ".join(f"{r['framework']} x{r['devices']} ({r['load_avg_max']:.1f} on "
                      f"{r['cores']} cores)" for r in busy)  # fmt: skip
    return (
        f"Busy machine: the 1-minute load average exceeded the core count during {cells}; more "
        "work than cores competed with these runs, so their timings are noisy."
    )


def markdown(sweep: Sweep, records: list[dict[str, Any]], plots: list[Path], plot_note: str) -> str:
    table = rows(sweep, records)
    headers, body = table_cells(sweep, table)
    host = sweep.host
    gpus = ", ".join(host.get("gpus", [])) or "none"
    parts = [
        f"# dp-bench: {heading(sweep, records)}",
        "",
        f"- Command: `{sweep.command}`",
        f"- Machine: {host.get('cpu', '?')} ({host.get('cpu_count', '?')} logical CPUs); "
        f"GPUs: {gpus}; {host.get('platform', '')}",
        f"- Started {sweep.started}" + (f", finished {sweep.finished}" if sweep.finished else ""),
        *([f"- {busy}"] if (busy := load_note(sweep, table)) else []),
        "- s/epoch = timed seconds / timed epochs (the first epoch of every process, with "
        "compilation and warm-up, is reported separately); images/s = timed images / timed "
        "seconds; epoch-1 loss = the first epoch's mean training loss (same start and data in "
        "every framework: what differs is float rounding, which training amplifies over an "
        "epoch; compare it with the seed-to-seed ±); with several runs per cell "
        "(--repeat) both show the median over the runs and (min-max), test acc the mean ± std; "
        f"{NOISE_MARK} = images/s within noise of another framework's (ranges overlap); "
        "speed-up = images/s over the same framework's 1-device row; efficiency = speed-up / "
        "devices; state/device = params, grads, optimiser state and buffers one device keeps; "
        "sent/step = bytes one device's collectives send per step (computed from the "
        "shardings, ring algorithms, or read from a --profile trace); mode = the execution "
        "mode the runs' records say they ran (NAME+VARIANT in --frameworks: the framework in "
        "another mode, a row of its own).",
        "",
        markdown_table(headers, body),
        "",
    ]
    parts += [f"- {line}" for line in table_notes(sweep, table, records) if line]
    from benchmarks.analysis import predict  # numpy: only where a report is made

    parts += predict.section(records, _busy)  # measured against PREDICTED scaling
    parts += breakdowns.section(records)  # --profile runs: where each step's time went
    failed = [r for r in records if r["status"] != "ok"]
    if failed:
        parts += ["", "## Failed runs", ""]
        for r in failed:
            runner = r.get("runner", {})
            parts += [
                f"### {runner.get('run_id')}: {r['status']}", "",
                f"{one_line(r)} (exit code {runner.get('returncode')}; log `{runner.get('log')}`)",
                "", "```", *runner.get("log_tail", []), "```", "",
            ]  # fmt: skip
    if plots or plot_note:
        parts += ["", "## Plots", ""]
        parts += [f"![{p.stem}]({p.name})" for p in plots]
        if plot_note:
            parts.append(plot_note)
    parts += ["", "Every run's record is in `runs/`, its log in `logs/`, its command in "
              "`config.json`.", ""]  # fmt: skip
    return "\n".join(parts)


def write_tables(out: Path, sweep: Sweep, records: list[dict[str, Any]],
                 plots: Iterable[Path] = (), plot_note: str = "") -> None:  # fmt: skip
    """results.csv (one row per cell), runs.csv (one row per run) and results.md."""
    table = rows(sweep, records)
    write_atomic(out / "results.csv", _csv(CSV_COLUMNS, table))
    write_atomic(out / "runs.csv", _csv(RUN_COLUMNS, [run_row(r) for r in records]))
    write_atomic(out / "results.md", markdown(sweep, records, list(plots), plot_note))


# -- plots ---------------------------------------------------------------------------------------


def write_plots(out: Path, sweep: Sweep, records: list[dict[str, Any]]) -> tuple[list[Path], str]:
    """PNG plots; returns the files written and a note when plots could not be made."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return [], "Plots skipped: matplotlib is not installed in this interpreter (use .venv)."
    table = [r for r in rows(sweep, records) if r.get("images_per_sec")]
    title = heading(sweep, records, sep="\n")
    colours = {fw: f"C{i}" for i, fw in enumerate(sweep.frameworks)}
    modes = {
        fw: _joined(r.get("mode", "") for r in table if r["framework"] == fw) for fw in colours
    }
    labels = {fw: f"{fw} ({modes[fw]})" if modes[fw] else fw for fw in colours}
    written = []

    def save(fig: Any, name: str) -> None:
        png = io.BytesIO()
        try:
            fig.savefig(png, format="png", dpi=120, bbox_inches="tight")
        finally:
            plt.close(fig)
        write_atomic(out / name, png.getvalue())
        written.append(out / name)

    subtitle = "Throughput vs devices (median, bars: min-max over repeats; dashed: ideal scaling)"
    fig, ax = harness.device_axes(
        plt, sweep.counts, f"{subtitle}\n{title}", "images/s (timed epochs)"
    )
    for fw in sweep.frameworks:
        pts = [r for r in table if r["framework"] == fw]
        if not pts:
            continue
        xs = [r["devices"] for r in pts]
        ys = [r["images_per_sec"] for r in pts]
        err = [  # the min-max range over the repeats around the median
            [r["images_per_sec"] - r["images_per_sec_min"] for r in pts],
            [r["images_per_sec_max"] - r["images_per_sec"] for r in pts],
        ]
        ax.errorbar(xs, ys, yerr=err, marker="o", color=colours[fw], label=labels[fw], capsize=3)
        base = next((r["images_per_sec"] for r in pts if r["devices"] == 1), None)
        if base:
            ideal = [base * n for n in sweep.counts]
            ax.plot(sweep.counts, ideal, "--", color=colours[fw], alpha=0.5)
    ax.set_ylim(bottom=0)
    if table:
        ax.legend(fontsize=8)
    save(fig, "throughput.png")

    fig, ax = harness.device_axes(plt, sweep.counts, f"Scaling efficiency vs devices\n{title}")
    ax.axhline(1.0, color="k", linestyle="--", alpha=0.5, label="ideal")
    for fw in sweep.frameworks:
        pts = [r for r in table if r["framework"] == fw and "efficiency" in r]
        if pts:
            ax.plot([r["devices"] for r in pts], [r["efficiency"] for r in pts], marker="o",
                    color=colours[fw], label=labels[fw])  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.legend(fontsize=8)
    save(fig, "efficiency.png")

    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.set_title(f"Test accuracy vs wall time, per run\n{title}", fontsize=8)
    ax.set_xlabel("wall time since training started (s; interpreter start-up and imports excluded)")
    ax.set_ylabel("test accuracy")
    ax.grid(alpha=0.3)
    styles = ["-", "--", ":", "-."]
    for r in records:
        epochs = [e for e in r.get("epochs", []) if e.get("wall_sec") is not None]
        if not epochs:
            continue
        k = sweep.counts.index(r["devices"]) if r["devices"] in sweep.counts else 0
        ax.plot([e["wall_sec"] for e in epochs], [e["test_accuracy"] for e in epochs],
                marker="os^Dv<>p"[k % 8], linestyle=styles[k % 4],
                color=colours.get(harness.row_key(r), "k"),
                label=r.get("runner", {}).get("run_id", harness.row_key(r)))  # fmt: skip
    if sweep.target_accuracy > 0:
        ax.axhline(sweep.target_accuracy, color="k", linestyle="--", alpha=0.5, label="target")
    ax.set_ylim(0, 1)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=7, ncol=2)
    save(fig, "accuracy_vs_time.png")
    from benchmarks.analysis import predict

    if (fig := predict.sweep_plot(plt, sweep.counts, sweep.frameworks, records, title)) is not None:
        save(fig, "predicted_efficiency.png")
    if (fig := breakdowns.plot(plt, records, title)) is not None:
        save(fig, "breakdown.png")
    return written, ""


# -- rebuilding a comparison's files -----------------------------------------------------------

TOOL = "report"


@dataclass
class Rebuild:
    out: Path
    config: dict[str, Any]
    sweep: Sweep
    records: list[dict[str, Any]]


def sweep_from_config(config: dict[str, Any]) -> Sweep:
    """The Sweep that benchmarks.compare planned, from the config.json it wrote."""
    base = config["base_config"]
    return Sweep(
        title=sweep_title(
            base["model"], base["width"], base["dataset"], base["preset"], config["scaling"]
        ),
        command=config["command"],
        frameworks=list(config["frameworks"]),
        counts=[int(n) for n in config["device_counts"]],
        planned=Counter((run["framework"], int(run["devices"])) for run in config["runs"]),
        skipped=dict(config.get("skipped") or {}),
        not_applicable={
            (na["framework"], int(na["devices"])): na["reason"]
            for na in config.get("not_applicable") or []
        },
        expected_kind=config.get("device_kind") or "cpu-simulated",
        target_accuracy=base.get("target_accuracy") or 0.0,
        host=dict(config.get("host") or {}),
        started=config.get("started") or "",
        finished=config.get("finished") or "",
    )


def records_of(out: Path, config: dict[str, Any]) -> list[dict[str, Any]]:
    """Every planned run's record, in the sweep's order; one whose file cannot be read is
    "damaged", not "not run". A record the runner did not finish (the trainer's own: no
    `runner` part) gets the runner facts config.json has."""
    records = []
    for run in config["runs"]:
        record = harness.read_record(out / run["output"])
        if record is None and (out / run["output"]).exists():  # truncated / not a record
            record = {
                **{k: run.get(k) for k in ("framework", "devices", "global_batch_size", "config")},
                "status": "damaged",
                "error": f"{run['output']} is damaged (truncated or not a run record); rerun it",
            }
        if record is None:
            continue
        record.setdefault("runner", {
            "run_id": run["run_id"], "framework": run["framework"],
            **{k: run.get(k) for k in ("seed", "peak_lr", "command", "log")},
            "returncode": None, "ended": "unknown (the runner did not finish this run)",
        })  # fmt: skip
        records.append(record)
    return records


def make_rebuild(argv: list[str]) -> Rebuild:
    about = "Rebuild a comparison's tables and plots from its config.json and runs/*.json."
    p = harness.Parser(TOOL, description=about)
    p.add_argument("dir", help="the comparison's directory, e.g. results/20261123T120000Z")
    ns = p.parse_args(argv)
    out = Path(ns.dir).expanduser().resolve()
    path = out / "config.json"
    config = harness.read_json_file(
        path, "comparison", "give the directory benchmarks.compare wrote"
    )
    try:  # the keys report uses without .get
        sweep = sweep_from_config(config)
        records = records_of(out, config)
    except (KeyError, TypeError, AttributeError) as exc:
        why = f"no key {exc}" if isinstance(exc, KeyError) else exc
        raise UsageError(f"{path} is not a comparison's config.json ({why})") from None
    why = harness.unwritable(out, "dir")  # type: ignore[assignment]
    if why:
        raise UsageError(f"{out}: {why}")
    harness.claim_existing(out)
    return Rebuild(out, config, sweep, records)


def rebuild(plan: Rebuild) -> int:
    sweep, records = plan.sweep, plan.records
    if plan.config.get("status") == "running":
        runner = plan.config.get("runner") or {}
        if harness.gone(runner):  # killed (kill -9, the OOM killer): config.json could not say so
            print(f"report: the comparison in {plan.out} stopped: its runner (pid "
                  f"{runner['pid']}) is gone; config.json still says running")  # fmt: skip
        else:
            print(f"report: the comparison in {plan.out} never finished (config.json says running)")
    try:
        plots, plot_note = write_plots(plan.out, sweep, records)
        write_tables(plan.out, sweep, records, plots, plot_note)
    except OSError as exc:
        print(f"report: error: could not write into {plan.out}: {exc.strerror or exc}")
        return 1
    print_table(sweep, records)
    print(f"\nreport: {len(records)} of {len(plan.config['runs'])} planned runs have records; "
          f"rewrote results.md, results.csv, runs.csv and the plots in {plan.out}")  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit 0 rebuilt, 1 not written, 2 bad input."""
    return harness.run_tool(TOOL, argv, make_rebuild, rebuild)


if __name__ == "__main__":
    raise SystemExit(main())
