"""`--tensorboard DIR` (common/tensorboard.py) and compare's DIR/tensorboard/<run id>/: event
files read back by TensorBoard's reader and held against the record (assert_events_match_record,
also applied by test_contract.py and test_compare.py to real runs); here the writer in-process,
its failure modes, the lazy import, and compare's plan."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from benchmarks import compare
from common import tensorboard
from common.config import RESUME_KEYS, ConfigError, config_from_dict, preset
from common.results import RunRecorder
from common.schedule import lr_table_for
from common.trainer import run_main
from tests.conftest import MAIN_PYTHON, TENSORBOARD_MISSING, read_json, run_python

pytestmark = pytest.mark.skipif(bool(TENSORBOARD_MISSING), reason=TENSORBOARD_MISSING)

# The record's epoch-row field behind each scalar tag ("lr" comes from the LR table).
ROW_FIELD = {"train/loss": "train_loss", "test/accuracy": "test_accuracy", "test/loss": "test_loss",
             "perf/images_per_sec": "images_per_sec", "perf/epoch_sec": "sec"}  # fmt: skip


def read_events(logdir: Path) -> tuple[dict[str, list[tuple[int, float]]], dict[str, str]]:
    """(scalars: tag -> [(step, value)], texts: name -> text) of the one event file in `logdir`,
    read by TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing import event_accumulator as ea

    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert len(files) == 1, files  # process 0 alone writes, once
    acc = ea.EventAccumulator(str(logdir), size_guidance={ea.SCALARS: 0, ea.TENSORS: 0})
    acc.Reload()
    tags = acc.Tags()
    scalars = {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in tags["scalars"]}
    texts = {}
    for t in tags["tensors"]:
        (event,) = acc.Tensors(t)  # written once
        texts[t.split("/")[0]] = event.tensor_proto.string_val[0].decode()
    return scalars, texts


def unindent(text: str) -> Any:
    """The JSON of a `config` / `environment` text (written as an indented Markdown block)."""
    return json.loads("\n".join(line[4:] for line in text.splitlines()))


def assert_events_match_record(logdir: Path, record: dict[str, Any]) -> None:
    """The event file in `logdir` holds, for each epoch of `record`, every tag at the global step
    (epochs x steps per epoch) with the record's value, and the record's config as text."""
    scalars, texts = read_events(logdir)
    assert sorted(scalars) == sorted([*tensorboard.SCALARS, "lr"])
    assert sorted(texts) == ["config", "environment"]
    cfg = config_from_dict(record["config"])
    assert unindent(texts["config"]) == json.loads(json.dumps(record["config"]))
    env = unindent(texts["environment"])
    assert env["device_kind"] == record["device_kind"] and env["devices"] == record["devices"]
    assert env["threads"] == record["threads"] and env["versions"] == record["versions"]
    rows = record["epochs"]
    steps = rows[0]["images"] // cfg.batch_size
    lr = lr_table_for(cfg, steps)
    for tag, points in scalars.items():
        assert [s for s, _ in points] == [r["epoch"] * steps for r in rows], tag  # one per epoch
        want = [r[ROW_FIELD[tag]] if tag in ROW_FIELD else lr[r["epoch"] * steps - 1] for r in rows]
        assert [v for _, v in points] == [float(np.float32(w)) for w in want], tag


# -- the writer, in-process -----------------------------------------------------------------------

ROWS = [  # (sec, images, train_loss, correct, total, test_loss_sum) of 3 epochs of 4 steps
    (2.5, 96, 2.31, 3.0, 10.0, 22.9),
    (0.5, 96, 1.87, 6.0, 10.0, 17.2),
    (0.25, 96, 1.52, 8.0, 10.0, 12.8),
]


def recorded_run(tmp_path: Path, **overrides: Any) -> dict[str, Any]:
    """A recorder run through ROWS (smoke preset, cosine schedule with warm-up: the LR moves
    every epoch), its record written to tmp_path/run.json."""
    cfg = preset("smoke", framework="jax-pmap", epochs=3, lr_schedule="cosine", warmup_epochs=1,
                 tensorboard=str(tmp_path / "tb"), output=str(tmp_path / "run.json"),
                 **overrides)  # fmt: skip
    rec = RunRecorder(cfg, devices=2, device_kind="cpu-simulated", params=10, is_main=True)
    rec.threads = {"total": 2}
    for epoch, row in enumerate(ROWS):
        rec.end_epoch(epoch, *row)
    return rec.finish()


def test_each_epoch_writes_every_tag_at_the_global_step(tmp_path: Path) -> None:
    record = recorded_run(tmp_path)
    assert_events_match_record(tmp_path / "tb", record)
    scalars, _ = read_events(tmp_path / "tb")
    assert [s for s, _ in scalars["lr"]] == [4, 8, 12]  # 96 images / batch 24 = 4 steps
    assert len({v for _, v in scalars["lr"]}) == 3  # the epoch's last LR, not a constant
    assert scalars["test/accuracy"][-1][1] == pytest.approx(0.8)


