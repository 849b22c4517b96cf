"""The performance tools: the throughput benchmark, the compute-only loop, the communication
probe (narrow models, tiny images, a few steps, simulated CPU devices), and the Prefetcher's
end-of-iteration behaviour that jax-pmap's device prefetch relies on."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from common.pipeline import Prefetcher
from tests.conftest import MAIN_PYTHON, MXNET_PYTHON, read_json, run_module


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_stays_exhausted(depth: int) -> None:
    # A consumer that asks again after the end (jax-pmap's prefetch_to_devices refills with
    # islice(batches, 1) after every step) must get StopIteration, not block on the queue.
    batches = Prefetcher(iter(range(3)), depth)
    assert list(itertools.islice(batches, 2)) == [0, 1]
    assert list(itertools.islice(batches, 5)) == [2]
    assert list(itertools.islice(batches, 1)) == []
    assert next(batches, "end") == "end"


def test_prefetcher_stops_after_a_loader_error() -> None:
    def source():  # noqa: ANN202
        yield 1
        raise ValueError("bad batch")

    batches = Prefetcher(source(), 2)
    assert next(batches) == 1
    with pytest.raises(ValueError, match="bad batch"):
        next(batches)
    assert next(batches, "end") == "end"


# -- the tools ----------------------------------------------------------------------------------

PAIR = ("torch-ddp", "jax-pmap")  # one framework of each family that runs in the main venv
TINY = ("--width", "0.125", "--image-size", "16")


def test_throughput_table_has_every_framework_and_device_count(tmp_path: Path) -> None:
    out = tmp_path / "tp"
    # Weak scaling at 2 devices ("2,": not also 1): a per-device batch of 8, each family's
    # compute-only run at that batch.
    args = ["--frameworks", ",".join(PAIR), "--gpus", "2,", "--scaling", "weak", *TINY,
            "--batch-size", "8", "--steps", "3", "--epochs", "2", "--warmup", "2",
            "--out", str(out)]  # fmt: skip
    proc = run_module("benchmarks.throughput", *args, python=MAIN_PYTHON, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_json(out / "throughput.json")
    rows = result["rows"]
    assert [(r["framework"], r["devices"]) for r in rows] == [(fw, 2) for fw in PAIR]
    assert result["device_kind"] == "cpu-simulated" and "cpu-simulated" in result["title"]
    assert not result["interrupted"]
    for r in rows:
        assert r["status"] == "ok", r
        assert r["global_batch"] == 8 * r["devices"] and r["per_device_batch"] == 8
        assert r["real_images_per_sec"] > 0 and r["compute_images_per_sec"] > 0
        expected = r["real_images_per_sec"] / (r["devices"] * r["compute_images_per_sec"])
        assert r["ratio"] == pytest.approx(expected)
        # loops of 3 steps timed apart on shared cores: a ratio off by the per-device batch
        # (8x) would still be far outside
        assert 0 < r["ratio"] < 4
        assert r["first_epoch_sec"] > 0 and r["first_step_sec"] > 0
        assert r["compute_peak_memory_bytes"] > 0 and r["real_peak_rss_bytes"] > 0
        assert r["memory_source"].startswith("peak RSS")
        # The real loop ran the trainer module itself, whose record is kept.
        record = read_json(out / r["real"][0]["record"])
        assert record["framework"] == r["framework"] and record["devices"] == r["devices"]
        assert record["images_per_sec"] == pytest.approx(r["real_images_per_sec"])
        assert r["real"][0]["steps_per_epoch"] == 3
        # The compute-only loop (`python -m benchmarks.compute_only --framework torch|jax`):
        # the family's model on one device, as many timed steps as the real loop (3 x (2 - 1)).
        compute = r["compute"][0]
        assert compute["family"] == r["framework"].split("-")[0]
        assert compute["command"][1:5] == ["-m", "benchmarks.compute_only", "--framework",
                                           compute["family"]]  # fmt: skip
        assert compute["device_kind"] == "cpu-simulated" and compute["steps"] == 3
        assert compute["images_per_sec"] == pytest.approx(8 / (compute["step_ms"] / 1000))
        assert compute["params"] == RESNET18_NUMEL
    md = (out / "throughput.md").read_text()
    assert "cpu-simulated" in md.splitlines()[0]
    assert md.count("| torch-ddp |") == 1 and md.count("| jax-pmap |") == 1


def test_compute_only_interleaves_the_trainer_loop() -> None:
    args = ["--framework", "torch-ddp", *TINY, "--batch-size", "8", "--steps", "2",
            "--warmup", "1", "--interleave", "2"]  # fmt: skip
    proc = run_module("benchmarks.compute_only", *args, python=MAIN_PYTHON, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["family"] == "torch" and result["images_per_sec"] > 0
    inter = result["interleaved"]
    assert inter["rounds"] == 2 and inter["steps_per_round"] == 2
    assert len(inter["bare_step_ms"]) == len(inter["loop_step_ms"]) == 2
    assert min(inter["bare_step_ms"] + inter["loop_step_ms"]) > 0
    pairs = sorted(b / lp for b, lp in zip(inter["bare_step_ms"], inter["loop_step_ms"]))
    assert inter["ratio"] == pytest.approx(sum(pairs) / 2)  # the median of two rounds


# Trainable parameters of ResNet-18 (CIFAR-10) at width 0.125, as every framework's model has them.
RESNET18_NUMEL = 176_402


def test_comm_probe_two_simulated_devices(tmp_path: Path) -> None:
    out = tmp_path / "comm"
    # "2," is a one-element list: 2 devices only (a bare 2 would also run 1 device).
    args = ["--frameworks", "torch-ddp,jax-pmap,mxnet-gluon", "--gpus", "2,", "--models",
            "resnet18", "--width", "0.125", "--reps", "3", "--warmup", "1",
            "--out", str(out)]  # fmt: skip
    proc = run_module("benchmarks.analysis.comm_probe", *args, python=MAIN_PYTHON, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_json(out / "comm.json")
    assert "cpu-simulated" in result["title"]
    rows = {(r["framework"], r["devices"]): r for r in result["rows"]}
    assert set(rows) == {(fw, 2) for fw in ("torch-ddp", "jax-pmap", "mxnet-gluon")}
    mxnet_here = MXNET_PYTHON.exists()
    for (fw, _), r in rows.items():
        if fw == "mxnet-gluon" and not mxnet_here:
            assert r["status"] == "skipped" and "setup.sh mxnet" in r["note"]
            continue
        assert r["status"] == "ok", r
        assert r["bytes"] == 4 * RESNET18_NUMEL  # float32 gradients of ResNet-18
        assert (out / r["log"]).read_text().startswith("$ ")
        assert len(r["times_sec"]) == 3 and min(r["times_sec"]) > 0
        assert r["median_sec"] > 0 and r["algbw_gbps"] > 0
        assert r["device_kind"] == "cpu-simulated"
        # nccl-tests' bus bandwidth: 2(n-1)/n x algbw, = algbw at 2 devices
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])
    assert "| torch-ddp | dist.all_reduce | 2 |" in (out / "comm.md").read_text()


def tool_main(module: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`python -m benchmarks.<module> argv` in this process: (exit code, stderr)."""
    import importlib

    try:
        code = importlib.import_module(f"benchmarks.{module}").main(argv)
    except SystemExit as exc:  # refused by the flag parser
        code = int(exc.code or 0)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("module", ["throughput", "analysis.comm_probe"])
