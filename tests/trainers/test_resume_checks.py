"""Hostile loads (issue 29, reliability round two): everything the project loads (checkpoints,
the init cache, dataset files and their verification marker) belongs to this run and
is read bounded (common/safe_io.py; the checks: common/trainer.py, common/init.py,
common/datasets.py).

- silently wrong results: a resume on another device count; an init cache of zeros, or another
  seed's under this one's name; a JAX checkpoint of float16 (or int32) parameters, or whose
  epoch counter went back (or below 0); a hand-written `.verified.json`, or a file rewritten
  with its mtime set back;
- unbounded memory and hangs: an init-cache member that inflates; a checkpoint that is a FIFO, a
  link to /dev/zero or larger than its configuration can need: one line, exit 2, at once.

MXNet's side: tests/mxnet/test_mxnet_hostile_loads.py.
"""

from __future__ import annotations

import importlib
import io
import json
import os
import shutil
import time
import tracemalloc
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import common.init as init_module
from common import cli, datasets
from common.checkpoints import checkpoint_meta, restore_meta
from common.config import ConfigError, preset
from common.datasets import DatasetError
from common.init import cache_key, digest, draw, initial_state, parameter_spec
from common.results import RunRecorder
from tests.common.test_dataset_files import _official
from tests.conftest import (
    SMOKE,
    deadline,
    module_of,
    ok,
    one_line_error,
    payload,
    reseal,
    reseal_index,
    run_trainer,
    skip_without_interpreter,
)

# ---- helpers ---------------------------------------------------------------------------------


def files(directory: Path) -> dict[str, bytes]:
    """The contents of `directory`'s regular files but the lock every run takes."""
    return {
        p.name: p.read_bytes()
        for p in sorted(directory.iterdir())
        if p.name != ".lock" and p.is_file() and not p.is_symlink()
    }


def the_error(err: str) -> str:
    """The one line of a refused in-process run, with no traceback."""
    assert "Traceback" not in err, err
    (line,) = err.strip().splitlines()  # (torch-dp's CPU note is on stdout)
    return line


def refused_at_once(proc: Any, seconds: float, *fragments: str) -> str:
    """Exit 2, one line naming the problem, and soon (a hang ends at the subprocess timeout)."""
    line = one_line_error(proc, *fragments)
    assert "Traceback" not in proc.stderr
    assert seconds < 20, f"took {seconds:.1f} s"
    return line


def timed_trainer(
    framework: str, *args: str, env: dict[str, str] | None = None
) -> tuple[Any, float]:
    start = time.perf_counter()
    proc = run_trainer(framework, *args, env=env, timeout=30)
    return proc, time.perf_counter() - start


