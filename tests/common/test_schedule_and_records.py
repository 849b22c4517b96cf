"""LR schedules and run-result records."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from common import results
from common.config import config_from_dict, preset
from common.schedule import lr_table, scaled_lr


def test_lr_scaling_then_warmup_from_one_over_n_then_constant() -> None:
    rules = {"none": 0.1, "linear": 0.4, "sqrt": 0.2}
    assert {r: scaled_lr(0.1, 512, 128, r) for r in rules} == pytest.approx(rules)
    t = lr_table(0.1, 1024, 256, "linear", "constant", epochs=10, steps_per_epoch=10,
                 warmup_epochs=5, warmup_start_factor=None)  # fmt: skip
    assert len(t) == 100
    assert t[0] == pytest.approx(0.1 + 0.3 / 50, rel=1e-5)  # starts at the 1-device LR
    assert np.all(np.diff(t[:50]) > 0)
    assert t[49] == pytest.approx(0.4) and np.allclose(t[50:], 0.4)


def test_cosine_and_step_schedules() -> None:
    c = lr_table(1.0, 8, 8, "none", "cosine", epochs=4, steps_per_epoch=5, warmup_epochs=1)
    assert c[4] == pytest.approx(1.0)  # end of warm-up = peak
    assert np.all(np.diff(c[5:]) <= 1e-7) and 0 < c[-1] < 0.02
    s = lr_table(
        1.0, 8, 8, "none", "step", epochs=4, steps_per_epoch=5, step_epochs=(2, 3), step_factor=0.1
    )
    np.testing.assert_allclose(s, [1.0] * 10 + [0.1] * 5 + [0.01] * 5, rtol=1e-6)


def _record(cfg, accs, secs=(5.0, 1.0, 2.0, 3.0)):
    rec = results.RunRecorder(cfg, devices=2, device_kind="cpu-simulated", params=123,
                              is_main=True, packages=("numpy",), n_test=10)  # fmt: skip
    stop = False
    for e, (acc, sec) in enumerate(zip(accs, secs)):
        stop = rec.end_epoch(e, sec, 100, 0.5, acc * 10, 10, 3.0)
        if stop:
            break
    return rec, stop


def test_record_round_trips_with_timing_and_config(tmp_path: Path, capsys) -> None:
    cfg = preset("smoke", framework="torch-ddp", output=str(tmp_path / "r.json"))
    rec, _ = _record(cfg, [0.1, 0.2, 0.3, 0.4])
    out = rec.finish()
    saved = json.loads((tmp_path / "r.json").read_text())
    assert saved == json.loads(json.dumps(out))
    assert saved["first_epoch_sec"] == 5.0
    assert saved["sec_per_epoch"] == 2.0  # median of epochs after the first
    assert saved["images_per_sec"] == pytest.approx(300 / 6.0)
    assert saved["test_accuracy"] == pytest.approx(0.4) and saved["test_examples"] == 10
    assert saved["status"] == "ok" and saved["versions"]["numpy"] == np.__version__
    assert config_from_dict(saved["config"]) == cfg
    assert capsys.readouterr().out.count("epoch ") == 4
    keys = "framework model dataset devices device_kind global_batch_size epochs params host"
    assert set(keys.split()) <= set(saved)


def test_target_with_patience_and_divergence() -> None:
    cfg = preset("smoke", target_accuracy=0.5, patience=2)
    rec, stop = _record(cfg, [0.6, 0.4, 0.6, 0.7])
    assert stop and len(rec.epochs) == 4 and rec.epochs_to_target == 1
    rec = results.RunRecorder(cfg, devices=1, device_kind="cpu", params=1, is_main=False)
    assert rec.end_epoch(0, 1.0, 10, math.nan, 1, 10, 1.0)
    assert rec.result()["status"] == "diverged"
