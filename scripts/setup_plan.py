"""Which builds scripts/setup.sh installs into each environment, from what the NVIDIA driver says,
and which Python builds each.

    python3 scripts/setup_plan.py [--device auto|cpu|cuda12|cuda13] [--shell]

For each environment (main -> .venv, mxnet -> .venv-mxnet) it picks an interpreter and a
requirements file, each with one reason. The interpreter is the first of these that runs and is
a Python the environment's pins have wheels for, else uv where it is installed (`uv venv
--python 3.11` fetches a managed 3.11 where none is installed), else none:
  .venv        3.10 to 3.13: $PYTHON, python3.11, python3, python3.13, python3.12, python3.10
               (none: setup.sh stops with the reason and the fix)
  .venv-mxnet  3.10 or 3.11 (numpy 1.23.5 has no wheel for 3.12+): $PYTHON, python3.11,
               python3.10, python3; DPBENCH_SETUP_MXNET_PYTHON=PATH names one instead (one that
               is not 3.10 or 3.11: exit 2); none: .venv-mxnet is not built, the reason and the
               fix in one line, and the rest goes on without mxnet-gluon
The requirements file: without a working `nvidia-smi` (missing, failing, or listing no GPU) it picks
requirements/main.txt and requirements/mxnet.txt, the CPU builds CI has always used. With one:
  .venv        driver CUDA >= 13 -> requirements/cuda13.txt; 12.x -> cuda12.txt; older -> CPU
  .venv-mxnet  every GPU below compute capability 9.0 -> the newest mxnet-cu11X the driver runs
               (when the CUDA 11 libraries it links are installed), otherwise the CPU build
`--device` (or DPBENCH_SETUP_DEVICE) overrides the detection: `cpu` on a GPU machine, `cuda12` or
`cuda13` where no driver is visible (e.g. building an image). Prints the plan for a person, or
with --shell as `NAME=VALUE` lines quoted for bash's `eval` (setup.sh's form). Standard library
only: it runs with the system python before any environment exists.
"""

from __future__ import annotations

import functools
import hashlib
import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEVICES = ("auto", "cpu", "cuda12", "cuda13")
ENVS = {"main": ".venv", "mxnet": ".venv-mxnet"}
CPU = {"main": "requirements/main.txt", "mxnet": "requirements/mxnet.txt"}
# MXNet 1.9.1's CUDA wheels, newest first: the CUDA version each was built for (a driver runs a
# runtime as old as its own CUDA version or older) and the CUDA libraries its libmxnet.so links
# and does not bundle (readelf -d, besides the driver's libcuda.so.1). Without them on the loader's
# path `import mxnet` fails ("libcudart.so.11.0: cannot open shared object file").
CUDA11 = (
    "libcudart.so.11.0 libcublas.so.11 libcufft.so.10 libcurand.so.10 libnvToolsExt.so.1 "
    "libcudnn.so.8 libnccl.so.2"
)
MXNET_CUDA = (
    ("mxnet-cu117", (11, 7), f"{CUDA11} libcusolver.so.11 libcusparse.so.11 libnvrtc.so.11.2"),
    ("mxnet-cu112", (11, 2), f"{CUDA11} libcusolver.so.11 libnvrtc.so.11.2"),
    ("mxnet-cu110", (11, 0), f"{CUDA11} libcusolver.so.10 libnvrtc.so.11.0"),
)
# {file: [(digest of the file before a comment-only edit, digest of its pins then)]}: an edit of
# comments alone must not rebuild every environment stamped before it. None now: main.txt's
# entry (its "add jax[cuda12] by hand" advice, removed) ended when pytest-xdist joined its pins.
EARLIER: dict[str, list[tuple[str, str]]] = {}
NVIDIA_SMI_TIMEOUT_S = 60  # a wedged driver can hang nvidia-smi; that is a machine without a GPU
# The Pythons each environment's pins have wheels for (pip's resolver for CPython on x86_64,
# 2026-12-01): torch 2.14.1, jax 0.10.2 and the rest 3.10 to 3.13; MXNet's numpy 1.23.5 and
# scikit-learn 1.7.2 3.10 and 3.11 only (for 3.12 pip builds numpy from source and fails).
PYTHONS = {"main": ((3, 10), (3, 13)), "mxnet": ((3, 10), (3, 11))}
NEEDS = {
    "main": "torch 2.14.1 and jax 0.10.2 have wheels for Python 3.10 to 3.13",
    "mxnet": "MXNet 1.9.1's numpy 1.23.5 has no wheel for Python 3.12 and newer",
}
CANDIDATES = {
    "main": ("python3.11", "python3", "python3.13", "python3.12", "python3.10"),
    "mxnet": ("python3.11", "python3.10", "python3"),
}
UV_PYTHON = "3.11"  # what `uv venv --python` asks for: the version CI tests both environments on
MXNET_PYTHON_VAR = "DPBENCH_SETUP_MXNET_PYTHON"
VERSION_TIMEOUT_S = 30