def inflating_member(path: Path, name: str, nbytes: int) -> None:
    """Append a member to zip `path` whose header claims an .npy of `nbytes` bytes of zeros:
    a few hundred KB on disk, `nbytes` once inflated."""
    with zipfile.ZipFile(path, "a", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        with z.open(name, "w", force_zip64=True) as member:
            head = io.BytesIO()
            np.lib.format.write_array_header_1_0(
                head, {"descr": "|u1", "fortran_order": False, "shape": (nbytes,)}
            )
            member.write(head.getvalue())
            block = bytes(1 << 22)
            for _ in range(nbytes >> 22):
                member.write(block)


# ---- resume: the same run, on the same devices -------------------------------------------------


@pytest.fixture(scope="module")
def torch_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A torch-dp checkpoint after the smoke preset's 2 epochs. Trained in a process of its
    own, as every training run of this file: on the first GPU machine (torch 2.11.0+cu130, a
    16-core Xeon) torch's CPU backward aborted inside pytest-xdist workers (double free), and
    a dead worker ends the whole session (xdist's loadfile scheduler fails on its
    replacement); a dead trainer fails one test. The refusals, which train nothing, stay
    in-process."""
    root = tmp_path_factory.mktemp("torch-ckpt")
    data = root / "data"
    ok(
        run_trainer(
            "torch-dp", *SMOKE, "--checkpoint-dir", str(root / "ck"), "--data-dir", str(data)
        )
    )
    return root / "ck"


def torch_args(ck: Path, out: Path, *extra: str) -> list[str]:
    data = ck.parent / "data"
    return [*SMOKE, "--checkpoint-dir", str(ck), "--data-dir", str(data), "--output", str(out),
            "--resume", "--epochs", "3", *extra]  # fmt: skip


def test_a_resume_on_another_device_count_is_refused_and_writes_nothing(
    torch_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from frameworks.torch_dp import main

    ck = tmp_path / "ck"
    shutil.copytree(torch_ckpt, ck)
    ck.joinpath(".lock").unlink(missing_ok=True)
    before, out = files(ck), tmp_path / "run.json"
    capsys.readouterr()
    for flags, named in [
        (("--gpus", "2"), "--gpus 1 (now 2)"),
        (("--prefetch", "3"), "--prefetch"),
    ]:
        assert main(torch_args(ck, out, *flags)) == 2
        line = the_error(capsys.readouterr().err)
        assert "is from another run" in line and named in line, line
        assert files(ck) == before and not out.exists()
    ok(run_trainer("torch-dp", *torch_args(ck, out)))  # the same settings: resumed (trains)
    assert [e["epoch"] for e in json.loads(out.read_text())["epochs"]] == [1, 2, 3]


def test_a_checkpoint_made_elsewhere_is_refused_naming_what_differs() -> None:
    """What the config does not say: the devices seen, their kind, the library versions."""
    cfg = preset("smoke", framework="torch-dp")
    made = RunRecorder(
        cfg, devices=1, device_kind="cpu", params=0, is_main=False, packages=("torch",)
    )
    made.end_epoch(0, 1.0, 96, 2.3, 1, 10, 23.0)
    meta = json.loads(json.dumps(checkpoint_meta(cfg, made, 0, 4)))  # as saved
    same = RunRecorder(
        cfg, devices=1, device_kind="cpu", params=0, is_main=False, packages=("torch",)
    )
    assert restore_meta(meta, same, Path("ck.pt")) == (1, 4)
    other = RunRecorder(cfg, devices=2, device_kind="cuda:H100", params=0, is_main=False,
                        packages=("torch",))  # fmt: skip
    with pytest.raises(ConfigError, match=r"devices 1 \(now 2\); device kind 'cpu'"):
        restore_meta(meta, other, Path("ck.pt"))
    old = json.loads(json.dumps(meta))
    old["run"]["versions"]["torch"] = "1.0.0"
    with pytest.raises(ConfigError, match=r"versions .*'torch': '1.0.0'"):
        restore_meta(old, same, Path("ck.pt"))


# ---- checkpoints: what they hold -------------------------------------------------------------


@pytest.mark.parametrize(
    "tamper,fragment",
    [("fp16", "conv1.weight is torch.float16[8, 3, 3, 3] where this model has torch.float32["),
     ("zeros", "conv1.weight is all zeros"),
     ("nan", "NaN or infinite"),
     ("step", "its step counter 5 disagrees with the 8 steps"),
     ("epoch", "its epoch counter -1 is outside 0..3")],
)  # fmt: skip
def test_a_tampered_torch_checkpoint_is_one_line_and_exit_2(
    torch_ckpt: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], tamper: str, fragment: str
) -> None:
    """load_state_dict casts a float16 tensor into the model and takes zeros or NaN as they are,
    and the counters as they are; refused instead, with nothing written."""
    import torch

    from frameworks.torch_dp import main

    ck = tmp_path / "ck"
    shutil.copytree(torch_ckpt, ck)
    ckpt = torch.load(io.BytesIO(payload(ck / "torch-dp.pt")), weights_only=True)
    model = ckpt["model"]
    if tamper == "fp16":
        ckpt["model"] = {k: v.half() if v.is_floating_point() else v for k, v in model.items()}
    elif tamper in ("zeros", "nan"):
        model["conv1.weight"] = model["conv1.weight"] * (0 if tamper == "zeros" else float("nan"))
    elif tamper == "epoch":
        ckpt["epoch"] = -1  # was (before the checks): a traceback from numpy's seeding
    else:
        ckpt["step"] = 5
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    reseal(ck / "torch-dp.pt", buf.getvalue())  # a matching sha256: the checks behind it
    before, out = files(ck), tmp_path / "run.json"
    capsys.readouterr()
    assert main(torch_args(ck, out)) == 2
    line = the_error(capsys.readouterr().err)
    assert fragment in line, line
    assert files(ck) == before and not out.exists()


@pytest.fixture(scope="module")
def jax_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A jax-pmap checkpoint after 2 epochs of one step (a subprocess: ~5 s)."""
    ck = tmp_path_factory.mktemp("jax-ckpt") / "ck"
    proc = run_trainer("jax-pmap", *jax_args(ck))
    assert proc.returncode == 0, proc.stderr[-2000:]
    return ck


def jax_args(ck: Path) -> list[str]:
    return [*SMOKE, "--max-steps-per-epoch", "1", "--checkpoint-dir",
            str(ck), "--data-dir", str(ck.parent / "data")]  # fmt: skip


def tamper_msgpack(path: Path, how: str) -> None:
    from flax import serialization

    ckpt = serialization.msgpack_restore(payload(path))
    meta = json.loads(ckpt["meta"])

    def each(tree: dict[str, Any], f: Any) -> dict[str, Any]:
        return {k: each(v, f) if isinstance(v, dict) else f(k, v) for k, v in tree.items()}

    if how in ("fp16", "int32"):
        ckpt["state"]["params"] = each(
            ckpt["state"]["params"], lambda k, a: a.astype(how.replace("fp", "float"))
        )
    elif how == "zeros":
        ckpt["state"]["params"] = each(ckpt["state"]["params"], lambda k, a: np.zeros_like(a))
    elif how == "backwards":
        meta["epoch"] = 1  # the record keeps epochs 1 and 2: it would then list 1, 2, 2, 3
    elif how == "negative":
        meta["epoch"] = -1
    ckpt["meta"] = json.dumps(meta)
    reseal(path, serialization.msgpack_serialize(ckpt))  # a matching sha256


@pytest.mark.parametrize(
    "how,fragment",
    [("fp16", "is float16[8] where this model has float32[8]"),
     ("int32", "is int32[8] where this model has float32[8]"),
     ("zeros", "is all zeros"),
     ("backwards", "its epoch counter 1 disagrees with the epochs its record holds (1, 2)"),
     ("negative", "its epoch counter -1 is outside 0..3")],
)  # fmt: skip
def test_a_tampered_jax_checkpoint_is_one_line_and_exit_2(
    jax_ckpt: Path, tmp_path: Path, how: str, fragment: str
) -> None:
    """float16 parameters used to train, int32 ones to fail inside the step (a traceback), an
    epoch counter moved back to be accepted (the record then listed an epoch twice), a negative
    one to fail in numpy's seeding (a traceback)."""
    ck = tmp_path / "ck"
    shutil.copytree(jax_ckpt, ck)
    ck.joinpath(".lock").unlink(missing_ok=True)
    tamper_msgpack(ck / "jax-pmap.msgpack", how)
    before, out = files(ck), tmp_path / "run.json"
    proc, sec = timed_trainer("jax-pmap", *jax_args(ck), "--resume", "--epochs", "3",
                              "--output", str(out))  # fmt: skip
    refused_at_once(proc, sec, f"checkpoint {ck / 'jax-pmap.msgpack'}", fragment)
    assert files(ck) == before and not out.exists()


# ---- checkpoints that are no file: one line at once, nothing read ------------------------------

CHECKPOINT = {"torch-dp": "torch-dp.pt", "torch-ddp": "torch-ddp.pt",
              "jax-pmap": "jax-pmap.msgpack", "jax-shard": "jax-shard.msgpack"}  # fmt: skip


@pytest.mark.parametrize(
    "framework,kind,fragment",
    [("torch-dp", "fifo", "is a FIFO, not a file"),
     ("torch-ddp", "fifo", "is a FIFO, not a file"),
     ("jax-pmap", "fifo", "is a FIFO, not a file"),
     ("jax-shard", "fifo", "is a FIFO, not a file"),
     ("jax-pmap", "dev-zero", "is a character device, not a file"),
     ("torch-ddp", "dev-zero", "is a character device, not a file"),
     ("jax-shard", "oversized", "bytes, more than this configuration's checkpoint can hold")],
)  # fmt: skip
def test_a_checkpoint_that_is_no_file_is_refused_at_once(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], framework: str, kind: str, fragment: str
) -> None:
    """A FIFO blocked the reader for ever (torch-ddp, jax-pmap); a link to /dev/zero grew to
    6 GB before failing (JAX); a sparse 1 TB file would be read whole."""
    ck = tmp_path / "ck"
    ck.mkdir()
    path = ck / CHECKPOINT[framework]
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "dev-zero":
        path.symlink_to("/dev/zero")
    else:
        with open(path, "wb") as f:
            f.truncate(1 << 40)  # sparse: no disk used
    out = tmp_path / "run.json"
    args = [*SMOKE, "--checkpoint-dir", str(ck), "--resume", "--output", str(out)]
    if framework.startswith("torch"):  # in-process (the check runs before any worker starts)
        main = importlib.import_module(module_of(framework)).main
        start = time.perf_counter()
        with deadline(20):
            assert main(args) == 2
        sec, line = time.perf_counter() - start, the_error(capsys.readouterr().err)
        assert f"checkpoint {path}" in line and fragment in line, line
        assert sec < 20
    else:
        proc, sec = timed_trainer(framework, *args)
        refused_at_once(proc, sec, f"checkpoint {path}", fragment, "delete it or drop --resume")
    assert sorted(p.name for p in ck.iterdir()) == [path.name] and not out.exists()


