"""`python -m benchmarks.parity`: does one training step give the same update in every framework?

Every framework runs in its own process (its own interpreter) from the shared initial state
(`--init shared`) on the same K global batches of the real pipeline, and saves its parameters
and BN running statistics after K steps (`--save-state`, torch's names and layouts); the parent
compares them with a torch-ddp reference run. What is compared, the reference of each row and why
the configuration (random images, 16 images per device at 2 devices, >= 64 values per channel in
every BN layer, K=1) keeps rounding from changing the verdict: docs/fairness.md, "Cross-framework
parity". update_rel_diff = ||dW_f - dW_ref|| / ||dW_ref||, dW = W_K - W_0, over all parameters
(per tensor in parity.json); running_mean_rel_diff the same for the BN running means;
running_var_factor = reference / framework running-variance update, min..max over the BN layers
(n/(n-1) between torch's unbiased and Flax's or MXNet's biased variance; reported, not judged).
Outputs in --out DIR: parity.json, parity.md, runs/ (states and records), logs/. Exit 0 when every
row is ok (or skipped), 1 otherwise, 2 on bad input (nothing ran), 128 + the signal interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks import harness
from benchmarks.harness import REGISTRY, UsageError
from common.checkpoints import load_saved_state
from common.config import BN_MODES, FRAMEWORKS, MODELS, ConfigError, preset, train_size
from common.results import host_info, write_json_atomic
from common.runtime import ROOT

PROG = "python -m benchmarks.parity"
REFERENCE = "torch-ddp"
# update_rel_diff tolerance at K=1. Measured on the default grid (Intel Xeon, 2 cores):
# <= 4e-6 for every framework; rounding-level noise (3e-7 relative) on the step's batch (tests):
# <= 2.2e-6. A one-step LR shift moves the update by 0.89 at K=3 (jax-pmap, measured).
TOLERANCE = 1e-4
# For K > 1 steps: every step is another forward pass whose ReLU inputs are not conditioned, and
# one ReLU within rounding of 0 moves the update by ~1e-3..5e-3 (measured); 2e-2 stays far from
# the semantic slips (LR shift at K=3: 0.89).
TOLERANCE_MULTI_STEP = 2e-2
# running_mean_rel_diff: a forward quantity, continuous in the inputs; measured <= 8e-7 at K=1.
# A BN momentum of 0.9 instead of 0.1 (Flax's convention in torch's place) gives ~8.
MEAN_TOLERANCE = 1e-5
# Seed 13: of seeds 0-15, the one whose first step keeps every ReLU input and every max-pool
# gap (top two of a window) furthest from a tie, >= 2e-6 over both models at 1 and 2 devices
# (seed 0: 9e-9 in the WideResNet, where jax-pmap and torch-ddp then differ by 9e-4).
# Rounding-level differences between frameworks move those values by ~1e-7.
SEED = 13
BASE = "throughput"  # the preset whose synthetic data set (8192 random images) feeds the runs


def build_parser() -> argparse.ArgumentParser:
    p = harness.Parser("parity", description=__doc__.split("\n\n")[0].split(": ", 1)[1])
    harness.add_flags(p, frameworks=",".join(FRAMEWORKS), gpus="2")
    p.add_argument("--models", default=",".join(MODELS), metavar="LIST",
                   help=f"comma-separated, from: {', '.join(MODELS)} (default: both)")  # fmt: skip
    p.add_argument("--bn", default=",".join(BN_MODES), metavar="LIST",
                   help="BatchNorm modes, comma-separated: local, sync (default both)")  # fmt: skip
    harness.add_numbers(
        p,
        ("--steps", int, 1, "training steps compared (default 1)", "K"),
        ("--tolerance", float, None, f"largest update_rel_diff that is ok (default {TOLERANCE:g} "
         f"at K=1, {TOLERANCE_MULTI_STEP:g} for K > 1)"),
        ("--mean-tolerance", float, MEAN_TOLERANCE,
         f"largest running_mean_rel_diff that is ok (default {MEAN_TOLERANCE:g})"),
        ("--batch-size", int, 32, "GLOBAL batch (default 32: 16 images per device at 2 devices)"),
        ("--image-size", int, 16, "image side (default 16)"),
        ("--width", float, 0.125, "width multiplier (default 0.125)"),
        ("--seed", int, SEED, f"weights, data, augmentation (default {SEED}: SEED in the source)"),
        ("--jobs", int, 2, "runs at a time (default 2; a check, not a timing)"),
    )  # fmt: skip
    harness.add_flags(p, python=True, out="results/parity-", timeout=600.0, devices=True)
    return p


# -- the plan -----------------------------------------------------------------------------------


@dataclass
class Plan(harness.SweepPlan):
    models: list[str]
    bns: list[str]
    tolerance: float


def make_plan(argv: list[str]) -> Plan:
    ns = build_parser().parse_args(argv)
    harness.check_options(ns)
    frameworks = harness.parse_frameworks(ns.frameworks)
    models = harness.pick(ns.models, MODELS, "--models", " (comma-separated)")
    bns = harness.pick(ns.bn, BN_MODES, "--bn", " (comma-separated)")
    counts = harness.parse_gpus(ns.gpus)
    harness.check_positive(steps=ns.steps, batch_size=ns.batch_size, jobs=ns.jobs)
    harness.check_positive(timeout=ns.timeout, mean_tolerance=ns.mean_tolerance)
    if ns.tolerance is not None:
        harness.check_positive(tolerance=ns.tolerance)
    if ns.python is not None:
        harness.use_interpreter(ns.python)
    gpus = harness.machine_gpus(ns.devices)
    harness.check_counts(counts, gpus)
    for n in counts:
        for model in models:
            try:
                cfg = preset(BASE, **workload(ns, model, "local", n))
            except ConfigError as exc:
                raise UsageError(str(exc)) from None
    if ns.steps * ns.batch_size > train_size(cfg):
        raise UsageError(
            f"--steps {ns.steps} x --batch-size {ns.batch_size} is more than the "
            f"{train_size(cfg)} synthetic training images (one epoch); use fewer steps"
        )
    tolerance = ns.tolerance or (TOLERANCE if ns.steps == 1 else TOLERANCE_MULTI_STEP)
    skipped = harness.unavailable(list(dict.fromkeys([REFERENCE, *frameworks])))
    if REFERENCE in skipped:
        raise UsageError(f"the reference {REFERENCE} cannot run here: {skipped[REFERENCE]}")
    wanted = [f for f in dict.fromkeys([REFERENCE, *frameworks]) if f not in skipped]
    chosen = harness.choose_devices(ns.devices, wanted)
    skipped.update(chosen.skipped)
    ns.devices = chosen.choice  # what workload() gives every run
    if ns.jobs > 1:  # JAX runs sharing a GPU: none takes 75% of its memory up front
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
    out = harness.output_dir(ns.out, "parity-", "parity.json")
    command = [*PROG.split(), *argv]
    return Plan(ns, frameworks, counts, gpus, skipped, out, command, chosen, models, bns, tolerance)


def workload(ns: argparse.Namespace, model: str, bn: str, devices: int) -> dict[str, Any]:
    """The Config values of every run (the flags below, as `preset` keywords)."""
    return dict(
        model=model, width=ns.width, dataset="synthetic", image_size=ns.image_size, augment=True,
        batch_size=ns.batch_size, epochs=1, max_steps_per_epoch=ns.steps, lr=0.1,
        lr_base_batch=ns.batch_size, lr_schedule="cosine", warmup_epochs=0.5, momentum=0.9,
        nesterov=True, weight_decay=5e-4, label_smoothing=0.1, dropout=0.0, bn=bn, gpus=devices,
        devices=ns.devices or "auto", seed=ns.seed, prefetch=1,
    )  # fmt: skip


# -- the grid -----------------------------------------------------------------------------------


def reference_of(bn: str, devices: int) -> tuple[str, int]:
    """(bn, devices) of the torch-ddp run a row is compared with: the 1-device maths, except
    BN statistics per device at 2+ devices (see the module docstring)."""
    return ("local", devices) if bn == "local" and devices > 1 else ("local", 1)


def why_not(plan: Plan, fw: str, bn: str, n: int) -> str:
    """Why a (framework, bn, devices) row cannot run ("" when it can)."""
    if fw in plan.skipped:
        return plan.skipped[fw]
    if fw == "mxnet-gluon" and bn == "sync" and not plan.gpus:
        return "mxnet-gluon refuses --bn sync on CPU (SyncBatchNorm deadlocks in MXNet 1.9.1)"
    needs_cuda = REGISTRY[fw].multi_device_needs_cuda
    if n > 1 and needs_cuda and not plan.gpus:
        return f"{needs_cuda}: a 2-device run would be the 1-device run again"
    if fw == "torch-dp" and bn == "sync" and n > 1:
        return "torch-dp has no synchronised BatchNorm over several GPUs (nn.DataParallel)"
    return ""


def plan_rows(plan: Plan) -> list[dict[str, Any]]:
    rows = []
    for model in plan.models:
        for bn in plan.bns:
            for n in plan.counts:
                for fw in plan.frameworks:
                    ref_bn, ref_n = reference_of(bn, n)
                    why = why_not(plan, fw, bn, n)
                    rows.append(dict(
                        framework=fw, model=model, devices=n, bn=bn, steps=plan.ns.steps,
                        reference=f"{REFERENCE} {ref_n} device{'s' * (ref_n > 1)} {ref_bn}",
                        update_rel_diff=None, running_mean_rel_diff=None,
                        running_var_factor=None, ok=None,
                        status="skipped" if why else "planned", note=why,
                        run=run_tag(fw, model, bn, n),
                        ref_run=run_tag(REFERENCE, model, ref_bn, ref_n),
                    ))  # fmt: skip
    return rows


def run_tag(fw: str, model: str, bn: str, n: int) -> str:
    return f"{fw}-{model}-{bn}-{n}dev"


def command_for(plan: Plan, fw: str, model: str, bn: str, n: int) -> list[str]:
    framework = REGISTRY[fw]
    tag = run_tag(fw, model, bn, n)
    command = [str(framework.python), "-m", framework.module, "--preset", BASE]
    for name, value in workload(plan.ns, model, bn, n).items():
        command += harness.flag(name, value)
    state, record = plan.out / "runs" / f"{tag}.npz", plan.out / "runs" / f"{tag}.json"
    return [*command, "--save-state", str(state), "--output", str(record)]


def run_all(plan: Plan, rows: list[dict[str, Any]], say: Any) -> dict[str, dict[str, Any]]:
    """Every run the rows need (their own and their references), `--jobs` at a time, slowest
    first (JAX compiles, torch-ddp at 2 devices starts 2 processes); tag -> outcome."""
    todo: dict[str, tuple[str, str, str, int]] = {}
    for r in rows:
        if r["status"] == "planned":
            ref_bn, ref_n = reference_of(r["bn"], r["devices"])
            todo.setdefault(r["run"], (r["framework"], r["model"], r["bn"], r["devices"]))
            todo.setdefault(r["ref_run"], (REFERENCE, r["model"], ref_bn, ref_n))
    order = sorted(todo, key=lambda t: (-todo[t][3], REGISTRY[todo[t][0]].family != "jax"))

    def one(tag: str) -> tuple[str, dict[str, Any]]:
        fw, model, bn, n = todo[tag]
        command = command_for(plan, fw, model, bn, n)
        log = plan.out / "logs" / f"{tag}.log"
        child = harness.run_child(command, log, plan.ns.timeout, tag="parity", reraise=True)
        record = harness.read_record(plan.out / "runs" / f"{tag}.json") or {}
        outcome = {"command": command, "wall_sec": round(child.wall_sec, 1), "record": record}
        if not child.ok or record.get("status") != "ok":
            outcome["error"] = record.get("error") or child.error() or "no record"
        say(f"{tag}: {outcome.get('error', 'ok')} ({child.wall_sec:.1f} s)")
        return tag, outcome

    with ThreadPoolExecutor(max_workers=plan.ns.jobs) as pool:
        return dict(pool.map(one, order))


# -- the comparison -----------------------------------------------------------------------------


def load_state(path: Path) -> dict[str, np.ndarray]:
    """A saved state whose arrays are the ones its sha256 names (common/checkpoints.py;
    damaged: a ConfigError), as float64."""
    arrays = load_saved_state(path, "rerun parity")
    return {
        k: a.astype(np.float64) for k, a in arrays.items() if not k.endswith("num_batches_tracked")
    }


def relative(init: dict[str, np.ndarray], a: dict[str, np.ndarray],
             b: dict[str, np.ndarray], keys: list[str]) -> float:  # fmt: skip
    """||dA - dB|| / ||dB|| over `keys` together, dX = X - init."""
    da = np.concatenate([(a[k] - init[k]).ravel() for k in keys])
    db = np.concatenate([(b[k] - init[k]).ravel() for k in keys])
    return float(np.linalg.norm(da - db) / max(float(np.linalg.norm(db)), 1e-300))


def compare(init: dict[str, np.ndarray], fw: dict[str, np.ndarray],
            ref: dict[str, np.ndarray], momentum: float, steps: int) -> dict[str, Any]:  # fmt: skip
    """The row's numbers: the update and running-mean differences and the variance factor."""
    params = [k for k in init if not k.endswith(("running_mean", "running_var"))]
    means = [k for k in init if k.endswith("running_mean")]
    missing = sorted(set(init) - set(fw))
    if missing:
        raise ValueError(f"the saved state lacks {len(missing)} tensors, e.g. {missing[0]}")
    # running_var after K steps = (1 - m)^K var_0 + (the batch variances' share): the factor
    # compares the latter, which is m * (batch variance) at K=1.
    keep = (1.0 - momentum) ** steps
    factors = [
        float(np.median((ref[k] - keep * init[k]) / (fw[k] - keep * init[k])))
        for k in init
        if k.endswith("running_var")
    ]
    per_tensor = {k: relative(init, fw, ref, [k]) for k in params}
    return dict(
        update_rel_diff=relative(init, fw, ref, params),
        running_mean_rel_diff=relative(init, fw, ref, means) if means else 0.0,
        running_var_factor=[min(factors), max(factors)] if factors else None,
        update_rel_diff_per_tensor=per_tensor,
        worst_tensor=max(per_tensor, key=per_tensor.__getitem__),
    )


