"""benchmarks/analysis/predict.py: the ring formula, what N = 1 costs, the shape of the predicted
curves, how each framework cuts its gradients, the overlap bracket, bad input on the command line,
and that the validation against published rows tunes nothing to them. Pure arithmetic: fast, CPU."""

from __future__ import annotations

import json
from dataclasses import fields, replace

import pytest

from benchmarks.analysis import predict as P
from tests.conftest import ROOT

H100 = ROOT / "docs" / "results" / "h100-20261123"
BD = P.Breakdown(step_ms=10.0, batch=512, compute_ms=9.0)  # 1 ms of host time per step


def setup(framework: str, link: str = "pcie5", **kw) -> P.Setup:
    base = dict(gpus_per_node=64, nics_per_node=1, overlap=None)  # one fixed link up to 64
    return P.Setup(framework, "resnet18", "fp32", link, P.PRESETS[link], P.INTER_NODE["ib-ndr"],
                   **{**base, **kw})  # fmt: skip


def test_ring_allreduce_against_hand_computed_values():
    # 1 GB over 4 ranks at 100 GB/s, α 5 us: 2·3·5 us + 2·3/4 · 1e9/1e11 s = 0.03 + 15 ms
    assert P.ring_allreduce_ms(1e9, 4, 100, 5) == pytest.approx(15.03)
    # 800 MB over 2 ranks at 50 GB/s, α 1 us: 2 us + 1 · 16 ms
    assert P.ring_allreduce_ms(8e8, 2, 50, 1) == pytest.approx(16.002)
    # latency only: 8 ranks, 0 bytes: 14 steps of α
    assert P.ring_allreduce_ms(0, 8, 1, 2.5) == pytest.approx(0.035)
    assert P.ring_allreduce_ms(1e9, 1, 100, 5) == 0.0


@pytest.mark.parametrize("link", sorted(P.PRESETS))
@pytest.mark.parametrize("framework", P.FRAMEWORKS)
def test_weak_scaling_efficiency_is_1_at_one_device_and_never_rises_with_n(framework, link):
    """On a fixed link; one device has no communication."""
    rows = P.curve(BD, setup(framework, link), [1, 2, 3, 4, 8, 16, 32, 64], "weak", BD.batch)
    assert rows[0]["comm_ms"] == rows[0]["exposed_comm_ms"] == 0.0
    assert rows[0]["step_ms"] == pytest.approx(BD.step_ms)
    eff = [r["efficiency"] for r in rows]
    assert eff[0] == pytest.approx(1.0) and eff[-1] < 1.0
    assert all(b <= a + 1e-12 for a, b in zip(eff, eff[1:], strict=False)), eff


def test_bucketed_ddp_pays_more_latency_than_one_combined_allreduce():
    grad = [t * 4 for t in P.MODELS["resnet18"].tensors]
    free_bytes = P.Link(1e12, 10.0, "latency only", "test")  # the bandwidth term ~ 0
    n = 8
    ddp = P.allreduce_comm(P.messages("torch-ddp", grad), n, free_bytes)
    one = P.allreduce_comm([sum(grad)], n, free_bytes)
    per_key = P.allreduce_comm(P.messages("mxnet-gluon", grad), n, free_bytes)
    step_alpha = 2 * (n - 1) * 10.0e-3  # ms: one all-reduce's latency term
    assert ddp.count == 3 and one.count == 1 and per_key.count == 62
    assert ddp.total_ms - one.total_ms == pytest.approx(2 * step_alpha, rel=1e-3)
    assert per_key.total_ms > ddp.total_ms > one.total_ms
    assert sum(P.messages("torch-ddp", grad)) == sum(P.messages("jax-pmap", grad)) == sum(grad)


