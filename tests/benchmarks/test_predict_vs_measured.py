"""A compare sweep's measured N-device efficiency beside the one benchmarks/analysis/predict.py
predicts from the 1-device run alone, and the report section and plot that show them.
Hand-made records, numbers computed by hand; no training."""

from __future__ import annotations

import pytest

from benchmarks import report
from benchmarks.analysis import predict as P

# The digits preset's ResNet-18: width 0.25, 1x16x16 inputs, 10 classes = 701,178 parameters,
# 2,804,712 bytes of fp32 gradients; XLA's combiner sends them as ONE all-reduce (< 30 MiB).
CONFIG = {"model": "resnet18", "width": 0.25, "dataset": "digits", "image_size": 16}
PARAMS = 701_178
GRAD_BYTES = 4 * PARAMS
# 10 GB/s, no latency: a ring all-reduce of S bytes over 2 ranks = 2(2-1)/2 x S / B
LINK = ("test link", P.Link(10.0, 0.0, "a test link", "stated by the test"), "stated by the test")
COMM_2 = GRAD_BYTES / 10e9 * 1e3  # ms: 0.2804712
GPU = "cuda:Test GPU"
SIM = "cpu-simulated"


def record(fw: str, n: int, ips: float, batch: int, kind: str = GPU, **extra) -> dict:
    """A run record as compare keeps it, with only what the report and the prediction read."""
    return {
        "framework": fw, "devices": n, "status": "ok", "device_kind": kind,
        "global_batch_size": batch, "images_per_sec": ips, "model": "resnet18",
        "params": PARAMS, "config": dict(CONFIG), "execution": "pmap (one XLA program per device)",
        "bn_mode": "local", "test_examples": 10, "test_set_size": 10,
        "runner": {"run_id": f"{fw}-{n}dev", "framework": fw, "seed": 0, "peak_lr": 0.1},
        **extra,
    }  # fmt: skip


def weak_sweep(kind: str = GPU) -> list[dict]:
    # 1 device: 64 images at 2,000 img/s = a 32 ms step; 2 devices: 128 images at 3,600 img/s
    return [record("jax-pmap", 1, 2000.0, 64, kind), record("jax-pmap", 2, 3600.0, 128, kind)]


def test_weak_scaling_on_gpus_by_hand():
    (row,) = P.measured_vs_predicted(weak_sweep(), link=LINK)
    assert (row["framework"], row["devices"], row["scaling"]) == ("jax-pmap", 2, "weak")
    assert row["per_device_batch"] == 64
    assert row["measured_efficiency"] == pytest.approx(3600 / (2 * 2000))  # 0.9
    assert row["measured_step_ms"] == pytest.approx(128 / 3600 * 1e3)
    # own GPUs, overlap 0 (XLA): step(2) = 32 ms + the whole all-reduce
    assert row["predicted_step_ms"] == pytest.approx(32 + COMM_2)
    assert row["predicted_efficiency"] == pytest.approx(32 / (32 + COMM_2))  # 0.99131
    assert row["difference_pp"] == pytest.approx(100 * (0.9 - 32 / (32 + COMM_2)))
    got = row["inputs"]
    assert got["grad_bytes"] == GRAD_BYTES and got["collective_bytes"] == [GRAD_BYTES]
    assert got["link"]["name"] == "test link" and got["link"]["busbw_gbps"] == 10.0
    assert got["overlap"] == 0.0 and got["overlap_source"].startswith("default")
    assert got["compute_factor"] == 1 and got["one_device"]["step_ms"] == pytest.approx(32)
    # Nothing measured at N devices is read: a slow N-device run with a breakdown of its own
    # moves the measured figures only; a faster 1-device run moves the prediction.
    slow = weak_sweep()
    bd = dict(step_ms=900.0, compute_ms=100.0, comm_ms=700.0, exposed_comm_ms=10.0)
    slow[1].update(images_per_sec=500.0, breakdown={**bd, "input_wait_ms": 5.0, "host_gap_ms": 1.0})
    (changed,) = P.measured_vs_predicted(slow, link=LINK)
    assert changed["measured_efficiency"] == pytest.approx(500 / 4000)
    for key in ("predicted_step_ms", "predicted_efficiency", "inputs"):
        assert changed[key] == row[key], key
    faster = weak_sweep()
    faster[0]["images_per_sec"] = 4000.0  # a 16 ms step
    moved = P.measured_vs_predicted(faster, link=LINK)[0]
    assert moved["predicted_efficiency"] == pytest.approx(16 / (16 + COMM_2))


