"""benchmarks.analysis.mfu: MFU from throughput tables (gpu_suite.sh's optional step 9), run on the
first H200 run's headline table (tests/fixtures/gpu_check)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.analysis import mfu
from tests.conftest import ROOT

TABLE = ROOT / "tests" / "fixtures" / "gpu_check" / "suite" / "throughput-bf16" / "throughput.json"


def test_the_table_of_the_h200_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert mfu.main([str(TABLE), "--out", str(tmp_path)]) == 0
    rows = {r["framework"]: r for r in json.loads((tmp_path / "mfu.json").read_text())["rows"]}
    graphs = rows["torch-ddp+reduce-overhead"]
    # 79,753 img/s x 3.33 GFLOP / 989 TFLOP/s, worked out by hand: 26.85%
    assert graphs["real_mfu"] == pytest.approx(79752.77 * 3.33e9 / 989e12)
    assert 0.268 < graphs["real_mfu"] < 0.269
    assert rows["jax-pmap"]["real_mfu"] < 0.031  # the float32 regression's 9,002 img/s
    assert "| torch-ddp+reduce-overhead |" in (tmp_path / "mfu.md").read_text()
    assert "26.9%" in capsys.readouterr().out
    # another peak halves it
    assert mfu.main([str(TABLE), "--peak-tflops", "1978", "--out", str(tmp_path)]) == 0
    rows = {r["framework"]: r for r in json.loads((tmp_path / "mfu.json").read_text())["rows"]}
    assert rows["torch-ddp+reduce-overhead"]["real_mfu"] == pytest.approx(graphs["real_mfu"] / 2)


@pytest.mark.parametrize(("edit", "says"), [
    (lambda t: t["settings"].update(image_size=64), "where the FLOP count is for resnet18"),
    (lambda t: t["rows"][0].pop("devices"), "is not a throughput table (a key missing)"),
])  # fmt: skip
def test_a_table_it_cannot_use_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], edit, says: str
) -> None:
    table = json.loads(TABLE.read_text())
    edit(table)
    bad = tmp_path / "throughput.json"
    bad.write_text(json.dumps(table))
    assert mfu.main([str(bad)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err and str(bad) in err, err