# ---- the init cache --------------------------------------------------------------------------


def init_cfg(tmp_path: Path, seed: int = 0) -> Any:
    return preset("smoke", data_dir=str(tmp_path), seed=seed)


def fresh_initial_state(cfg: Any) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    init_module._initial_state.cache_clear()  # as a new process: read the file
    return initial_state(cfg, 3, 10)


def test_an_init_cache_of_zeros_is_drawn_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Its shapes were right, so the run used to start from zeros."""
    cfg = init_cfg(tmp_path)
    want, info = fresh_initial_state(cfg)
    path = Path(info["file"])
    spec = parameter_spec(cfg.model, cfg.width, 3, 10)
    zeros = {name: np.zeros_like(want[name]) for name, _, _ in spec}
    for forged in (False, True):  # as written by hand; with a key naming the zeros' digest
        np.savez(path, **zeros)
        if forged:
            with zipfile.ZipFile(path, "a") as archive:
                archive.comment = cache_key(cfg.model, cfg.width, 3, 10, cfg.seed, digest(zeros))
        got, info = fresh_initial_state(cfg)
        assert info["sha256"] == digest(draw(spec, cfg.seed)) and digest(got) == info["sha256"]
        why = "conv1.weight is all zeros" if forged else "it holds no key"
        assert f"note: init cache {path} drawn again ({why}" in capsys.readouterr().err
        assert digest(fresh_initial_state(cfg)[0]) == info["sha256"]  # the file was replaced
        assert capsys.readouterr().err == ""


def test_another_seeds_init_cache_under_this_name_is_drawn_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The name is not the key: seed 1's arrays copied to seed 0's file name."""
    mine, theirs = init_cfg(tmp_path), init_cfg(tmp_path, seed=1)
    want, info = fresh_initial_state(mine)
    other = Path(fresh_initial_state(theirs)[1]["file"])
    shutil.copyfile(other, info["file"])
    got, again = fresh_initial_state(mine)
    assert again["sha256"] == info["sha256"] and digest(got) == digest(want)
    assert '"seed": 1' in capsys.readouterr().err