def test_the_models_tensors_and_ddps_buckets_are_the_frameworks():
    torch = pytest.importorskip("torch")
    import torch.distributed as dist

    from frameworks.torch_models import create_model

    for name, build in (("resnet18", P.resnet18_cifar), ("wideresnet", P.wideresnet)):
        for width, channels in ((1.0, 3), (0.25, 1), (0.3, 3)):  # any width, any input channels
            model = create_model(name, channels, 10, width=width)
            got = [p.numel() for p in model.parameters() if p.requires_grad]
            assert build(10, width, channels) == got, (name, width, channels)
            assert width != 1.0 or list(P.MODELS[name].tensors) == got, name
    cases = {m: P.MODELS[m].tensors for m in ("resnet18", "wideresnet", "resnet50")}
    cases["edge"] = (20, 10, 25 * 2**18, 2**18)  # buckets that reach their limits exactly
    for name, sizes in cases.items():
        ready = [torch.empty(n) for n in reversed(sizes)]  # float32, in backward order
        limits = [P.DDP_FIRST_BUCKET, P.DDP_BUCKET_CAP]
        buckets, _ = dist._compute_bucket_assignment_by_size(ready, limits)
        torch_bytes = [sum(ready[i].numel() * 4 for i in b) for b in buckets]
        assert P.ddp_buckets([n * 4 for n in sizes]) == torch_bytes, name
    torchvision = pytest.importorskip("torchvision")
    r50 = [p.numel() for p in torchvision.models.resnet50().parameters()]
    assert list(P.MODELS["resnet50"].tensors) == r50
    # MXNet's symbol, by hand from its resnet.py: torch's ResNet18 with 1000 classes, minus its
    # BN (9,600), plus the pre-activation BN (7,814), plus stage 1's 1x1 shortcut (4,096).
    torch_1000 = sum(P.resnet18_cifar(1000))
    assert sum(P.MODELS["resnet18-mxnet"].tensors) == torch_1000 - 9_600 + 7_814 + 4_096
    assert len(P.MODELS["resnet18-mxnet"].tensors) == 59


@pytest.mark.parametrize("framework", ["torch-ddp", "mxnet-gluon", "jax-pmap"])
def test_full_overlap_and_no_overlap_bracket_the_step(framework):
    """And a measured breakdown sets the overlap, unless --overlap is given."""
    full, default, none = (
        P.curve(BD, setup(framework, overlap=o), [8], "weak", BD.batch)[0] for o in (1.0, None, 0.0)
    )
    assert full["step_ms"] < none["step_ms"] and default["step_ms"] <= none["step_ms"]
    assert full["step_ms"] <= default["step_ms"]
    base = BD.host_ms + BD.compute  # at the 1-device batch
    assert none["step_ms"] == pytest.approx(base + none["comm_ms"])  # nothing hidden
    last = P.step_comm(setup(framework), 8, BD.batch).last_ms
    assert full["step_ms"] >= base + last - 1e-12  # the last collective never hides
    bd = replace(BD, backward_ms=6.0, comm_ms=2.0, exposed_comm_ms=0.5)
    assert P.overlap_for(framework, bd, None) == (0.25, "from a measured breakdown")
    assert P.overlap_for(framework, bd, 0.7)[0] == 0.7


def test_sharded_data_parallel_sends_1_5x_ddp_resharded_and_as_much_without():
    """FSDP per unit (a residual block, the stem and head): an all-gather or reduce-scatter costs
    half an all-reduce of its bytes; two gathers and a reduce-scatter 1.5x (no latency here)."""
    fast = P.Link(35, 0.0, "no latency", "test")
    comm = {fw: P.step_comm(replace(setup(fw), intra_link=fast), 8, 256) for fw in P.FRAMEWORKS}
    ddp = comm["torch-ddp"].total_ms
    assert comm["torch-fsdp"].total_ms == pytest.approx(1.5 * ddp)
    assert comm["torch-fsdp+no-reshard"].total_ms == pytest.approx(ddp)
    assert comm["jax-fsdp"].total_ms == pytest.approx(comm["jax-pmap"].total_ms)
    units = P.fsdp_units("resnet18", P.MODELS["resnet18"].tensors)
    assert len(units) == 9 and sum(units) == sum(P.MODELS["resnet18"].tensors)  # 8 blocks + root
    assert comm["torch-fsdp"].count == 27 and comm["jax-fsdp"].count == 2 * comm["jax-pmap"].count


def test_strong_scaling_shrinks_the_per_device_batch_and_dp_stops_at_one_node():
    rows = P.curve(BD, setup("torch-ddp", "h100-nvlink"), [1, 8], "strong", 512)
    assert [r["per_device_batch"] for r in rows] == [512, 64]
    assert rows[1]["images_per_sec"] > rows[0]["images_per_sec"]
    assert rows[1]["efficiency"] < 1.0  # host time does not shrink with the batch
    rows = P.curve(BD, setup("torch-dp", gpus_per_node=8), [8, 16], "weak", BD.batch)
    assert "efficiency" in rows[0] and "n/a" in rows[1]["note"]  # one process


def test_the_committed_h100_tables_are_read_as_they_say():
    run4, run7 = (P.read_throughput_table(H100 / f"run{run}-throughput-bf16{mode}.json")
                  for run, mode in ((4, ""), (7, "-reduce-overhead")))  # fmt: skip
    got = {(fw, mode): bd for fw, mode, bd in run4}
    assert set(got) == {("torch-ddp", "eager"), ("torch-dp", "eager"), ("jax-pmap", "XLA"),
                        ("jax-shard", "XLA")}  # fmt: skip
    assert got["jax-pmap", "XLA"].step_ms == pytest.approx(512 / 71493.8 * 1e3)
    assert got["jax-pmap", "XLA"].compute == pytest.approx(512 / 75369.7 * 1e3)
    assert {fw for fw, mode, _ in run7 if mode == "CUDA graphs"} == {"torch-ddp", "torch-dp"}
    assert len(run7) == 2


