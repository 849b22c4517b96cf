"""The one harness under every benchmark tool (compare, throughput, comm_probe, tutorial_loops).

Each tool is plan -> run -> summarise: it validates its whole command line into a plan before
anything starts (bad input: one line, `<tool>: error: <problem>; <fix>`, exit code 2), runs every
measurement as a child process in a process group of its own (`run_child`; a trainer gets
SIGTERM when this tool dies, even by kill -9: common.runtime.stop_with_harness), and writes its
tables from the records. The runners import no framework (they start fast in either environment).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NoReturn

import psutil

from common import devices
from common.config import (
    COMPILE_MODES,
    CUDA_GRAPH_MODES,
    MAX_EPOCHS,
    MAX_IMAGE_SIZE,
    MAX_SEED,
    MAX_WIDTH,
    PRECISIONS,
    Config,
    ConfigError,
    preset,
)
from common.devices import CHOICES as DEVICE_CHOICES
from common.runtime import (
    ENTRY_POINTS,
    MIN_FREE_BYTES,
    PARENT_ENV,
    ROOT,
    atomic_write_bytes,
    check_xla_flags,
    cpu_threads,
    unwritable,
)

PYTHON_ENV = "DPBENCH_PYTHON_{}"
TOOL = "python -m benchmarks.{}"  # how each runner is started (the analysis tools: prog=)
TAIL_LINES = 15  # the last lines of a log kept with a failed run's record


class UsageError(Exception):
    """Bad input found before any run starts; the message names the problem and the fix."""


# -- frameworks -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Framework:
    name: str  # the name on the command line and in every table, e.g. "torch-ddp"
    module: str  # run as `python -m <module>`
    venv: str  # the environment directory under the project root
    setup: str  # `bash scripts/setup.sh <setup>` builds that environment
    # Why device counts > 1 are not applicable without CUDA (None: they are).
    multi_device_needs_cuda: str | None = None

    @property
    def family(self) -> str:  # torch, jax or mxnet
        return self.name.split("-")[0]

    @property
    def packages(self) -> tuple[str, ...]:  # what its interpreter must import
        return ENTRY_POINTS[self.module]

    @property
    def install(self) -> str:
        return f"bash scripts/setup.sh {self.setup}"

    @property
    def python(self) -> Path:
        """DPBENCH_PYTHON_<NAME> (e.g. _MXNET_GLUON=/opt/mx/bin/python), else its venv's python."""
        override = os.environ.get(PYTHON_ENV.format(self.name.upper().replace("-", "_")))
        return Path(override) if override else ROOT / self.venv / "bin" / "python"

    @property
    def source(self) -> Path:
        return ROOT.joinpath(*self.module.split(".")).with_suffix(".py")


DP_NEEDS_CUDA = "nn.DataParallel needs CUDA; on CPU it runs one replica"
REGISTRY: dict[str, Framework] = {
    f.name: f
    for f in (
        Framework("torch-dp", "frameworks.torch_dp", ".venv", "main", DP_NEEDS_CUDA),
        Framework("torch-ddp", "frameworks.torch_ddp", ".venv", "main"),
        Framework("torch-fsdp", "frameworks.torch_fsdp", ".venv", "main"),
        Framework("jax-pmap", "frameworks.jax_pmap", ".venv", "main"),
        Framework("jax-shard", "frameworks.jax_shard", ".venv", "main"),
        Framework("jax-shardmap", "frameworks.jax_shardmap", ".venv", "main"),
        Framework("jax-fsdp", "frameworks.jax_fsdp", ".venv", "main"),
        Framework("mxnet-gluon", "frameworks.mxnet_gluon", ".venv-mxnet", "mxnet"),
    )
}

# Run by a framework's interpreter: prints the packages it cannot find (nothing is imported).
PROBE_TIMEOUT = 60.0  # seconds; the device probe imports the framework
DEVICE_PROBE_TIMEOUT = 300.0
_PROBE = (
    "import importlib.util as u, sys; "
    "print(' '.join(p for p in sys.argv[1:] if u.find_spec(p) is None))"
)


# "<framework>+<variant>" (torch-ddp+reduce-overhead) runs a framework in another execution mode,
# a row of its own in compare's and throughput's tables; each names the trainer settings it sets.
# torch only: JAX always compiles its step with XLA, and MXNet's trainer always hybridizes.
VARIANTS: dict[str, dict[str, Any]] = {
    "eager": {"compile": False, "compile_mode": "default"},
    "compile": {"compile": True, "compile_mode": "default"},
    **{m: {"compile": True, "compile_mode": m} for m in COMPILE_MODES if m != "default"},
}
VARIANT_FAMILIES = ("torch",)
VARIANT_BASES = [n for n, f in REGISTRY.items() if f.family in VARIANT_FAMILIES]
VARIANT_EXAMPLE = "torch-ddp,torch-ddp+reduce-overhead,jax-pmap"
VARIANT_HELP = (
    f"; NAME+VARIANT is NAME in another execution mode, a row of its own (VARIANT, torch only: "
    f"{', '.join(VARIANTS)}; e.g. {VARIANT_EXAMPLE}: eager, torch.compile with CUDA graphs and "
    "JAX in one table; torch.compile applies on CUDA only)"
)


def framework(name: str) -> Framework:
    """The registry entry of a name in --frameworks: "torch-ddp+compile" -> torch-ddp's."""
    return REGISTRY[name.partition("+")[0]]


def variant_settings(name: str) -> dict[str, Any]:
    """The trainer settings a variant sets ({} for a plain framework name)."""
    return dict(VARIANTS[name.partition("+")[2]]) if "+" in name else {}