def evaluate(plan: Plan, rows: list[dict[str, Any]], runs: dict[str, dict[str, Any]]) -> None:
    """Fill every planned row from its run and its reference run."""
    states: dict[str, dict[str, np.ndarray]] = {}

    def state(tag: str) -> dict[str, np.ndarray]:
        if tag not in states:
            states[tag] = load_state(plan.out / "runs" / f"{tag}.npz")
        return states[tag]

    for r in rows:
        if r["status"] != "planned":
            continue
        run, ref = runs.get(r["run"], {}), runs.get(r["ref_run"], {})
        r["wall_sec"] = run.get("wall_sec")
        if "error" in run or "error" in ref:
            which = "run" if "error" in run else f"reference {r['ref_run']}"
            r.update(status="failed", ok=False, note=f"{which}: {(run or ref)['error']}")
            continue
        rec, ref_rec = run["record"], ref["record"]
        r["devices_ran"] = rec.get("devices")
        init_info, ref_init = rec.get("init") or {}, ref_rec.get("init") or {}
        if init_info.get("sha256") != ref_init.get("sha256") or not init_info.get("file"):
            r.update(status="failed", ok=False, note="not the reference's initial state")
            continue
        try:
            init = load_state(ROOT / init_info["file"])
            numbers = compare(init, state(r["run"]), state(r["ref_run"]),
                              rec["config"]["bn_momentum"], r["steps"])  # fmt: skip
        except (OSError, KeyError, ValueError) as exc:
            r.update(status="failed", ok=False, note=f"cannot compare: {exc}")
            continue
        r.update(numbers)
        ok = (
            numbers["update_rel_diff"] <= plan.tolerance
            and numbers["running_mean_rel_diff"] <= plan.ns.mean_tolerance
        )
        r.update(ok=ok, status="ok" if ok else "DIFFERS")
        if r["run"] == r["ref_run"]:
            r["note"] = "the reference itself"
        elif not ok:
            r["note"] = f"largest per-tensor difference: {numbers['worst_tensor']}"


