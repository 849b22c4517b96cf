"""Records the tools read back: a record a broken machine cut short is one line naming the file,
and the tool goes on with the other runs."""

from __future__ import annotations

import csv
import json
from pathlib import Path


def a_comparison(out: Path, frameworks: str, gpus: str) -> None:
    """A comparison's directory `out` as compare writes it (config.json, runs/), no run made.
    The caller keeps compare from probing the machine (the no_probe fixture)."""
    from benchmarks import compare
    from common.results import write_json_atomic

    plan = compare.make_plan(["--frameworks", frameworks, "--gpus", gpus, "--preset", "smoke",
                              "--out", str(out)])  # fmt: skip
    out.mkdir()
    write_json_atomic(out / "config.json", compare.config_json(plan, compare.sweep_of(plan), "x"))
    (out / "runs").mkdir()


def test_report_shows_a_truncated_record_as_damaged_and_goes_on(tmp_path, no_probe, capsys):
    from benchmarks import report

    out = tmp_path / "out"
    a_comparison(out, "torch-ddp", "1,2,4")
    record = {"framework": "torch-ddp", "devices": 4, "status": "ok", "epochs": []}
    (out / "runs" / "torch-ddp-4dev.json").write_text(json.dumps(record))
    (out / "runs" / "torch-ddp-1dev.json").write_text('{"framework": "torch-ddp", "stat')  # cut
    assert report.main([str(out)]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "runs/torch-ddp-1dev.json is damaged" in err[0], err
    with open(out / "results.csv") as f:
        rows = {r["devices"]: r for r in csv.DictReader(f)}
    assert rows["1"]["status"] == "damaged", rows["1"]
    assert "runs/torch-ddp-1dev.json is damaged" in rows["1"]["note"], rows["1"]
    assert rows["2"]["status"] == "not run"  # no file at all: still "not run"
    assert rows["4"]["status"] == "ok", rows["4"]  # the other runs' records are read on
