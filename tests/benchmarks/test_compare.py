"""The benchmark runner: an end-to-end sweep over real frameworks (smoke preset, simulated CPU
devices) with a failed and a missing one; planning, reporting and bad input in-process."""

from __future__ import annotations

import contextlib
import csv
import io
import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks import compare, harness, report
from benchmarks.progress import RichProgress, parse_epoch_line
from common.config import preset
from common.results import RunRecorder
from tests.conftest import FRAMEWORKS, TENSORBOARD_MISSING, read_json, run_module
from tests.trainers.test_tensorboard import assert_events_match_record

# Two real frameworks of different families, each at 1 and 2 simulated devices.
PAIR = ("torch-ddp", "jax-shard")
MXNET_PYTHON = ("DPBENCH_PYTHON_MXNET_GLUON", "/nonexistent/.venv-mxnet/bin/python")  # missing
PLOTS = ("throughput.png", "efficiency.png", "accuracy_vs_time.png")
PNG = b"\x89PNG\r\n\x1a\n"


def read_csv(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_end_to_end_two_frameworks_a_failed_one_and_a_missing_one(tmp_path: Path) -> None:
    """One sweep: two frameworks at 1 and 2 devices, one that fails at start-up (its log tail
    reported, the others keep their results, exit 1) and one whose interpreter is missing."""
    out = tmp_path / "out"
    frameworks = ",".join(["torch-dp", *PAIR, "mxnet-gluon"])  # the failed run first
    args = ["--frameworks", frameworks, "--gpus", "2", "--preset", "smoke", "--out", str(out)]
    args += ["--no-tensorboard"] if TENSORBOARD_MISSING else []  # its checks below left out
    env = dict([MXNET_PYTHON, ("DPBENCH_FAIL", "torch-dp")])
    # --timeout well below run_module's: a hung run must be ended (and reported) by the runner
    proc = run_module("benchmarks.compare", *args, "--timeout", "240", env=env, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr

    rows = read_csv(out / "results.csv")
    assert [(r["framework"], r["devices"], r["status"]) for r in rows] == [
        ("torch-dp", "1", "failed"),
        ("torch-dp", "2", "n/a"),
        *((fw, n, "ok") for fw in PAIR for n in ("1", "2")),
        ("mxnet-gluon", "-", "skipped"),
    ]
    assert "failure injected" in rows[0]["note"] and "scripts/setup.sh mxnet" in rows[-1]["note"]
    for r in rows[2:6]:
        assert r["device_kind"] == "cpu-simulated" and int(r["cores"]) == os.cpu_count()
        assert int(r["test_examples"]) == preset("smoke").synthetic_test
        assert float(r["efficiency"]) == pytest.approx(float(r["speedup"]) / int(r["devices"]))

    ok_runs = sorted(f"{fw}-{n}dev.json" for fw in PAIR for n in (1, 2))
    for name in ok_runs:
        record = read_json(out / "runs" / name)
        assert record["status"] == "ok" and len(record["epochs"]) == 2
        assert "epoch 2/2" in (out / record["runner"]["log"]).read_text()
    failed = read_json(out / "runs" / "torch-dp-1dev.json")
    assert failed["status"] == "failed" and failed["runner"]["returncode"] == 1
    assert any("failure injected" in line for line in failed["runner"]["log_tail"])
    # every record carries the load around its run
    assert all(float(run["load_avg_end"]) >= 0 for run in read_csv(out / "runs.csv"))
    config = read_json(out / "config.json")
    assert config["status"] == "finished" and "mxnet-gluon" in config["skipped"]

    md = (out / "results.md").read_text()
    assert "NOT GPU scaling" in md and "## Failed runs" in md and "use --repeat 3" in md
    predicted = md.split("\n## Measured and predicted")[1].split("\n## ")[0]
    assert predicted.count(f"| {PAIR[0]} |") == 1  # its 2-device run against the prediction
    assert all((out / png).read_bytes()[:8] == PNG and f"]({png})" in md for png in PLOTS)
    assert not list(out.rglob("*.tmp"))  # atomic writes leave no temporaries
    assert f"{PAIR[1]} x2: epoch 2/2 test_accuracy=" in proc.stdout
    assert "mxnet-gluon: skipped" in proc.stdout and "failure injected" in proc.stdout
    # TensorBoard (on by default): one event file per run under tensorboard/<run id>/, with the
    # record's values
    if TENSORBOARD_MISSING:  # a python without the writer (a GPU machine's own): said by -rs
        assert_report_rebuilds_the_same_files(out)
        pytest.skip(f"the TensorBoard part of this test: {TENSORBOARD_MISSING}")
    tb = out / "tensorboard"
    for name in ok_runs:
        assert_events_match_record(tb / name.removesuffix(".json"), read_json(out / "runs" / name))
    assert_report_rebuilds_the_same_files(out)


def assert_report_rebuilds_the_same_files(out: Path) -> None:
    """`python -m benchmarks.report DIR` rebuilds the runner's files byte for byte."""
    rebuilt = ("results.md", "results.csv", "runs.csv")
    written = {name: (out / name).read_bytes() for name in rebuilt}
    for name in [*rebuilt, *PLOTS]:
        (out / name).unlink()
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert report.main([str(out)]) == 0
    assert {name: (out / name).read_bytes() for name in rebuilt} == written
    assert (out / PLOTS[0]).read_bytes()[:8] == PNG and "5 of 5 planned" in printed.getvalue()
    assert not (out / harness.LOCK_NAME).exists() and not list(out.rglob("*.tmp"))


def test_report_bad_directory_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    for config, says in [(None, "No such file"), ("garbage", "is not JSON"), ("{}", "no key")]:
        if config is not None:
            (tmp_path / "config.json").write_text(config)
        assert report.main([str(tmp_path)]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("report: error: ") and says in err
        assert [p.name for p in tmp_path.iterdir()] == (["config.json"] if config else [])


def _gpu_machine(monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    """This process on a machine with `gpus` H100s, which every framework sees."""
    seen = harness.Seen(("NVIDIA H100",) * gpus, "")
    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    monkeypatch.setattr(harness, "detect_gpus", lambda: list(seen.gpus))
    monkeypatch.setattr(harness, "probe_devices", lambda names: dict.fromkeys(names, seen))
    monkeypatch.delenv("DPBENCH_DEVICES", raising=False)  # the test session's pin to the CPU


BAD_INPUT = {
    "unknown framework": (["--frameworks", "torch-ddp,caffe"], "unknown framework 'caffe'"),
    "batch does not divide": (["--preset", "smoke", "--gpus", "1,2,5"], "does not divide"),
    "dataset not on disk": (["--dataset", "cifar10", "--no-download", "--data-dir",
                             "{tmp}/nodata"], "dataset 'cifar10' is not on disk"),
    "output is the runner's": (["--output", "x.json"], "use --out DIR"),
    "unknown variant": (["--frameworks", "torch-ddp+turbo"], "unknown variant 'turbo'"),
    "nothing available": (["--frameworks", "mxnet-gluon"], "bash scripts/setup.sh mxnet"),
    "more GPUs than the machine": (["--gpus", "4"], "this machine has 1 GPU(s)"),
    "compiled DataParallel on GPUs": (["--frameworks", "torch-dp+compile", "--gpus", "2,"],
                                      "cannot trace nn.DataParallel"),
}  # fmt: skip


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2_before_any_run(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    args, message = BAD_INPUT[case]
    if case == "nothing available":
        monkeypatch.setenv(*MXNET_PYTHON)
    if "GPU" in case:
        _gpu_machine(monkeypatch, gpus=1 if case.startswith("more") else 2)
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit:
        sys.exit(compare.main([a.format(tmp=tmp_path) for a in args] + ["--out", str(out)]))
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err.count("\n") == 1 and message in err, err
    assert err.startswith("compare: error: ")
    assert not out.exists()  # no logs/, no runs/: nothing started


def test_default_plan_is_every_framework_at_1_and_2_on_digits(no_probe: None, tmp_path) -> None:
    assert harness.parse_gpus("6") == [1, 2, 4, 6] and harness.parse_gpus("3,1,2") == [1, 2, 3]
    plan = compare.make_plan(["--out", str(tmp_path / "out")])
    assert plan.frameworks == list(FRAMEWORKS) and plan.counts == [1, 2]
    assert (plan.base.preset, plan.scaling, plan.expected_kind) == (
        "digits", "strong", "cpu-simulated",
    )  # fmt: skip
    # torch-dp without CUDA: only the 1-device cell, and the table says why
    assert "needs CUDA" in plan.not_applicable[("torch-dp", 2)]
    mx = next(s for s in plan.runs if s.framework == "mxnet-gluon")
    assert mx.command[0].endswith(".venv-mxnet/bin/python")
    assert mx.command[1:3] == ("-m", "frameworks.mxnet_gluon")
    # the trainers' default (--init shared); native only when asked
    assert all("--init" not in s.command and s.cfg.init == "shared" for s in plan.runs)
    assert not (tmp_path / "out").exists()  # planning writes nothing
    native = compare.make_plan(["--init", "native", "--out", str(tmp_path / "out")])
    assert all("--init native" in " ".join(s.command) for s in native.runs)


def test_weak_and_strong_scaling_batches_lr_and_pass_through(no_probe: None, tmp_path) -> None:
    common_args = ["--frameworks", "jax-pmap", "--gpus", "4", "--preset", "smoke"]
    extra = ["--lr-scaling", "linear", "--bn", "sync", "--epochs", "3", "--out", str(tmp_path)]
    weak = compare.make_plan([*common_args, "--scaling", "weak", *extra])
    assert [s.cfg.batch_size for s in weak.runs] == [24, 48, 96]
    assert [s.peak_lr for s in weak.runs] == pytest.approx([0.05, 0.1, 0.2])
    strong = compare.make_plan([*common_args, *extra, "--repeat", "2", "--seed", "5"])
    assert {s.cfg.batch_size for s in strong.runs} == {24}
    assert [s.run_id for s in strong.runs][:2] == ["jax-pmap-1dev-seed5", "jax-pmap-1dev-seed6"]
    for spec in strong.runs:
        line = " ".join(spec.command)
        assert "--bn sync" in line and "--epochs 3" in line and "--lr-scaling linear" in line
        assert f"--gpus {spec.devices} " in line and f"--seed {spec.seed} " in line
    # a per-device preset defaults to weak scaling; a --batch-size (a global one) to strong
    args = ["--preset", "cifar10-wrn-nvidia", "--frameworks", "torch-ddp", "--out", str(tmp_path)]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(compare, "check_available", lambda cfg: None)  # CIFAR-10 not needed
        weak = compare.make_plan(args)
        strong = compare.make_plan([*args, "--batch-size", "128"])
    assert weak.scaling == "weak" and [s.cfg.batch_size for s in weak.runs] == [256, 512]
    assert [s.peak_lr for s in weak.runs] == pytest.approx([0.01, 0.02])  # linear LR scaling
    assert strong.scaling == "strong" and [s.cfg.batch_size for s in strong.runs] == [128, 128]


def test_on_gpus_the_default_fits_and_compiled_data_parallel_is_n_a(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """On CUDA the counts default to the machine's; torch-dp runs every count, but its compile
    variant at 2+ GPUs is n/a (compile cannot trace nn.DataParallel's replicas)."""
    _gpu_machine(monkeypatch, gpus=1)
    assert compare.make_plan(["--frameworks", "torch-dp", "--out", str(tmp_path)]).counts == [1]
    _gpu_machine(monkeypatch, gpus=2)
    keys = "torch-dp,torch-dp+reduce-overhead"
    plan = compare.make_plan(["--frameworks", keys, "--out", str(tmp_path / "out")])
    assert [(s.framework, s.devices) for s in plan.runs] == [
        ("torch-dp", 1), ("torch-dp", 2), ("torch-dp+reduce-overhead", 1),
    ]  # fmt: skip
    assert plan.expected_kind == "cuda:NVIDIA H100"
    assert "torch-ddp+reduce-overhead" in plan.not_applicable[("torch-dp+reduce-overhead", 2)]


def _record(fw: str, n: int, seed: int, ips: float, acc: float, status: str = "ok", *,
            sec: float = 1.0, load: float = 1.0) -> dict:  # fmt: skip
    return {
        "framework": fw, "devices": n, "status": status, "device_kind": "cpu-simulated",
        "bn_mode": "local", "global_batch_size": 24, "test_accuracy": acc, "sec_per_epoch": sec,
        "first_epoch_sec": 3.0, "images_per_sec": ips, "test_examples": 10, "test_set_size": 10,
        "time_to_target_sec": 2.0 if acc >= 0.9 else None, "epochs_to_target": 1,
        "epochs": [{"epoch": 1, "wall_sec": 1.0, "test_accuracy": acc}],
        "load_avg": {"start": 0.5, "end": load, "cores": 2},
        "error": "" if status == "ok" else "RuntimeError: boom",
        "runner": {"run_id": f"{fw}-{n}dev-seed{seed}", "seed": seed, "peak_lr": 0.05,
                   "returncode": 0 if status == "ok" else 1, "log": "logs/x.log",
                   "wall_sec": 5.0, "log_tail": ["Traceback", "RuntimeError: boom"],
                   "load_avg": [1.5, 3.0 if n == 2 else 1.0]},
    }  # fmt: skip


def _sweep(frameworks: list[str], repeat: int, **kw: Any) -> report.Sweep:
    planned = {(fw, n): repeat for fw in frameworks for n in (1, 2)}
    return report.Sweep("t", "c", frameworks, [1, 2], planned, host={"cpu_count": 2}, **kw)


def test_report_means_stds_speedup_and_files(tmp_path: Path) -> None:
    sweep = _sweep(["a", "b"], 2, not_applicable={("b", 2): "needs CUDA"}, target_accuracy=0.9)
    records = [_record("a", 1, 0, 100.0, 0.90), _record("a", 1, 1, 120.0, 0.94),
               _record("a", 2, 0, 180.0, 0.92), _record("a", 2, 1, 0.0, 0.0, status="failed"),
               _record("b", 1, 0, 50.0, 0.5) | {"test_examples": 8}]  # fmt: skip
    rows = report.rows(sweep, records)
    a1, a2, b1, b2 = rows
    # the mean and sample std of 100 and 120
    assert (a1["images_per_sec"], a1["images_per_sec_std"]) == pytest.approx((110, 14.142), 1e-3)
    assert a2["status"] == "ok 1, failed 1" and "RuntimeError: boom" in a2["note"]
    assert (a2["speedup"], a2["efficiency"]) == pytest.approx((180 / 110, 180 / 110 / 2))
    assert b1["reached_target"] == 0 and b1["note"] == "evaluated 8 test images of 10"
    assert b2["status"] == "n/a" and b2["note"] == "needs CUDA"
    headers, body = report.table_cells(sweep, rows)
    assert body[0][headers.index("test acc")] == "0.9200 ± 0.0283"
    report.write_tables(tmp_path, sweep, records)
    assert len(read_csv(tmp_path / "results.csv")) == 4 == len(read_csv(tmp_path / "runs.csv")) - 1
    md = (tmp_path / "results.md").read_text()
    assert "### a-2dev-seed1: failed" in md and "during a x2 (3.0 on 2 cores)" in md


def test_repeats_give_median_range_noise_marks_and_load_warning(tmp_path: Path) -> None:
    sweep = _sweep(["a", "b", "c"], repeat=3)
    records = [
        _record("a", 1, 0, 100.0, 0.90, sec=2.0),
        _record("a", 1, 1, 130.0, 0.92, sec=1.5),
        _record("a", 1, 2, 110.0, 0.94, sec=1.8),
        _record("b", 1, 0, 125.0, 0.90),  # 125-150 overlaps a's 100-130
        _record("b", 1, 1, 150.0, 0.90),
        _record("b", 1, 2, 140.0, 0.90),
        _record("c", 1, 0, 200.0, 0.90),  # 200-210: clear of both
        _record("c", 1, 1, 210.0, 0.90, load=3.5),  # more work than the 2 cores
        _record("c", 1, 2, 205.0, 0.90),
        # at 2 devices a and c overlap only at a point (a's max = c's min); b has one run
        *(_record("a", 2, s, ips, 0.9) for s, ips in enumerate((180.0, 190.0, 200.0))),
        *(_record("c", 2, s, ips, 0.9) for s, ips in enumerate((200.0, 240.0, 220.0))),
        _record("b", 2, 0, 195.0, 0.9),
        _record("b", 2, 1, 0.0, 0.0, status="failed"),
    ]
    table = report.rows(sweep, records)
    rows = {(r["framework"], r["devices"]): r for r in table}
    a1, b1, c1 = rows["a", 1], rows["b", 1], rows["c", 1]
    assert [a1[f"images_per_sec{s}"] for s in ("", "_min", "_max")] == [110.0, 100.0, 130.0]
    assert a1["test_accuracy"] == pytest.approx(0.92)  # mean
    assert a1["test_accuracy_std"] == pytest.approx(0.02)  # sample std of 0.90, 0.92, 0.94
    assert rows["a", 2]["speedup"] == pytest.approx(190 / 110)  # of the medians
    assert (a1["within_noise_of"], b1["within_noise_of"], c1["within_noise_of"]) == ("b", "a", "")
    assert rows["a", 2]["within_noise_of"] == "c" and rows["c", 2]["within_noise_of"] == "a"
    assert "within_noise_of" not in rows["b", 2]  # one successful run: no range to compare
    assert c1["load_avg_max"] == 3.5

    headers, body = report.table_cells(sweep, table)
    cells = {(line[0], line[headers.index("devices")]): line for line in body}
    assert cells["a", "1"][headers.index("images/s")] == "110 (100-130) †"
    assert cells["b", "2"][headers.index("images/s")] == "195"  # one run: the value alone
    assert any(n.endswith("a ~ c") for n in report.spread_notes(table))
    busy = report.load_note(sweep, table)  # runner's load: 3.0 at x2
    assert "b x2 (3.0 on 2 cores), c x1 (3.5 on 2 cores)" in busy and "a x1" not in busy
    report.write_tables(tmp_path, sweep, records)
    assert busy in (tmp_path / "results.md").read_text()


def test_epoch_line_contract_with_the_recorder_and_the_live_display(
    capsys: pytest.CaptureFixture[str],
) -> None:
    recorder = RunRecorder(preset("smoke"), devices=1, device_kind="cpu", params=1, is_main=True)
    recorder.end_epoch(0, 2.0, 96, 2.25, 7, 10, 12.5)
    row = parse_epoch_line(capsys.readouterr().out.splitlines()[0])
    assert row is not None
    assert (row["epoch"], row["epochs"], row["test_accuracy"]) == (1, 2, 0.7)
    assert row["images_per_sec"] == pytest.approx(48.0) and row["test_loss"] == 1.25
    assert parse_epoch_line("epoch 1 of 2") is None
    from rich.console import Console

    stream = io.StringIO()
    with RichProgress([2, 2], Console(file=stream, force_terminal=True, width=140)) as progress:
        progress.start_run("torch-ddp x1", 2, "logs/torch-ddp-1dev.log")
        progress.epoch(row)
        progress.end_run("ok in 3.0s")
    assert "[1/2] torch-ddp x1: ok in 3.0s" in stream.getvalue()


def test_epoch1_loss_and_the_shared_start_are_reported() -> None:
    """Epoch 1's training loss per cell, and whether every run of a seed had one start."""
    start = {"config": {"seed": 0}, "init": {"mode": "shared", "sha256": "d0" * 32}}
    records = [_record(fw, 1, 0, 100.0, 0.9) | start for fw in "ab"]
    records[0]["epochs"][0]["train_loss"] = 2.3
    assert report.rows(_sweep(["a", "b"], 1), records)[0]["epoch1_train_loss"] == 2.3
    assert "(yes: 1 seed(s))" in report.start_note(records)
    records[1]["init"] = {"mode": "shared", "sha256": "e1" * 32}  # another start, same seed
    assert "(NO: 1 seed(s))" in report.start_note(records)
    records[1]["init"] = {"mode": "native", "sha256": None}
    assert "not one shared start" in report.start_note(records)


def test_state_and_collective_bytes_are_shown_and_an_older_record_gets_a_dash() -> None:
    sweep = _sweep(["a", "b"], repeat=1)
    new = _record("a", 2, 0, 100.0, 0.9)
    new["state_bytes_per_device"] = {"total": 3 * 2**20}
    new["collective_bytes_per_step"] = {"total": 2**19, "source": "computed from the shardings"}
    rows = report.rows(sweep, [new, _record("b", 2, 0, 100.0, 0.9)])  # b: an older record
    headers, body = report.table_cells(sweep, rows)
    cells = {line[0]: dict(zip(headers, line)) for line in body if line[2] == "2"}
    assert cells["a"]["state/device MiB"] == "3" and cells["a"]["sent/step MiB"] == "0.5 (computed)"
    assert cells["b"]["state/device MiB"] == cells["b"]["sent/step MiB"] == "-"


def test_a_run_without_a_timed_epoch_is_marked() -> None:
    """A record without a timed epoch (its figures are warm-up's) is marked and named in a note."""
    sweep = _sweep(["a", "b"], repeat=1)
    warm = {**_record("a", 1, 0, 50.0, 0.9, sec=3.9), "timed_epochs": 0}
    rows = report.rows(sweep, [warm, {**_record("b", 1, 0, 100.0, 0.9), "timed_epochs": 3}])
    headers, body = report.table_cells(sweep, rows)
    epoch_sec = headers.index("s/epoch")
    assert (body[0][epoch_sec], body[2][epoch_sec]) == ("3.9 ‡", "1")
    assert "‡ no timed epoch in a run of a x1 " in "\n".join(report.spread_notes(rows))


def test_mode_label_names_what_each_trainer_records() -> None:
    from frameworks.torch_support import device_plan, execution

    def torch_run(compiled: bool, **kw: object) -> str:
        return execution(device_plan(preset("smoke", **kw), "cuda"), compiled=compiled)

    for recorded, label in [
        (torch_run(False), "eager"),
        (torch_run(False, compile=True), "eager"),  # --compile on the CPU: the trainer ran eager
        (torch_run(True, compile=True), "torch.compile"),
        (
            torch_run(True, compile=True, compile_mode="reduce-overhead"),
            "torch.compile reduce-overhead + CUDA graphs",
        ),
        ("pmap (one XLA program per device); XLA:CPU (its own code)", "XLA (pmap)"),
        ("jit (XLA SPMD over the mesh)", "XLA (jit)"),
        ("hybridized (static_alloc, static_shape)", "hybridized (static alloc)"),
        (None, ""),
    ]:
        assert harness.mode_label(recorded) == label, recorded


MODES = ["torch-ddp", "torch-ddp+reduce-overhead", "jax-pmap"]
RAN = {  # the records' `execution` on a GPU
    "torch-ddp": "eager, channels_last, cuDNN",
    "torch-ddp+reduce-overhead": "torch.compile(reduce-overhead), channels_last, cuDNN",
    "jax-pmap": "pmap (one XLA program per device)",
}


def _mode_record(key: str, n: int, ips: float, execution: str, kind: str = "cuda:H200") -> dict:
    """A record as compare keeps it: the trainer's framework, the runner's row (a variant)."""
    record = _record(key.partition("+")[0], n, 0, ips, 0.9)
    record["runner"].update(framework=key, run_id=f"{key}-{n}dev")
    config = harness.variant_settings(key) or {"compile": False, "compile_mode": "default"}
    return record | {"execution": execution, "device_kind": kind, "config": config}


def test_table_shows_every_rows_mode_and_says_when_they_differ(tmp_path: Path) -> None:
    """Each row says its mode, a line under the table says when they differ; torch-ddp in two
    modes is two rows, each with its own speed-up."""
    ips = {"torch-ddp": (46812, 80000), "torch-ddp+reduce-overhead": (81381, 150000),
           "jax-pmap": (79648, 140000)}  # fmt: skip
    records = [_mode_record(k, n, float(ips[k][n - 1]), RAN[k]) for k in MODES for n in (1, 2)]
    table = report.rows(_sweep(MODES, 1), records)
    assert [(r["framework"], r["mode"]) for r in table][::2] == [
        ("torch-ddp", "eager"),
        ("torch-ddp+reduce-overhead", "torch.compile reduce-overhead + CUDA graphs"),
        ("jax-pmap", "XLA (pmap)"),
    ]
    assert table[1]["speedup"] == pytest.approx(80000 / 46812)  # over its own 1-device row
    assert table[3]["speedup"] == pytest.approx(150000 / 81381)
    differ, asked = harness.mode_notes(table)
    assert differ.startswith("Rows differ in execution mode: eager (torch-ddp) vs compiled ")
    assert asked == ""  # every row ran the mode it asked for
    report.write_tables(tmp_path, _sweep(MODES, 1), records)
    assert f"- {differ}" in (tmp_path / "results.md").read_text()
    runs = read_csv(tmp_path / "runs.csv")
    assert [r["framework"] for r in runs][::2] == MODES  # the row, not the trainer's name

    # Without the compiled torch row, the note names the variant that would give one.
    plain = ["torch-ddp", "jax-pmap"]
    two = report.rows(_sweep(plain, 1), [r for r in records if harness.row_key(r) in plain])
    assert "add torch-ddp+reduce-overhead to --frameworks" in harness.mode_notes(two)[0]
    # Rows of one kind of mode: no note.
    alike = MODES[1:]
    compiled = report.rows(_sweep(alike, 1), [r for r in records if harness.row_key(r) in alike])
    assert harness.mode_notes(compiled) == ["", ""]
    # A +reduce-overhead row that ran eager on the CPU shows eager, and a line says so.
    cpu = [_mode_record(k, 1, 700.0, RAN[k].replace("torch.compile(reduce-overhead)", "eager"),
                        "cpu-simulated") for k in alike]  # fmt: skip
    cpu_table = report.rows(_sweep(alike, 1), cpu)
    assert [r["mode"] for r in cpu_table if r["devices"] == 1] == ["eager", "XLA (pmap)"]
    differ, asked = harness.mode_notes(cpu_table)
    assert "torch.compile applies on CUDA only" in differ
    assert asked.startswith("Mode not as asked: torch-ddp+reduce-overhead x1 ran eager")


def test_one_framework_in_two_modes_is_two_rows_of_its_own(no_probe: None, tmp_path: Path) -> None:
    plan = compare.make_plan(["--frameworks", ",".join(MODES), "--gpus", "2", "--preset",
                              "smoke", "--out", str(tmp_path / "out")])  # fmt: skip
    assert [(s.framework, s.devices) for s in plan.runs] == [(k, n) for k in MODES for n in (1, 2)]
    by_id = {s.run_id: s for s in plan.runs}
    plain, variant = by_id["torch-ddp-1dev"], by_id["torch-ddp+reduce-overhead-1dev"]
    assert plain.command[:3] == variant.command[:3] and "--compile" not in plain.command
    assert "--compile --compile-mode reduce-overhead" in " ".join(variant.command)
    assert (variant.cfg.framework, variant.cfg.compile) == ("torch-ddp", True)
    assert variant.output != plain.output and variant.log != plain.log
    # A variant wins over the sweep's own flags: +eager under --compile runs eager.
    args = ["--frameworks", "torch-ddp,torch-ddp+eager", "--gpus", "1", "--preset", "smoke"]
    compiled, eager = compare.make_plan([*args, "--compile", "--out", str(tmp_path / "o2")]).runs
    assert compiled.cfg.compile and "--compile" in compiled.command
    assert not eager.cfg.compile and "--no-compile" in eager.command