# -- output -------------------------------------------------------------------------------------

HEADERS = ["framework", "model", "bn", "devices", "reference", "update rel diff",
           "running_mean rel diff", "running_var factor", "status", "note"]  # fmt: skip


def table(rows: list[dict[str, Any]]) -> list[list[str]]:
    body = []
    for r in rows:
        f = r.get("running_var_factor")
        body.append([
            r["framework"], r["model"], r["bn"], str(r["devices"]), r["reference"],
            *(harness.cell(r[k], ".1e") for k in ("update_rel_diff", "running_mean_rel_diff")),
            "-" if f is None else f"{f[0]:.5f}..{f[1]:.5f}", r["status"], r["note"],
        ])  # fmt: skip
    return body


def notes(plan: Plan) -> list[str]:
    ns = plan.ns
    return [
        f"{ns.steps} step(s) of a global batch of {ns.batch_size} synthetic {ns.image_size}x"
        f"{ns.image_size} images (augmented), width {ns.width:g}, seed {ns.seed}; cosine LR "
        "with warm-up, SGD + Nesterov 0.9, weight decay 5e-4, label smoothing 0.1, dropout 0",
        f"ok: update rel diff <= {plan.tolerance:g} and running_mean rel diff <= "
        f"{ns.mean_tolerance:g}; update rel diff = ||dW - dW_ref|| / ||dW_ref|| over all "
        "parameters (per tensor in parity.json)",
        "reference: torch-ddp at 1 device, except --bn local at 2 devices (per-device BN "
        "statistics are other maths): torch-ddp --bn local at 2 devices",
        "running_var factor: reference / framework running-variance update, min..max over BN "
        "layers; n/(n-1) between torch (unbiased batch variance) and Flax or MXNet (biased); "
        "not part of ok",
    ]


