"""--profile on mxnet-gluon: MXNet's profiler writes a Chrome trace whose device lanes (cpu/0,
cpu/1) hold the kvstore's copies and sums, read into the same breakdown as torch's and JAX's
(tests/trainers/test_profile.py)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.trainers.test_profile import check_profiled, profiled_run


def test_mxnet_gluon_profile_reads_the_kvstore_s_reduction_per_device(tmp_path: Path) -> None:
    record = profiled_run("mxnet-gluon", tmp_path)
    b = check_profiled(record, "mxnet", tmp_path)
    assert sorted(b["devices"]) == ["cpu/0", "cpu/1"]
    names = {e.get("name") for e in json.loads(Path(record["profile"]["trace"]).read_text())[
        "traceEvents"]}  # fmt: skip
    assert "ElementwiseSum" in names and "h2d" in names  # the reduction; the phases as ranges
