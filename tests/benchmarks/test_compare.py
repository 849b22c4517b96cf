"""The benchmark runner: an end-to-end sweep over real frameworks (smoke preset, simulated CPU
devices) with a failed and a missing one; planning, reporting and bad input in-process."""

from __future__ import annotations

import contextlib
import csv
import io
import os
from pathlib import Path

import pytest

from benchmarks import compare, harness, report
from benchmarks.progress import RichProgress, parse_epoch_line
from common.config import preset
from common.results import RunRecorder
from tests.conftest import (
    FRAMEWORKS,
    TENSORBOARD_MISSING,
    fake_nvidia_smi,
    read_json,
    run_module,
)
from tests.trainers.test_tensorboard import assert_events_match_record

# Two real frameworks of different families, each at 1 and 2 simulated devices.
PAIR = ("torch-ddp", "jax-shard")
SMOKE_TEST_SET = preset("smoke").synthetic_test
# Well below run_module's own timeout: a hung run must be ended (and reported) by the runner.
RUN_TIMEOUT = ("--timeout", "240")
MISSING_PYTHON = {"DPBENCH_PYTHON_MXNET_GLUON": "/nonexistent/.venv-mxnet/bin/python"}


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
    env = {**MISSING_PYTHON, "DPBENCH_FAIL": "torch-dp"}
    proc = run_module("benchmarks.compare", *args, *RUN_TIMEOUT, env=env, timeout=900)
    assert proc.returncode == 1, proc.stdout + proc.stderr

    rows = read_csv(out / "results.csv")
    assert [(r["framework"], r["devices"], r["status"]) for r in rows] == [
        ("torch-dp", "1", "failed"),
        ("torch-dp", "2", "n/a"),
        (PAIR[0], "1", "ok"),
        (PAIR[0], "2", "ok"),
        (PAIR[1], "1", "ok"),
        (PAIR[1], "2", "ok"),
        ("mxnet-gluon", "-", "skipped"),
    ]
    assert "failure injected" in rows[0]["note"]
    assert "bash scripts/setup.sh mxnet" in rows[-1]["note"]
    for r in rows[2:6]:
        assert r["device_kind"] == "cpu-simulated"
        assert int(r["test_examples"]) == int(r["test_set_size"]) == SMOKE_TEST_SET
        assert r["global_batch_size"] == "24"  # strong scaling: the same global batch
        assert float(r["sec_per_epoch"]) > 0 and float(r["first_epoch_sec"]) > 0
        assert r["bn_mode"] == "local"
        speedup = float(r["speedup"])
        assert float(r["efficiency"]) == pytest.approx(speedup / int(r["devices"]))
        if r["devices"] == "1":
            assert speedup == pytest.approx(1.0)
        # one run per cell: its range is the value itself, and no "within noise" mark
        assert r["images_per_sec_min"] == r["images_per_sec"] == r["images_per_sec_max"]
        assert r["sec_per_epoch_min"] == r["sec_per_epoch"] == r["sec_per_epoch_max"]
        assert r["test_accuracy_std"] == "" and r["within_noise_of"] == ""
        assert int(r["cores"]) == os.cpu_count()

    runs = sorted(p.name for p in (out / "runs").glob("*.json"))
    ok_runs = sorted(f"{fw}-{n}dev.json" for fw in PAIR for n in (1, 2))
    assert runs == sorted([*ok_runs, "torch-dp-1dev.json"])
    for name in ok_runs:
        record = read_json(out / "runs" / name)
        assert record["status"] == "ok" and record["test_examples"] == SMOKE_TEST_SET
        assert len(record["epochs"]) == 2
        log = out / record["runner"]["log"]
        assert log.read_text().startswith("$ ") and "epoch 2/2" in log.read_text()
    failed = read_json(out / "runs" / "torch-dp-1dev.json")
    assert failed["status"] == "failed" and failed["runner"]["returncode"] == 1
    assert any("failure injected" in line for line in failed["runner"]["log_tail"])
    for run in read_csv(out / "runs.csv"):  # every record carries the load around its run
        assert float(run["load_avg_start"]) >= 0 and float(run["load_avg_end"]) >= 0
    assert len(read_csv(out / "runs.csv")) == 5

    config = read_json(out / "config.json")
    assert config["status"] == "finished" and config["device_counts"] == [1, 2]
    assert "mxnet-gluon" in config["skipped"]
    commands = [r["command_line"] for r in config["runs"]]
    assert len(commands) == 5 and all("--preset smoke" in c for c in commands)
    assert sum("--gpus 2" in c for c in commands) == 2

    md = (out / "results.md").read_text()
    assert "cpu-simulated" in md and "NOT GPU scaling" in md
    assert "## Failed runs" in md and "failure injected" in md
    table, *sections = md.split("\n## ")  # the results table, then the report's sections
    assert table.count(f"| {PAIR[0]} |") == 2 and "| mxnet-gluon | - | - | skipped |" in table
    predicted = next(s for s in sections if s.startswith("Measured and predicted"))
    assert predicted.count(f"| {PAIR[0]} |") == 1  # its 2-device run against the prediction
    for png in ("throughput.png", "efficiency.png", "accuracy_vs_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert f"]({png})" in md
    assert not list(out.rglob("*.tmp"))  # atomic writes leave no temporaries
    # progress lines while running, then the table, then the failed run's log tail
    assert f"{PAIR[1]} x2: epoch 2/2 test_accuracy=" in proc.stdout
    assert "NOT GPU scaling" in proc.stdout and "mxnet-gluon: skipped" in proc.stdout
    assert "Every cell is one run" in proc.stdout and "use --repeat 3" in md
    assert "failure injected" in proc.stdout
    # TensorBoard (on by default): one event file per run under tensorboard/<run id>/, with the
    # record's values; the viewer's own loader lists every run; the summary prints the command
    tb = out / "tensorboard"
    if TENSORBOARD_MISSING:  # a python without the writer (a GPU machine's own): said by -rs
        assert_report_rebuilds_the_same_files(out)
        pytest.skip(f"the TensorBoard part of this test: {TENSORBOARD_MISSING}")
    for name in ok_runs:
        assert_events_match_record(tb / name.removesuffix(".json"), read_json(out / "runs" / name))
    from tensorboard.backend.event_processing.plugin_event_multiplexer import EventMultiplexer

    viewer = EventMultiplexer().AddRunsFromDirectory(str(tb))
    assert sorted(viewer.Runs()) == sorted(name.removesuffix(".json") for name in ok_runs)
    assert f".venv/bin/tensorboard --logdir {tb}" in proc.stdout
    assert read_json(out / "config.json")["tensorboard"] == str(tb)
    assert_report_rebuilds_the_same_files(out)


