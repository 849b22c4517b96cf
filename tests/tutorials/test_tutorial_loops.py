"""The runner that times our trainers against the seed tutorials' loops: input checks, the
pairing of runs into ratios, the same work on both sides, and a failed run that loses nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import tutorial_loops
from tests.conftest import MAIN_PYTHON, read_json, run_module

WORK_KEYS = ("model", "width", "dataset", "image_size", "train_limit", "epochs", "batch_size",
             "lr", "momentum", "weight_decay", "augment", "lr_schedule", "seed")  # fmt: skip
TINY = ["--preset", "smoke", "--epochs", "2", "--gpus", "1", "--repeat", "1"]


@pytest.mark.parametrize("args, words", [
    (["--tutorials", "keras"], "unknown tutorial keras"),
    (["--gpus", "0"], "every device count must be >= 1"),
    (["--repeat", "0"], "--repeat must be >= 1"), (["--epochs", "1"], "needs --epochs 2 or more"),
    (["--batch-size", "7", "--gpus", "2"], "does not divide"),
    (["--preset", "nope"], "unknown preset"),
    (["--python", "/nonexistent/python"], "--python /nonexistent/python"),
    (["--compile"], "the tutorials' loops have no torch.compile"),
])  # fmt: skip
def test_bad_input_is_one_line_and_runs_nothing(
    args: list[str], words: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = tutorial_loops.main([*args, "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and words in err[0], err
    assert not (tmp_path / "out").exists()


def _run(side: str, rep: int, ips: float | None, epoch_sec: float | None = 1.0) -> dict:
    return {
        "tutorial": "d2l-torch", "devices": 1, "side": side, "repeat": rep,
        "status": "ok" if ips else "failed", "images_per_sec": ips, "epoch_sec": epoch_sec,
        "test_examples": 10,
    }  # fmt: skip


def test_ratio_pairs_runs_of_the_same_repeat_and_skips_broken_pairs(tmp_path: Path) -> None:
    plan = tutorial_loops.plan_from(["--tutorials", "d2l-torch", *TINY, "--repeat", "3",
                                     "--out", str(tmp_path)])  # fmt: skip
    runs = [
        _run("ours", 0, 200.0, 2.0), _run("tutorial", 0, 100.0, 3.0),  # ratio 2.0
        _run("tutorial", 1, 300.0), _run("ours", 1, 150.0),  # ratio 0.5 (order swapped)
        _run("ours", 2, 400.0), _run("tutorial", 2, None),  # the tutorial failed: no ratio
    ]  # fmt: skip
    (row,) = tutorial_loops.summarise(plan, runs)
    assert row["ratios"] == [2.0, 0.5] and row["ratio"] == pytest.approx(1.25)
    assert row["epoch_speedup"] == pytest.approx((1.5 + 1.0) / 2)
    assert row["ours_images_per_sec"] == 200.0 and row["tutorial_images_per_sec"] == 200.0
    assert row["status"] == "failed"


def test_both_sides_run_the_same_work_and_the_table_is_written(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_module("benchmarks.tutorial_loops", "--tutorials", "d2l-torch", *TINY,
                      "--out", str(out), python=MAIN_PYTHON, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = read_json(out / "tutorial_loops.json")
    ours, theirs = sorted(result["runs"], key=lambda r: r["side"] != "ours")
    assert (ours["side"], theirs["side"]) == ("ours", "tutorial")
    rec_ours, rec_theirs = (read_json(out / r["record"]) for r in (ours, theirs))
    assert rec_ours["framework"] == "torch-dp" and rec_theirs["tutorial"] == "d2l-torch"
    assert rec_ours["config"]["channels_last"] is False
    for key in WORK_KEYS:  # the comparison is only fair if this holds
        assert rec_ours["config"][key] == rec_theirs["config"][key], key
    assert rec_ours["config"]["augment"] is False
    assert rec_ours["config"]["lr_schedule"] == "constant"
    assert len(rec_ours["epochs"]) == len(rec_theirs["epochs"]) == 2
    (row,) = result["summary"]
    assert row["ratio"] == pytest.approx(rec_ours["images_per_sec"] / rec_theirs["images_per_sec"])
    table = (out / "tutorial_loops.md").read_text()
    # the trainer's record says eager; d2l's loop, which records no mode, is eager as written
    modes = "eager / eager"
    assert f"| d2l-torch | torch-dp | {modes} | 1 | {rec_ours['images_per_sec']:.1f} |" in table


def test_a_failed_run_keeps_the_other_and_exits_1(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_module("benchmarks.tutorial_loops", "--tutorials", "d2l-torch", *TINY,
                      "--out", str(out), python=MAIN_PYTHON, timeout=600,
                      env={"DPBENCH_FAIL": "torch-dp"})  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = read_json(out / "tutorial_loops.json")
    by_side = {r["side"]: r for r in result["runs"]}
    assert by_side["ours"]["status"] == "failed" and "DPBENCH_FAIL" in by_side["ours"]["error"]
    assert by_side["tutorial"]["status"] == "ok" and by_side["tutorial"]["images_per_sec"] > 0
    (row,) = result["summary"]
    assert row["status"] == "failed" and row["ratio"] is None
    # ours failed at start-up, before it recorded its mode
    assert "| d2l-torch | torch-dp | — / eager | 1 | — |" in (out / "tutorial_loops.md").read_text()


def test_the_table_shows_both_sides_modes_and_says_when_rows_differ(tmp_path: Path) -> None:
    """Each row says both sides' modes; a line under the table says when rows differ."""
    plan = tutorial_loops.plan_from(["--tutorials", "d2l-torch,d2l-jax", *TINY,
                                     "--out", str(tmp_path)])  # fmt: skip
    modes = (("d2l-torch", "eager"), ("d2l-jax", "XLA (pmap)"))
    runs = [{**_run(side, 0, 100.0), "tutorial": tut, "mode": mode}
            for tut, mode in modes for side in ("ours", "tutorial")]  # fmt: skip
    rows = tutorial_loops.summarise(plan, runs)
    assert [(r["ours_mode"], r["tutorial_mode"]) for r in rows] == [
        ("eager", "eager"), ("XLA (pmap)", "XLA (pmap)"),
    ]  # fmt: skip
    md = tutorial_loops.markdown(plan, rows, {})
    assert "| d2l-torch | torch-dp | eager / eager | 1 |" in md
    assert "| d2l-jax | jax-pmap | XLA (pmap) / XLA (pmap) | 1 |" in md
    under = md.split("| d2l-jax | jax-pmap |")[1].split("\n")[2]  # the line under the table
    assert under.startswith("- Rows differ in execution mode: eager (d2l-torch) vs compiled")
    assert "Rows differ" not in tutorial_loops.markdown(plan, rows[:1], {})
