"""Any JSON, one line (issue 41, item 4): every tool that reads a record, a config, a breakdown, a
table or a trace refuses JSON it cannot use (nested deeper than any it writes, a number out of
range, a field of the wrong type) in one line naming the file and the field, exit 2; before,
RecursionError, OverflowError and AttributeError tracebacks (common/json_input.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from common import json_input
from common.json_input import Refused, Required, Whole
from tests.hostile_helpers import a_comparison

NESTED = "[" * 100_000 + "]" * 100_000  # was: RecursionError
HUGE_FLOAT = "1e999"  # was: OverflowError (int(inf)), or inf in a table
HUGE_INT = "9" * 5000  # was: ValueError past Python's 4300 digits


# ---- the reader ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, says",
    [
        (NESTED, "nested deeper than 64 levels"),
        ("[" * 70 + "]" * 70, "nested deeper than 64 levels"),  # under Python's own limit
        ('{"a": [1, {"b": 1e999}]}', "field a[1].b is the number 1e999, out of range"),
        ('{"a": ' + HUGE_INT + "}", "field a is an integer of 5000 digits"),
    ],
)
def test_parse_refuses_nesting_and_numbers_naming_the_field(text, says):
    with pytest.raises(Refused, match="^f.json: ") as caught:
        json_input.parse(text, "f.json")
    assert says in str(caught.value) and "\n" not in str(caught.value)


def test_parse_keeps_what_json_dumps_writes():
    value = {"loss": float("nan"), "inf": float("inf"), "n": 2**62, "x": [[{"y": -1.5e300}]]}
    back = json_input.parse(json.dumps(value), "f.json")
    assert back["n"] == 2**62 and back["inf"] == float("inf") and back["loss"] != back["loss"]
    with pytest.raises(ValueError):  # no JSON at all: the caller's (a "damaged" record)
        json_input.parse('{"status": "ok", "epo', "f.json")
    # MXNet's profiler writes thread ids as uint64 (20 digits): its traces were refused at 19
    tid = json_input.parse('{"traceEvents": [{"tid": 18446744073709551615}]}', "trace.json")
    assert tid["traceEvents"][0]["tid"] == 2**64 - 1
    with pytest.raises(Refused, match="an integer of 21 digits"):
        json_input.parse('{"tid": 184467440737095516150}', "trace.json")


SCHEMA = {"runs": Required([{"devices": Whole(1), "name": (str, None)}]), "n": float}


@pytest.mark.parametrize(
    "value, says",
    [
        ([], "its top level is a list of 0 items, not an object"),
        ({}, "no field runs"),
        ({"runs": [{"devices": "2"}]}, 'field runs[0].devices is a string "2", not an integer'),
        ({"runs": [{"devices": 0}]}, "field runs[0].devices is an integer 0, not an integer >= 1"),
        ({"runs": [{"devices": True}]}, "field runs[0].devices is a boolean true"),
        ({"runs": [{"name": 3}]}, "field runs[0].name is an integer 3, not a string or null"),
        ({"runs": [], "n": "x"}, 'field n is a string "x", not a number'),
    ],
)
def test_check_names_the_field_and_what_it_needs(value, says):
    with pytest.raises(Refused, match="^f.json: ") as caught:
        json_input.check(value, SCHEMA, "f.json")
    assert says in str(caught.value)
    json_input.check({"runs": [{"devices": 2, "name": None}], "n": 1}, SCHEMA, "f.json")


# ---- report: config.json and the runs' records ---------------------------------------------

RECORD = "runs/torch-dp-1dev.json"
A_RECORD = {"framework": "torch-dp", "devices": 1, "status": "ok", "epochs": []}


def _config(out: Path) -> dict[str, Any]:
    return json.loads((out / "config.json").read_text())


@pytest.mark.parametrize(
    "which, content, says",
    [
        ("config.json", NESTED, "nested deeper than 64 levels"),
        ("config.json", lambda c: {**c, "device_counts": [HUGE_FLOAT]}, "field device_counts[0]"),
        ("config.json", lambda c: {**c, "host": []}, "field host is a list"),
        ("config.json", lambda c: {**c, "base_config": 5}, "field base_config is an integer"),
        (
            "config.json",
            lambda c: {**c, "runs": [{**c["runs"][0], "devices": "1"}]},
            "field runs[0].devices is a string",
        ),  # fmt: skip
        (RECORD, NESTED, "nested deeper than 64 levels"),
        (RECORD, {**A_RECORD, "test_accuracy": HUGE_FLOAT}, "field test_accuracy is the number"),
        (RECORD, {**A_RECORD, "test_accuracy": HUGE_INT}, "field test_accuracy is an integer of"),
        (RECORD, {**A_RECORD, "runner": 5}, "field runner is an integer 5, not an object"),
        (RECORD, {**A_RECORD, "epochs": "x"}, 'field epochs is a string "x", not a list'),
        (RECORD, {**A_RECORD, "status": [1]}, "field status is a list of 1 items, not a string"),
        (RECORD, {**A_RECORD, "load_avg": {"start": "high"}}, "field load_avg.start is a string"),
    ],
)
def test_report_refuses_json_it_cannot_use_in_one_line(
    which, content, says, tmp_path, no_probe, capsys
):
    from benchmarks import report

    out = tmp_path / "out"
    a_comparison(out)
    if callable(content):
        content = json.dumps(content(_config(out))).replace(f'"{HUGE_FLOAT}"', HUGE_FLOAT)
    elif isinstance(content, dict):
        content = json.dumps(content)
        for big in (HUGE_FLOAT, HUGE_INT):
            content = content.replace(f'"{big}"', big)
    (out / which).write_text(content)
    capsys.readouterr()
    rc = report.main([str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert str(out / which) in err[0] and says in err[0], err[0]


def test_report_keeps_a_truncated_record_damaged(tmp_path, no_probe, capsys):
    from benchmarks import report

    out = tmp_path / "out"
    a_comparison(out)
    (out / RECORD).write_text(json.dumps(A_RECORD)[:20])  # a run killed while writing: no JSON
    assert report.main([str(out)]) == 0
    assert "damaged" in capsys.readouterr().out


# ---- predict: --breakdown and --throughput-table -------------------------------------------


@pytest.mark.parametrize(
    "content, says",
    [
        (NESTED, "nested deeper than 64 levels"),
        ('{"step_ms": 1e999, "batch": 128}', "field step_ms is the number 1e999, out of range"),
        ('{"step_ms": "x", "batch": 128}', 'field step_ms is a string "x", not a number'),
        ('{"step_ms": 10, "batch": ' + HUGE_INT + "}", "field batch is an integer of 5000"),
        ('{"step_ms": 10, "batch": 0}', "field batch is an integer 0"),
    ],
)
def test_predict_refuses_a_breakdown_it_cannot_use_in_one_line(content, says, tmp_path, capsys):
    from benchmarks.analysis import predict

    path = tmp_path / "b.json"
    path.write_text(content)
    rc = predict.main(["--breakdown", str(path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and str(path) in err[0] and says in err[0], err


@pytest.mark.parametrize(
    "cell, says",
    [
        ("1e999", "real_images_per_sec is the number 1e999, out of range"),
        ("Infinity", "torch-ddp's real img/s is inf"),
        ("0", "torch-ddp's real img/s is 0"),
    ],
)
def test_predict_refuses_a_table_cell_out_of_range_in_one_line(cell, says, tmp_path, capsys):
    from benchmarks.analysis import predict

    path = tmp_path / "t.json"
    settings = '{"model": "resnet18", "width": 1.0, "image_size": 32, "precision": "fp32"}'
    path.write_text(
        f'{{"settings": {settings}, "rows": [{{"framework": "torch-ddp", "devices": 1, '
        f'"global_batch": 128, "real_images_per_sec": {cell}, "compute_images_per_sec": 900}}]}}'
    )
    rc = predict.main(["--throughput-table", str(path)])  # was: ZeroDivisionError
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    assert str(path) in err[0] and says in err[0], err


# ---- gpu_verdicts: throughput.json; a trace ---------------------------------------------------


@pytest.mark.parametrize(
    "content, says",
    [
        (NESTED, "nested deeper than 64 levels"),
        ('{"rows": 5}', "field rows is an integer 5, not a list"),
        ('{"rows": [{"real": {"status": "ok"}}]}', "field rows[0].real is an object"),
        ('{"rows": [], "settings": {"out": 1e999}}', "field settings.out is the number 1e999"),
    ],
)
def test_gpu_verdicts_refuses_a_table_it_cannot_use_in_one_line(content, says, tmp_path, capsys):
    from benchmarks.analysis import gpu_verdicts

    (tmp_path / "throughput.json").write_text(content)
    rc = gpu_verdicts.main([str(tmp_path)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "throughput.json" in err[0] and says in err[0], err


@pytest.mark.parametrize(
    "content, says",
    [
        (NESTED, "nested deeper than 64 levels"),
        ('{"traceEvents": [{"ph": "X", "ts": 1e999, "dur": 1}]}', "traceEvents[0].ts is the"),
        ('{"traceEvents": [{"ph": "X", "ts": "abc", "dur": 1}]}', 'field [0].ts is a string "abc"'),
        ('[{"ph": "M", "name": "thread_name", "args": 5}]', "field [0].args is an integer 5"),
    ],
)
def test_a_trace_it_cannot_use_is_one_trace_error(content, says, tmp_path):
    from common.breakdown import TraceError, load_events

    path = tmp_path / "t.json"
    path.write_text(content)
    with pytest.raises(TraceError) as caught:
        load_events(path)
    assert str(path) in str(caught.value) and says in str(caught.value), caught.value


# ---- every record a trainer writes passes -------------------------------------------------


def test_a_recorders_record_passes_the_record_schema(tmp_path):
    from common.config import Config
    from common.results import RECORD_SCHEMA, RunRecorder

    recorder = RunRecorder(
        Config(), devices=2, device_kind="cpu-simulated", params=10, is_main=False, n_test=10
    )
    recorder.end_epoch(1, 0.5, 96, float("nan"), 1.0, 10.0, 23.0)  # a diverged epoch
    record = json.loads(json.dumps(recorder.result(), default=str))
    json_input.check(record, RECORD_SCHEMA, "record")
