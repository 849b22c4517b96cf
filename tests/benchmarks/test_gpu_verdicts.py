"""benchmarks/analysis/gpu_verdicts.py, the judge of a GPU check (scripts/gpu_check.sh's
archive), on tests/fixtures/gpu_check/: the H200 run of 2026-11-27 cut down
(tests/make_gpu_verdicts_fixture.py). The fixture made right passes every check, so no FAIL is
one the judge reports whatever the input."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import tarfile
from pathlib import Path
from typing import Any

from benchmarks.analysis.breakdowns import kernel_dtype, kernel_dtype_shares
from tests.conftest import MAIN_PYTHON, ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "gpu_check"
TABLE = "suite/throughput-bf16"
JAX_TRACE = "runs/jax-pmap-1dev.profile/rank0/plugins/profile/2026_11_27_15_45_10/vm.trace.json.gz"
TORCH_RO = "runs/torch-ddp+reduce-overhead-1dev"
FAILED_GPU_TEST = "test_devices_cpu_simulates_the_devices_although_a_gpu_is_visible[torch-ddp]"


def judge(path: Path | str) -> subprocess.CompletedProcess[str]:
    run = [str(MAIN_PYTHON), "-m", "benchmarks.analysis.gpu_verdicts", str(path)]
    return subprocess.run(run, cwd=ROOT, capture_output=True, text=True, timeout=120)


def verdict(out: str, check: str) -> str:
    """The status (PASS, FAIL, -) and figure of the line of `check`."""
    (line,) = [ln for ln in out.splitlines() if ln[6:].startswith(check + " ")]
    return line[:4].strip() + " " + line[6 + len(check) :].strip()


def copy(tmp_path: Path) -> Path:
    """The fixture as gpu_check.sh's OUT_DIR, to change before packing."""
    out = tmp_path / "gA"
    shutil.copytree(FIXTURE, out)
    return out


def pack(out: Path) -> Path:
    archive = out.parent / "gpu.tar.xz"
    with tarfile.open(archive, "w:xz") as tar:
        tar.add(out, arcname=out.name)
    return archive


def edit_json(path: Path, change: Any) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def test_the_fixture_archive_is_judged_as_the_run_it_was_cut_from(tmp_path: Path) -> None:
    proc = judge(pack(copy(tmp_path)))
    assert proc.returncode == 1 and proc.stderr == "", proc.stdout + proc.stderr
    out = proc.stdout
    assert verdict(out, "precision jax-pmap x1").startswith("FAIL bf16 0.00, fp32 1.00")
    assert verdict(out, "real/compute-only jax-pmap x1").startswith("FAIL 0.106")
    assert FAILED_GPU_TEST in verdict(out, "GPU tests: 0 failed")
    assert verdict(out, "main suite: 0 failed") == "PASS 3 tests: 3 passed, 0 failed, 0 skipped"
    ro = verdict(out, "precision torch-ddp+reduce-overhead x1")
    assert ro.startswith("PASS bf16 0.95") and "(record's ran)" in ro  # its record has a `ran`
    assert verdict(out, "real/compute-only torch-ddp+reduce-overhead x1").startswith("PASS 0.947")
    assert verdict(out, "real/compute-only torch-ddp x1").startswith("- eager: host-bound")
    missing = "FAIL not reached: torch-dp+reduce-overhead, torch-dp, jax-shard, jax-shardmap"
    assert verdict(out, "rows reached (throughput-bf16)") == missing  # the call ran out of time
    assert out.splitlines()[-1] == "gpu_verdicts: 7 of 11 checks pass, 4 FAIL"


