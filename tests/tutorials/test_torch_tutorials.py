"""The PyTorch tutorial loops (d2l-torch, nvidia-course) on real digits: they learn, their
records count exactly the images the tutorials' loaders yield, and bad flags exit 2."""

from __future__ import annotations

import math

import pytest

from tests.conftest import MAIN_PYTHON, read_json, run_module

# 1437 training and 359 test digits (prime: no process count divides it), global batch 40,
# constant LR: what the tutorials can run. Three epochs at 1/8 width take a few seconds each.
DIGITS = (
    "--preset", "digits", "--width", "0.125", "--epochs", "3", "--no-augment",
    "--lr-schedule", "constant", "--warmup-epochs", "0", "--batch-size", "40",
    "--test-limit", "359",
)  # fmt: skip
N_TRAIN, N_TEST = 1437, 359
PASSIVE = {"OMP_WAIT_POLICY": "PASSIVE"}  # 2 shared cores: spinning OpenMP threads stall


def run(module: str, out, *args: str):
    proc = run_module(f"tutorials.{module}", *DIGITS, *args, "--output", str(out),
                      python=MAIN_PYTHON, env=PASSIVE, timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return read_json(out), proc


def check_record(rec: dict, tutorial: str, compared: str) -> None:
    assert rec["status"] == "ok" and rec["error"] == ""
    assert rec["tutorial"] == tutorial and rec["compared_with"] == compared
    assert len(rec["epochs"]) == 3 and rec["timed_epochs"] == 2
    assert rec["images_per_sec"] > 0 and rec["deviations"]
    assert rec["test_set_size"] == N_TEST
    # well above chance (0.10); measured 0.82-0.96 after 3 epochs
    assert rec["test_accuracy"] >= 0.6, [e["test_accuracy"] for e in rec["epochs"]]


def test_d2l_torch_learns_and_counts_every_image(tmp_path):
    rec, proc = run("d2l_torch", tmp_path / "d2l.json")
    check_record(rec, "d2l-torch", "torch-dp")
    assert rec["devices"] == 1 and rec["device_kind"] == "cpu"
    # shuffle=True without drop_last: the final partial batch (1437 = 35 x 40 + 37) is stepped
    assert [e["images"] for e in rec["epochs"]] == [N_TRAIN] * 3
    # evaluate_accuracy_gpu: every test image once, no drop, no padding
    assert [e["test_examples"] for e in rec["epochs"]] == [N_TEST] * 3
    note, *epochs = proc.stdout.strip().splitlines()  # the CPU note, then a line per epoch
    assert note.startswith("note: no CUDA device") and len(epochs) == 3, proc.stdout


def test_nvidia_course_learns_and_reports_the_test_images_it_saw(tmp_path):
    """DistributedSampler pads each set to a multiple of the 2 ranks, DataLoader(drop_last=True)
    cuts every rank to whole batches of 20."""
    rec, proc = run("nvidia_course", tmp_path / "nv.json", "--gpus", "2")
    check_record(rec, "nvidia-course", "torch-ddp")
    assert rec["devices"] == 2 and rec["device_kind"] == "cpu-simulated"
    images = math.ceil(N_TRAIN / 2) // 20 * 20 * 2
    tested = math.ceil(N_TEST / 2) // 20 * 20 * 2
    # 35 and 9 batches of 20 per rank, the test shard padded from 179.5 to 180, none dropped
    assert (images, tested) == (1400, 360)
    assert [e["images"] for e in rec["epochs"]] == [images] * 3
    assert [e["test_examples"] for e in rec["epochs"]] == [tested] * 3
    assert len(proc.stdout.strip().splitlines()) == 3  # rank 0 alone prints


@pytest.mark.parametrize(("module", "args", "names"), [
    ("d2l_torch", ["--precision", "bf16"], "--precision bf16"),
    ("d2l_torch", ["--lr-schedule", "cosine"], "--lr-schedule cosine"),
    ("d2l_torch", ["--target-accuracy", "0.9"], "--target-accuracy"),
    ("nvidia_course", ["--bn", "sync"], "--bn sync"), ("nvidia_course", ["--augment"], "--augment"),
    ("nvidia_course", ["--optimizer", "novograd"], "--optimizer novograd"),
    ("nvidia_course", ["--batch-size", "2048"], "--batch-size"),
])  # fmt: skip
def test_bad_flags_exit_2_with_one_line(capsys, module, args, names):
    import importlib

    main = importlib.import_module(f"tutorials.{module}").main
    try:
        code = main([*DIGITS, *args])
    except SystemExit as exc:  # refused by the flag parser itself (common.config.validate)
        code = exc.code
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and names in err[0] and "use " in err[0], err


def test_batch_not_dividing_over_processes_exits_2(capsys):
    from tutorials.nvidia_course import main

    with pytest.raises(SystemExit) as exc:
        main([*DIGITS, "--gpus", "3"])  # 40 over 3 processes
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch-size 39 or 42" in err[0], err


@pytest.mark.filterwarnings("ignore:This DataLoader will create 4 worker processes")
def test_failure_inside_the_loop_still_writes_the_record(tmp_path, monkeypatch):
    from tutorials import d2l_torch

    def broken(*_args):
        raise RuntimeError("evaluation broke")

    monkeypatch.setattr(d2l_torch, "evaluate_accuracy_gpu", broken)
    out = tmp_path / "failed.json"
    argv = [*DIGITS, "--max-steps-per-epoch", "1", "--output", str(out)]
    assert d2l_torch.main(argv) == 1
    rec = read_json(out)
    assert rec["status"] == "failed" and "evaluation broke" in rec["error"]
    assert rec["epochs"] == [] and rec["tutorial"] == "d2l-torch"
