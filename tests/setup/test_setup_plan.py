"""scripts/setup_plan.py and setup.sh: which requirements file and Python each environment gets,
and why, for the drivers, GPUs and pythons a user may have. No network, pip or GPU: stand-ins for
nvidia-smi, ldconfig and the pythons come first on PATH; the machine is the stand-in."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ROOT

PLAN = ROOT / "scripts" / "setup_plan.py"
# what MXNet's CUDA 11 wheels link, as an installed CUDA 11.7 runtime with cuDNN 8 and NCCL 2 has it
CUDA11_LIBS = (
    "libcudart.so.11.0 libcublas.so.11 libcufft.so.10 libcurand.so.10 libnvToolsExt.so.1 "
    "libcudnn.so.8 libnccl.so.2 libcusolver.so.11 libcusparse.so.11 libnvrtc.so.11.2"
).split()
A100 = [("NVIDIA A100-SXM4-80GB", "8.0")]
H100 = [("NVIDIA H100 80GB HBM3", "9.0")]


def machine(
    tmp_path: Path,
    cuda: str | None = None,
    gpus: Sequence[tuple[str, str]] = (),
    driver: str = "580.159.04",
    compute_cap: bool = True,
    fail: bool = False,
    libs: Sequence[str] = (),
    pythons: dict[str, str] | None = None,
) -> dict[str, str]:
    """PATH first: a stand-in nvidia-smi (none when `cuda` is None and not `fail`), ldconfig
    (listing `libs`); with `pythons` ({"python3": "3.13.5", "uv": ""}) the only pythons."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True, exist_ok=True)
    for name, version in (pythons or {}).items():
        if name == "uv":
            stand_in_uv(bin_dir / "uv", tmp_path)
        else:
            stand_in_python(bin_dir / name, version, tmp_path / "log")
    cat = lambda text: f"cat <<'EOF'\n{text}EOF\n"  # noqa: E731
    cache = "".join(f"\t{lib} (libc6,x86-64) => /usr/local/cuda-11.7/lib64/{lib}\n" for lib in libs)
    tools = {"ldconfig": cat(f"{len(libs)} libs found in cache `/etc/ld.so.cache'\n{cache}")}
    # a driver before R510 refuses the compute_cap field, as nvidia-smi 470 does
    no_cc = "echo 'Field \"compute_cap\" is not a valid field to query.'; exit 2\n"
    if fail:
        tools["nvidia-smi"] = "echo 'NVIDIA-SMI has failed'\nexit 9\n"
    elif cuda is not None:
        rows = "".join(f"{name}, {cc}, {driver}\n" for name, cc in gpus)
        old_rows = "".join(f"{name}, {driver}\n" for name, _ in gpus)
        header = f"| NVIDIA-SMI {driver}   Driver Version: {driver}   CUDA Version: {cuda}     |\n"
        tools["nvidia-smi"] = (
            f'case "$*" in\n  *compute_cap*) {cat(rows) if compute_cap else no_cc} ;;\n'
            f"  *--query-gpu*) {cat(old_rows)} ;;\n  *) {cat(header)} ;;\nesac\n"
        )
    for name, text in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\n{text}")
        (bin_dir / name).chmod(0o755)
    dropped = ("DPBENCH_SETUP_DEVICE", "LD_LIBRARY_PATH", "DPBENCH_SETUP_MXNET_PYTHON")
    env = {k: v for k, v in os.environ.items() if k not in dropped}
    if pythons is not None:
        env.pop("PYTHON", None)
    env["PATH"] = os.pathsep.join([str(bin_dir), *without(tmp_path, pythons is not None)])
    return env


def without(tmp_path: Path, pythons: bool) -> list[str]:
    """PATH, each folder holding a real nvidia-smi (or with `pythons` a python or uv) replaced
    by links to everything else in it."""

    def dropped(name: str) -> bool:
        return name == "nvidia-smi" or pythons and (name.startswith("python") or name == "uv")

    out = []
    for i, folder in enumerate(os.environ["PATH"].split(os.pathsep)):
        names = os.listdir(folder) if os.path.isdir(folder) else []
        shadow = tmp_path / f"path-{i}"
        if any(map(dropped, names)) and not shadow.exists():
            shadow.mkdir()
            for name in (n for n in names if not dropped(n)):
                (shadow / name).symlink_to(os.path.join(folder, name))
        out.append(str(shadow) if any(map(dropped, names)) else folder)
    return out


