"""The hostile sweep of issue 29, run by pytest: every case of the issue's list (its five groups)
and the cases of the same kind found since, each a whole command run as a careless or hostile
user would run it, in a child process with a small file or environment made in a temporary
directory.

The cases are the table tests/hostile_cases.toml (its head says what a case's keys mean); this
module holds what runs them: the runners, the set-ups a case names (SETUPS) and the further
checks (CHECKS). Each case checks: the exit code (2 bad input, 1 a runtime failure, 0 where the
right answer is to go on: a cache drawn again, TensorBoard turned off), no 'Traceback' in stdout
or stderr, the last line of stderr (stdout where stderr is empty) saying what the case is about,
the time bound (a hang was the failure of several), and nothing left behind (no temporary or
partial file, no record where bad input must write none). The MXNet cases run in .venv-mxnet. A
full disk is a child whose file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) makes writes past it
fail with EFBIG.

A case that another test already runs (the same input, the same expectation, most of them
in-process, at a fraction of the cost) names that test (`covered`) and is not run again here:
test_every_covered_case_names_a_test checks the name. The suite runs the others. The whole
sweep, covered cases included (a few minutes on 2 cores):

    .venv/bin/python -m pytest tests/trainers/test_hostile_cases.py --hostile-all [-k WORD]
"""

from __future__ import annotations

import ast
import json
import os
import re
import resource
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import tomllib

from tests.conftest import MAIN_PYTHON, MXNET_PYTHON, ROOT, python_for, skip_without_interpreter
from tests.hostile_helpers import LONG, MXNET_STATES_FAIL, a_comparison

TABLE = Path(__file__).parents[1] / "hostile_cases.toml"
SMOKE = ["--preset", "smoke", "--prefetch", "1"]
PARTIAL = re.compile(r"\.tmp\d*$|\.part$|\.[A-Za-z0-9_]{8}\.tmp\d+$")


@dataclass
class Case:
    name: str
    group: str  # the group 1..5, "+" beyond its list
    expect: int
    argv: list[str]  # the command, "{d}" standing for the case's directory
    fragment: str  # what the last line must say ("" = any)
    framework: str = ""  # the trainer the command starts, if any (its interpreter must exist)
    env: dict[str, str] = field(default_factory=dict)
    setup: Callable[[Path], None] | None = None
    bound: float = 60.0
    absent: tuple[str, ...] = ()  # paths (relative to the case's directory) that must not exist
    fsize: int | None = None  # RLIMIT_FSIZE: a full disk at this many bytes per file
    background: bool = False  # SIGINT ignored, no terminal, own session: a background job
    check: Callable[[Path], str | None] | None = None
    anywhere: bool = False  # the fragment may be on any line (a run that goes on)
    covered: str = ""  # "tests/FILE.py::TEST": the test that runs this case already


def trainer(framework: str, *args: str) -> list[str]:
    return [str(python_for(framework)), "-m", f"frameworks.{framework.replace('-', '_')}", *args]


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
    assert proc.returncode == 0, f"set-up {' '.join(argv[:4])} failed: {proc.stderr[-500:]}"


# ---- set-ups (a case's `setup = [NAME, ARGUMENT...]`: NAME(d, ARGUMENT...)) -------------------


def a_file(d: Path) -> None:
    (d / "file").write_text("x")


def a_fifo(d: Path, name: str) -> None:
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(d / name)


def a_link_to_dev_zero(d: Path, name: str) -> None:
    (d / name).parent.mkdir(parents=True, exist_ok=True)
    (d / name).symlink_to("/dev/zero")


JAX_CKPT = [*SMOKE, "--max-steps-per-epoch", "1", "--checkpoint-dir",
            "{d}/ck", "--data-dir", "{d}/data"]  # fmt: skip


def jax_checkpoint(d: Path, how: str) -> None:
    """A JAX checkpoint, tampered with `how` (tests/trainers/test_resume_checks.py's tamper_msgpack)."""
    from tests.trainers.test_resume_checks import tamper_msgpack

    must_run(trainer("jax-pmap", *JAX_CKPT), d)
    (d / "ck" / ".lock").unlink(missing_ok=True)
    tamper_msgpack(d / "ck" / "jax-pmap.msgpack", how)


def torch_checkpoint_negative_epoch(d: Path) -> None:
    """A torch-dp checkpoint whose epoch is -1, resealed (a matching sha256)."""
    import io

    import torch

    from tests.conftest import payload, reseal

    must_run(trainer("torch-dp", *SMOKE, "--checkpoint-dir", "{d}/ck", "--data-dir", "{d}/data"), d)
    path = d / "ck" / "torch-dp.pt"
    (d / "ck" / ".lock").unlink(missing_ok=True)
    ckpt = torch.load(io.BytesIO(payload(path)), weights_only=True)
    ckpt["epoch"] = -1
    buf = io.BytesIO()
    torch.save(ckpt, buf)
    reseal(path, buf.getvalue())


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
    from tests.trainers.test_resume_checks import inflating_member

    inflating_member(init_cache(d), "extra.npy", 256 << 20)


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