def test_an_init_cache_member_that_would_inflate_is_refused_by_its_header(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An extra member of 128 MiB (about 130 KB on disk): refused by ZipInfo.file_size before
    anything is inflated; in a trainer one line, exit 2, no record. (The reported file took a
    run's peak memory from 1.1 to 3.9 GB.)"""
    from frameworks.torch_dp import main

    cfg = init_cfg(tmp_path)
    path = Path(fresh_initial_state(cfg)[1]["file"])
    inflating_member(path, "extra.npy", 128 << 20)
    init_module._initial_state.cache_clear()
    tracemalloc.start()
    try:
        with pytest.raises(ConfigError, match=r"holds a member 'extra.npy' that no init cache has"):
            initial_state(cfg, 3, 10)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak >> 20} MiB read"
    init_module._initial_state.cache_clear()
    out = tmp_path / "run.json"
    capsys.readouterr()
    start = time.perf_counter()
    assert main([*SMOKE, "--data-dir", str(tmp_path), "--output", str(out)]) == 2
    assert time.perf_counter() - start < 20
    line = the_error(capsys.readouterr().err)
    assert f"init cache {path} holds a member 'extra.npy'" in line and not out.exists()


@pytest.mark.parametrize("kind", ["fifo", "oversized member"])
def test_an_init_cache_that_is_no_file_or_too_large_is_one_line(tmp_path: Path, kind: str) -> None:
    cfg = init_cfg(tmp_path)
    path = Path(fresh_initial_state(cfg)[1]["file"])
    if kind == "fifo":
        path.unlink()
        os.mkfifo(path)
    else:  # this model's own member, its header claiming more than the array needs
        arrays = dict(np.load(path))
        arrays.pop("fc.bias")
        np.savez(path, **arrays)
        inflating_member(path, "fc.bias.npy", 64 << 20)
    init_module._initial_state.cache_clear()
    fragment = "is a FIFO, not a file" if kind == "fifo" else "member fc.bias.npy inflates to"
    with deadline(10), pytest.raises(ConfigError, match=fragment) as refused:
        initial_state(cfg, 3, 10)
    assert "\n" not in str(refused.value)


# ---- the JAX step cache ------------------------------------------------------------------------


# ---- the dataset's verification marker ---------------------------------------------------------


def rewrite_keeping_size_and_mtime(path: Path) -> None:
    """Flip one bit of the gzip stream's start and set the mtime back (as `cp -p`, `touch -r`,
    or a hand-edited file would)."""
    st = path.stat()
    raw = bytearray(path.read_bytes())
    raw[20] ^= 1
    path.write_bytes(bytes(raw))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns


def test_a_hand_written_verification_marker_does_not_skip_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _official(monkeypatch, tmp_path)
    md5 = datasets.SOURCES["cifar10"][path.name][1]
    rewrite_keeping_size_and_mtime(path)
    st = path.stat()
    marker = path.parent / datasets.VERIFIED
    marker.write_text(json.dumps({path.name: [st.st_size, st.st_mtime_ns, md5]}))
    assert_md5_is_checked(tmp_path)


def test_a_verified_file_rewritten_with_its_mtime_set_back_is_verified_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = _official(monkeypatch, tmp_path)
    datasets.load("cifar10", str(tmp_path), download=False)  # verified, marker written
    assert json.loads((path.parent / datasets.VERIFIED).read_text())[path.name]
    rewrite_keeping_size_and_mtime(path)
    assert_md5_is_checked(tmp_path)


def assert_md5_is_checked(data_dir: Path) -> None:
    """Loading CIFAR-10 from `data_dir` hashes the file again and refuses it."""
    with pytest.raises(DatasetError, match="has MD5 .*, the official cifar-10-python.tar.gz has"):
        datasets.load("cifar10", str(data_dir), download=False)


# ---- checkpoints: corrupt or foreign, one line, exit 2, nothing trained ------------------------

CHECKPOINT_FILES = {
    "torch-dp": "torch-dp.pt",
    "jax-pmap": "jax-pmap.msgpack",
    "mxnet-gluon": "mxnet-gluon.json",
}


@pytest.mark.parametrize("framework", list(CHECKPOINT_FILES))
def test_a_corrupt_checkpoint_is_one_line_and_exit_2(framework, tmp_path) -> None:
    skip_without_interpreter(framework)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    rng = np.random.default_rng(0)
    (ckpt / CHECKPOINT_FILES[framework]).write_bytes(rng.bytes(4096))
    out = tmp_path / "run.json"
    args = (*SMOKE, "--checkpoint-dir", str(ckpt), "--resume", "--output", str(out))
    line = one_line_error(run_trainer(framework, *args), "cannot read checkpoint", "--resume")
    assert "weights_only" not in line  # torch's advice to unpickle anyway is not repeated
    assert not out.exists()


def test_an_mxnet_index_naming_a_corrupt_states_file_is_refused_before_training(tmp_path):
    """The index is valid JSON of this run, the weights file is garbage: refused by the check
    before the run (it used to fail at load time with MXNet's C++ text, exit 1)."""
    skip_without_interpreter("mxnet-gluon")
    cfg = cli.parse_args([*SMOKE, "--checkpoint-dir", str(tmp_path)], "mxnet-gluon")
    index = {"params": "w.params", "states": "w.states", "epoch": 1, "step": 4}
    (tmp_path / "w.params").write_bytes(b"\x12\x01" * 100)
    (tmp_path / "w.states").write_bytes(b"\x12\x01" * 100)
    (tmp_path / "mxnet-gluon.json").write_text("{}")
    reseal_index(tmp_path / "mxnet-gluon.json", **index, config=cfg.to_dict())  # digests match
    args = (*SMOKE, "--checkpoint-dir", str(tmp_path), "--resume")
    line = one_line_error(run_trainer("mxnet-gluon", *args), "cannot read checkpoint")
    assert "Invalid NDArray file format" in line and "Traceback" not in line