def stand_in_python(path: Path, version: str, log: Path) -> None:
    """A python that reports `version`, logs `-m venv` (making the environment), `-m pip` and
    `-m benchmarks.devices` (which fails, as a devices check may), runs the rest for real."""
    path.write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in\n'
        f"  '-c '*version_info*) echo {version} ;;\n"
        f'  "-m venv") echo "venv $(basename "$0") $3 $4" >>{log}; shift 2\n'
        '    [ "$1" = --clear ] && shift\n'
        '    mkdir -p "$1/bin"; cp "$0" "$1/bin/python"; touch "$1/pyvenv.cfg" ;;\n'
        f'  "-m pip") echo "pip $*" >>{log} ;;\n'
        f'  "-m benchmarks.devices") echo devices >>{log}; exit 3 ;;\n'
        f'  *) exec {sys.executable} "$@" ;;\n'
        "esac\n"
    )
    path.chmod(0o755)


def stand_in_uv(path: Path, tmp_path: Path) -> None:
    """uv that logs its arguments and makes the environment with a python reporting 3.11.14."""
    stand_in_python(tmp_path / "uv-python3.11", "3.11.14", tmp_path / "log")
    path.write_text(
        "#!/bin/sh\n"
        f'echo "uv UV_VENV_CLEAR=$UV_VENV_CLEAR $*" >>{tmp_path / "log"}\n'
        'for last; do :; done\nmkdir -p "$last/bin"; touch "$last/pyvenv.cfg"\n'
        f'cp {tmp_path / "uv-python3.11"} "$last/bin/python"\n'
    )
    path.chmod(0o755)