def test_strong_scaling_on_simulated_devices_shares_the_cores():
    records = [record("jax-pmap", 1, 2000.0, 64, SIM), record("jax-pmap", 2, 2200.0, 64, SIM)]
    (row,) = P.measured_vs_predicted(records, link=LINK)
    assert row["scaling"] == "strong" and row["per_device_batch"] == 32
    # half the batch per device, computed at half the speed (2 devices on the 1-device cores)
    assert row["inputs"]["compute_factor"] == 2
    assert row["predicted_step_ms"] == pytest.approx(32 + COMM_2)
    assert row["predicted_efficiency"] == pytest.approx(32 / (2 * (32 + COMM_2)))  # 0.49566
    assert row["measured_efficiency"] == pytest.approx(2200 / 4000)
    # without a link the simulated devices get the host-memory link, labelled an assumption
    (default,) = P.measured_vs_predicted(records)
    assert default["inputs"]["link"]["source"].startswith("ASSUMED")
    assert default["inputs"]["link"]["busbw_gbps"] == P.HOST_LINK.busbw_gbps


def test_a_measured_breakdown_sets_compute_input_wait_and_host():
    # profiled: 16 ms steps of 12 ms compute, 2 ms input wait; the timed step (32 ms) is twice
    # that, so compute 24, input wait 4, host 4 ms. Its comm at 1 device (a collective over one
    # device, as JAX's trace shows) says nothing about overlap at N: the default (0) stays.
    bd = {"step_ms": 16.0, "compute_ms": 12.0, "comm_ms": 0.2, "exposed_comm_ms": 0.0,
          "input_wait_ms": 2.0, "host_gap_ms": 2.0}  # fmt: skip
    one, two = record("jax-pmap", 1, 2000.0, 64, breakdown=bd), record("jax-pmap", 2, 3000.0, 64)
    (row,) = P.measured_vs_predicted([one, two], link=LINK)
    got = [row["inputs"]["one_device"][k] for k in ("compute_ms", "input_wait_ms", "host_ms")]
    assert got == pytest.approx([24.0, 4.0, 4.0])
    assert row["inputs"]["overlap"] == 0 and row["inputs"]["overlap_source"].startswith("default")
    # strong, own GPUs: host 4 + (24 + 4) x 32/64 + the all-reduce
    assert row["predicted_step_ms"] == pytest.approx(4 + 14 + COMM_2)
    assert row["predicted_efficiency"] == pytest.approx(32 / (2 * (18 + COMM_2)))  # 0.87525
    (plain,) = P.measured_vs_predicted([{**one, "breakdown": None}, two], link=LINK)
    assert plain["predicted_efficiency"] == pytest.approx(32 / (2 * (16 + COMM_2)))  # all compute