def markdown(plan: Plan, rows: list[dict[str, Any]], host: dict[str, Any]) -> str:
    lines = [
        "# Cross-framework parity",
        "",
        f"`{' '.join(plan.command)}` on {host.get('cpu', '?')} ({plan.device_kind}),"
        f" {harness.utc_now()}",
        "",
        harness.markdown_table(HEADERS, table(rows)),
        "",
        *[f"- {n}" for n in notes(plan)],
        "",
    ]
    return "\n".join(lines)


def execute(plan: Plan) -> int:
    rows = plan_rows(plan)
    host = host_info()

    def say(text: str) -> None:
        print(f"[parity] {text}", file=sys.stderr, flush=True)

    def save() -> None:
        write_json_atomic(plan.out / "parity.json", rows)
        harness.write_atomic(plan.out / "parity.md", markdown(plan, rows, host))

    plan.out.mkdir(parents=True, exist_ok=True)
    say(f"writing {plan.out}")
    try:
        runs = run_all(plan, rows, say)
    except KeyboardInterrupt:
        for r in rows:
            if r["status"] == "planned":
                r.update(status="interrupted", ok=False)
        save()
        return harness.interrupted()
    evaluate(plan, rows, runs)  # a skipped row keeps ok None: neither a pass nor a failure
    save()
    harness.print_table(
        f"Parity with {REFERENCE} after {plan.ns.steps} step(s)", HEADERS, table(rows), notes(plan)
    )
    print(json.dumps({"parity": str(plan.out / "parity.json")}))
    return 0 if all(r["ok"] is not False for r in rows) else 1


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m benchmarks.parity --help`; exit codes: the module docstring."""
    return harness.run_tool("parity", argv, make_plan, execute)


if __name__ == "__main__":
    sys.exit(main())
