"""The hostile sweep of issue 29: every case of the issue's list (its five groups) and the cases
of the same kind found since, each run as a careless or hostile user would run it, in a child
process with a small file or environment made in a temporary directory.

    .venv/bin/python scripts/hostile_sweep.py [--only SUBSTRING] [--keep]

The cases are listed in scripts/hostile_cases.toml (its head says what a case's keys mean); this
script holds what runs them: the runners, the set-ups a case names (SETUPS) and the further
checks (CHECKS). Each case checks: the exit code (2 bad input, 1 a runtime failure, 0 where the
right answer is to go on: a cache drawn again, TensorBoard turned off), no 'Traceback' in stdout
or stderr, the last line of stderr (stdout where stderr is empty) saying what the case is about,
the time bound (a hang was the failure of several), and nothing left behind (no temporary or
partial file, no record where bad input must write none). The MXNet cases run in .venv-mxnet. A
full disk is a child whose file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes writes past it
fail with EFBIG. Prints a table and the totals; exit 0 when every case is clean. Not part of
the test suite (tests/test_hostile_inputs*.py hold the unit tests): it takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
MAIN = ROOT / ".venv" / "bin" / "python"
MXNET = ROOT / ".venv-mxnet" / "bin" / "python"
SMOKE = ["--preset", "smoke", "--prefetch", "1"]
LONG = "x" * 300  # a component over NAME_MAX: ENAMETOOLONG
PARTIAL = re.compile(r"\.tmp\d*$|\.part$|\.[A-Za-z0-9_]{8}\.tmp\d+$")


@dataclass
class Case:
    name: str
    group: str  # the group 1..5, "+" beyond its list
    expect: int
    argv: list[str]  # the command, "{d}" standing for the case's directory
    fragment: str  # what the last line must say ("" = any)
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None
    bound: float = 60.0
    absent: tuple[str, ...] = ()  # paths (relative to the case's directory) that must not exist
    fsize: int | None = None  # RLIMIT_FSIZE: a full disk at this many bytes per file
    background: bool = False  # SIGINT ignored, no terminal, own session: a background job
    check: Callable[[Path, subprocess.CompletedProcess[str]], str | None] | None = None
    anywhere: bool = False  # the fragment may be on any line (a run that goes on)


def trainer(framework: str, *args: str) -> list[str]:
    python = MXNET if framework == "mxnet-gluon" else MAIN
    return [str(python), "-m", f"frameworks.{framework.replace('-', '_')}", *args]


def in_dir(argv: list[str], d: Path) -> list[str]:
    return [a.replace("{d}", str(d)) for a in argv]


def child_env(extra: dict[str, str]) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    env.pop("XLA_FLAGS", None)
    env.update({"DPBENCH_DEVICES": "cpu", "CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": "cpu"})
    env.update(extra)
    return env


def must_run(argv: list[str], d: Path) -> None:
    """A set-up step (a first run that makes a checkpoint or a cache): it must succeed."""
    argv = in_dir(argv, d)
    proc = subprocess.run(argv, cwd=ROOT, env=child_env({}), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"set-up {' '.join(argv[:4])} failed: {proc.stderr[-500:]}")


# ---- set-ups (a case's `setup = [NAME, ARGUMENT...]`: NAME(d, ARGUMENT...)) -------------------


def a_file(d: Path) -> None:
    (d / "file").write_text("x")


def a_fifo(d: Path, name: str) -> None:
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(d / name)


def a_link_to_dev_zero(d: Path, name: str) -> None:
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    (d / name).symlink_to("/dev/zero")


JAX_CKPT = [*SMOKE, "--max-steps-per-epoch", "1", "--no-compile-cache", "--checkpoint-dir",
            "{d}/ck", "--data-dir", "{d}/data"]  # fmt: skip


def jax_checkpoint(d: Path, how: str) -> None:
    """A JAX checkpoint, tampered with `how` (tests/test_hostile_loads.py's tamper_msgpack)."""
    from tests.test_hostile_loads import tamper_msgpack

    must_run(trainer("jax-pmap", *JAX_CKPT), d)
    (d / "ck" / ".lock").unlink(missing_ok=True)
    tamper_msgpack(d / "ck" / "jax-pmap.msgpack", how)


def torch_checkpoint_negative_epoch(d: Path) -> None:
    import torch

    must_run(trainer("torch-dp", *SMOKE, "--checkpoint-dir", "{d}/ck", "--data-dir", "{d}/data"), d)
    path = d / "ck" / "torch-dp.pt"
    ckpt = torch.load(path, weights_only=True)
    ckpt["epoch"] = -1
    torch.save(ckpt, path)


def resumed_on_one_device(d: Path) -> None:
    must_run(trainer("jax-pmap", *JAX_CKPT, "--gpus", "1", "--epochs", "1"), d)


def init_cache(d: Path) -> Path:
    must_run(trainer("torch-dp", *SMOKE, "--epochs", "1", "--data-dir", "{d}/data"), d)
    (path,) = (d / "data" / "init").glob("*.npz")
    return path


def init_cache_of_zeros(d: Path) -> None:
    import numpy as np

    path = init_cache(d)
    with np.load(path) as f:
        arrays = {k: np.zeros_like(f[k]) for k in f.files}
    path.unlink()
    np.savez(path, **arrays)


def init_cache_that_inflates(d: Path) -> None:
    from tests.test_hostile_loads import inflating_member

    inflating_member(init_cache(d), "extra.npy", 256 << 20)


def step_cache_under_another_name(d: Path) -> None:
    """config A's exported step copied over config B's file name."""
    base = [*SMOKE, "--max-steps-per-epoch", "1", "--epochs", "1", "--cache-dir", "{d}/c"]
    must_run(trainer("jax-pmap", *base), d)
    a = set((d / "c" / "jax-steps").glob("*"))
    must_run(trainer("jax-pmap", *base, "--bn", "sync"), d)
    b = set((d / "c" / "jax-steps").glob("*")) - a
    (file_a,), (file_b,) = [p for p in a if p.is_file()], [p for p in b if p.is_file()]
    shutil.copyfile(file_a, file_b)


def fashion_mnist_with_a_hand_written_marker(d: Path) -> None:
    """Files that are not the official ones, and a marker claiming they were verified (their
    true size, times and inode, the official MD5, a made-up sample hash)."""
    from common.datasets import SOURCES, VERIFIED

    root = d / "data" / "fashion-mnist"
    root.mkdir(parents=True)
    marker = {}
    for filename, (_, md5) in SOURCES["fashion-mnist"].items():
        path = root / filename
        path.write_bytes(b"not the official file")
        st = path.stat()
        marker[filename] = [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, md5, "0" * 64]
    (root / VERIFIED).write_text(json.dumps(marker))


def truncated(path: Path) -> None:
    path.write_text('{"framework": "torch-dp", "stat')


MAKERS: dict[str, Callable[[Path], None]] = {
    "truncated": truncated,
    "fifo": os.mkfifo,
    "/dev/zero": lambda p: p.symlink_to("/dev/zero"),
}


def a_comparison_with(d: Path, name: str, made: str) -> None:
    """A comparison's directory d/out as compare writes it (config.json, runs/), no run made,
    its file `name` then made again as MAKERS[made] makes it."""
    from benchmarks import harness
    from tests.hostile_helpers import a_comparison

    harness.unavailable = lambda names: {}  # type: ignore[assignment]  # no probe needed
    harness.detect_gpus = lambda: []  # type: ignore[assignment]
    a_comparison(d / "out")
    path = d / "out" / name
    path.unlink(missing_ok=True)
    MAKERS[made](path)


SETUPS: dict[str, Callable[..., None]] = {
    f.__name__: f
    for f in (
        a_file,
        a_fifo,
        a_link_to_dev_zero,
        jax_checkpoint,
        torch_checkpoint_negative_epoch,
        resumed_on_one_device,
        init_cache_of_zeros,
        init_cache_that_inflates,
        step_cache_under_another_name,
        fashion_mnist_with_a_hand_written_marker,
        a_comparison_with,
    )
}


# ---- checks (a case's `check = NAME`: CHECKS[NAME](d, proc)) ----------------------------------


def failed_record(epochs: int | None = None) -> Callable[[Path, object], str | None]:
    def check(d: Path, proc: object) -> str | None:
        try:
            record = json.loads((d / "r.json").read_text())
        except (OSError, ValueError) as exc:
            return f"no failed record ({exc})"
        if record.get("status") != "failed":
            return f"record status {record.get('status')!r}"
        if epochs is not None and len(record.get("epochs", [])) != epochs:
            return f"record keeps {len(record.get('epochs', []))} epochs, not {epochs}"
        return None

    return check


def only_the_lock(d: Path, proc: object) -> str | None:
    left = sorted(p.name for p in (d / "ck").iterdir())
    return None if left == [".lock"] else f"left in ck/: {left}"


def both(*checks: Callable[[Path, object], str | None]) -> Callable[[Path, object], str | None]:
    return lambda d, proc: next((w for c in checks if (w := c(d, proc))), None)


CHECKS = {
    "failed_record": failed_record(),
    "failed_after_1_epoch_only_the_lock_left": both(failed_record(1), only_the_lock),
}

HELD: list[socket.socket] = []  # listening sockets, held open for the whole sweep


def busy_port() -> int:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    HELD.append(s)
    return int(s.getsockname()[1])


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- the cases: scripts/hostile_cases.toml ----------------------------------------------------

CASES = Path(__file__).with_name("hostile_cases.toml")
OUT = ["--output", "{d}/r.json"]
CK2 = [*SMOKE, "--epochs", "2", *OUT, "--checkpoint-dir", "{d}/ck"]
RESUME = [*JAX_CKPT, "--resume", "--epochs", "3", *OUT]
LISTS = {"SMOKE": SMOKE, "OUT": OUT, "CK2": CK2, "JAX_CKPT": JAX_CKPT, "RESUME": RESUME}
KEYS = {"name", "group", "expect", "command", "fragment", "env", "setup", "bound", "absent",
        "fsize", "background", "check", "anywhere"}  # fmt: skip


def replaced(text: str, words: dict[str, str]) -> str:
    for word, value in words.items():
        text = text.replace(word, value)
    return text


def command(words: list[str], texts: dict[str, str]) -> list[str]:
    """A case's `command`: the runner's words, then its arguments ("*NAME": LISTS[NAME], the
    texts' names replaced)."""
    kind, _, what = words[0].partition(" ")
    if kind == "trainer":
        argv = trainer(what)
    elif kind == "tool":
        argv = [str(MAIN), "-m", f"benchmarks.{what}"]
    elif kind == "python" and what in ("", "mxnet"):
        argv = [str(MXNET if what else MAIN)]
    else:
        raise ValueError(f"{CASES.name}: no runner {words[0]!r}")
    for word in words[1:]:
        argv.extend(LISTS[word[1:]] if word.startswith("*") else [replaced(word, texts)])
    return argv


def a_setup(name: str, *args: str) -> Callable[[Path], None]:
    make = SETUPS[name]
    return lambda d: make(d, *args)


def cases() -> list[Case]:
    try:
        import tomllib  # Python 3.11
    except ModuleNotFoundError:
        sys.exit("hostile_sweep.py: error: reading scripts/hostile_cases.toml needs Python 3.11+ "
                 "(tomllib); run it with .venv/bin/python")  # fmt: skip

    from tests.hostile_helpers import MXNET_STATES_FAIL

    texts = {"{long}": LONG, "{main}": str(MAIN), "{mxnet_states_fail}": MXNET_STATES_FAIL}
    with open(CASES, "rb") as f:
        tables = tomllib.load(f)["case"]
    ports = {"{closed_port}": str(closed_port()), "{busy_port}": str(busy_port())}
    chosen = []
    for t in tables:
        if unknown := set(t) - KEYS:
            raise ValueError(f"{CASES.name}: {t.get('name')!r}: unknown {sorted(unknown)}")
        chosen.append(Case(
            t["name"], t["group"], t["expect"], command(t["command"], texts), t["fragment"],
            env={k: replaced(v, ports) for k, v in t.get("env", {}).items()},
            setup=a_setup(*t["setup"]) if "setup" in t else None,
            bound=float(t.get("bound", 60.0)),
            absent=tuple(t.get("absent", ())),
            fsize=t.get("fsize"),
            background=t.get("background", False),
            check=CHECKS[t["check"]] if "check" in t else None,
            anywhere=t.get("anywhere", False),
        ))  # fmt: skip
    return chosen


# ---- running ---------------------------------------------------------------------------------


def preexec(case: Case) -> Callable[[], None] | None:
    if case.fsize is None and not case.background:
        return None

    def set_up() -> None:
        if case.fsize is not None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit: EFBIG
            resource.setrlimit(resource.RLIMIT_FSIZE, (case.fsize, case.fsize))
        if case.background:  # as `(cmd &)` or nohup starts it
            signal.signal(signal.SIGINT, signal.SIG_IGN)

    return set_up


def last_line(proc: subprocess.CompletedProcess[str]) -> str:
    for text in (proc.stderr, proc.stdout):
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if lines:
            return lines[-1].strip()
    return ""


def run_case(case: Case, d: Path) -> tuple[str, float, list[str], str]:
    """(got, seconds, problems, last line)."""
    try:
        if case.setup is not None:
            case.setup(d)
    except Exception as exc:  # noqa: BLE001 (a set-up that fails is reported, not fatal)
        return "setup", 0.0, [f"set-up failed: {exc}"], ""
    argv = in_dir(case.argv, d)
    start = time.monotonic()
    try:
        proc = subprocess.run(argv, cwd=ROOT, env=child_env(case.env), capture_output=True,
                              text=True, timeout=case.bound + 60, preexec_fn=preexec(case),
                              stdin=subprocess.DEVNULL,
                              start_new_session=case.background)  # fmt: skip
    except subprocess.TimeoutExpired:
        waited = time.monotonic() - start
        return "hang", waited, [f"still running after {waited:.0f} s"], ""
    sec = time.monotonic() - start
    problems = []
    if proc.returncode != case.expect:
        problems.append(f"exit {proc.returncode}")
    if "Traceback" in proc.stdout + proc.stderr:
        problems.append("a traceback")
    line = last_line(proc)
    text = proc.stdout + proc.stderr if case.anywhere else line
    if case.fragment and case.fragment not in text:
        problems.append(f"no {case.fragment!r}")
    if not case.anywhere and proc.returncode != 0 and proc.stderr.strip().count("\n") > 0:
        err = [ln for ln in proc.stderr.splitlines()
               if ln.strip() and not ln.startswith(("warning:", "note:"))]  # fmt: skip
        if case.expect == 2 and len(err) > 1:
            problems.append(f"{len(err)} stderr lines")
    if sec > case.bound:
        problems.append(f"{sec:.0f} s > {case.bound:.0f} s")
    partial = [str(p.relative_to(d)) for p in d.rglob("*") if PARTIAL.search(p.name)]
    if partial:
        problems.append(f"left {partial[:2]}")
    present = [a for a in case.absent if (d / a).exists()]
    if present:
        problems.append(f"wrote {present}")
    if case.check is not None:
        why = case.check(d, proc)
        if why:
            problems.append(why)
    return str(proc.returncode), sec, problems, line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", default="", help="run the cases whose name holds this text")
    p.add_argument("--keep", action="store_true", help="keep the cases' directories")
    ns = p.parse_args(argv)
    chosen = [c for c in cases() if ns.only.lower() in c.name.lower()]
    rows = []
    top = Path(tempfile.mkdtemp(prefix="hostile-sweep-"))
    try:
        for i, case in enumerate(chosen, 1):
            d = top / f"case{i:02d}"
            d.mkdir()
            got, sec, problems, line = run_case(case, d)
            clean = not problems
            rows.append((case, got, sec, clean, problems, line))
            mark = "yes" if clean else "NO: " + "; ".join(problems)
            print(f"[{i}/{len(chosen)}] {case.name}: exit {got} in {sec:.1f} s, clean {mark}",
                  flush=True)  # fmt: skip
    finally:
        if not ns.keep:
            shutil.rmtree(top, ignore_errors=True)
    print()
    head = f"| {'group':5} | {'case':58} | {'expected':8} | {'got':5} | {'sec':>5} | clean |"
    print(head)
    print("|" + "|".join("-" * len(c) for c in head.split("|")[1:-1]) + "|")
    for case, got, sec, clean, _, _ in rows:
        print(f"| {case.group:5} | {case.name[:58]:58} | {case.expect:8} | {got:5} | "
              f"{sec:5.1f} | {'yes' if clean else 'no':5} |")  # fmt: skip
    print()
    for case, _, _, clean, problems, line in rows:
        if not clean:
            print(f"not clean: {case.name}: {'; '.join(problems)} (last line: {line[:200]})")
    n_clean = sum(1 for r in rows if r[3])
    print(f"{len(rows)} cases tried, {n_clean} clean")
    return 0 if n_clean == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
