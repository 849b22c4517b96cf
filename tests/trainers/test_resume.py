"""Resume (common/checkpoints.py): a checkpoint of another run, config or device count is
refused with one line before any work (exit 2); one run at a time per --checkpoint-dir; a
resumed record is the uninterrupted run's; a damaged checkpoint (bytes flipped, cut short) is
one line naming it, nothing trained. The bitwise kill/resume: tests/trainers/test_contract.py;
MXNet's damaged checkpoint: tests/mxnet/test_mxnet_resume.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from common.checkpoints import (
    CHECKPOINT_FORMAT,
    Checkpoints,
    check_resume,
    checkpoint_meta,
    lock_checkpoint_dir,
    restore_meta,
)
from common.config import ConfigError, preset
from common.results import RunRecorder
from tests.conftest import SMOKE, ok, one_line_error, read_json, run_trainer


def saved(meta: dict, path: Path) -> Checkpoints:
    """A framework's checkpoints whose file at `path` holds `meta` (check_resume reads only it)."""
    never = lambda *a: pytest.fail("check_resume loads no state")  # noqa: E731
    return Checkpoints(path=lambda cfg: path, save=never, load=never, meta_of=lambda p: meta)


def test_a_checkpoint_of_other_settings_or_fewer_epochs_is_refused(tmp_path: Path) -> None:
    ck = tmp_path / "ck.pt"
    ck.write_text("")
    base = preset("smoke", checkpoint_dir=str(tmp_path), resume=True, epochs=4)
    config = json.loads(json.dumps(base.to_dict()))  # as a JSON checkpoint keeps it: lists
    meta = {"format": CHECKPOINT_FORMAT, "config": config, "epoch": 2, "step": 8}
    check_resume(base, saved(meta, ck))  # the same run (tuples as lists): accepted
    check_resume(base.replace(epochs=7), saved(meta, ck))  # a constant LR: --epochs may grow
    for change, flag in [
        (dict(lr=0.5), "--lr 0.05 (now 0.5)"),
        (dict(batch_size=48, lr_base_batch=48), "--batch-size"),
        (dict(gpus=2), "--gpus 1 (now 2)"),  # the record would mix two device counts' timings
        (dict(precision="bf16"), "--precision"),
        (dict(framework="jax-shard"), "--framework"),
    ]:
        with pytest.raises(ConfigError, match=f"is from another run: .*{re.escape(flag)}"):
            check_resume(base.replace(**change), saved(meta, ck))
    with pytest.raises(
        ConfigError, match="after epoch 2 but --epochs is 1; resume with --epochs 2"
    ):
        check_resume(base.replace(epochs=1), saved(meta, ck))
    with pytest.raises(ConfigError, match="not checkpoint format"):
        check_resume(base, saved({**meta, "format": 1}, ck))


def test_a_checkpoint_made_on_other_devices_is_refused_naming_what_differs() -> None:
    """What the config does not say: the devices seen, their kind, the library versions."""
    cfg = preset("smoke", framework="torch-dp")

    def recorder(devices: int, kind: str) -> RunRecorder:
        return RunRecorder(cfg, devices=devices, device_kind=kind, params=0, is_main=False,
                           packages=("torch",))  # fmt: skip

    made = recorder(1, "cpu")
    made.end_epoch(0, 1.0, 96, 2.3, 1, 10, 23.0)
    meta = json.loads(json.dumps(checkpoint_meta(cfg, made, 0, 4)))  # as saved
    assert restore_meta(meta, recorder(1, "cpu"), Path("ck.pt")) == (1, 4)
    with pytest.raises(ConfigError, match=r"devices 1 \(now 2\); device kind 'cpu'"):
        restore_meta(meta, recorder(2, "cuda:H100"), Path("ck.pt"))
    meta["run"]["versions"]["torch"] = "1.0.0"
    with pytest.raises(ConfigError, match=r"versions .*'torch': '1.0.0'"):
        restore_meta(meta, recorder(1, "cpu"), Path("ck.pt"))


def test_a_second_run_on_a_locked_checkpoint_dir_is_refused(tmp_path, monkeypatch):
    cfg = preset("smoke", checkpoint_dir=str(tmp_path / "ck"), resume=True)
    held = lock_checkpoint_dir(cfg)
    try:
        with pytest.raises(ConfigError, match=f"in use by another run \\(pid {os.getpid()} "):
            lock_checkpoint_dir(cfg)
        out = tmp_path / "run.json"
        bad = run_trainer(
            "torch-dp", *SMOKE, "--checkpoint-dir", str(tmp_path / "ck"), "--resume",
            "--output", str(out),
        )  # fmt: skip
        one_line_error(bad, "is in use by another run", "use another --checkpoint-dir")
        assert not out.exists() and sorted(p.name for p in (tmp_path / "ck").iterdir()) == [".lock"]
    finally:
        held.close()
    lock_checkpoint_dir(cfg).close()  # released: the next run may take it