REBUILT = ("results.md", "results.csv", "runs.csv")


def assert_report_rebuilds_the_same_files(out: Path) -> None:
    """`python -m benchmarks.report DIR` rebuilds the runner's files byte for byte."""
    written = {name: (out / name).read_bytes() for name in REBUILT}
    for name in [*REBUILT, "throughput.png", "efficiency.png", "accuracy_vs_time.png"]:
        (out / name).unlink()
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert report.main([str(out)]) == 0
    assert {name: (out / name).read_bytes() for name in REBUILT} == written
    assert (out / "throughput.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "5 of 5 planned runs have records" in printed.getvalue()
    assert not (out / harness.LOCK_NAME).exists() and not list(out.rglob("*.tmp"))


@pytest.mark.parametrize(
    "config, says",
    [
        (None, "config.json (No such file or directory); give the directory benchmarks.compare"),
        ("garbage", "config.json is not JSON (Expecting value"),
        ('{"runs": []}', "config.json is not a comparison's config.json (no key 'base_config')"),
    ],
)
def test_report_bad_directory_is_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], config: str | None, says: str
) -> None:
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("report: error: ") and says in err
    assert sorted(p.name for p in tmp_path.iterdir()) == (["config.json"] if config else [])


# -- bad input: one line, exit code 2, nothing started --------------------------------------------


def _fake_nvidia_smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, gpus: int) -> None:
    """This process on a machine with `gpus` H100s, whose every framework sees them."""
    for name, value in fake_nvidia_smi(tmp_path / "bin", gpus).items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    _frameworks_see(monkeypatch, ["NVIDIA H100 80GB HBM3"] * gpus)


def _frameworks_see(monkeypatch: pytest.MonkeyPatch, gpus: list[str]) -> None:
    monkeypatch.setattr(
        harness, "probe_devices", lambda names: {n: harness.Seen(tuple(gpus), "") for n in names}
    )