def parse_frameworks(text: str, variants: bool = False) -> list[str]:
    """--frameworks: registry names, and with `variants` (compare, throughput) NAME+VARIANT."""
    names = list(dict.fromkeys(t.strip() for t in text.split(",") if t.strip()))
    for name in names:
        base, plus, variant = name.partition("+")
        if base not in REGISTRY:
            raise UsageError(
                f"unknown framework {base!r}; choose from {', '.join(REGISTRY)} "
                "(comma-separated, e.g. --frameworks "
                f"{VARIANT_EXAMPLE if variants else 'torch-ddp,jax-pmap'})"
            )
        if not plus:
            continue
        if not variants:
            raise UsageError(f"{name}: framework variants are for benchmarks.compare and "
                             f"benchmarks.throughput; give {base}")  # fmt: skip
        if variant not in VARIANTS:
            raise UsageError(
                f"unknown variant {variant!r} in {name}; choose from {', '.join(VARIANTS)} "
                f"(e.g. --frameworks {VARIANT_EXAMPLE})"
            )
        if base not in VARIANT_BASES:
            raise UsageError(
                f"{name}: variants choose torch.compile and apply to "
                f"{', '.join(VARIANT_BASES)} only ({base} has one execution mode); give {base}"
            )
    if not names:
        raise UsageError(f"--frameworks is empty; give one or more of {', '.join(REGISTRY)}")
    if any(n.startswith("jax") for n in names):  # the JAX children read the user's XLA_FLAGS
        try:
            check_xla_flags()
        except ConfigError as exc:
            raise UsageError(str(exc)) from None
    return names


def pick(text: str, choices: Sequence[str], what: str, hint: str) -> list[str]:
    """A comma-separated flag of names (each once), each one of `choices`; `hint`: how to give
    them."""
    names = list(dict.fromkeys(x.strip() for x in text.split(",") if x.strip()))
    if not names or (unknown := [x for x in names if x not in choices]):
        raise UsageError(f"unknown {what} {', '.join(unknown) if names else '(empty)'}; choose "
                         f"from {', '.join(choices)}{hint}")  # fmt: skip
    return names


def not_applicable(name: str, devices: int, gpus: Sequence[str]) -> str | None:
    """Why `name` cannot run at `devices` devices here, refused before any run (None: it can)."""
    why = framework(name).multi_device_needs_cuda
    if devices > 1 and why and not gpus:
        return why
    if devices > 1 and framework(name).name == "torch-dp" and variant_settings(name).get("compile"):
        # frameworks/torch_dp.py would fall back to eager: the row would not be the mode asked
        return (
            "torch.compile cannot trace nn.DataParallel's replicas (torch-dp compiles on one GPU "
            "only); use torch-ddp+" + name.partition("+")[2] + " for compiled scaling"
        )
    return None


def _missing_packages(python: Path, packages: tuple[str, ...]) -> str | None:
    """Why `python` cannot import `packages` (None: it can)."""
    try:
        out = run_captured([str(python), "-c", _PROBE, *packages], timeout=PROBE_TIMEOUT)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"interpreter {python} does not start ({exc.__class__.__name__})"
    if out.returncode != 0:
        return f"interpreter {python} does not start (exit code {out.returncode})"
    missing = out.stdout.split()
    return f"{', '.join(missing)} not installed in {python}" if missing else None


def in_parallel(probe: Callable[[Any], Any], keys: list[Any]) -> list[Any]:
    """[probe(key) for key in keys], in threads; Ctrl-C kills the probes' children at once."""
    with ThreadPoolExecutor(max_workers=max(1, len(keys))) as pool:
        try:
            return list(pool.map(probe, keys))
        except BaseException:
            kill_children()
            raise


def unavailable(names: Sequence[str]) -> dict[str, str]:
    """Frameworks among `names` that cannot run here -> why, ending with the install command
    (one find_spec probe per interpreter, in parallel; nothing is imported)."""
    reasons: dict[str, str] = {}
    probes: dict[tuple[Path, tuple[str, ...]], list[str]] = {}
    for name in names:
        fw = framework(name)
        if not fw.source.exists():
            reasons[name] = f"{fw.source.relative_to(ROOT)} is not in this checkout"
        elif not fw.python.exists():
            # setup.sh's note where no Python on this machine could build the environment
            note = ROOT / fw.venv / "not-built.txt"
            reasons[name] = (
                note.read_text().strip()
                if fw.python == ROOT / fw.venv / "bin" / "python" and note.is_file()
                else f"interpreter {fw.python} not found; install with: {fw.install}"
            )
        else:
            probes.setdefault((fw.python, fw.packages), []).append(name)
    answers = dict(zip(probes, in_parallel(lambda key: _missing_packages(*key), list(probes))))
    for key, why in answers.items():
        for name in probes[key]:
            if why:
                reasons[name] = f"{why}; install with: {framework(name).install}"
    return reasons


def use_interpreter(path: str) -> None:
    """`--python PATH` for every framework. Absolute but not resolved: a venv's python is a
    symlink whose target would lose the environment."""
    python = Path(path).expanduser()
    if not (python.is_file() and os.access(python, os.X_OK)):
        raise UsageError(f"--python {path}: no executable interpreter there; give the path of "
                         "a python that has torch and/or jax installed")  # fmt: skip
    for name in REGISTRY:
        os.environ[PYTHON_ENV.format(name.upper().replace("-", "_"))] = os.path.abspath(python)


# -- devices ------------------------------------------------------------------------------------


def parse_gpus(text: str) -> list[int]:
    """'4' -> [1, 2, 4]; '6' -> [1, 2, 4, 6]; '1,2,3' -> [1, 2, 3]; '2,' -> [2]."""
    example = "e.g. --gpus 4 or --gpus 1,2,3"
    if not text.strip():
        raise UsageError(f"--gpus is empty; give a count or a list of counts ({example})")
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(f"--gpus {text!r} is not a count or a list of counts; {example}") from None
    if not values or min(values) < 1:
        raise UsageError(
            f"--gpus {text} asks for {min(values, default=0)} devices; every device count must "
            "be >= 1 (e.g. --gpus 1)"
        )
    if "," in text:
        return sorted(set(values))
    n = values[0]
    return [2**k for k in range(n.bit_length()) if 2**k < n] + [n]