def test_a_resumed_record_is_true(tmp_path, capsys):
    """torch-dp runs 2 epochs, then a resume with --epochs 1 is refused (one line, nothing
    written), then one with --epochs 3 ends with a record that counts 3 epochs, keeps every
    epoch's LR (a step schedule, read from the schedule) and times neither process's first
    epoch. The trainings run in processes of their own (torch's CPU backward once aborted
    inside pytest-xdist workers, which ends the session); the refusal, which trains nothing,
    in-process."""
    from common.schedule import lr_table_for
    from frameworks.torch_dp import main

    ck, out = str(tmp_path / "ck"), tmp_path / "run.json"
    sched = ("--lr-schedule", "step", "--lr-step-epochs", "1,2", "--lr-step-factor", "0.5")
    args = [*SMOKE, *sched, "--checkpoint-dir", ck, "--output", str(out)]
    ok(run_trainer("torch-dp", *args, "--epochs", "2"))
    first = read_json(out)
    files = lambda: {p.name: p.stat().st_mtime_ns for p in Path(ck).iterdir() if p.name != ".lock"}  # noqa: E731
    before = files()
    capsys.readouterr()
    assert main([*args, "--epochs", "1", "--resume"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "is after epoch 2 but --epochs is 1; resume with --epochs 2 or more" in line
    assert read_json(out) == first  # nothing written, the checkpoint untouched
    assert files() == before
    ok(run_trainer("torch-dp", *args, "--epochs", "3", "--resume"))
    rec = read_json(out)
    assert rec["config"]["epochs"] == 3 and [e["epoch"] for e in rec["epochs"]] == [1, 2, 3]
    assert rec["epochs"][:2] == first["epochs"]  # the first process's rows, kept as they were
    assert [e["timed"] for e in rec["epochs"]] == [False, True, False]
    assert rec["sec_per_epoch"] == pytest.approx(rec["epochs"][1]["sec"])
    cfg = preset("smoke", lr_schedule="step", lr_step_epochs=(1, 2), lr_step_factor=0.5)
    steps = rec["epochs"][0]["images"] // cfg.batch_size
    table = lr_table_for(cfg.replace(epochs=3), steps)
    assert [e["lr"] for e in rec["epochs"]] == pytest.approx([0.05, 0.025, 0.0125])
    for e in rec["epochs"]:
        assert e["lr"] == pytest.approx(table[(e["epoch"] - 1) * steps])
        assert e["lr_last"] == pytest.approx(table[e["epoch"] * steps - 1])


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """`trained(framework)`: a folder holding ck/ (its checkpoint after the smoke preset's 2
    epochs of 1 step) and data/, made once per module."""
    made: dict[str, Path] = {}

    def make(framework: str) -> Path:
        if framework not in made:
            root = tmp_path_factory.mktemp(framework)
            args = ("--checkpoint-dir", str(root / "ck"), "--data-dir", str(root / "data"))
            ok(run_trainer(framework, *SMOKE, "--max-steps-per-epoch", "1", *args, timeout=120))
            made[framework] = root
        return made[framework]

    return make


@pytest.mark.parametrize("framework,name", [("torch-dp", "torch-dp.pt"),
                                            ("jax-pmap", "jax-pmap.msgpack")])  # fmt: skip
@pytest.mark.parametrize("damage", ["bits flipped", "cut short"])
def test_a_damaged_checkpoint_is_one_line_and_nothing_trained(
    framework: str, name: str, damage: str, trained: Callable[[str], Path], tmp_path: Path
) -> None:
    """A checkpoint whose content is not what was written (a disk's flipped bits, a copy cut
    short): one line naming it (its sha256), exit 2, nothing trained or written."""
    root, ck = trained(framework), tmp_path / "ck"
    shutil.copytree(root / "ck", ck, ignore=shutil.ignore_patterns(".lock"))
    path = ck / name
    data = bytearray(path.read_bytes())
    if damage == "bits flipped":
        data[len(data) // 2] ^= 0x10
    else:
        del data[len(data) // 2 :]
    path.write_bytes(bytes(data))
    out = tmp_path / "run.json"
    proc = run_trainer(framework, *SMOKE, "--max-steps-per-epoch", "1", "--checkpoint-dir",
                       str(ck), "--data-dir", str(root / "data"), "--resume", "--epochs", "3",
                       "--output", str(out), timeout=60)  # fmt: skip
    one_line_error(proc, f"checkpoint {path}", "sha256", "drop --resume")
    assert "Traceback" not in proc.stderr and not out.exists()
    assert path.read_bytes() == bytes(data)