class PlanError(Exception):
    """Bad input: one line for the user, exit 2."""


@dataclass(frozen=True)
class Gpu:
    name: str
    cc: tuple[int, int] | None  # compute capability; None where nvidia-smi cannot report it


@dataclass(frozen=True)
class Driver:
    version: str
    cuda: tuple[int, int] | None  # the newest CUDA version the driver runs ("CUDA Version: X.Y")
    gpus: tuple[Gpu, ...]


def nvidia_smi(*args: str) -> tuple[str | None, str]:
    """(nvidia-smi's stdout or None when it is missing, fails or hangs; what went wrong)."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=NVIDIA_SMI_TIMEOUT_S
        )
    except FileNotFoundError:
        return None, "nvidia-smi not found"
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"nvidia-smi failed: {exc}"
    if proc.returncode != 0:
        said = next(
            (ln.strip() for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()), ""
        )
        return None, f"nvidia-smi failed, exit {proc.returncode}" + (
            f": {said[:160]}" if said else ""
        )
    return proc.stdout, ""


def detect() -> tuple[Driver | None, str]:
    """The NVIDIA driver and its GPUs (None: no usable GPU) and one line saying what was seen."""
    header, problem = nvidia_smi()
    if header is None:
        return None, f"no NVIDIA GPU ({problem})"
    rows, _ = nvidia_smi("--query-gpu=name,compute_cap,driver_version", "--format=csv,noheader")
    with_cc = rows is not None
    if rows is None:  # drivers before R510 have no compute_cap field to query
        rows, _ = nvidia_smi("--query-gpu=name,driver_version", "--format=csv,noheader")
    gpus, version = [], ""
    for row in (rows or "").splitlines():
        fields = [f.strip() for f in row.rsplit(",", 2 if with_cc else 1)]
        if len(fields) != (3 if with_cc else 2) or not fields[0]:
            continue
        cc = re.fullmatch(r"(\d+)\.(\d+)", fields[1]) if with_cc else None
        gpus.append(Gpu(fields[0], (int(cc[1]), int(cc[2])) if cc else None))
        version = fields[-1]
    if not gpus:
        return None, "no NVIDIA GPU (nvidia-smi lists none)"
    m = re.search(r"CUDA Version:\s*(\d+)\.(\d+)", header)
    driver = Driver(version, (int(m[1]), int(m[2])) if m else None, tuple(gpus))
    cuda = f"CUDA {dotted(driver.cuda)}" if driver.cuda else "no CUDA version"
    names = ", ".join(f"{g.name} ({cc_text(g)})" for g in gpus)
    return driver, f"NVIDIA driver {version} ({cuda}), {len(gpus)} GPU(s): {names}"


def dotted(v: tuple[int, int] | None) -> str:
    return "unknown" if v is None else f"{v[0]}.{v[1]}"


def cc_text(gpu: Gpu) -> str:
    return f"compute capability {dotted(gpu.cc)}"


def missing_libraries(libs: str) -> list[str]:
    """Those of `libs` (sonames, space-separated) the dynamic loader would not find: neither in
    LD_LIBRARY_PATH's folders nor in its cache (`ldconfig -p`). A presence check: nothing is
    loaded."""
    names = libs.split()
    found = set()
    for folder in os.environ.get("LD_LIBRARY_PATH", "").split(":"):
        if folder:
            found.update(n for n in names if os.path.exists(os.path.join(folder, n)))
    ldconfig = shutil.which("ldconfig") or next(
        (p for p in ("/sbin/ldconfig", "/usr/sbin/ldconfig") if os.path.exists(p)), None
    )
    if ldconfig:
        try:
            cache = subprocess.run([ldconfig, "-p"], capture_output=True, text=True, timeout=30)
            found.update(line.split()[0] for line in cache.stdout.splitlines()[1:] if line.split())
        except (OSError, subprocess.TimeoutExpired):
            pass
    return [n for n in names if n not in found]


def plan_main(device: str, source: str, driver: Driver | None, seen: str) -> tuple[str, str]:
    """(requirements file, reason) for .venv."""
    if device == "cpu":
        return CPU["main"], f"{source}: CPU builds asked for"
    cuda12 = "torch's CUDA 12.8 build from the PyTorch index and jax[cuda12]"
    cuda13 = "PyPI's torch, a CUDA 13.0 build, and jax[cuda13]"
    if device in ("cuda12", "cuda13"):
        want = (12, 0) if device == "cuda12" else (13, 0)
        what = cuda12 if device == "cuda12" else cuda13
        if driver is None:
            note = f"not checked against a driver: {seen}"
        elif driver.cuda is None or driver.cuda < want:
            need = "525" if device == "cuda12" else "580"
            note = f"the driver runs CUDA {dotted(driver.cuda)}, these need a driver >= {need}"
        else:
            note = f"the driver runs CUDA {dotted(driver.cuda)}"
        return f"requirements/{device}.txt", f"{source}: {what}; {note}"
    if driver is None:
        return CPU["main"], f"{seen}: CPU builds"
    if driver.cuda is None:
        return CPU["main"], "nvidia-smi reports no CUDA version for the driver: CPU builds"
    runs = f"driver {driver.version} runs CUDA {dotted(driver.cuda)}"
    if driver.cuda >= (13, 0):
        old = [g for g in driver.gpus if g.cc is not None and g.cc < (7, 5)]
        if not old:
            return "requirements/cuda13.txt", f"{runs}: {cuda13}"
        # CUDA 13 dropped Maxwell, Pascal and Volta: its builds carry no code for them
        why = f"CUDA 13 builds have no code for {old[0].name} ({cc_text(old[0])} < 7.5)"
        return "requirements/cuda12.txt", f"{runs}, but {why}: {cuda12}"
    if driver.cuda >= (12, 0):
        return "requirements/cuda12.txt", f"{runs} (PyPI's torch needs 13.0): {cuda12}"
    return CPU["main"], (
        f"{runs}; torch 2.14.1 and jax 0.10.2 need CUDA 12 (driver >= 525) or 13 (>= 580): "
        "CPU builds until the NVIDIA driver is updated"
    )


def plan_mxnet(device: str, source: str, driver: Driver | None, seen: str) -> tuple[str, str]:
    """(requirements file, reason) for .venv-mxnet."""
    if device == "cpu":
        return CPU["mxnet"], f"{source}: CPU build asked for"
    if driver is None:
        if device == "auto":
            return CPU["mxnet"], f"{seen}: CPU build"
        return CPU["mxnet"], (
            f"{source} without a GPU to check: MXNet 1.9.1's CUDA wheels run only below compute "
            "capability 9.0, so MXNet runs on the CPU"
        )
    # nvidia-smi learnt compute_cap in R510, before any driver that runs Hopper (R520+): a GPU
    # whose capability it cannot report is older than 9.0
    new = [g for g in driver.gpus if g.cc is not None and g.cc >= (9, 0)]
    if new:
        return CPU["mxnet"], (
            "MXNet 1.9.1's CUDA wheels stop at CUDA 11.x and have no code for "
            f"{cc_text(new[0])} ({new[0].name}): MXNet runs on the CPU here"
        )
    runs = [w for w in MXNET_CUDA if driver.cuda is not None and driver.cuda >= w[1]]
    if not runs:
        return CPU["mxnet"], (
            f"the driver runs CUDA {dotted(driver.cuda)}; MXNet 1.9.1's CUDA wheels need "
            "11.0 or newer: MXNet runs on the CPU here"
        )
    for pkg, _, libs in runs:
        if not missing_libraries(libs):
            return f"requirements/{pkg}.txt", (
                f"every GPU is below compute capability 9.0, the driver runs CUDA "
                f"{dotted(driver.cuda)} and the CUDA 11 libraries are installed: {pkg}, the "
                "newest MXNet CUDA build that runs here"
            )
    pkg, _, libs = runs[0]
    return CPU["mxnet"], (
        f"{pkg} links a CUDA 11 runtime with cuDNN 8 and NCCL 2, which is not installed "
        f"({', '.join(missing_libraries(libs))} not found): MXNet runs on the CPU here until it is"
    )


@functools.cache  # each python runs once, for both environments (a pyenv shim takes 0.1 s)
def version_of(command: str) -> tuple[str, str] | None:
    """(its path, its version such as "3.13.5") for a python named by path or on PATH; None where
    it is missing or does not run (a pyenv shim for a version not selected exits 127)."""
    path = shutil.which(command)
    if path is None:
        return None
    code = "import sys; print('%d.%d.%d' % sys.version_info[:3])"
    try:
        proc = subprocess.run(
            [path, "-c", code], capture_output=True, text=True, timeout=VERSION_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    version = proc.stdout.strip()
    ok = proc.returncode == 0 and re.fullmatch(r"\d+\.\d+\.\d+", version)
    return (path, version) if ok else None


def plan_python(env: str) -> tuple[str, str]:
    """(the interpreter that builds `env`'s environment: a path, "uv", or "" for none; why)."""
    lo, hi = PYTHONS[env]
    named = os.environ.get(MXNET_PYTHON_VAR, "") if env == "mxnet" else ""
    if named:  # the user's choice: used, or one line saying why it cannot be
        found = version_of(named)
        if found is None:
            raise PlanError(f"{MXNET_PYTHON_VAR}={named}: no python runs there")
        if not lo <= minor(found[1]) <= hi:
            raise PlanError(f"{MXNET_PYTHON_VAR}={named} is Python {found[1]}; {NEEDS[env]}")
        return found[0], f"Python {found[1]} ({found[0]}), named by {MXNET_PYTHON_VAR}"
    # $PYTHON first, as setup.sh always took it (where it fits), then the usual names
    names = [os.environ.get("PYTHON", ""), *CANDIDATES[env]]
    seen = []
    for name in dict.fromkeys(n for n in names if n):
        found = version_of(name)
        if found is None:
            continue
        if lo <= minor(found[1]) <= hi:
            return found[0], f"Python {found[1]} ({name}; {NEEDS[env]})"
        seen.append(f"{name} is {found[1]}")
    span = f"{dotted(lo)} {'or' if hi[1] - lo[1] == 1 else 'to'} {dotted(hi)}"
    here = f"no Python {span} here ({'; '.join(seen) or 'no python3'})"
    if shutil.which("uv"):
        return "uv", (
            f"uv venv --python {UV_PYTHON} ({here}; uv fetches a managed Python where none is "
            f"installed; {NEEDS[env]})"
        )
    if env == "main":
        return "", f"{here}; {NEEDS[env]}: install one (e.g. python3.12) or uv"
    return "", (
        f"{here}; {NEEDS[env]}: .venv-mxnet is not built and mxnet-gluon does not run; install "
        f"python3.11 or uv (uv fetches a Python), or name one with {MXNET_PYTHON_VAR}=PATH, then "
        "run bash scripts/setup.sh mxnet"
    )


def minor(version: str) -> tuple[int, int]:
    major, minor_, *_ = version.split(".")
    return int(major), int(minor_)


def included(req: Path) -> list[Path]:
    """`req` and every file it includes with -r/-c (recursively, each once, in order)."""
    out: list[Path] = []

    def walk(path: Path) -> None:
        if path in out:
            return
        out.append(path)
        if not path.is_file():
            return
        for line in path.read_text().splitlines():
            m = re.match(r"\s*(-r|--requirement|-c|--constraint)(?:\s*=\s*|\s+)(\S+)", line)
            if m:
                walk((path.parent / m[2]).resolve())

    walk(req.resolve())
    return out


def digest(req: Path) -> str:
    """What setup.sh stamps an environment with: the sha256 of its requirements file and of the
    files that one includes, so a change in main.txt makes a cuda13.txt environment stale too.
    A file that includes none keeps its plain sha256, the stamp setup.sh wrote before there were
    includes: environments built from main.txt or mxnet.txt then are still up to date."""
    files = included(req)
    if not req.is_file():
        return "missing"  # pip says so, if this environment is the one being built
    if len(files) == 1:
        return hashlib.sha256(req.read_bytes()).hexdigest()
    h = hashlib.sha256()
    for f in files:
        h.update(os.path.relpath(f, ROOT).encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).digest() if f.is_file() else b"missing")
    return h.hexdigest()