def test_missing_interpreter_is_one_line_and_exit_2(
    module: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--python", "/nonexistent/bin/python", "--out", str(tmp_path)]
    code, err = tool_main(module, argv, capsys)
    assert code == 2 and err.count("\n") == 1 and "--python /nonexistent/bin/python" in err, err
    assert not (tmp_path / "throughput.json").exists() and not (tmp_path / "comm.json").exists()


@pytest.mark.parametrize(
    "module, args",
    [
        ("throughput", ["--frameworks", "tensorflow"]),
        ("throughput", ["--epochs", "1"]),
        ("throughput", ["--gpus", "2", "--batch-size", "5"]),
        ("throughput", ["--frameworks", "jax-pmap+compile"]),  # JAX has one mode
        ("analysis.comm_probe", ["--frameworks", "torch-ddp+compile"]),  # no variant
        ("analysis.comm_probe", ["--reps", "0"]),
        ("compute_only", ["--framework", "mxnet"]),  # MXNet is not in .venv
        ("compute_only", ["--framework", "torch", "--interleave", "2"]),  # which trainer's loop?
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    module: str, args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = [] if module == "compute_only" else ["--out", str(tmp_path / "out")]
    code, err = tool_main(module, [*args, *out], capsys)
    assert code == 2 and err.count("\n") == 1, (args, err)
    assert err.startswith(module.rpartition(".")[2] + ": error: "), err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "module",
    [
        "throughput",
        "analysis.comm_probe",
        "compute_only",
        "compare",
        "tutorial_loops",
        "parity",
        "analysis.ab",
    ],  # fmt: skip
)
def test_every_flag_has_a_help_text(module: str) -> None:
    import argparse
    import importlib

    tool = importlib.import_module(f"benchmarks.{module}")
    parser = tool.runner_parser() if module == "compare" else tool.build_parser()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, argparse._HelpAction):
            continue
        assert action.help and action.help.strip(), (module, action.option_strings)


# -- execution modes -----------------------------------------------------------------------

MODES = ("torch-ddp", "torch-ddp+reduce-overhead", "jax-pmap")
RAN = {  # the real loops' records' `execution` on a GPU
    "torch-ddp": "eager, channels_last, cuDNN",
    "torch-ddp+reduce-overhead": "torch.compile(reduce-overhead), channels_last, cuDNN",
    "jax-pmap": "pmap (one XLA program per device)",
}


def _measured(plan, cells: list[dict], ips: dict[str, float]) -> None:  # noqa: ANN001
    """Fill planned cells as sweep() would, with the facts the trainers' records give."""
    from benchmarks import throughput

    for cell in cells:
        fw = cell["framework"]
        kind = "cuda:NVIDIA H200"
        cell["real"] = [{"status": "ok", "images_per_sec": ips[fw], "first_epoch_sec": 1.0,
                         "device_kind": kind, "execution": RAN[fw],
                         "load_before": 0.5}]  # fmt: skip
        cell["compute"] = [{"status": "ok", "images_per_sec": ips[fw] * 1.05,
                            "first_step_sec": 1.0, "device_kind": kind,
                            "memory_source": "torch", "precision_note": ""}]  # fmt: skip
        throughput.summarise(cell)


def test_one_framework_in_two_modes_is_two_rows_and_the_table_says_the_modes(
    tmp_path: Path,
) -> None:
    from benchmarks import throughput

    plan = throughput.make_plan(["--frameworks", ",".join(MODES), "--batch-size", "8",
                                 "--out", str(tmp_path / "out")])  # fmt: skip
    assert plan.frameworks == list(MODES)
    cells = throughput.plan_cells(plan)
    assert [c["framework"] for c in cells] == list(MODES)
    # Each row's loops run in its mode: the variant's flags over the command line's.
    plain, variant = (throughput.settings(plan, fw) for fw in MODES[:2])
    assert "--no-compile" in throughput.workload(plain, 8)
    flags = throughput.workload(variant, 8)
    assert flags[flags.index("--compile") : flags.index("--compile") + 3] == [
        "--compile", "--compile-mode", "reduce-overhead",
    ]  # fmt: skip
    # ... and the variant has its own compute-only measurement (its own ratio).
    assert [throughput.compute_key(fw) for fw in MODES] == [
        "torch", "torch+reduce-overhead", "jax",
    ]  # fmt: skip

    _measured(plan, cells, {"torch-ddp": 46812.0, "torch-ddp+reduce-overhead": 81381.0,
                            "jax-pmap": 79648.0})  # fmt: skip
    assert throughput.HEADERS[:3] == ["framework", "mode", "devices"]
    rows = throughput.table(cells)
    assert [r[:3] for r in rows] == [
        ["torch-ddp", "eager", "1"],
        ["torch-ddp+reduce-overhead", "torch.compile reduce-overhead + CUDA graphs", "1"],
        ["jax-pmap", "XLA (pmap)", "1"],
    ]
    notes = throughput.notes(plan, cells)
    assert notes[0].startswith("Rows differ in execution mode: eager (torch-ddp) vs compiled")
    md = throughput.markdown(plan, cells, {})
    assert md.split("| jax-pmap | XLA (pmap) | 1 |")[1].split("\n")[2] == f"- {notes[0]}"
    # Rows of one kind of mode: no such line.
    del cells[0]
    assert not any(n.startswith("Rows differ") for n in throughput.notes(plan, cells))