def test_the_record_check_can_fail(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check catches a wrong value, a wrong x axis and a missing epoch."""
    record = recorded_run(tmp_path)
    wrong = json.loads(json.dumps(record))
    wrong["epochs"][1]["train_loss"] += 1e-3
    with pytest.raises(AssertionError, match="train/loss"):
        assert_events_match_record(tmp_path / "tb", wrong)
    with pytest.raises(AssertionError):  # one epoch more in the events than in the record
        assert_events_match_record(tmp_path / "tb", {**record, "epochs": record["epochs"][:2]})
    # the step within the epoch instead of the global step (an injected bug in the writer)
    monkeypatch.setattr(tensorboard, "global_step", lambda row, cfg: row["images"] // 24)
    record = recorded_run(tmp_path / "bug")
    with pytest.raises(AssertionError):
        assert_events_match_record(tmp_path / "bug" / "tb", record)


def test_a_failing_writer_never_costs_the_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("DPBENCH_INJECT", "tensorboard-error@jax-pmap")
    record = recorded_run(tmp_path)
    assert record["status"] == "ok" and len(record["epochs"]) == 3
    assert read_json(tmp_path / "run.json")["epochs"] == record["epochs"]
    err = capsys.readouterr().err.splitlines()
    (line,) = [line for line in err if line.startswith("tensorboard:")]  # one line, once
    assert f"writing {tmp_path / 'tb'} failed" in line and "the run goes on" in line


def test_bad_tensorboard_dir_is_one_line_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Through the trainers' shared entry point (run_main): refused before training starts."""
    blocker = tmp_path / "file"
    blocker.write_text("")
    trained = []
    argv = ["--preset", "smoke", "--tensorboard", str(blocker / "tb")]
    code = run_main(argv, "jax-pmap", check=lambda cfg: None, train=trained.append)
    assert code == 2 and trained == []
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith("python -m frameworks.jax_pmap: error: --tensorboard ")
    assert "cannot create that directory" in line and "give a writable directory" in line


def test_missing_writer_package_is_one_line_naming_the_setup(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = tensorboard.importlib.util.find_spec
    find = lambda name, *a: None if name == "tensorboardX" else real(name, *a)  # noqa: E731
    monkeypatch.setattr(tensorboard.importlib.util, "find_spec", find)
    cfg = preset("smoke", tensorboard=str(tmp_path / "tb"))
    with pytest.raises(ConfigError, match=r"needs the tensorboardX package.*scripts/setup.sh"):
        tensorboard.check(cfg)
    tensorboard.check(preset("smoke"))  # off: nothing is checked
    assert "tensorboard" not in RESUME_KEYS  # a path: resuming may log elsewhere


def test_the_writer_is_imported_lazily_and_without_torch() -> None:
    """Importing the recorder loads no writer; loading it does not load torch (tensorboardX's
    writer would, where torch is installed, as it is here: checked below)."""
    code = (
        "import sys\n"
        "import common.results, common.tensorboard as tb\n"
        "assert 'tensorboardX' not in sys.modules\n"
        "tb.summary_writer_class()\n"
        "assert 'tensorboardX' in sys.modules and 'torch' not in sys.modules\n"
        "import importlib.util\n"
        "assert importlib.util.find_spec('torch') is not None\n"
        "print('ok')\n"
    )
    proc = run_python(MAIN_PYTHON, "-c", code)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-2000:]


def test_the_guard_is_needed() -> None:
    """Proves the test above can fail: tensorboardX imported plainly does load torch here."""
    proc = run_python(MAIN_PYTHON, "-c", "import sys, tensorboardX; print('torch' in sys.modules)")
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]


# -- compare ------------------------------------------------------------------------------------


def test_compare_gives_every_run_its_own_directory(no_probe: None, tmp_path: Path) -> None:
    out = tmp_path / "out"
    argv = ["--frameworks", "torch-ddp,jax-pmap,mxnet-gluon", "--preset", "smoke"]
    plan = compare.make_plan([*argv, "--out", str(out)])
    assert len(plan.runs) == 6
    for spec in plan.runs:
        want = str(out.resolve() / "tensorboard" / spec.run_id)
        assert spec.cfg.tensorboard == want
        i = spec.command.index("--tensorboard")
        assert spec.command[i + 1] == want
    off = compare.make_plan([*argv, "--out", str(out), "--no-tensorboard"])
    assert all("--tensorboard" not in s.command and not s.cfg.tensorboard for s in off.runs)
    assert not out.exists()  # planning writes nothing