def detect_gpus() -> list[str]:
    """GPU names from `nvidia-smi -L` (honours CUDA_VISIBLE_DEVICES); [] without a working one."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = run_captured(["nvidia-smi", "-L"], timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    names = []
    for line in out.stdout.splitlines():
        m = re.match(r"GPU \d+: (.+?)(?: \(UUID: [^)]*\))?$", line.strip())
        if m:
            names.append(m.group(1))
    return names[: visible_count(len(names))]


def visible_count(listed: int) -> int:
    """How many of the `listed` GPUs CUDA_VISIBLE_DEVICES leaves visible: CUDA stops at the
    first invalid entry ("-1", "" or "0,-1,1" hide all after it)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return listed
    count = 0
    for entry in (e.strip() for e in visible.split(",")):
        valid = entry.startswith(("GPU-", "MIG-")) or (entry.isdigit() and int(entry) < listed)
        if not valid:
            break
        count += 1
    return min(count, listed)


def check_counts(counts: list[int], gpus: list[str]) -> None:
    """Without GPUs any count is simulated on the CPU; with GPUs no count may exceed them."""
    if gpus and max(counts) > len(gpus):
        raise UsageError(
            f"--gpus asks for {max(counts)} devices but this machine has {len(gpus)} GPU(s) "
            f"(nvidia-smi -L); use --gpus {len(gpus)} or fewer"
        )


def device_kind(gpus: list[str]) -> str:
    """The device kind runs report (common.results): "cuda:<name>" or "cpu-simulated"."""
    return f"cuda:{gpus[0]}" if gpus else "cpu-simulated"


def gpu_compute_capabilities() -> list[float]:
    """Each visible GPU's compute capability from nvidia-smi (9.0 = Hopper); [] where unknown."""
    try:
        out = run_captured(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], 30)
        return [float(v) for v in out.stdout.split()] if out.returncode == 0 else []
    except (OSError, subprocess.SubprocessError, ValueError):
        return []


@dataclass(frozen=True)
class Seen:  # what one framework's interpreter sees
    gpus: tuple[str, ...]
    detail: str


def _probe(python: Path, family: str) -> Seen:
    env = {**child_env(), "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}  # a probe takes no memory
    try:
        out = run_captured(
            [str(python), "-m", "benchmarks.device_probe", family],
            timeout=DEVICE_PROBE_TIMEOUT, env=env, cwd=ROOT,
        )  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return Seen((), f"its interpreter {python} did not answer the device probe: {exc}")
    try:
        answer = json.loads(out.stdout.strip().splitlines()[-1])
        return Seen(tuple(answer["gpus"]), f"{answer['detail']}; interpreter {python}")
    except (ValueError, IndexError, KeyError, TypeError):
        last = (out.stderr.strip().splitlines() or ["no output"])[-1][:200]
        return Seen((), f"its interpreter {python} failed the device probe: {last}")


def probe_devices(names: Sequence[str]) -> dict[str, Seen]:
    """One probe per interpreter and family, in parallel (each imports its framework)."""
    keys = {name: (framework(name).python, framework(name).family) for name in names}
    unique = list(dict.fromkeys(keys.values()))
    seen = dict(zip(unique, in_parallel(lambda key: _probe(*key), unique)))
    return {name: seen[key] for name, key in keys.items()}


@dataclass
class Devices:
    """Where a tool's runs go, decided before any starts: every child gets `--devices <choice>`."""

    choice: str  # "cpu" (simulated CPU devices) or "cuda"
    gpus: list[str]  # the GPUs' names (nvidia-smi -L); [] with "cpu"
    why: str  # why this choice, for the devices line
    seen: dict[str, Seen] = field(default_factory=dict)
    skipped: dict[str, str] = field(default_factory=dict)  # cannot use these GPUs: why

    @property
    def flags(self) -> list[str]:
        return ["--devices", self.choice]

    def line(self) -> str:
        if self.choice == "cpu":
            return f"devices: simulated CPU devices for every framework ({self.why})"
        used = [f"{n} on cuda ({', '.join(dict.fromkeys(s.gpus))})" for n, s in self.seen.items()]
        used += [f"{n} skipped ({why.split(':')[0]})" for n, why in self.skipped.items()]
        return f"devices: {'; '.join(used)} ({self.why})"


@dataclass
class SweepPlan:
    """What every framework x device-count tool (throughput, parity, comm_probe) plans."""

    ns: argparse.Namespace
    frameworks: list[str]
    counts: list[int]
    gpus: list[str]  # GPU names from nvidia-smi; empty: simulated CPU devices
    skipped: dict[str, str]  # framework -> why it cannot run here
    out: Path
    command: list[str]
    devices: Devices

    @property
    def device_kind(self) -> str:
        return device_kind(self.gpus)


MXNET_NO_HOPPER = (
    "MXNet 1.9.1's CUDA wheels stop at CUDA 11.x and have no code for compute capability 9.0 "
    "and newer ({gpu}): MXNet runs on the CPU only here; compare it with --devices cpu"
)


def choose_devices(
    asked: str | None, names: Sequence[str], seen: dict[str, Seen] | None = None
) -> Devices:
    """`--devices` for the runs of `names` (None: $DPBENCH_DEVICES, else auto). With GPUs, a
    framework that sees none stops the tool (no table mixes GPU rows with CPU ones); MXNet on
    Hopper, which has no GPU build, is skipped with the reason."""
    gpus = machine_gpus(asked)
    if not gpus:
        why = "--devices cpu" if _asked(asked) == "cpu" else "no GPU here: nvidia-smi -L lists none"
        return Devices("cpu", [], why)
    out = Devices("cuda", gpus, f"{len(gpus)} x {gpus[0]} listed by nvidia-smi -L")
    caps = None
    seen = seen if seen is not None else probe_devices(names)  # `seen`: probed already
    for name in names:
        if framework(name).family == "mxnet":  # even a CUDA build has no kernels for Hopper
            caps = gpu_compute_capabilities() if caps is None else caps
            if caps and max(caps) >= 9.0:
                out.skipped[name] = MXNET_NO_HOPPER.format(gpu=gpus[0])
                continue
        if seen[name].gpus:
            out.seen[name] = seen[name]
            continue
        raise UsageError(
            f"this machine has {len(gpus)} GPU(s) ({gpus[0]}; nvidia-smi -L) but {name} sees "
            f"none ({seen[name].detail}); install its GPU build with "
            f"`{framework(name).install}` (it picks the CUDA builds by the driver), or run every "
            "framework on simulated CPU devices with --devices cpu"
        )
    return out


def _asked(asked: str | None) -> str:
    try:
        return asked or devices.default() or "auto"
    except ValueError as exc:  # a bad DPBENCH_DEVICES
        raise UsageError(str(exc)) from None


def machine_gpus(asked: str | None) -> list[str]:
    """The GPUs `--devices` gives a tool's runs, from nvidia-smi alone (cheap, before
    `choose_devices` asks the frameworks); [] = simulated CPU devices."""
    choice = _asked(asked)
    gpus = [] if choice == "cpu" else detect_gpus()
    if choice == "cuda" and not gpus:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        note = f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else ""
        raise UsageError(f"--devices cuda but nvidia-smi -L lists no GPU on this machine{note}; "
                         "use --devices cpu for simulated CPU devices")  # fmt: skip
    return gpus


# -- command lines ------------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """argparse whose errors are one line, `<tool>: error: <problem>; see <prog> --help`, exit 2."""

    def __init__(self, tool: str, **kwargs: Any):
        kwargs.setdefault("prog", TOOL.format(tool))
        kwargs.setdefault("allow_abbrev", False)  # an abbreviation must not swallow a flag
        super().__init__(**kwargs)
        self.tool = tool

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.tool}: error: {message}; see {self.prog} --help\n")