def plan(env: dict[str, str], *args: str, script: Path = PLAN) -> dict[str, str]:
    proc = subprocess.run([sys.executable, str(script), "--shell", *args], env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return dict(shlex.split(line)[0].split("=", 1) for line in proc.stdout.splitlines())


CU12 = {"cuda": "12.2", "gpus": A100, "libs": CUDA11_LIBS}  # a CUDA 12 machine with an A100
CU13 = CU12 | {"cuda": "13.0"}
T4 = {"cuda": "11.4", "gpus": [("Tesla T4", "7.5")], "driver": "470.82.01", "libs": CUDA11_LIBS}


@pytest.mark.parametrize("machine_kw, args, files, why", [
    # setup_plan's flags and VAR=value settings -> main and mxnet files, and why
    (CU12, "", "cuda12 mxnet-cu117", "runs CUDA 12.2"),
    (CU12 | {"libs": CUDA11_LIBS[:5] + CUDA11_LIBS[6:]}, "", "cuda12 mxnet", "libcudnn.so.8"),
    (CU12 | {"libs": []}, "LD_LIBRARY_PATH=/x:{libs}", "cuda12 mxnet-cu117", ""),
    (CU13 | {"gpus": H100}, "", "cuda13 mxnet", "compute capability 9.0"),
    (CU13 | {"gpus": A100 + H100}, "", "cuda13 mxnet", "compute capability 9.0"),
    (CU13 | {"gpus": [("Tesla V100", "7.0")]}, "", "cuda12 mxnet-cu117", "7.0 < 7.5"),
    (T4, "", "main mxnet-cu112", "NVIDIA driver is updated"),
    (T4 | {"compute_cap": False}, "", "main mxnet-cu112", "runs CUDA 11.4"),
    ({}, "", "main mxnet", "nvidia-smi not found"),
    ({"fail": True}, "", "main mxnet", "exit 9"),
    ({"cuda": "13.0", "gpus": []}, "", "main mxnet", ""),
    (CU12, "--device cpu", "main mxnet", "--device cpu"),
    (CU12, "DPBENCH_SETUP_DEVICE=cpu", "main mxnet", "DPBENCH_SETUP_DEVICE=cpu"),
    (CU12, "DPBENCH_SETUP_DEVICE=cpu --device=auto", "cuda12 mxnet-cu117", ""),  # flag wins
    ({}, "--device cuda13", "cuda13 mxnet", "not checked"),
    (CU12, "--device cuda13", "cuda13 mxnet-cu117", "need a driver >= 580"),
])  # fmt: skip
def test_each_machine_gets_its_requirements_files(
    tmp_path: Path, machine_kw: dict[str, Any], args: str, files: str, why: str
) -> None:
    for lib in CUDA11_LIBS:  # for LD_LIBRARY_PATH
        (tmp_path / lib).touch()
    settings = [a.format(libs=tmp_path).split("=", 1) for a in args.split() if "=" in a]
    env = machine(tmp_path, **machine_kw) | dict(settings)
    p = plan(env, *(a for a in args.split() if "=" not in a or a.startswith("--")))
    assert [p["main_req"], p["mxnet_req"]] == [f"requirements/{n}.txt" for n in files.split()]
    assert why in p["main_why"] + p["mxnet_why"], p
    if not machine_kw and not args:  # a file that includes none is stamped with its plain sha256
        digest = hashlib.sha256((ROOT / p["main_req"]).read_bytes()).hexdigest()
        assert p["main_digest"] == digest and p["main_earlier"] == ""


def project(where: Path) -> Path:
    """A copy of the scripts and requirements, so no test touches the real environments."""
    (where / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "setup_plan.py", "fix_scripts.py"):
        shutil.copy(ROOT / "scripts" / name, where / "scripts" / name)
    shutil.copytree(ROOT / "requirements", where / "requirements")
    return where


def setup_sh(root: Path, env: dict[str, str], *args: str, code: int = 0) -> str:
    proc = subprocess.run(["bash", "scripts/setup.sh", *args], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == code, proc.stderr
    return proc.stdout if code == 0 else proc.stderr


@pytest.mark.parametrize("args, setting, code, said", [
    (["--dry-run", "--device", "gpu"], {}, 2, "gpu"),
    (["--dry-run"], {"DPBENCH_SETUP_DEVICE": "cuda11"}, 2, "cuda11"),
    # a python named for MXNet that does not fit or is not there: exit 2 before anything
    (["--dry-run"], {"DPBENCH_SETUP_MXNET_PYTHON": "py313"}, 2, "is Python 3.13.5"),
    (["--dry-run"], {"DPBENCH_SETUP_MXNET_PYTHON": "nowhere"}, 2, "no python"),
    (["all"], {}, 1, "no Python 3.10 to 3.13 here"),
])  # fmt: skip
def test_bad_input_and_no_fitting_python_are_one_line(
    tmp_path: Path, args: list[str], setting: dict[str, str], code: int, said: str
) -> None:
    env = machine(tmp_path, pythons={"python3": "3.14.1", "py313": "3.13.5"}) | setting
    err = setup_sh(project(tmp_path / "p"), env, *args, code=code)
    assert err.count("\n") == 1 and said in err, err
    assert not (tmp_path / "log").exists() and not (tmp_path / "p" / ".venv").exists()


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    files = lambda: {p: (p.stat().st_mtime_ns, p.read_bytes()) for p in root.rglob("*.*")}  # noqa: E731
    before = files()
    out = setup_sh(root, machine(tmp_path, **CU12) | {"PYTHON": sys.executable}, "--dry-run")
    assert ".venv-mxnet: requirements/mxnet-cu117.txt" in out and ".venv would be built" in out
    assert files() == before and not (root / ".venv").exists()  # no stamp, nothing rewritten


def test_the_stamp_covers_the_chosen_file_and_what_it_includes(tmp_path: Path) -> None:
    """A stamp from before a comment-only edit of main.txt (in setup_plan.EARLIER) is up to date
    for the CPU plan; the CUDA plan rebuilds afresh (a failing devices check or not); new pins
    make both stale. A .venv without pyvenv.cfg (a GPU machine's own python) is used as it is."""
    root = project(tmp_path / "p")
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "devices.py").touch()
    log = tmp_path / "log"
    stand_in_python(tmp_path / "fakepy", "3.12.3", log)
    venv = root / ".venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(tmp_path / "fakepy", venv / "bin" / "python")
    (venv / "pyvenv.cfg").touch()
    main, script = root / "requirements" / "main.txt", root / "scripts" / "setup_plan.py"
    before = hashlib.sha256(main.read_bytes().replace(b"\n", b"\n# removed since\n", 1)).hexdigest()
    lines = [ln.split("#", 1)[0].strip() for ln in main.read_text().splitlines()]
    held = hashlib.sha256("\n".join(ln for ln in lines if ln).encode()).hexdigest()
    table = "EARLIER: dict[str, list[tuple[str, str]]] = {}"
    entry = f'EARLIER = {{"requirements/main.txt": [("{before}", "{held}")]}}'
    script.write_text(script.read_text().replace(table, entry))
    stamp = venv / ".requirements.sha256"
    stamp.write_text(f"{before}\n")  # as an environment built before the edit has it
    env = machine(tmp_path, "13.0", H100) | {"PYTHON": str(tmp_path / "fakepy")}
    assert "is up to date" in setup_sh(root, env, "--dry-run", "--device", "cpu", "main")
    assert "would be rebuilt afresh" in setup_sh(root, env, "--dry-run", "main")
    out = setup_sh(root, env, "main")
    assert "from requirements/cuda13.txt" in out and "benchmarks.devices exited 3" in out
    calls = log.read_text()
    assert "venv fakepy --clear .venv" in calls and calls.endswith("cuda13.txt\ndevices\n")
    digest = plan(env, script=script)["main_digest"]
    assert stamp.read_text() == f"{digest} requirements/cuda13.txt\n"
    log.unlink()
    assert "is up to date" in setup_sh(root, env, "main") and not log.exists()
    setup_sh(root, env, "--device", "cpu", "main")  # afresh, no devices check on the CPU plan
    assert log.read_text().endswith("-q -r requirements/main.txt\n")
    main.write_text(main.read_text() + "six==1.17.0\n")
    assert "would be built" in setup_sh(root, env, "--dry-run", "--device", "cpu", "main")
    stamp.write_text(f"{digest} requirements/cuda13.txt\n")
    assert "would be built" in setup_sh(root, env, "--dry-run", "main")
    log.unlink()
    (venv / "pyvenv.cfg").unlink()
    (venv / "bin" / "python").write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    assert "(no pyvenv.cfg); used as it is" in setup_sh(root, env, "main")
    assert not log.exists()  # the plan runs, nothing installs


def test_mxnet_cuda_files_are_mxnet_txt_with_the_package_swapped() -> None:
    def pins(name: str) -> list[str]:
        lines = (ROOT / "requirements" / name).read_text().splitlines()
        return [ln for ln in lines if ln.strip() and not ln.startswith("#")]

    for cu in ("cu117", "cu112", "cu110"):
        want = [f"mxnet-{cu}==1.9.1" if p == "mxnet==1.9.1" else p for p in pins("mxnet.txt")]
        assert pins(f"mxnet-{cu}.txt") == want and "numpy==1.23.5" in want


def test_each_environment_gets_a_python_its_wheels_fit(tmp_path: Path) -> None:
    """Debian 13 (python3 3.13, no 3.11, no uv): .venv from python3, .venv-mxnet not built (one
    line why, in its not-built.txt). Then uv builds it; uv offline, python3.11, a named one."""
    root = project(tmp_path / "p")
    env = machine(tmp_path, pythons={"python3": "3.13.5"})
    out = setup_sh(root, env, "all")
    assert "venv python3 .venv" in (tmp_path / "log").read_text()
    note = (root / ".venv-mxnet" / "not-built.txt").read_text()
    assert note.count("\n") == 1 and "install python3.11 or uv" in note, note
    assert f"not built: {note}" in out and not (root / ".venv-mxnet" / "bin").exists()
    stand_in_uv(tmp_path / "bin" / "uv", tmp_path)
    setup_sh(root, env, "mxnet")
    uv = "uv UV_VENV_CLEAR=1 venv -q --no-project --seed --python 3.11 .venv-mxnet"
    assert uv in (tmp_path / "log").read_text()
    shutil.rmtree(root / ".venv-mxnet")
    (tmp_path / "bin" / "uv").write_text(
        "#!/bin/sh\necho 'error: Failed to download' >&2\nexit 2\n"
    )
    setup_sh(root, env, "mxnet")
    note = (root / ".venv-mxnet" / "not-built.txt").read_text()
    assert note.startswith("uv venv --python 3.11 failed"), note
    stand_in_python(tmp_path / "bin" / "python3.11", "3.11.14", tmp_path / "log")
    assert "built with Python 3.11.14 (python3.11" in setup_sh(root, env, "mxnet")
    assert not (root / ".venv-mxnet" / "not-built.txt").exists()
    stand_in_python(tmp_path / "bin" / "py310", "3.10.16", tmp_path / "log")
    named = plan(env | {"DPBENCH_SETUP_MXNET_PYTHON": "py310"})["mxnet_python"]
    assert named == str(tmp_path / "bin" / "py310")