def test_the_command_writes_labelled_predictions_and_the_validation(tmp_path, capsys):
    """Each framework of the list beside the others; the files say PREDICTED; --validate puts
    predicted beside published."""
    args = ["--step-ms", "100", "--batch-per-device", "256", "-N", "8", "--no-plot"]
    assert P.main([*args, "--framework", "torch-ddp,torch-fsdp", "--interconnect", "pcie5"]) == 0
    rows = [ln.split(" | ")[0] for ln in capsys.readouterr().out.splitlines() if "| pcie5 |" in ln]
    assert rows == ["| torch-ddp", "| torch-fsdp"]
    out, table = tmp_path / "p", str(H100 / "run4-throughput-bf16.json")
    args = ["--throughput-table", table, "--frameworks", "jax-pmap", "-N", "1,8,16"]
    assert P.main([*args, "--interconnect", "h100-nvlink,pcie5", "--out", str(out)]) == 0
    md = (out / "predicted-weak.md").read_text()
    assert md.startswith("# Predicted") and "PREDICTED" in md and "460 GB/s" in md
    record = json.loads((out / "predicted-weak.json").read_text())
    assert record["predicted"] is True and len(record["rows"]) == 6
    assert (out / "predicted-weak.png").stat().st_size > 0
    assert P.main(["--validate", "--out", str(tmp_path)]) == 0
    md = (tmp_path / "validation.md").read_text()
    assert "Predicted against published" in md and "7,248" in md and "9,128" in md
    assert json.loads((tmp_path / "validation.json").read_text())["predicted"] is True


@pytest.mark.parametrize("args, fragment", [
    (["--bus-bandwidth", "-5", "--latency-us", "1"], "--bus-bandwidth must be a positive"),
    (["--interconnect", "nvlink9"], "unknown --interconnect nvlink9"),
    (["-N", "0,8"], "GPU counts >= 1"), (["--overlap", "1.5"], "--overlap must be in [0, 1]"),
    (["--compute-ms", "20"], "exceed the step"),
    (["--framework", "torch-ddp,tf-mirrored"], "unknown --framework tf-mirrored"),
    (["--framework", "torch-fsdp", "--model", "resnet50"], "modelled for resnet18 or wide"),
    (None, "give one 1-device measurement"), (["--breakdown", "b.json"], "unknown keys"),
])  # fmt: skip
def test_bad_input_is_one_line_and_exit_2(capsys, args, fragment, tmp_path):
    """(None: no measurement; b.json: a breakdown with a key it does not know.)"""
    (tmp_path / "b.json").write_text(json.dumps({"step_ms": 10, "batch": 512, "gpu_util": 0.9}))
    argv = ["--step-ms", "10", "--batch-per-device", "512", *(args or [])] if args else []
    if args and args[0] == "--breakdown":
        argv = ["--breakdown", str(tmp_path / "b.json")]
    assert P.main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("predict: error:") and fragment in err, err


def test_validation_rows_tune_nothing_to_the_published_rows():
    # A row holds what was published and the hardware: no overlap, bandwidth or efficiency.
    assert {f.name for f in fields(P.Published)} == {
        "name", "framework", "model", "grad_dtype", "batch", "scaling", "link",
        "images_per_sec", "source", "left_out", "why",
    }  # fmt: skip
    rows = P.validate()
    assert {r["name"] for r in rows} == {p.name for p in P.PUBLISHED}
    for r in rows:  # the framework's default overlap, the preset's link, for every row
        assert r["overlap"] == P.OVERLAP[r["framework"]][0], r["name"]
        assert r["link"] in P.PRESETS
    # The prediction reads the 1-GPU figure only: other published values change nothing.
    halve = [{n: v if n == 1 else v / 2 for n, v in p.images_per_sec.items()} for p in P.PUBLISHED]
    moved = [replace(p, images_per_sec=h) for p, h in zip(P.PUBLISHED, halve, strict=True)]
    again = P.validate(moved)
    assert [r["predicted"]["images_per_sec"] for r in again] == [
        r["predicted"]["images_per_sec"] for r in rows
    ]
    for name, link in {**P.PRESETS, **P.INTER_NODE}.items():  # each preset cites a source
        assert link.busbw_gbps > 0 and link.latency_us > 0 and link.source, name