def add_flags(p: argparse.ArgumentParser, *, frameworks: str | None = None,
              gpus: str | None = None, repeat: int | None = None, out: str | None = None,
              timeout: float | None = None, python: bool = False, wait_load: bool = False,
              devices: bool = False, variants: bool = False) -> None:  # fmt: skip
    """The flags the tools share, one meaning and help text each; a value given here is that
    tool's default (None, False: no such flag); `variants`: --frameworks takes NAME+VARIANT."""
    every = "all" if frameworks == ",".join(REGISTRY) else frameworks
    for given, name, kwargs in (
        (frameworks, "--frameworks", dict(default=frameworks, metavar="LIST",
         help=f"comma-separated, from: {', '.join(REGISTRY)} (default: {every}; a framework whose "
         "environment is missing is reported as skipped)" + (VARIANT_HELP if variants else ""))),
        (gpus, "--gpus", dict(default=gpus, metavar="N|LIST",
         help="device counts: N runs 1, 2, 4, ... (powers of two below N) and N; a list such as "
         "1,2,3 (or '2,' for 2 alone) runs exactly those (default %(default)s). Without GPUs the "
         "devices are simulated on the CPU")),
        (devices or None, "--devices", DEVICES_FLAG),
        (repeat, "--repeat", dict(type=int, default=repeat, metavar="K",
         help="measure every cell K times (default %(default)s)")),
        (python or None, "--python", dict(metavar="PATH",
         help="one interpreter for every framework, e.g. a GPU machine's python3 holding torch "
         "and JAX (default: each framework's own environment, .venv or .venv-mxnet)")),
        (wait_load or None, "--wait-load", dict(type=float, default=0.0, metavar="L",
         help="on a shared machine: before each run wait (up to 10 minutes) until the 1-minute "
         "load average is below L (0 = do not wait; the load is recorded either way)")),
        (timeout, "--timeout", dict(type=float, default=timeout, metavar="SEC",
         help="time limit per child process; one still going is killed with every process it "
         "started (default %(default)g)")),
        (out, "--out", dict(metavar="DIR",
         help=f"output directory (default {out}<UTC timestamp>/ under the project root)")),
    ):  # fmt: skip
        if given is not None:
            p.add_argument(name, **kwargs)  # type: ignore[arg-type]


def add_numbers(p: Any, *flags: tuple[Any, ...]) -> None:
    """A tool's own numeric flags, each (name, type, default, help[, metavar])."""
    for name, kind, default, text, *metavar in flags:
        p.add_argument(name, type=kind, default=default, help=text, metavar=(metavar or [None])[0])


DEVICES_FLAG: dict[str, Any] = dict(
    choices=DEVICE_CHOICES,
    help="where every framework runs: auto (default, or $DPBENCH_DEVICES) = the GPUs when "
    "nvidia-smi lists some, and then every framework must see them (one that sees none stops "
    "the tool before any run), else simulated CPU devices; cpu = simulated CPU devices for "
    "every framework, also on a GPU machine; cuda = the GPUs or nothing",
)


def add_workload_flags(p: argparse.ArgumentParser, batch_size: int, batch_help: str) -> None:
    """The step the throughput tools time: model, images, batch, the fast paths and where."""
    on_off = argparse.BooleanOptionalAction
    for name, kwargs in (
        ("--devices", DEVICES_FLAG),
        ("--model", dict(default="resnet18", choices=("resnet18", "wideresnet"),
                         help="model architecture (default resnet18)")),
        ("--width", dict(type=float, default=1.0, help="channel-width multiplier (default 1.0)")),
        ("--image-size", dict(type=int, default=32,
                              help="side of the synthetic square images (default 32, CIFAR's)")),
        ("--batch-size", dict(type=int, default=batch_size, help=batch_help)),
        ("--precision", dict(default="fp32", choices=PRECISIONS,
                             help="CUDA: fp32, or mixed precision bf16 / fp16 (CPU: fp32)")),
        ("--channels-last", dict(action=on_off, default=None,
                                 help="channels-last memory format (torch; default: on CUDA, "
                                 "NCHW on a CPU)")),
        ("--xla-cpu-ynn", dict(action=on_off, default=True,
                               help="JAX on CPU: XLA's YNNPACK fusion kernels")),
        ("--compile", dict(action=on_off, default=False,
                           help="CUDA: torch.compile the model (torch)")),
        ("--compile-mode", dict(default="default", choices=COMPILE_MODES,
                                help="with --compile: torch.compile's mode (reduce-overhead: "
                                     "CUDA graphs)")),
    ):  # fmt: skip
        p.add_argument(name, **kwargs)  # type: ignore[arg-type]