def test_no_prediction_without_a_pair_or_a_known_model_and_a_note_without_a_step():
    """A breakdown without step_ms: the prediction is made from the step alone, with a note."""
    assert P.measured_vs_predicted([record("jax-pmap", 1, 2000.0, 64)]) == []
    assert P.measured_vs_predicted([record("jax-pmap", 2, 2000.0, 64)]) == []
    failed = weak_sweep()
    failed[0]["status"] = "failed"
    assert P.measured_vs_predicted(failed) == []
    wrong = [{**r, "params": 12345} for r in weak_sweep()]
    (row,) = P.measured_vs_predicted(wrong, link=LINK)
    assert row["predicted_efficiency"] is None and "12,345 parameters" in row["note"]
    assert row["measured_efficiency"] == pytest.approx(0.9)
    records = weak_sweep()
    records[0]["breakdown"] = {"compute_ms": 5.0}
    (row,) = P.measured_vs_predicted(records, link=LINK)
    assert row["predicted_efficiency"] is not None and "without step_ms" in row["note"]
    assert "the whole step is compute" in row["inputs"]["one_device"]["source"]
    lines = P.section(records, report._busy)
    assert any(ln.startswith("- jax-pmap x2: note: breakdown without step_ms") for ln in lines)
    assert not any("no prediction" in ln for ln in lines), lines


def sweep(records: list[dict]) -> report.Sweep:
    planned = {("jax-pmap", 1): 1, ("jax-pmap", 2): 1}
    return report.Sweep("resnet18 on digits", "python -m benchmarks.compare", ["jax-pmap"], [1, 2],
                        planned, expected_kind=GPU, host={"cpu_count": 2})  # fmt: skip


def test_the_report_section_shows_measured_predicted_and_the_inputs(tmp_path):
    records = weak_sweep()
    md = report.markdown(sweep(records), records, [], "")
    section = md.split(f"## {P.SECTION_TITLE}")[1]
    # the default GPU link (ASSUMED pcie4): 2 x 1/2 x 2,804,712 B / 17.5 GB/s + 2 x 3.1 us
    comm = GRAD_BYTES / 17.5e9 * 1e3 + 2 * 3.1e-3
    line = next(ln for ln in section.splitlines() if ln.startswith("| jax-pmap |"))
    cells = [c.strip() for c in line.strip("|").split("|")]
    eff = 32 / (32 + comm)
    want = ["2", "weak", "64 images", f"{128 / 3600 * 1e3:.2f} ms", f"{32 + comm:.2f} ms"]
    assert cells[2:10] == [*want, "90.0%", f"{eff:.1%}", f"{100 * (0.9 - eff):+.1f} pp"]
    assert "PREDICTED" in section and "ASSUMED" in section and "busbw 17.5 GB/s" in section
    assert "2,804,712 bytes of fp32 gradients in 1 collective(s) of 2.67 MiB" in section
    # the plot: measured points and predicted lines, only when there is something to compare
    plots, _ = report.write_plots(tmp_path, sweep(records), records)
    assert "predicted_efficiency.png" in [p.name for p in plots]
    assert "Busy machine (load average" not in section
    records[0]["load_avg"] = {"start": 2.5, "end": 1.0, "cores": 2}  # a busy 1-device run
    section = report.markdown(sweep(records), records, [], "").split(P.SECTION_TITLE)[1]
    assert "Busy machine (load average above the core count) during jax-pmap x1:" in section
    ones = records[:1]
    assert P.SECTION_TITLE not in report.markdown(sweep(ones), ones, [], "")
    plots, _ = report.write_plots(tmp_path / "one", sweep(ones), ones)
    assert "predicted_efficiency.png" not in [p.name for p in plots]


@pytest.mark.parametrize("framework", ["torch-fsdp", "jax-fsdp"])
def test_the_sharded_strategies_are_predicted_from_their_gathers(framework):
    """compare's report on a sweep of a sharded trainer (it once raised: 'does not all-reduce')."""
    records = [record(framework, 1, 2000.0, 64), record(framework, 2, 3600.0, 128)]
    (row,) = P.measured_vs_predicted(records, link=LINK)
    gathers = P.FSDP_GATHERS[framework]  # each a half all-reduce, + the reduce-scatter
    assert row["predicted_comm_ms"] == pytest.approx((gathers + 1) / 2 * COMM_2)
    assert sum(row["inputs"]["collective_bytes"]) == GRAD_BYTES
