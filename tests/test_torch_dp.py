"""torch-dp (nn.DataParallel) on a CPU-only machine: it claims one device and says so once, it
follows torch-ddp's arithmetic, and it resumes to the uninterrupted run's weights."""

from __future__ import annotations

import torch

from tests.conftest import MAIN_PYTHON, read_json, run_module

SMALL = ("--preset", "smoke", "--prefetch", "1")


def run(module: str, *args: str, env: dict[str, str] | None = None):
    return run_module(module, *SMALL, *args, python=MAIN_PYTHON, env=env, timeout=300)


def ok(proc) -> None:
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]


def test_cpu_run_records_one_device_and_warns_once(tmp_path):
    out = tmp_path / "dp.json"
    proc = run(
        "frameworks.torch_dp",
        "--gpus",
        "2",
        "--epochs",
        "1",
        "--max-steps-per-epoch",
        "2",
        "--output",
        str(out),
    )
    ok(proc)
    rec = read_json(out)
    assert rec["devices"] == 1 and rec["device_kind"] == "cpu"
    assert rec["framework"] == "torch-dp" and rec["test_examples"] == 10
    warnings = [ln for ln in proc.stderr.splitlines() if "DataParallel" in ln]
    assert len(warnings) == 1, proc.stderr
    assert "used 1 device" in warnings[0] and "--gpus 2" in warnings[0]
    assert "DataParallel" not in proc.stdout


def test_step_equals_torch_ddp_single_process_step(tmp_path):
    step = ("--epochs", "1", "--max-steps-per-epoch", "1", "--gpus", "1")
    ok(run("frameworks.torch_dp", *step, "--checkpoint-dir", str(tmp_path)))
    ok(run("frameworks.torch_ddp", *step, "--checkpoint-dir", str(tmp_path)))
    dp = torch.load(tmp_path / "torch-dp.pt", weights_only=True)["model"]
    ddp = torch.load(tmp_path / "torch-ddp.pt", weights_only=True)["model"]
    assert set(dp) == set(ddp)
    for key in dp:
        torch.testing.assert_close(dp[key], ddp[key], rtol=0, atol=1e-6, msg=key)


def test_kill_resume_ends_with_the_uninterrupted_weights(tmp_path):
    args = ("--model", "wideresnet", "--epochs", "2", "--max-steps-per-epoch", "2")
    ok(run("frameworks.torch_dp", *args, "--checkpoint-dir", str(tmp_path / "full")))
    killed = run(
        "frameworks.torch_dp",
        *args,
        "--checkpoint-dir",
        str(tmp_path / "cut"),
        env={"DPBENCH_FAIL": "torch-dp@1"},
    )
    assert killed.returncode == 17  # os._exit in the one process: nothing else ran
    ok(run("frameworks.torch_dp", *args, "--checkpoint-dir", str(tmp_path / "cut"), "--resume"))
    full = torch.load(tmp_path / "full" / "torch-dp.pt", weights_only=True)
    cut = torch.load(tmp_path / "cut" / "torch-dp.pt", weights_only=True)
    assert full["epoch"] == cut["epoch"] == 2
    for key, value in full["model"].items():
        assert torch.equal(cut["model"][key], value), key