def workload_config(ns: argparse.Namespace, **more: Any) -> Config:
    """The "throughput" preset with `add_workload_flags`' step (and --lr) as given in `ns`."""
    keys = ("model", "width", "image_size", "batch_size", "precision", "lr", "compile")
    return preset(
        "throughput", **{k: getattr(ns, k) for k in keys}, compile_mode=ns.compile_mode, **more
    )


def check_positive(**values: float) -> None:
    """`--repeat 0`, `--timeout 0`, `--width nan` ...: one line naming the flag."""
    for name, value in values.items():
        if not (value > 0 and math.isfinite(value)):
            least = ">= 1" if isinstance(value, int) else "a finite number > 0"
            raise UsageError(f"--{name.replace('_', '-')} must be {least} (got {value:g})")


# The most any tool accepts for a shared option: far above a sensible run, low enough that a
# typo (--repeat 100000000) is refused at once instead of running for ever.
OPTION_LIMITS: dict[str, float] = {
    "repeat": 1000,
    "reps": 100_000,
    "steps": 100_000,
    "compute_steps": 1_000_000,
    "warmup": 10_000,
    "epochs": MAX_EPOCHS,
    "interleave": 10_000,
    "jobs": 64,
    "timeout": 7 * 86_400,
    "wait_load": 10_000,
    "width": MAX_WIDTH,
    "image_size": MAX_IMAGE_SIZE,
    "batch_size": 1 << 20,
    "seed": MAX_SEED,
    "lr": 1e6,
    "tolerance": 1e6,
    "mean_tolerance": 1e6,
}


def check_options(ns: argparse.Namespace) -> None:
    """Every number a tool was given: finite, >= 0, at most OPTION_LIMITS; each tool then checks
    its own lower bounds."""
    for name, value in vars(ns).items():
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        flag = "--" + name.replace("_", "-")
        if not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number (got {value})")
        if value < 0:
            raise UsageError(f"{flag} must be >= 0 (got {value:g})")
        limit = OPTION_LIMITS.get(name)
        if limit is not None and value > limit:
            raise UsageError(f"{flag} must be <= {limit:g} (got {value:g})")


SWITCHES = {f.name for f in dataclasses.fields(Config) if f.metadata.get("switch")}


def flag(name: str, value: Any) -> list[str]:
    """A shared training flag back on a command line, in the form common.cli parses."""
    opt = "--" + name.replace("_", "-")
    if value is None and name in SWITCHES:  # unset: the trainer decides (e.g. --xla-cpu-ynn)
        return []
    if isinstance(value, bool):
        return [opt if value else "--no-" + name.replace("_", "-")]
    if value is None:
        return [opt, "none"]
    if isinstance(value, tuple):
        return [opt, ",".join(str(v) for v in value)]
    return [opt, str(value)]


def utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def output_dir(given: str | None, prefix: str, marker: str, need: int = MIN_FREE_BYTES) -> Path:
    """--out DIR, or results/<prefix><UTC timestamp>/; refused where it holds `marker` (a
    finished result of the tool) or cannot be written (now, not after the runs)."""
    if given is not None and not given.strip():  # `--out ""` (an unset variable) is no default
        raise UsageError("--out is empty; give a directory, or leave --out out for results/")
    if given:
        out = Path(given).expanduser().resolve()
    else:
        out = ROOT / "results" / (prefix + datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%SZ"))
    why = unwritable(out, "dir", need)  # need: the bytes free the tool's own files want
    if (out / marker).exists():
        raise UsageError(f"{out} already holds a result ({marker}); choose a new --out")
    if why:
        raise UsageError(f"--out {out}: {why}; choose another --out")
    _CLAIMS.append((out, marker))
    return out


def claim_existing(out: Path) -> None:
    """`benchmarks.report DIR` rewrites files there: `run_tool` locks it as it does an --out."""
    _CLAIMS.append((out, None))


_CLAIMS: list[tuple[Path, str | None]] = []  # output directories of the plan being made
LOCK_NAME = ".lock"


def claim(out: Path, marker: str | None) -> Any:
    """An exclusive lock on out/.lock (two tools started at once on one --out cannot both pass
    the `marker` check), then the check again under it; the open file holds the lock."""
    import fcntl  # POSIX only, like the process groups below

    out.mkdir(parents=True, exist_ok=True)
    lock = open(out / LOCK_NAME, "a")  # noqa: SIM115 (held open for the whole run)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        fix = "wait for it to finish" if marker is None else "choose a new --out"
        raise UsageError(f"{out} is in use by another run; {fix}") from None
    if marker is not None and (out / marker).exists():
        lock.close()
        raise UsageError(f"{out} already holds a result ({marker}); choose a new --out")
    return lock


def run_tool(tool: str, argv: Sequence[str] | None, make_plan: Callable[[list[str]], Any],
             execute: Callable[[Any], int]) -> int:  # fmt: skip
    """plan -> run: bad input is one line and exit 2 before anything starts; SIGTERM ends the run
    like Ctrl-C, a KeyboardInterrupt that `execute` turns into saved partial results and exit
    128 + the signal (`interrupted`); no child is left running."""
    args = list(sys.argv[1:] if argv is None else argv)
    _CLAIMS.clear()
    locks: list[tuple[Any, Path]] = []
    _STOPPED_BY[0] = signal.SIGINT
    previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _interrupt)}
    try:
        try:
            plan = make_plan(args)
            for out, marker in _CLAIMS:
                locks.append((claim(out, marker), out))
        except (ConfigError, UsageError) as exc:
            print(f"{tool}: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # during the checks: their probes are killed (in_parallel)
            print(f"{tool}: interrupted before any run started", file=sys.stderr)
            return interrupted()
        chosen = getattr(plan, "devices", None)
        if isinstance(chosen, Devices):  # which device each framework will use, before any run
            print(chosen.line(), flush=True)
        return execute(plan)
    finally:
        _STOPPED_BY[0] = signal.SIGINT
        for s, handler in previous.items():
            signal.signal(s, handler)
        for lock, out in locks:
            with contextlib.suppress(OSError):
                (out / LOCK_NAME).unlink()
            lock.close()


_STOPPED_BY = [signal.SIGINT]  # the signal that stopped this tool (Ctrl-C: Python's own raise)


def _interrupt(signum: int, _frame: Any) -> NoReturn:
    _STOPPED_BY[0] = signal.Signals(signum)
    raise KeyboardInterrupt


def interrupted() -> int:
    """128 + the signal that stopped the tool, as a trainer's (130 Ctrl-C, 143 SIGTERM)."""
    return 128 + _STOPPED_BY[0]


# -- running a child ----------------------------------------------------------------------------


def child_env() -> dict[str, str]:
    """Every child's: the project on PYTHONPATH, unbuffered output, OpenMP threads that fill the
    cores, no simulated-device count inherited (every JAX child sets its own)."""
    env = dict(os.environ)
    env[PARENT_ENV] = str(os.getpid())  # a trainer stops if this process dies (stop_with_harness)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("OMP_NUM_THREADS", str(cpu_threads()))
    # Idle OpenMP threads sleep instead of spinning: a spinning team stalls whenever anything
    # else holds a core (a 1-process torch run measured 10-40x slower on a busy 2-core machine).
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    xla = [f for f in env.pop("XLA_FLAGS", "").split() if "host_platform_device_count" not in f]
    if xla:
        env["XLA_FLAGS"] = " ".join(xla)
    return env


STOP_GRACE = 2.0  # seconds between SIGTERM (a trainer writes its record) and SIGKILL
_running: set[subprocess.Popen[str]] = set()  # run_captured's children, for kill_children


def wait_group(proc: subprocess.Popen[str], timeout: float) -> tuple[int, Any, str]:
    """Reap group leader `proc` with os.wait4 (ru_maxrss covers its reaped descendants) ->
    (status, usage, "exited" | "timeout" | "interrupted"); the latter two SIGTERM the group,
    then SIGKILL it after STOP_GRACE s. What the leader leaves is killed."""
    deadline, ended = time.monotonic() + timeout, "exited"
    try:
        while not (reaped := os.wait4(proc.pid, os.WNOHANG))[0]:
            if time.monotonic() > deadline:
                ended = "timeout"
                break
            time.sleep(0.1)
    except KeyboardInterrupt:
        ended = "interrupted"
    if ended != "exited":
        reaped = _end_group(proc.pid)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # what the leader left running
    _, status, usage = reaped
    proc.returncode = os.waitstatus_to_exitcode(status)
    return status, usage, ended


def _end_group(pid: int) -> tuple[int, int, Any]:
    """SIGTERM the group of leader `pid`, SIGKILL it after STOP_GRACE seconds; reap the leader."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE
    while time.monotonic() < deadline:
        if (reaped := os.wait4(pid, os.WNOHANG))[0]:
            return reaped
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)
    return os.wait4(pid, 0)


def run_captured(
    command: Sequence[str], timeout: float, **popen: Any
) -> subprocess.CompletedProcess[str]:
    """subprocess.run(capture_output=True, text=True) for a probe, in a process group of its own
    that a timeout or `kill_children` kills."""
    with subprocess.Popen(
        command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, errors="replace", start_new_session=True, **popen,
    ) as proc:  # fmt: skip
        _running.add(proc)
        try:
            out, err = proc.communicate(timeout=timeout)
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        finally:
            _running.discard(proc)
    return subprocess.CompletedProcess(list(command), proc.returncode, out, err)


def kill_children() -> None:
    """Kill the process groups of the probes still running."""
    for proc in list(_running):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def identity() -> dict[str, Any]:
    """Host, pid and start time: names this process (pids are reused, the pair is not)."""
    return {"host": socket.gethostname(), "pid": os.getpid(),
            "start": str(psutil.Process().create_time())}  # fmt: skip


def gone(who: Any) -> bool | None:
    """Whether the process an `identity` names has ended (a zombie counts); None: cannot tell."""
    if not isinstance(who, dict) or who.get("host") != socket.gethostname():
        return None
    pid, start = who.get("pid"), who.get("start")
    if not isinstance(pid, int) or not isinstance(start, str):
        return None
    try:
        proc = psutil.Process(pid)
        return str(proc.create_time()) != start or proc.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True
    except psutil.Error:
        return None


def settle(limit: float, max_wait: float = 600.0) -> float:
    """Wait (at most `max_wait` s) until the 1-minute load is below `limit` (0: no wait); -> it."""
    deadline = time.monotonic() + max_wait
    while limit > 0 and os.getloadavg()[0] >= limit and time.monotonic() < deadline:
        time.sleep(5)
    return os.getloadavg()[0]


@dataclass
class Child:
    """One finished child; `ended`: "exited", "timeout" or "interrupted" (its group killed)."""

    command: list[str]
    log: Path
    timeout: float
    returncode: int = -1
    ended: str = "exited"
    peak_rss_bytes: int = 0  # the child and its reaped descendants (os.wait4's ru_maxrss)
    wall_sec: float = 0.0
    load_avg: tuple[float, float] = (0.0, 0.0)  # 1-minute load before and after
    tail: list[str] = field(default_factory=list)  # the last TAIL_LINES lines of output

    @property
    def ok(self) -> bool:
        return self.ended == "exited" and self.returncode == 0

    def last_line(self) -> str:
        return next((line for line in reversed(self.tail) if line.strip()), "")

    def error(self) -> str:
        """Why it did not succeed, in one line ("" when it did)."""
        if self.ended == "timeout":
            return f"still running after {self.timeout:g} s (--timeout); killed"
        if self.ended == "interrupted":
            return "interrupted (Ctrl-C or SIGTERM); killed"
        if self.returncode != 0:
            return f"exit code {self.returncode}: {self.last_line()}"
        return ""

    def json_line(self) -> dict[str, Any] | None:
        """The last line of the log that is a JSON object (a tool's one-line result)."""
        for line in reversed(self.log.read_text(errors="replace").splitlines()):
            if line.startswith("{"):
                try:
                    return json.loads(line)
                except ValueError:
                    return None
        return None


def run_child(command: Sequence[str], log: Path, timeout: float, *, tag: str,
              on_line: Callable[[str], None] | None = None, wait_load: float = 0.0,
              reraise: bool = False) -> Child:  # fmt: skip
    """Run `command` from the project root in a process group of its own, stdout and stderr to
    `log` behind a `$ command` line and to `on_line`. The group is killed at `timeout` and on
    Ctrl-C / SIGTERM, which end the child as "interrupted" (`reraise`: then KeyboardInterrupt,
    once it is reaped and its log closed)."""
    child = Child(list(command), log, timeout, tail=[])
    tail: deque[str] = deque(maxlen=TAIL_LINES)
    log.parent.mkdir(parents=True, exist_ok=True)
    load_before = settle(wait_load)
    t0 = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(child.command)}\n")
        f.flush()
        proc = subprocess.Popen(
            child.command, cwd=ROOT, env=child_env(), stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
            start_new_session=True,  # its own process group, so a kill ends all of it
        )  # fmt: skip

        def read() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                f.write(line)
                f.flush()
                tail.append(line.rstrip("\n"))
                if on_line is not None:
                    on_line(line)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        status, usage, child.ended = wait_group(proc, timeout)
        child.returncode = os.waitstatus_to_exitcode(status)
        reader.join(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()
        if child.ended != "exited":
            f.write(f"[{tag}] {child.error().replace('; killed', ': killed')}\n")
    child.tail = list(tail)
    child.peak_rss_bytes = usage.ru_maxrss * 1024  # Linux reports KiB
    child.wall_sec = time.monotonic() - t0
    child.load_avg = (round(load_before, 2), round(os.getloadavg()[0], 2))
    if reraise and child.ended == "interrupted":
        raise KeyboardInterrupt
    return child


# -- execution modes ----------------------------------------------------------------------------

EAGER = ("eager", "imperative")  # op by op from Python: the host issues every kernel


def row_key(record: dict[str, Any]) -> str:
    """A record's row: the name in --frameworks it ran for (a variant), else its framework."""
    return str((record.get("runner") or {}).get("framework") or record.get("framework") or "?")


def mode_label(execution: str | None) -> str:
    """A row's execution mode in a few words, from its record's `execution` ("" when unknown)."""
    if not execution:
        return ""
    if execution.startswith("hybridized"):  # MXNet: "hybridized (static_alloc, static_shape)"
        return "hybridized (static alloc)" if "static_alloc" in execution else "hybridized"
    first = execution.split(";")[0].split(",")[0].strip()  # "torch.compile(reduce-overhead)"
    if first.startswith("torch.compile"):
        mode = first.removeprefix("torch.compile").strip("()")
        return compile_label(True, mode or "default")
    if first.startswith(("pmap", "jit", "shard_map")):  # "pmap (one XLA program per device)"
        return f"XLA ({first.split()[0]})"
    return first  # "eager", or a mode this list does not know yet, as its record says it


def ran_label(record: dict[str, Any]) -> str:
    """`mode_label`, and the dtype that ran where not float32: "XLA (pmap), bfloat16"."""
    mode = mode_label(record.get("execution"))
    dtype = (record.get("ran") or {}).get("activation_dtype")
    return f"{mode}, {dtype}" if mode and dtype and dtype != "float32" else mode


def compile_label(compile: bool, compile_mode: str) -> str:
    """The label of a torch run's mode as its flags ask for it (`mode_label`'s words)."""
    if not compile:
        return "eager"
    if compile_mode == "default":
        return "torch.compile"
    return f"torch.compile {compile_mode}" + (" + CUDA graphs" * (compile_mode in CUDA_GRAPH_MODES))


def asked_label(name: str, config: dict[str, Any] | None) -> str:
    """The mode a torch run's settings ask for: `name`'s variant over `config` ("" not torch)."""
    base = REGISTRY.get(name.partition("+")[0])
    if base is None or base.family != "torch" or config is None:
        return ""
    settings = {**config, **variant_settings(name)}
    return compile_label(bool(settings.get("compile")), settings.get("compile_mode") or "default")


def mode_note(rows: Sequence[tuple[str, str]], cuda: bool, fix: str | None = None) -> str:
    """A note under a table whose `rows` (name, mode label) mix eager and compiled, naming what
    would make them alike (`fix`, or the torch variant with CUDA graphs); "" when alike."""
    eager = list(dict.fromkeys(n for n, m in rows if m.startswith(EAGER)))
    compiled = list(dict.fromkeys(n for n, m in rows if m and not m.startswith(EAGER)))
    if not eager or not compiled:
        return ""
    if fix is None:
        bases = dict.fromkeys(n.split()[0].partition("+")[0] for n in eager)  # "torch-dp x2"
        wanted = [f"{b}+reduce-overhead" for b in bases if b in VARIANT_BASES]
        missing = [w for w in wanted if w not in {n.split()[0] for n, _ in rows}]
        add = f"add {', '.join(missing)} to --frameworks to compare compiled with compiled"
        if not wanted:
            fix = "compare rows of one mode"
        elif not cuda:
            fix = "torch.compile applies on CUDA only, so on the CPU the torch rows run eager; " + (
                f"on a GPU, {add}"
                if missing
                else f"on a GPU the rows of {', '.join(wanted)} compile"
            )
        elif missing:
            fix = add
        else:
            fix = f"compiled against compiled: {', '.join(compiled)}"
    return (
        f"Rows differ in execution mode: eager ({', '.join(eager)}) vs compiled "
        f"({', '.join(compiled)}); an eager step issues every kernel from Python and can be "
        f"bound by the host where a compiled one is not; {fix}."
    )


def asked_note(rows: Sequence[tuple[str, str, str]]) -> str:
    """A note naming the rows (name, asked, ran) that ran another mode than asked ("" if none)."""
    moved = [
        f"{n} ran {ran}, not {asked}" for n, asked, ran in rows if ran and asked not in ("", ran)
    ]
    if not moved:
        return ""
    return (
        f"Mode not as asked: {'; '.join(moved)} (torch.compile applies on CUDA only, and in "
        "torch-dp on one GPU only; the run's log says which)."
    )


def mode_notes(table: Sequence[dict[str, Any]]) -> list[str]:
    """`mode_note` and `asked_note` under compare's and throughput's tables; a row is named by
    framework, with its devices where that framework's rows differ in mode."""
    modes: dict[str, str] = {}
    for r in table:
        if r.get("mode"):
            of_it = {o.get("mode") for o in table if o["framework"] == r["framework"]}
            same = of_it - {"", None} == {r["mode"]}
            modes[r["framework"] if same else f"{r['framework']} x{r['devices']}"] = r["mode"]
    cuda = any(str(r.get("device_kind") or "").startswith("cuda") for r in table)
    asked = [(f"{r['framework']} x{r['devices']}", r.get("mode_asked") or "", r.get("mode") or "")
             for r in table]  # fmt: skip
    return [mode_note(list(modes.items()), cuda), asked_note(asked)]


# -- records and files --------------------------------------------------------------------------


def read_json_file(path: Path, what: str, fix: str) -> Any:
    """The JSON in `path`; UsageError naming it and `fix` where it cannot be read as JSON."""
    try:
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise UsageError(f"cannot read {what} {path} ({exc.strerror}); {fix}") from None
    except ValueError as exc:
        raise UsageError(f"{what} {path} is not JSON ({exc}); {fix}") from None


THROUGHPUT_FIX = "give the throughput.json files benchmarks.throughput wrote"


def read_throughput(path: Path, what: str = "throughput table") -> dict[str, Any]:
    """A throughput.json with the keys the tools read; UsageError naming the file otherwise."""
    table = read_json_file(path, what, THROUGHPUT_FIX)
    try:  # the keys the tools use without .get
        settings = {"model", "image_size", "width", "precision"} <= table["settings"].keys()
        rows = all({"framework", "devices", "global_batch"} <= r.keys() for r in table["rows"])
    except (KeyError, TypeError, AttributeError):
        settings = rows = False
    if not (settings and rows):
        raise UsageError(
            f"{what} {path} is not a throughput table (a key missing); {THROUGHPUT_FIX}"
        )
    return table  # type: ignore[no-any-return]


def read_record(path: Path) -> dict[str, Any] | None:
    """A run's record; None where missing (the run did not finish) or damaged (then one line on
    stderr naming it)."""
    try:
        record = json.loads(path.read_bytes())
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        record = None
    if isinstance(record, dict) and {"status", "devices"} <= record.keys():
        return record
    print(f"warning: {path} is damaged (cut short or not a run record); ignored", file=sys.stderr)
    return None


def write_atomic(path: Path, data: str | bytes) -> None:
    """Text or bytes via a temporary file and a rename: never half a file."""
    atomic_write_bytes(path, data.encode() if isinstance(data, str) else data)


Column = Callable[[dict[str, Any]], str]  # a table column: a row's cell


def cell(value: Any, spec: str, none: str = "-") -> str:
    """A table cell: `value` formatted by `spec`, or `none` where there is no value."""
    return none if value is None else format(value, spec)


def device_axes(
    plt: Any, counts: list[int], title: str, ylabel: str = "scaling efficiency (speed-up / devices)"
) -> tuple[Any, Any]:
    """A sweep's figure against the device count (report's plots and predict.sweep_plot's)."""
    fig, ax = plt.subplots(figsize=(7.5, 4.8))
    ax.set_title(title, fontsize=8)
    ax.set_xlabel("devices")
    ax.set_ylabel(ylabel)
    ax.set_xticks(counts)
    ax.grid(alpha=0.3)
    return fig, ax


def markdown_table(headers: Sequence[str], body: Sequence[Sequence[str]], align: str = "") -> str:
    """A Markdown table; `align`: one letter a column, "r" for a right-aligned one."""

    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "\\|") for c in cells) + " |"

    rule = ["---:" if a == "r" else "---" for a in align.ljust(len(headers), "l")]
    return "\n".join([line(headers), line(rule), *map(line, body)])


def print_table(title: str, headers: Sequence[str], body: Sequence[Sequence[str]],
                notes: Sequence[str] = (), *, left: Sequence[str] = ("framework", "status"),
                styles: Sequence[str | None] | None = None,
                stream: Any = None) -> None:  # fmt: skip
    """A table on stdout: rich where installed (a GPU machine's python3 may lack it), else
    Markdown; then the notes."""
    notes = [n for n in notes if n]
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(f"\n{title}\n\n{markdown_table(headers, body)}", file=stream)
        for n in notes:
            print(f"- {n}", file=stream)
        return
    console = Console(file=stream)
    if not console.is_terminal:
        console = Console(file=stream, width=max(console.width, 260))
    table = Table(title=title, caption="\n".join(notes) or None)
    for h in headers:
        table.add_column(h, justify="left" if h in left else "right")
    for i, row in enumerate(body):
        table.add_row(*row, style=styles[i] if styles else None)
    console.print(table)