BAD_INPUT = {
    "unknown framework": (["--frameworks", "torch-ddp,caffe"], "unknown framework 'caffe'"),
    "zero devices": (["--gpus", "0"], "every device count must be >= 1"),
    "batch does not divide": (
        ["--preset", "smoke", "--gpus", "1,2,5"],
        "global batch 24 does not divide over 5 devices",
    ),
    "weak batch exceeds the data": (
        ["--preset", "smoke", "--scaling", "weak", "--gpus", "8"],
        "global batch 192 is larger than the synthetic training set",
    ),
    "dataset not on disk": (
        ["--dataset", "cifar10", "--no-download", "--data-dir", "{tmp}/nodata"],
        "dataset 'cifar10' is not on disk",
    ),
    "output is the runner's": (["--output", "x.json"], "use --out DIR"),
    "unknown flag": (["--epochz", "3"], "unrecognized arguments: --epochz"),
    "unknown variant": (
        ["--frameworks", "torch-ddp,torch-ddp+turbo"],
        "unknown variant 'turbo' in torch-ddp+turbo; choose from eager, compile, reduce-overhead",
    ),
    "a variant of a framework without torch.compile": (
        ["--frameworks", "jax-pmap+compile"],
        "jax-pmap+compile: variants choose torch.compile and apply to torch-dp, torch-ddp, "
        "torch-fsdp only",
    ),
}


