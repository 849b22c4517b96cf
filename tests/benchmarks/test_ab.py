"""benchmarks.analysis.ab: alternating A/B runs of one trainer; bad input is one line and exit 2."""

from __future__ import annotations

import json

import pytest

from tests.conftest import read_json, run_module


@pytest.mark.parametrize("args, words", [
    (["--framework", "torch-dp", "--a=--lr 0.1", "--b=--lr 0.1"], "same settings"),
    (["--framework", "torch-dp", "--b=--output x.json"], "--output is set by ab"),
    (["--framework", "nope"], "invalid choice"),
    (["--framework", "torch-dp", "--b=--no-channels-last", "--repeat", "0"], "--repeat"),
    (["--framework", "torch-dp", "--a=--lr '0.1", "--b="], "no closing quotation"),
])  # fmt: skip
def test_bad_input_is_one_line(args: list[str], words: str, capsys) -> None:
    from benchmarks.analysis import ab

    try:
        code = ab.main(args)
    except SystemExit as exc:  # refused by the flag parser
        code = exc.code
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and words in err, err


def test_pairs_alternate_and_the_ratio_is_reported(tmp_path) -> None:
    out = tmp_path / "ab"
    proc = run_module(
        "benchmarks.analysis.ab",
        *("--framework", "torch-dp", "--a=--no-channels-last", "--b=--channels-last"),
        *("--repeat", "2", "--out", str(out), "--", "--preset", "smoke", "--epochs", "2"),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = read_json(out / "ab.json")
    assert [(r["pair"], r["side"]) for r in result["runs"]] == [
        (0, "A"),
        (0, "B"),
        (1, "A"),
        (1, "B"),
    ]
    assert len(result["ratios_b_over_a"]) == 2 and result["median_ratio"] > 0
    for r in result["runs"]:
        assert (
            r["first_over_later"]
            == r["first_epoch_sec"] / read_json(r["record"])["sec_per_epoch_median"]
        )
    firsts = result["first_epoch_over_later_median"]
    assert firsts.keys() == {"A", "B"} and "first epoch / a later one, median" in proc.stdout
    by_side = {r["side"]: r for r in result["runs"]}
    assert "NCHW" in by_side["A"]["execution"] and "channels_last" in by_side["B"]["execution"]
    # B went first in the second pair: its log was written before A's
    logs = sorted((out / "logs").glob("*-1.log"), key=lambda p: p.stat().st_mtime)
    assert [p.name for p in logs] == ["B-1.log", "A-1.log"]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"ab": str(out / "ab.json")}


def test_a_stop_during_a_run_ends_ab_there_with_130(tmp_path, monkeypatch) -> None:
    """A stop while side A runs: B never starts, ab.json keeps what ran, exit 130."""
    from benchmarks import harness
    from benchmarks.analysis import ab

    started: list[list[str]] = []

    def run_child(command, log, timeout, reraise=False, **kw):
        started.append(list(command))
        if reraise:  # as harness.run_child does for an interrupted child
            raise KeyboardInterrupt
        return harness.Child(list(command), log, timeout, ended="interrupted")

    monkeypatch.setattr(harness, "run_child", run_child)
    plan = ab.make_plan(
        ["--framework", "torch-dp", "--a=--lr 0.05", "--b=--lr 0.06", "--out", str(tmp_path / "ab")]
    )
    assert ab.execute(plan) == 130
    assert len(started) == 1  # side A only
    assert json.loads((tmp_path / "ab" / "ab.json").read_text())["runs"] == []