MAKERS: dict[str, Callable[[Path], None]] = {
    "truncated": lambda p: p.write_text('{"framework": "torch-dp", "stat'),
    "fifo": os.mkfifo,
    "/dev/zero": lambda p: p.symlink_to("/dev/zero"),
}


def a_comparison_with(d: Path, name: str, made: str) -> None:
    """A comparison's directory d/out as compare writes it (config.json, runs/), no run made,
    its file `name` then made again as MAKERS[made] makes it (the test's no_probe fixture keeps
    compare from probing the machine)."""
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
        fashion_mnist_with_a_hand_written_marker,
        a_comparison_with,
    )
}


# ---- checks (a case's `check = NAME`: CHECKS[NAME](d)) ---------------------------------------


def failed_record(epochs: int | None = None) -> Callable[[Path], str | None]:
    def check(d: Path) -> str | None:
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


def only_the_lock(d: Path) -> str | None:
    left = sorted(p.name for p in (d / "ck").iterdir())
    return None if left == [".lock"] else f"left in ck/: {left}"


def both(*checks: Callable[[Path], str | None]) -> Callable[[Path], str | None]:
    return lambda d: next((why for c in checks if (why := c(d))), None)


CHECKS = {
    "failed_record": failed_record(),
    "failed_after_1_epoch_only_the_lock_left": both(failed_record(1), only_the_lock),
}


@contextmanager
def ports(env: dict[str, str]) -> Iterator[dict[str, str]]:
    """The case's variables with "{closed_port}" (a port nothing listens on) and "{busy_port}"
    (one a socket listens on for as long as the case runs) replaced."""
    words: dict[str, str] = {}
    with socket.socket() as closed, socket.socket() as busy:
        for word, s in (("{closed_port}", closed), ("{busy_port}", busy)):
            s.bind(("127.0.0.1", 0))
            words[word] = str(s.getsockname()[1])
        busy.listen()
        closed.close()
        yield {k: replaced(v, words) for k, v in env.items()}


# ---- the cases: tests/hostile_cases.toml -----------------------------------------------------

OUT = ["--output", "{d}/r.json"]
CK2 = [*SMOKE, "--epochs", "2", *OUT, "--checkpoint-dir", "{d}/ck"]
RESUME = [*JAX_CKPT, "--resume", "--epochs", "3", *OUT]
LISTS = {"SMOKE": SMOKE, "OUT": OUT, "CK2": CK2, "JAX_CKPT": JAX_CKPT, "RESUME": RESUME}
KEYS = {"name", "group", "expect", "command", "fragment", "env", "setup", "bound", "absent",
        "fsize", "background", "check", "anywhere", "covered"}  # fmt: skip
TEXTS = {"{long}": LONG, "{main}": str(MAIN_PYTHON), "{mxnet_states_fail}": MXNET_STATES_FAIL}


def replaced(text: str, words: dict[str, str]) -> str:
    for word, value in words.items():
        text = text.replace(word, value)
    return text


def command(words: list[str]) -> tuple[list[str], str]:
    """A case's `command` and the framework it starts: the runner's words, then its arguments
    ("*NAME": LISTS[NAME], TEXTS' names replaced)."""
    kind, _, what = words[0].partition(" ")
    framework = what if kind == "trainer" else "mxnet-gluon" if kind == "python" and what else ""
    if kind == "trainer":
        argv = trainer(what)
    elif kind == "tool":
        argv = [str(MAIN_PYTHON), "-m", f"benchmarks.{what}"]
    elif kind == "python" and what in ("", "mxnet"):
        argv = [str(MXNET_PYTHON if what else MAIN_PYTHON)]
    else:
        raise ValueError(f"{TABLE.name}: no runner {words[0]!r}")
    for word in words[1:]:
        argv.extend(LISTS[word[1:]] if word.startswith("*") else [replaced(word, TEXTS)])
    return argv, framework


def a_setup(name: str, *args: str) -> Callable[[Path], None]:
    make = SETUPS[name]
    return lambda d: make(d, *args)


