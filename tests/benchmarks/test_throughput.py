"""The performance tools: the throughput benchmark, the compute-only loop, the communication
probe (narrow models, tiny images, a few steps, simulated CPU devices), and the Prefetcher's
end-of-iteration behaviour that jax-pmap's device prefetch relies on."""

from __future__ import annotations

import importlib
import itertools
import json
from pathlib import Path

import pytest

from common.pipeline import Prefetcher
from tests.conftest import MAIN_PYTHON, MXNET_PYTHON, read_json, run_module


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_stays_exhausted_and_stops_after_a_loader_error(depth: int) -> None:
    """A consumer that asks again after the end (jax-pmap's prefetch_to_devices refills with
    islice(batches, 1) after every step) gets StopIteration, not a blocked queue."""
    batches = Prefetcher(iter(range(3)), depth)
    assert list(itertools.islice(batches, 2)) == [0, 1]
    assert list(itertools.islice(batches, 5)) == [2]
    assert list(itertools.islice(batches, 1)) == [] and next(batches, "end") == "end"

    def source():  # noqa: ANN202
        yield 1
        raise ValueError("bad batch")

    batches = Prefetcher(source(), depth)
    assert next(batches) == 1
    with pytest.raises(ValueError, match="bad batch"):
        next(batches)
    assert next(batches, "end") == "end"


# -- the tools ----------------------------------------------------------------------------------

PAIR = ("torch-ddp", "jax-pmap")  # one framework of each family that runs in the main venv
TINY = ("--width", "0.125", "--image-size", "16")
RESNET18_NUMEL = 176_402  # trainable parameters at width 0.125, in every framework's model


def test_throughput_table_has_every_framework_and_device_count(tmp_path: Path) -> None:
    """Weak scaling at 2 devices ("2,": not also 1): a per-device batch of 8, each family's
    compute-only run (its model on one device, as many timed steps: 3 x (2 - 1)) at that batch."""
    out = tmp_path / "tp"
    args = ["--frameworks", ",".join(PAIR), "--gpus", "2,", "--scaling", "weak", *TINY,
            "--batch-size", "8", "--steps", "3", "--epochs", "2", "--warmup", "2",
            "--out", str(out)]  # fmt: skip
    proc = run_module("benchmarks.throughput", *args, python=MAIN_PYTHON, timeout=400)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = read_json(out / "throughput.json")
    rows = result["rows"]
    assert [(r["framework"], r["devices"]) for r in rows] == [(fw, 2) for fw in PAIR]
    assert result["device_kind"] == "cpu-simulated" and not result["interrupted"]
    for r in rows:
        assert r["status"] == "ok" and r["global_batch"] == 16 and r["per_device_batch"] == 8, r
        expected = r["real_images_per_sec"] / (r["devices"] * r["compute_images_per_sec"])
        # 3-step loops timed apart on shared cores: a ratio off by the batch (8x) is far outside
        assert r["ratio"] == pytest.approx(expected) and 0 < r["ratio"] < 4
        assert r["compute_peak_memory_bytes"] > 0 and r["real_peak_rss_bytes"] > 0
        record = read_json(out / r["real"][0]["record"])  # the trainer's own, kept
        assert record["framework"] == r["framework"] and record["devices"] == r["devices"]
        assert record["images_per_sec"] == pytest.approx(r["real_images_per_sec"])
        assert r["real"][0]["steps_per_epoch"] == 3
        compute = r["compute"][0]
        family = r["framework"].split("-")[0]
        assert compute["command"][1:5] == ["-m", "benchmarks.compute_only", "--framework", family]
        assert compute["device_kind"] == "cpu-simulated" and compute["steps"] == 3
        assert compute["images_per_sec"] == pytest.approx(8 / (compute["step_ms"] / 1000))
        assert compute["params"] == RESNET18_NUMEL
    md = (out / "throughput.md").read_text()
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
    assert min(inter["bare_step_ms"] + inter["loop_step_ms"]) > 0
    pairs = sorted(
        b / lp for b, lp in zip(inter["bare_step_ms"], inter["loop_step_ms"], strict=True)
    )
    assert len(pairs) == 2 and inter["ratio"] == pytest.approx(sum(pairs) / 2)  # their median