def test_a_right_run_passes_every_check(tmp_path: Path) -> None:
    """JAX's kernels bf16, its loop at 0.95, no failed GPU test: every check passes, exit 0."""
    out = copy(tmp_path)
    trace = out / TABLE / JAX_TRACE
    events = json.loads(gzip.decompress(trace.read_bytes()))
    for e in events["traceEvents"]:
        if kernel_dtype(str(e.get("name", ""))) == "float32":
            e["name"] = "sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc_kernel"
    trace.write_bytes(gzip.compress(json.dumps(events).encode()))
    assert kernel_dtype_shares(trace, "jax")["bfloat16"] > 0.9

    def fast(table: dict[str, Any]) -> None:
        for row in table["rows"]:
            row["ratio"] = max(row["ratio"], 0.95)
        frameworks = table["command"].index("--frameworks") + 1  # the rows it reached
        table["command"][frameworks] = ",".join(row["framework"] for row in table["rows"])

    edit_json(out / TABLE / "throughput.json", fast)
    xml = out / "suite" / "gpu-tests.xml"
    text = xml.read_text().replace('failures="1"', 'failures="0"')
    xml.write_text(text.replace("<failure ", "<system-out ").replace("</failure>", "</system-out>"))
    proc = judge(pack(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "FAIL" not in proc.stdout and verdict(proc.stdout, "precision jax-pmap x1").startswith(
        "PASS bf16 1.00"
    )
    assert proc.stdout.splitlines()[-1] == "gpu_verdicts: 11 of 11 checks pass"


def test_a_wrong_dtype_or_device_in_a_record_fails(tmp_path: Path) -> None:
    """float32 said to run under bf16; fp32 asked with bf16 kernels in the trace; a CPU record."""
    out = copy(tmp_path)
    edit_json(out / TABLE / f"{TORCH_RO}.json",
              lambda r: r["ran"].update(activation_dtype="float32"))  # fmt: skip
    edit_json(out / TABLE / "runs/torch-ddp-1dev.json",
              lambda r: r["config"].update(precision="fp32"))  # fmt: skip
    edit_json(out / TABLE / "runs/jax-pmap-1dev.json", lambda r: r.update(device_kind="cpu"))
    proc = judge(out)  # a folder is read as the archive is
    assert proc.returncode == 1
    got = verdict(proc.stdout, "precision torch-ddp+reduce-overhead x1")
    assert got == "FAIL record says float32 ran, bfloat16 was asked"
    got = verdict(proc.stdout, "precision torch-ddp x1")
    assert got.startswith("FAIL bf16 0.96") and "want 0 bf16 for float32" in got
    assert verdict(proc.stdout, "saw the GPU jax-pmap x1") == "FAIL cpu, cuda:NVIDIA H200"


def test_what_did_not_run_or_is_missing_is_a_fail_not_a_crash(tmp_path: Path) -> None:
    out = copy(tmp_path)
    (out / "tests.xml").unlink()
    (out / "suite" / "gpu-tests.xml").write_text("<testsuites><testsuite")  # cut short
    (out / TABLE / f"{TORCH_RO}.profile/rank0/vm_rank0.pt.trace.json").unlink()
    proc = judge(pack(out))
    assert proc.returncode == 1 and proc.stderr == "", proc.stdout + proc.stderr
    assert verdict(proc.stdout, "main suite: 0 failed") == (
        "FAIL tests.xml absent: the main suite did not run (--no-tests?)")  # fmt: skip
    assert verdict(proc.stdout, "GPU tests: 0 failed").startswith("FAIL gpu-tests.xml unreadable")
    got = verdict(proc.stdout, "precision torch-ddp+reduce-overhead x1")
    assert got.startswith("FAIL trace vm_rank0.pt.trace.json absent")


def test_an_unreadable_input_is_exit_2_in_one_line(tmp_path: Path) -> None:
    text = tmp_path / "notes.tar.xz"
    text.write_text("not an archive\n")
    empty = tmp_path / "empty"
    (empty / "gA" / "suite").mkdir(parents=True)
    (empty / "gA" / "tests.xml").write_text((FIXTURE / "tests.xml").read_text())
    broken = copy(tmp_path / "b")
    (broken / TABLE / "throughput.json").write_text("{")
    for path, says in (
        (tmp_path / "nope.tar.xz", "no file or folder"),
        (text, "is not a readable .tar.xz archive"),
        (empty, "no throughput.json under gA/"),
        (broken, "throughput.json as JSON"),
    ):
        proc = judge(path)
        assert proc.returncode == 2 and proc.stdout == "", (path, proc.stdout, proc.stderr)
        assert proc.stderr.count("\n") == 1 and says in proc.stderr, (path, proc.stderr)
        assert "Traceback" not in proc.stderr


def test_kernel_names_tell_their_dtype() -> None:
    """Names as the H200's traces hold them (cuDNN, cuBLAS, cutlass, ATen, XLA, Inductor)."""
    for name, dtype in (
        ("sm90_xmma_fprop_implicit_gemm_bf16bf16_bf16f32_f32_nhwckrsc_nhwc", "bfloat16"),
        ("void cutlass__5x_cudnn::Kernel<cutlass_tensorop_bf16_s16816fprop_optimized>", "bfloat16"),
        ("void at::native::batch_norm_transform_input<c10::BFloat16, float, float, 4>", "bfloat16"),
        ("void nhwcAddPaddingKernel<__nv_bfloat16, __nv_bfloat16, float, true>", "bfloat16"),
        ("sm80_xmma_fprop_implicit_gemm_f32f32_f32f32_f32_nchwkcrs_nchw", "float32"),
        ("sm80_xmma_gemm_cf32cf32_f32f32_cf32_nt_n_tilesize64x64x8", "float32"),
        ("void cudnn::detail::dgrad_engine<float, 512, 6, 5, 3, 3, 3, false>(int)", "float32"),
        ("sm80_xmma_gemm_f16f16_f16f32_f32_tn_n_tilesize128x128x32", "float16"),
        ("void at::native::elementwise_kernel<4, CUDAFunctor_add<c10::Half>>", "float16"),
        ("loop_add_fusion_20", ""),
        ("triton_poi_fused__native_batch_norm_legit_functional_relu_5", ""),
    ):
        assert kernel_dtype(name) == dtype, name