def pins(req: Path) -> str:
    """sha256 of a requirements file's lines less comments and blank lines."""
    lines = [ln.split("#", 1)[0].strip() for ln in req.read_text().splitlines()]
    return hashlib.sha256("\n".join(ln for ln in lines if ln).encode()).hexdigest()


def earlier(req: Path) -> str:
    """A stamp setup.sh also takes as up to date for `req` ("" for none): the digest of the file
    before an edit of its comments alone, while its pins are still the ones it held then."""
    rel = os.path.relpath(req, ROOT)
    return next(
        (old for old, held in EARLIER.get(rel, ()) if req.is_file() and pins(req) == held), ""
    )


def parse(argv: list[str]) -> tuple[str, str, bool]:
    """(device, where the choice came from, --shell) from the command line and environment."""
    device = os.environ.get("DPBENCH_SETUP_DEVICE", "") or "auto"
    source = f"DPBENCH_SETUP_DEVICE={device}"
    shell, args = False, list(argv)
    while args:
        arg = args.pop(0)
        if arg == "--shell":
            shell = True
        elif arg == "--device" or arg.startswith("--device="):
            if arg == "--device" and not args:
                raise PlanError("--device needs a value: auto, cpu, cuda12 or cuda13")
            device = arg.split("=", 1)[1] if "=" in arg else args.pop(0)
            source = f"--device {device}"
        else:
            raise PlanError(
                f"unknown argument {arg!r}; usage: setup_plan.py [--device DEVICE] [--shell]"
            )
    if device not in DEVICES:
        raise PlanError(f"{source}: the device must be one of {', '.join(DEVICES)}")
    return device, source, shell


