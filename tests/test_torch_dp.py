"""torch-dp (nn.DataParallel) on a CPU-only machine: it claims one device and says so once, and
it follows torch-ddp's arithmetic. Kill-and-resume, bad input, start-up failures and a crash in
the loop: tests/test_trainer_contract.py."""

from __future__ import annotations

import torch

from tests.conftest import SMOKE, ok, read_json, run_trainer


def run(framework: str, *args: str, env: dict[str, str] | None = None):
    return run_trainer(framework, *SMOKE, *args, env=env)


def test_cpu_run_records_one_device_and_warns_once(tmp_path):
    out = tmp_path / "dp.json"
    proc = run(
        "torch-dp",
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
    ok(run("torch-dp", *step, "--checkpoint-dir", str(tmp_path)))
    ok(run("torch-ddp", *step, "--checkpoint-dir", str(tmp_path)))
    dp = torch.load(tmp_path / "torch-dp.pt", weights_only=True)["model"]
    ddp = torch.load(tmp_path / "torch-ddp.pt", weights_only=True)["model"]
    assert set(dp) == set(ddp)
    for key in dp:
        torch.testing.assert_close(dp[key], ddp[key], rtol=0, atol=1e-6, msg=key)