def _main(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    try:
        code = compare.main(argv)
    except SystemExit as exc:
        code = int(exc.code or 0)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("case", BAD_INPUT)
def test_bad_input_is_one_line_and_exit_2_before_any_run(
    case: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, message = BAD_INPUT[case]
    out = tmp_path / "out"
    code, stdout, stderr = _main(
        [a.format(tmp=tmp_path) for a in args] + ["--out", str(out)], capsys
    )
    assert code == 2
    assert stderr.startswith("compare: error: ") and stderr.count("\n") == 1, stderr
    assert message in stderr
    assert not out.exists()  # no logs/, no runs/: nothing started


def test_on_a_one_gpu_machine_the_default_fits_and_more_gpus_is_bad_input(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _fake_nvidia_smi(tmp_path, monkeypatch, gpus=1)
    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    plan = compare.make_plan(["--frameworks", "torch-dp", "--out", str(tmp_path / "out")])
    assert plan.counts == [1] and plan.expected_kind == "cuda:NVIDIA H100 80GB HBM3"
    out = tmp_path / "out"
    code, _, stderr = _main(["--gpus", "4", "--out", str(out)], capsys)
    assert code == 2 and "this machine has 1 GPU(s)" in stderr and "use --gpus 1" in stderr
    assert not out.exists()


def test_nothing_available_is_bad_input_naming_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for name, value in MISSING_PYTHON.items():
        monkeypatch.setenv(name, value)
    out = tmp_path / "out"
    code, _, stderr = _main(["--frameworks", "mxnet-gluon", "--out", str(out)], capsys)
    assert code == 2 and "bash scripts/setup.sh mxnet" in stderr and not out.exists()


# -- planning -----------------------------------------------------------------------------------


def test_device_counts() -> None:
    for text, counts in (("1", [1]), ("4", [1, 2, 4]), ("6", [1, 2, 4, 6]), ("3,1,2", [1, 2, 3])):
        assert harness.parse_gpus(text) == counts


def test_default_plan_is_every_framework_at_1_and_2_on_digits(
    no_probe: None, tmp_path: Path
) -> None:
    plan = compare.make_plan(["--out", str(tmp_path / "out")])
    assert plan.frameworks == list(FRAMEWORKS)
    assert plan.counts == [1, 2] and plan.base.preset == "digits" and plan.base.width == 0.25
    assert plan.scaling == "strong" and plan.expected_kind == "cpu-simulated"
    # torch-dp without CUDA: only the 1-device cell, and the table says why
    assert plan.not_applicable == {
        ("torch-dp", 2): "nn.DataParallel needs CUDA; on CPU it runs one replica"
    }
    cells = [(s.framework, s.devices) for s in plan.runs]
    assert cells[:3] == [("torch-dp", 1), ("torch-ddp", 1), ("torch-ddp", 2)]
    mx = next(s for s in plan.runs if s.framework == "mxnet-gluon")
    assert mx.command[0].endswith(".venv-mxnet/bin/python")
    assert mx.command[1:3] == ("-m", "frameworks.mxnet_gluon")
    for spec in plan.runs:  # the trainers' default (--init shared); native only when asked
        assert "--init" not in spec.command and spec.cfg.init == "shared"
    assert not (tmp_path / "out").exists()  # planning writes nothing
    native = compare.make_plan(["--init", "native", "--out", str(tmp_path / "out")])
    assert all("--init native" in " ".join(s.command) for s in native.runs)


def test_weak_and_strong_scaling_batches_lr_and_pass_through(
    no_probe: None, tmp_path: Path
) -> None:
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
        assert line.count("--batch-size") == 1 and line.endswith(f"--output {spec.output}")


def test_a_per_device_preset_defaults_to_weak_scaling(
    no_probe: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(compare, "check_available", lambda cfg: None)  # CIFAR-10 not needed
    args = ["--preset", "cifar10-wrn-nvidia", "--frameworks", "torch-ddp", "--out", str(tmp_path)]
    weak = compare.make_plan(args)
    assert weak.scaling == "weak" and [s.cfg.batch_size for s in weak.runs] == [256, 512]
    assert [s.peak_lr for s in weak.runs] == pytest.approx([0.01, 0.02])  # linear LR scaling
    strong = compare.make_plan([*args, "--batch-size", "128"])  # a global batch: strong
    assert strong.scaling == "strong" and [s.cfg.batch_size for s in strong.runs] == [128, 128]


# -- reporting ----------------------------------------------------------------------------------


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


def test_report_means_stds_speedup_and_files(tmp_path: Path) -> None:
    sweep = report.Sweep(
        title="resnet18 on synthetic",
        command="python -m benchmarks.compare",
        frameworks=["a", "b"],
        counts=[1, 2],
        planned={("a", 1): 2, ("a", 2): 2, ("b", 1): 2},
        host={"cpu_count": 2},
        not_applicable={("b", 2): "needs CUDA"},
        target_accuracy=0.9,
    )
    records = [
        _record("a", 1, 0, 100.0, 0.90),
        _record("a", 1, 1, 120.0, 0.94),
        _record("a", 2, 0, 180.0, 0.92),
        _record("a", 2, 1, 0.0, 0.0, status="failed"),
        _record("b", 1, 0, 50.0, 0.5) | {"test_examples": 8},
    ]
    rows = report.rows(sweep, records)
    a1, a2, b1, b2 = rows
    assert a1["images_per_sec"] == pytest.approx(110.0)
    assert a1["images_per_sec_std"] == pytest.approx(14.142, rel=1e-3)  # sample std of 100, 120
    assert a2["status"] == "ok 1, failed 1" and a2["runs_ok"] == 1
    assert a2["speedup"] == pytest.approx(180 / 110) and a2["efficiency"] == pytest.approx(
        180 / 110 / 2
    )
    assert "RuntimeError: boom" in a2["note"]
    assert b1["reached_target"] == 0 and b1["note"] == "evaluated 8 test images of 10"
    assert b2["status"] == "n/a" and b2["note"] == "needs CUDA"
    headers, body = report.table_cells(sweep, rows)
    assert headers[-2:] == ["s to 0.9", "epochs to 0.9"]
    acc = headers.index("test acc")
    assert body[0][acc] == "0.9200 ± 0.0283" and body[2][-2] == "not reached"

    report.write_tables(tmp_path, sweep, records)
    plots, note = report.write_plots(tmp_path, sweep, records)
    assert [p.name for p in plots] == ["throughput.png", "efficiency.png", "accuracy_vs_time.png"]
    assert note == ""
    assert len(read_csv(tmp_path / "results.csv")) == 4
    assert len(read_csv(tmp_path / "runs.csv")) == 5
    md = (tmp_path / "results.md").read_text()
    assert "## Failed runs" in md and "### a-2dev-seed1: failed" in md and "±" in md
    assert "load average exceeded the core count during a x2 (3.0 on 2 cores)" in md
    printed = io.StringIO()
    report.print_table(sweep, records, stream=printed)
    assert "0.9200 ± 0.0283" in printed.getvalue() and "needs CUDA" in printed.getvalue()


def _repeat_sweep(frameworks: list[str], repeat: int) -> report.Sweep:
    return report.Sweep(
        title="resnet18 on synthetic",
        command="python -m benchmarks.compare --repeat 3",
        frameworks=frameworks,
        counts=[1, 2],
        planned={(fw, n): repeat for fw in frameworks for n in (1, 2)},
        host={"cpu_count": 2},
    )


def test_repeats_give_median_range_noise_marks_and_load_warning(tmp_path: Path) -> None:
    sweep = _repeat_sweep(["a", "b", "c"], repeat=3)
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
    rows = {(r["framework"], r["devices"]): r for r in report.rows(sweep, records)}
    a1, b1, c1 = rows["a", 1], rows["b", 1], rows["c", 1]
    assert (a1["images_per_sec"], a1["images_per_sec_min"], a1["images_per_sec_max"]) == (
        110.0, 100.0, 130.0,
    )  # fmt: skip
    assert (a1["sec_per_epoch"], a1["sec_per_epoch_min"], a1["sec_per_epoch_max"]) == (
        1.8, 1.5, 2.0,
    )  # fmt: skip
    assert a1["test_accuracy"] == pytest.approx(0.92)  # mean
    assert a1["test_accuracy_std"] == pytest.approx(0.02)  # sample std of 0.90, 0.92, 0.94
    assert rows["a", 2]["speedup"] == pytest.approx(190 / 110)  # of the medians
    assert (a1["within_noise_of"], b1["within_noise_of"], c1["within_noise_of"]) == ("b", "a", "")
    assert rows["a", 2]["within_noise_of"] == "c" and rows["c", 2]["within_noise_of"] == "a"
    assert "within_noise_of" not in rows["b", 2]  # one successful run: no range to compare
    assert c1["load_avg_max"] == 3.5 and c1["cores"] == 2

    headers, body = report.table_cells(sweep, list(rows.values()))
    devices = headers.index("devices")
    cells = {(line[0], line[devices]): dict(zip(headers, line)) for line in body}
    assert cells["a", "1"]["images/s"] == "110 (100-130) †"
    assert cells["c", "1"]["images/s"] == "205 (200-210)"
    assert cells["b", "2"]["images/s"] == "195"  # one run: the value alone
    assert cells["a", "1"]["s/epoch"] == "1.8 (1.5-2)"
    assert cells["a", "1"]["test acc"] == "0.9200 ± 0.0200"

    noise = [
        "† images/s within noise at 1 device (min-max ranges over the repeats overlap): a ~ b",
        "† images/s within noise at 2 devices (min-max ranges over the repeats overlap): a ~ c",
    ]
    assert report.spread_notes(report.rows(sweep, records))[:2] == noise
    busy = report.load_note(sweep, report.rows(sweep, records))  # runner's load: 3.0 at x2
    assert busy.startswith("Busy machine: the 1-minute load average exceeded the core count ")
    assert "a x2 (3.0 on 2 cores), b x2 (3.0 on 2 cores), c x1 (3.5 on 2 cores)" in busy
    assert "a x1" not in busy and "b x1" not in busy
    report.write_tables(tmp_path, sweep, records)
    table = read_csv(tmp_path / "results.csv")
    assert (table[0]["images_per_sec"], table[0]["images_per_sec_min"]) == ("110.0", "100.0")
    assert table[0]["within_noise_of"] == "b" and table[4]["load_avg_max"] == "3.5"
    runs = read_csv(tmp_path / "runs.csv")
    assert (runs[7]["load_avg_start"], runs[7]["load_avg_end"], runs[7]["cores"]) == (
        "0.5", "3.5", "2",
    )  # fmt: skip
    md = (tmp_path / "results.md").read_text()
    assert all(f"- {line}" in md for line in noise) and busy in md
    assert "| 110 (100-130) † |" in md
    printed = io.StringIO()
    report.print_table(sweep, records, stream=printed)
    text = printed.getvalue()
    assert "110 (100-130) †" in text and "a ~ b" in text and "c x1 (3.5 on 2 cores)" in text
    assert "one run" in text  # b x2 lost a run: "Some cells are one run"


def test_epoch_line_contract_with_the_recorder(capsys: pytest.CaptureFixture[str]) -> None:
    recorder = RunRecorder(preset("smoke"), devices=1, device_kind="cpu", params=1, is_main=True)
    recorder.end_epoch(0, 2.0, 96, 2.25, 7, 10, 12.5)
    row = parse_epoch_line(capsys.readouterr().out.splitlines()[0])
    assert row is not None
    assert (row["epoch"], row["epochs"], row["test_accuracy"]) == (1, 2, 0.7)
    assert row["images_per_sec"] == pytest.approx(48.0) and row["test_loss"] == 1.25
    assert parse_epoch_line("epoch 1 of 2") is None


def test_live_display_on_a_terminal() -> None:
    from rich.console import Console

    stream = io.StringIO()
    console = Console(file=stream, force_terminal=True, width=140)
    with RichProgress([2, 2], console) as progress:
        progress.start_run("torch-ddp x1", 2, "logs/torch-ddp-1dev.log")
        progress.epoch({"epoch": 1, "epochs": 2, "test_accuracy": 0.5, "sec": 1.0})
        progress.end_run("ok in 3.0s")
    text = stream.getvalue()
    assert "[1/2] torch-ddp x1: ok in 3.0s" in text and "test_accuracy=0.5000" in text


def test_epoch1_loss_and_the_shared_start_are_reported() -> None:
    """Epoch 1's training loss per cell, and whether every run of a seed had one start."""
    sweep = report.Sweep(
        title="t", command="c", frameworks=["a", "b"], counts=[1], planned={}, host={}
    )
    records = []
    for fw, loss in (("a", 2.30), ("b", 2.31)):
        r = _record(fw, 1, 0, 100.0, 0.9)
        r["epochs"][0]["train_loss"] = loss
        r["init"] = {"mode": "shared", "sha256": "d0" * 32}
        r["config"] = {"seed": 0}
        records.append(r)
    table = report.rows(sweep, records)
    assert [row["epoch1_train_loss"] for row in table] == [2.30, 2.31]
    headers, body = report.table_cells(sweep, table)
    assert [line[headers.index("epoch-1 loss")] for line in body] == ["2.3000", "2.3100"]
    assert "(yes: 1 seed(s))" in report.start_note(records)
    records[1]["init"]["sha256"] = "e1" * 32  # another start for the same seed: said so
    assert "(NO: 1 seed(s))" in report.start_note(records)
    records[1]["init"] = {"mode": "native", "sha256": None}
    assert "not one shared start" in report.start_note(records)


def test_state_and_collective_bytes_are_shown_and_an_older_record_gets_a_dash() -> None:
    sweep = _repeat_sweep(["a", "b"], repeat=1)
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
    sweep = _repeat_sweep(["a", "b"], repeat=1)
    warm = {**_record("a", 1, 0, 50.0, 0.9, sec=3.9), "timed_epochs": 0}
    rows = report.rows(sweep, [warm, {**_record("b", 1, 0, 100.0, 0.9), "timed_epochs": 3}])
    headers, body = report.table_cells(sweep, rows)
    devices = headers.index("devices")
    cells = {line[0]: dict(zip(headers, line)) for line in body if line[devices] == "1"}
    assert cells["a"]["s/epoch"] == "3.9 ‡" and cells["a"]["images/s"] == "50 ‡"
    assert "‡" not in cells["b"]["s/epoch"] + cells["b"]["images/s"]
    notes = report.spread_notes(rows)
    assert any(n.startswith("‡ no timed epoch in a run of a x1 ") for n in notes), notes


# -- execution modes -----------------------------------------------------------------------


def test_mode_label_names_what_each_trainer_records() -> None:
    """harness.mode_label's words for every `execution` the trainers write."""
    from frameworks.torch_support import device_plan, execution

    def torch_run(compiled: bool, **kw: object) -> str:
        return execution(device_plan(preset("smoke", **kw), "cuda"), compiled=compiled)

    assert harness.mode_label(torch_run(False)) == "eager"
    assert harness.mode_label(torch_run(True, compile=True)) == "torch.compile"
    ro = torch_run(True, compile=True, compile_mode="reduce-overhead")
    assert harness.mode_label(ro) == "torch.compile reduce-overhead + CUDA graphs"
    nocg = torch_run(True, compile=True, compile_mode="max-autotune-no-cudagraphs")
    assert harness.mode_label(nocg) == "torch.compile max-autotune-no-cudagraphs"
    # --compile on the CPU: the trainer runs eager, and its record says so
    assert harness.mode_label(torch_run(False, compile=True)) == "eager"
    assert harness.mode_label("pmap (one XLA program per device); XLA:CPU (its own code)") == (
        "XLA (pmap)"
    )
    assert harness.mode_label("jit (XLA SPMD over the mesh)") == "XLA (jit)"
    assert harness.mode_label("hybridized (static_alloc, static_shape)") == (
        "hybridized (static alloc)"
    )
    assert harness.mode_label(None) == ""


GPU = "cuda:NVIDIA H200"
MODES = ["torch-ddp", "torch-ddp+reduce-overhead", "jax-pmap"]
RAN = {  # the records' `execution` on a GPU
    "torch-ddp": "eager, channels_last, cuDNN",
    "torch-ddp+reduce-overhead": "torch.compile(reduce-overhead), channels_last, cuDNN",
    "jax-pmap": "pmap (one XLA program per device)",
}


def _mode_record(key: str, n: int, ips: float, execution: str, kind: str = GPU) -> dict:
    """A record as compare keeps it: the trainer's framework, the runner's row (a variant)."""
    record = _record(key.partition("+")[0], n, 0, ips, 0.9)
    record["runner"].update(framework=key, run_id=f"{key}-{n}dev")
    config = harness.variant_settings(key) or {"compile": False, "compile_mode": "default"}
    return record | {"execution": execution, "device_kind": kind, "config": config}


def _mode_sweep(keys: list[str]) -> report.Sweep:
    return report.Sweep(
        title="resnet18 on digits",
        command="python -m benchmarks.compare",
        frameworks=keys,
        counts=[1, 2],
        planned={(k, n): 1 for k in keys for n in (1, 2)},
        host={"cpu_count": 16},
    )


def test_table_shows_every_rows_mode_and_says_when_they_differ(tmp_path: Path) -> None:
    """Each row says its mode, a line under the table says when they differ; torch-ddp in two
    modes is two rows, each with its own speed-up."""
    ips = {"torch-ddp": (46812, 80000), "torch-ddp+reduce-overhead": (81381, 150000),
           "jax-pmap": (79648, 140000)}  # fmt: skip
    records = [
        _mode_record(key, n, float(ips[key][n - 1]), RAN[key]) for key in MODES for n in (1, 2)
    ]
    sweep = _mode_sweep(MODES)
    table = report.rows(sweep, records)
    assert [(r["framework"], r["devices"], r["mode"]) for r in table] == [
        ("torch-ddp", 1, "eager"),
        ("torch-ddp", 2, "eager"),
        ("torch-ddp+reduce-overhead", 1, "torch.compile reduce-overhead + CUDA graphs"),
        ("torch-ddp+reduce-overhead", 2, "torch.compile reduce-overhead + CUDA graphs"),
        ("jax-pmap", 1, "XLA (pmap)"),
        ("jax-pmap", 2, "XLA (pmap)"),
    ]
    assert table[1]["speedup"] == pytest.approx(80000 / 46812)  # over its own 1-device row
    assert table[3]["speedup"] == pytest.approx(150000 / 81381)
    headers, body = report.table_cells(sweep, table)
    assert headers[:3] == ["framework", "mode", "devices"]
    note = (
        "Rows differ in execution mode: eager (torch-ddp) vs compiled "
        "(torch-ddp+reduce-overhead, jax-pmap); "
    )
    lines = harness.mode_notes(table)
    assert lines[0].startswith(note) and "compiled against compiled" in lines[0], lines
    assert lines[1] == ""  # every row ran the mode it asked for

    report.write_tables(tmp_path, sweep, records)
    md = (tmp_path / "results.md").read_text()
    table_end = md.index("| jax-pmap | XLA (pmap) | 2 |")
    assert md[table_end:].split("\n")[2].startswith(f"- {note}")  # the line under the table
    assert "| torch-ddp+reduce-overhead | torch.compile reduce-overhead + CUDA graphs | 1 |" in md
    assert [r["mode"] for r in read_csv(tmp_path / "results.csv")][::2] == [
        "eager", "torch.compile reduce-overhead + CUDA graphs", "XLA (pmap)",
    ]  # fmt: skip
    runs = read_csv(tmp_path / "runs.csv")
    assert [r["framework"] for r in runs][::2] == MODES  # the row, not the trainer's name
    printed = io.StringIO()
    report.print_table(sweep, records, stream=printed)
    assert "torch.compile reduce-overhead + CUDA graphs" in printed.getvalue()
    assert "Rows differ in execution mode" in printed.getvalue()

    # Without the compiled torch row, the note names the variant that would give one.
    plain = ["torch-ddp", "jax-pmap"]
    two = report.rows(_mode_sweep(plain), [r for r in records if harness.row_key(r) in plain])
    assert "add torch-ddp+reduce-overhead to --frameworks" in harness.mode_notes(two)[0]
    # Rows of one kind of mode: no note.
    alike = ["torch-ddp+reduce-overhead", "jax-pmap"]
    compiled = report.rows(_mode_sweep(alike), [r for r in records if harness.row_key(r) in alike])
    assert harness.mode_notes(compiled) == ["", ""]


def test_the_mode_shown_is_what_ran_not_what_was_asked() -> None:
    """A +reduce-overhead row that ran eager on the CPU shows eager, and a line says so."""
    cpu = "cpu-simulated"
    keys = ["torch-ddp+reduce-overhead", "jax-pmap"]
    records = [
        _mode_record(keys[0], 1, 700.0, "eager, channels_last, oneDNN", cpu),
        _mode_record(keys[1], 1, 1100.0, "pmap (one XLA program per device); XLA:CPU", cpu),
    ]
    table = report.rows(_mode_sweep(keys), records)
    assert [r["mode"] for r in table if r["devices"] == 1] == ["eager", "XLA (pmap)"]
    differ, asked = harness.mode_notes(table)
    assert differ.startswith(
        "Rows differ in execution mode: eager (torch-ddp+reduce-overhead) vs compiled (jax-pmap)"
    )
    assert "torch.compile applies on CUDA only" in differ
    assert asked.startswith(
        "Mode not as asked: torch-ddp+reduce-overhead x1 ran eager, not torch.compile "
        "reduce-overhead + CUDA graphs"
    )


def test_one_framework_in_two_modes_is_two_rows_of_its_own(no_probe: None, tmp_path: Path) -> None:
    keys = ",".join(MODES)
    plan = compare.make_plan(["--frameworks", keys, "--gpus", "2", "--preset", "smoke",
                              "--out", str(tmp_path / "out")])  # fmt: skip
    assert plan.frameworks == MODES
    assert [(s.framework, s.devices) for s in plan.runs] == [(k, n) for k in MODES for n in (1, 2)]
    by_id = {s.run_id: s for s in plan.runs}
    plain, variant = by_id["torch-ddp-1dev"], by_id["torch-ddp+reduce-overhead-1dev"]
    assert plain.command[:3] == variant.command[:3]  # the same interpreter and module
    assert "--compile" not in plain.command
    assert "--compile --compile-mode reduce-overhead" in " ".join(variant.command)
    assert (variant.cfg.framework, variant.cfg.compile, variant.cfg.compile_mode) == (
        "torch-ddp", True, "reduce-overhead",
    )  # fmt: skip
    assert variant.output.name == "torch-ddp+reduce-overhead-1dev.json" != plain.output.name
    assert variant.log != plain.log
    sweep = compare.sweep_of(plan)
    assert sweep.frameworks == MODES and sweep.planned[("torch-ddp+reduce-overhead", 2)] == 1
    # A variant wins over the sweep's own flags: +eager under --compile runs eager.
    args = ["--frameworks", "torch-ddp,torch-ddp+eager", "--gpus", "1", "--preset", "smoke"]
    mixed = compare.make_plan([*args, "--compile", "--out", str(tmp_path / "o2")])
    compiled, eager = mixed.runs
    assert compiled.cfg.compile and "--compile" in compiled.command
    assert not eager.cfg.compile and "--no-compile" in eager.command
    assert "--compile" not in eager.command


def test_compiled_data_parallel_on_several_gpus_is_refused_before_any_run(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """On CUDA torch-dp runs every count, but its compile variant at 2+ GPUs is n/a (compile
    cannot trace nn.DataParallel's replicas), and alone it is bad input."""
    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    monkeypatch.setattr(harness, "detect_gpus", lambda: ["NVIDIA H100"] * 2)
    monkeypatch.delenv("DPBENCH_DEVICES")  # the test session's pin to the CPU
    _frameworks_see(monkeypatch, ["NVIDIA H100"] * 2)
    plan = compare.make_plan(["--frameworks", "torch-dp,torch-dp+reduce-overhead", "--out",
                              str(tmp_path / "out")])  # fmt: skip
    assert [(s.framework, s.devices) for s in plan.runs] == [
        ("torch-dp", 1), ("torch-dp", 2), ("torch-dp+reduce-overhead", 1),
    ]  # fmt: skip
    assert plan.expected_kind == "cuda:NVIDIA H100"
    why = plan.not_applicable[("torch-dp+reduce-overhead", 2)]
    assert "cannot trace nn.DataParallel" in why and "torch-ddp+reduce-overhead" in why
    out = tmp_path / "alone"
    code, _, stderr = _main(["--frameworks", "torch-dp+compile", "--gpus", "2,", "--out",
                             str(out)], capsys)  # fmt: skip
    assert code == 2 and stderr.count("\n") == 1 and "cannot trace nn.DataParallel" in stderr
    assert not out.exists()