def main(argv: list[str]) -> int:
    try:
        device, source, shell = parse(argv)
    except PlanError as exc:
        print(f"setup_plan: {exc}", file=sys.stderr)
        return 2
    driver, seen = (None, f"no GPU check ({source})") if device == "cpu" else detect()
    plan = {
        "main": plan_main(device, source, driver, seen),
        "mxnet": plan_mxnet(device, source, driver, seen),
    }
    try:
        pythons = {name: plan_python(name) for name in plan}
    except PlanError as exc:
        print(f"setup_plan: {exc}", file=sys.stderr)
        return 2
    if shell:
        print(f"machine={shlex.quote(seen)}")
        print(f"uv_python={UV_PYTHON}")
        for name, (req, why) in plan.items():
            print(f"{name}_req={shlex.quote(req)}")
            print(f"{name}_why={shlex.quote(why)}")
            print(f"{name}_digest={digest(ROOT / req)}")
            print(f"{name}_earlier={earlier(ROOT / req)}")
            print(f"{name}_python={shlex.quote(pythons[name][0])}")
            print(f"{name}_python_why={shlex.quote(pythons[name][1])}")
        return 0
    print(f"machine: {seen}")
    for name, (req, why) in plan.items():
        print(f"{name} environment {ENVS[name]}: {req} -- {why}")
        print(f"{name} environment {ENVS[name]}: {pythons[name][1]}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