def test_comm_probe_two_simulated_devices(tmp_path: Path) -> None:
    out, names = tmp_path / "comm", ("torch-ddp", "jax-pmap", "mxnet-gluon")
    args = ["--frameworks", ",".join(names), "--gpus", "2,", "--models", "resnet18", "--width",
            "0.125", "--reps", "3", "--warmup", "1", "--out", str(out)]  # fmt: skip
    proc = run_module("benchmarks.analysis.comm_probe", *args, python=MAIN_PYTHON, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = {(r["framework"], r["devices"]): r for r in read_json(out / "comm.json")["rows"]}
    assert sorted(rows) == sorted((fw, 2) for fw in names)
    for (fw, _), r in rows.items():
        if fw == "mxnet-gluon" and not MXNET_PYTHON.exists():
            assert r["status"] == "skipped" and "setup.sh mxnet" in r["note"]
            continue
        assert r["status"] == "ok" and r["device_kind"] == "cpu-simulated", r
        assert r["bytes"] == 4 * RESNET18_NUMEL  # float32 gradients of ResNet-18
        assert (out / r["log"]).read_text().startswith("$ ")
        assert len(r["times_sec"]) == 3 and min(r["times_sec"]) > 0 and r["median_sec"] > 0
        # nccl-tests' bus bandwidth: 2(n-1)/n x algbw, = algbw at 2 devices
        assert r["algbw_gbps"] > 0 and r["busbw_gbps"] == pytest.approx(r["algbw_gbps"])
    assert "| torch-ddp | dist.all_reduce | 2 |" in (out / "comm.md").read_text()


NO_PYTHON = ["--python", "/nonexistent/bin/python"]


@pytest.mark.parametrize("module, args", [
    ("throughput", NO_PYTHON),
    ("analysis.comm_probe", NO_PYTHON),
    ("throughput", ["--frameworks", "tensorflow"]),
    ("throughput", ["--epochs", "1"]),
    ("throughput", ["--gpus", "2", "--batch-size", "5"]),
    ("throughput", ["--frameworks", "jax-pmap+compile"]),  # JAX has one mode
    ("analysis.comm_probe", ["--frameworks", "torch-ddp+compile"]),  # no variant
    ("analysis.comm_probe", ["--reps", "0"]),
    ("compute_only", ["--framework", "mxnet"]),  # MXNet is not in .venv
    ("compute_only", ["--framework", "torch", "--interleave", "2"]),  # which trainer's loop?
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(
    module: str, args: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = [] if module == "compute_only" else ["--out", str(tmp_path / "out")]
    try:
        code = importlib.import_module(f"benchmarks.{module}").main([*args, *out])
    except SystemExit as exc:  # refused by the flag parser
        code = int(exc.code or 0)
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, (args, err)
    assert err.startswith(module.rpartition(".")[2] + ": error: "), err
    assert args != NO_PYTHON or "--python /nonexistent/bin/python" in err, err
    assert not (tmp_path / "out").exists()


# -- execution modes -----------------------------------------------------------------------

MODES = ("torch-ddp", "torch-ddp+reduce-overhead", "jax-pmap")
RAN = {  # the real loops' records' `execution` on a GPU, and the images/s measured
    "torch-ddp": ("eager, channels_last, cuDNN", 46812.0),
    "torch-ddp+reduce-overhead": ("torch.compile(reduce-overhead), channels_last, cuDNN", 81381.0),
    "jax-pmap": ("pmap (one XLA program per device)", 79648.0),
}


def test_one_framework_in_two_modes_is_two_rows_and_the_table_says_the_modes(
    tmp_path: Path,
) -> None:
    from benchmarks import throughput

    plan = throughput.make_plan(["--frameworks", ",".join(MODES), "--batch-size", "8",
                                 "--out", str(tmp_path / "out")])  # fmt: skip
    cells = throughput.plan_cells(plan)
    assert [c["framework"] for c in cells] == list(MODES)
    # Each row's loops run in its mode (the variant's flags over the command line's), and the
    # variant has its own compute-only measurement (its own ratio).
    plain, variant = (throughput.settings(plan, fw) for fw in MODES[:2])
    assert "--no-compile" in throughput.workload(plain, 8)
    assert "--compile --compile-mode reduce-overhead" in " ".join(throughput.workload(variant, 8))
    assert [throughput.compute_key(fw) for fw in MODES] == ["torch", "torch+reduce-overhead", "jax"]
    for cell in cells:  # as sweep() fills them, from the trainers' records
        ran, ips = RAN[cell["framework"]]
        common = {"status": "ok", "device_kind": "cuda:NVIDIA H200"}
        cell["real"] = [{**common, "images_per_sec": ips, "first_epoch_sec": 1.0, "execution": ran,
                         "load_before": 0.5}]  # fmt: skip
        cell["compute"] = [{**common, "images_per_sec": ips * 1.05, "first_step_sec": 1.0,
                            "memory_source": "torch", "precision_note": ""}]  # fmt: skip
        throughput.summarise(cell)
    assert throughput.HEADERS[:3] == ["framework", "mode", "devices"]
    assert [r[:3] for r in throughput.table(cells)] == [
        ["torch-ddp", "eager", "1"],
        ["torch-ddp+reduce-overhead", "torch.compile reduce-overhead + CUDA graphs", "1"],
        ["jax-pmap", "XLA (pmap)", "1"],
    ]
    notes = throughput.notes(plan, cells)
    assert notes[0].startswith("Rows differ in execution mode: eager (torch-ddp) vs compiled")
    assert f"- {notes[0]}" in throughput.markdown(plan, cells, {})
    del cells[0]  # rows of one kind of mode: no such line
    assert not any(n.startswith("Rows differ") for n in throughput.notes(plan, cells))