def load_cases() -> list[Case]:
    with open(TABLE, "rb") as f:
        tables = tomllib.load(f)["case"]
    cases = []
    for t in tables:
        if unknown := set(t) - KEYS:
            raise ValueError(f"{TABLE.name}: {t.get('name')!r}: unknown {sorted(unknown)}")
        argv, framework = command(t["command"])
        cases.append(Case(
            t["name"], t["group"], t["expect"], argv, t["fragment"], framework=framework,
            env=t.get("env", {}),
            setup=a_setup(*t["setup"]) if "setup" in t else None,
            bound=float(t.get("bound", 60.0)),
            absent=tuple(t.get("absent", ())),
            fsize=t.get("fsize"),
            background=t.get("background", False),
            check=CHECKS[t["check"]] if "check" in t else None,
            anywhere=t.get("anywhere", False),
            covered=t.get("covered", ""),
        ))  # fmt: skip
    return cases


CASES = load_cases()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """The cases no other test runs; with --hostile-all, every case."""
    if "case" in metafunc.fixturenames:
        every = metafunc.config.getoption("hostile_all")
        chosen = [c for c in CASES if every or not c.covered]
        ids = [re.sub(r"[^A-Za-z0-9_.=+-]+", "-", c.name).strip("-") for c in chosen]
        metafunc.parametrize("case", chosen, ids=ids)


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


def problems_of(case: Case, d: Path) -> tuple[list[str], str]:
    """Run `case` in directory `d`: what is wrong with it ([] when clean), and its last line."""
    if case.setup is not None:
        case.setup(d)
    start = time.monotonic()
    with ports(case.env) as env:
        try:
            proc = subprocess.run(in_dir(case.argv, d), cwd=ROOT, env=child_env(env),
                                  capture_output=True, text=True, timeout=case.bound + 60,
                                  preexec_fn=preexec(case), stdin=subprocess.DEVNULL,
                                  start_new_session=case.background)  # fmt: skip
        except subprocess.TimeoutExpired:
            return [f"still running after {time.monotonic() - start:.0f} s"], ""
    sec = time.monotonic() - start
    problems = []
    if proc.returncode != case.expect:
        problems.append(f"exit {proc.returncode}, not {case.expect}")
    if "Traceback" in proc.stdout + proc.stderr:
        problems.append("a traceback")
    line = last_line(proc)
    text = proc.stdout + proc.stderr if case.anywhere else line
    if case.fragment and case.fragment not in text:
        problems.append(f"no {case.fragment!r}")
    if not case.anywhere and case.expect == 2 and proc.returncode != 0:
        err = [ln for ln in proc.stderr.splitlines()
               if ln.strip() and not ln.startswith(("warning:", "note:"))]  # fmt: skip
        if len(err) > 1:
            problems.append(f"{len(err)} stderr lines")
    if sec > case.bound:
        problems.append(f"{sec:.0f} s > {case.bound:.0f} s")
    partial = [str(p.relative_to(d)) for p in d.rglob("*") if PARTIAL.search(p.name)]
    if partial:
        problems.append(f"left {partial[:2]}")
    present = [a for a in case.absent if (d / a).exists()]
    if present:
        problems.append(f"wrote {present}")
    if case.check is not None and (why := case.check(d)):
        problems.append(why)
    return problems, line


def test_hostile_case(case: Case, tmp_path: Path, no_probe: None) -> None:
    if case.framework:
        skip_without_interpreter(case.framework)
    problems, line = problems_of(case, tmp_path)
    assert not problems, f"{case.name}: {'; '.join(problems)} (last line: {line[:300]})"


# ---- the table itself ------------------------------------------------------------------------


def test_every_covered_case_names_a_test() -> None:
    """A case left to another test names it, and that test exists (a renamed or removed test
    would leave the case run by nobody)."""
    assert CASES and len({c.name for c in CASES}) == len(CASES)
    for case in CASES:
        if not case.covered:
            continue
        path, _, name = case.covered.partition("::")
        file = ROOT / path
        assert file.is_file() and name.startswith("test_"), f"{case.name}: {case.covered}"
        tests = {n.name for n in ast.parse(file.read_text()).body if isinstance(n, ast.FunctionDef)}
        assert name in tests, f"{case.name}: no {name} in {path}"


def test_the_case_check_can_fail(tmp_path: Path) -> None:
    """A case whose command ends otherwise than it says is reported on each count."""
    script = "import sys; open('{d}/x.tmp', 'w'); print('a\\nb', file=sys.stderr); sys.exit(3)"
    bad = Case("says ok", "+", 0, [str(MAIN_PYTHON), "-c", script], "ok", absent=("x.tmp",))
    problems, line = problems_of(bad, tmp_path)
    assert line == "b" and problems == ["exit 3, not 0", "no 'ok'", "left ['x.tmp']",
                                        "wrote ['x.tmp']"], problems  # fmt: skip
