"""scripts/setup_plan.py and setup.sh: which requirements file and Python each environment gets,
and why, for the drivers, GPUs and pythons a user may have. No network, pip or GPU: stand-ins for
nvidia-smi, ldconfig (the CUDA 11 libraries MXNet's CUDA wheels need) and the pythons come first
on PATH; the machine is the stand-in, the code is real."""

from __future__ import annotations

import hashlib
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

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
# sha256 of requirements/main.txt before this plan existed: a stamp of an older main.txt
MAIN_TXT_BEFORE = "6dfa370078f1332d08ac0f5c826ccba91298ed1301e21338cbb4ef5bf1169ad1"
FAILED = "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver."


def machine(
    tmp_path: Path,
    cuda: str | None = None,
    gpus: list[tuple[str, str]] | None = None,
    driver: str = "580.159.04",
    compute_cap: bool = True,
    fail: bool = False,
    libs: list[str] | None = None,
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
    if fail:
        smi = f'#!/bin/sh\necho "{FAILED}"\nexit 9\n'
    elif cuda is not None:
        header = f"| NVIDIA-SMI {driver}   Driver Version: {driver}   CUDA Version: {cuda}     |\n"
        rows = "".join(f"{name}, {cc}, {driver}\n" for name, cc in gpus or [])
        old_rows = "".join(f"{name}, {driver}\n" for name, _ in gpus or [])
        # a driver before R510 refuses the compute_cap field, as nvidia-smi 470 does
        cc_answer = (
            f"cat <<'EOF'\n{rows}EOF"
            if compute_cap
            else ("echo 'Field \"compute_cap\" is not a valid field to query.'; exit 2")
        )
        smi = (
            '#!/bin/sh\ncase "$*" in\n'
            f"  *compute_cap*) {cc_answer} ;;\n"
            f"  *--query-gpu*) cat <<'EOF'\n{old_rows}EOF\n  ;;\n"
            f"  *) cat <<'EOF'\n{header}EOF\n  ;;\nesac\n"
        )
    else:
        smi = None
    if smi is not None:
        (bin_dir / "nvidia-smi").write_text(smi)
        (bin_dir / "nvidia-smi").chmod(0o755)
    cache = "".join(
        f"\t{lib} (libc6,x86-64) => /usr/local/cuda-11.7/lib64/{lib}\n" for lib in libs or []
    )
    head = f"{len(libs or [])} libs found in cache `/etc/ld.so.cache'"
    (bin_dir / "ldconfig").write_text(f"#!/bin/sh\ncat <<'EOF'\n{head}\n{cache}EOF\n")
    (bin_dir / "ldconfig").chmod(0o755)
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
        if not os.path.isdir(folder) or not any(dropped(n) for n in os.listdir(folder)):
            out.append(folder)
            continue
        shadow = tmp_path / f"path-{i}"
        if not shadow.exists():
            shadow.mkdir()
            for entry in os.scandir(folder):
                if not dropped(entry.name):
                    (shadow / entry.name).symlink_to(entry.path)
        out.append(str(shadow))
    return out


def stand_in_python(path: Path, version: str, log: Path) -> None:
    """A python that reports `version`, logs `-m venv` (making the environment) and `-m pip`,
    and runs everything else with this interpreter."""
    path.write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in\n'
        f"  '-c '*version_info*) echo {version} ;;\n"
        f'  "-m venv") echo "venv $(basename "$0") $3 $4" >>{log}; shift 2\n'
        '    [ "$1" = --clear ] && shift\n'
        '    mkdir -p "$1/bin"; cp "$0" "$1/bin/python"; touch "$1/pyvenv.cfg" ;;\n'
        f'  "-m pip") echo "pip $*" >>{log} ;;\n'
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
    proc = subprocess.run(
        [sys.executable, str(script), "--shell", *args], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    return dict(shlex.split(line)[0].split("=", 1) for line in proc.stdout.splitlines())


def test_cuda12_driver_with_an_a100_gets_cuda12_and_mxnet_cu117(tmp_path: Path) -> None:
    p = plan(machine(tmp_path, "12.2", A100, driver="535.104.05", libs=CUDA11_LIBS))
    assert p["main_req"] == "requirements/cuda12.txt", p["main_why"]
    assert "runs CUDA 12.2" in p["main_why"] and "PyTorch index" in p["main_why"]
    assert p["mxnet_req"] == "requirements/mxnet-cu117.txt", p["mxnet_why"]
    assert "NVIDIA A100-SXM4-80GB (compute capability 8.0)" in p["machine"]


def test_an_a100_without_the_cuda11_libraries_keeps_mxnet_on_the_cpu(tmp_path: Path) -> None:
    """mxnet-cu117 links the CUDA 11 runtime, cuDNN 8 and NCCL 2 without bundling them: installed
    on a CUDA 12 machine that lacks them, `import mxnet` would fail."""
    p = plan(
        machine(tmp_path, "12.2", A100, libs=[lib for lib in CUDA11_LIBS if "cudnn" not in lib])
    )
    assert p["main_req"] == "requirements/cuda12.txt"
    assert p["mxnet_req"] == "requirements/mxnet.txt"
    assert "libcudnn.so.8 not found" in p["mxnet_why"], p["mxnet_why"]
    # the same libraries found through LD_LIBRARY_PATH instead of the loader's cache
    lib_dir = tmp_path / "cuda-11.7"
    lib_dir.mkdir()
    for lib in CUDA11_LIBS:
        (lib_dir / lib).touch()
    env = machine(tmp_path, "12.2", A100) | {"LD_LIBRARY_PATH": f"/nowhere:{lib_dir}"}
    assert plan(env)["mxnet_req"] == "requirements/mxnet-cu117.txt"


def test_cuda13_driver_with_an_h100_gets_cuda13_and_mxnet_on_the_cpu(tmp_path: Path) -> None:
    p = plan(machine(tmp_path, "13.0", H100, libs=CUDA11_LIBS))
    assert p["main_req"] == "requirements/cuda13.txt", p["main_why"]
    assert "driver 580.159.04 runs CUDA 13.0" in p["main_why"]
    assert p["mxnet_req"] == "requirements/mxnet.txt"
    assert p["mxnet_why"] == (
        "MXNet 1.9.1's CUDA wheels stop at CUDA 11.x and have no code for compute capability 9.0 "
        "(NVIDIA H100 80GB HBM3): MXNet runs on the CPU here"
    )
    # one Hopper among Ampere GPUs is enough: MXNet would run on all of them
    mixed = plan(machine(tmp_path, "13.0", A100 + H100, libs=CUDA11_LIBS))
    assert mixed["mxnet_req"] == "requirements/mxnet.txt"


def test_a_volta_gpu_on_a_cuda13_driver_gets_the_cuda12_builds(tmp_path: Path) -> None:
    """CUDA 13 dropped compute capability below 7.5 (Maxwell, Pascal, Volta)."""
    p = plan(machine(tmp_path, "13.0", [("Tesla V100-SXM2-32GB", "7.0")], libs=CUDA11_LIBS))
    assert p["main_req"] == "requirements/cuda12.txt", p["main_why"]
    assert "Tesla V100-SXM2-32GB (compute capability 7.0 < 7.5)" in p["main_why"]
    assert p["mxnet_req"] == "requirements/mxnet-cu117.txt"


def test_no_gpu_gets_todays_files(tmp_path: Path) -> None:
    p = plan(machine(tmp_path))
    assert (p["main_req"], p["mxnet_req"]) == ("requirements/main.txt", "requirements/mxnet.txt")
    assert "nvidia-smi not found" in p["main_why"]
    # a file that includes none is stamped with its plain sha256, as before the plan existed
    for name in ("main", "mxnet"):
        req = ROOT / p[f"{name}_req"]
        assert p[f"{name}_digest"] == hashlib.sha256(req.read_bytes()).hexdigest()
    assert p["main_earlier"] == ""  # no comment-only edit of today's pins to forgive
    # one that fails, one that lists no GPU: a machine without GPU
    p = plan(machine(tmp_path / "fails", fail=True))
    assert p["main_req"] == "requirements/main.txt" and f"exit 9: {FAILED}" in p["main_why"]
    assert plan(machine(tmp_path / "none", "13.0", []))["main_req"] == "requirements/main.txt"


@pytest.mark.parametrize("compute_cap", [True, False], ids=["cc", "no-cc-field"])
def test_a_cuda_11_4_driver_gets_cpu_builds_and_mxnet_cu112(tmp_path: Path, compute_cap) -> None:
    gpus = [("Tesla T4", "7.5")]
    env = machine(
        tmp_path, "11.4", gpus, driver="470.82.01", compute_cap=compute_cap, libs=CUDA11_LIBS
    )
    p = plan(env)
    assert p["main_req"] == "requirements/main.txt"
    assert "runs CUDA 11.4" in p["main_why"] and "NVIDIA driver is updated" in p["main_why"]
    assert p["mxnet_req"] == "requirements/mxnet-cu112.txt", p["mxnet_why"]  # 11.4 >= 11.2 < 11.7


def test_cpu_asked_for_on_a_gpu_machine(tmp_path: Path) -> None:
    env = machine(tmp_path, "12.2", A100, libs=CUDA11_LIBS)
    for p, said in (
        (plan(env, "--device", "cpu"), "--device cpu"),
        (plan(env | {"DPBENCH_SETUP_DEVICE": "cpu"}), "DPBENCH_SETUP_DEVICE=cpu"),
    ):
        assert (
            p["main_req"] == "requirements/main.txt" and p["mxnet_req"] == "requirements/mxnet.txt"
        )
        assert p["main_why"].startswith(said), p["main_why"]
    # the flag wins over the environment variable
    p = plan(env | {"DPBENCH_SETUP_DEVICE": "cpu"}, "--device=auto")
    assert p["main_req"] == "requirements/cuda12.txt"


def test_cuda13_asked_for_without_a_driver_or_over_an_old_one(tmp_path: Path) -> None:
    """An image built without GPUs: the CUDA builds, MXNet on the CPU (no GPU to check)."""
    p = plan(machine(tmp_path), "--device", "cuda13")
    assert (p["main_req"], p["mxnet_req"]) == ("requirements/cuda13.txt", "requirements/mxnet.txt")
    assert p["main_why"].startswith("--device cuda13: ") and "not checked" in p["main_why"]
    old = plan(machine(tmp_path / "old", "12.2", A100), "--device", "cuda13")
    assert old["main_req"] == "requirements/cuda13.txt"
    assert "runs CUDA 12.2, these need a driver >= 580" in old["main_why"]


def test_a_bad_device_is_one_line_and_exit_2(tmp_path: Path) -> None:
    env = machine(tmp_path)
    for cmd, extra in (
        ([sys.executable, str(PLAN)], {"DPBENCH_SETUP_DEVICE": "cuda11"}),
        (["bash", str(ROOT / "scripts" / "setup.sh"), "--dry-run", "--device", "gpu"], {}),
        (["bash", str(ROOT / "scripts" / "setup.sh"), "everything"], {}),
    ):
        proc = subprocess.run(cmd, env=env | extra, capture_output=True, text=True)
        assert proc.returncode == 2, (cmd, proc.stderr)
        assert len(proc.stderr.splitlines()) == 1 and not proc.stdout, (cmd, proc.stderr)


def project(where: Path) -> Path:
    """A copy of the scripts and requirements, so no test touches the real environments."""
    (where / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "setup_plan.py", "fix_scripts.py"):
        shutil.copy(ROOT / "scripts" / name, where / "scripts" / name)
    shutil.copytree(ROOT / "requirements", where / "requirements")
    return where


def snapshot(where: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(where)): (p.stat().st_mtime_ns, p.read_bytes() if p.is_file() else b"")
        for p in sorted(where.rglob("*"))
    }


def test_dry_run_prints_the_plan_and_changes_nothing(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    env = machine(tmp_path, "12.2", A100, libs=CUDA11_LIBS) | {"PYTHON": sys.executable}
    before = snapshot(root)
    proc = subprocess.run(
        ["bash", "scripts/setup.sh", "--dry-run"], cwd=root, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "[setup] dry run, nothing is installed; machine: NVIDIA driver 580.159.04" in out
    assert "[setup] main environment .venv: requirements/cuda12.txt -- driver" in out
    assert "[setup] mxnet environment .venv-mxnet: requirements/mxnet-cu117.txt -- every GPU" in out
    assert "dry run: main environment .venv would be built" in out
    assert snapshot(root) == before  # no .venv, no stamp, nothing rewritten


def earlier_edit(root: Path) -> str:
    """Register a comment-only edit of the copy's main.txt in its setup_plan.EARLIER; the
    digest of main.txt before the edit."""
    main = root / "requirements" / "main.txt"
    before = hashlib.sha256(main.read_bytes().replace(b"\n", b"\n# removed since\n", 1))
    lines = [ln.split("#", 1)[0].strip() for ln in main.read_text().splitlines()]
    held = hashlib.sha256("\n".join(ln for ln in lines if ln).encode()).hexdigest()
    script = root / "scripts" / "setup_plan.py"
    table = "EARLIER: dict[str, list[tuple[str, str]]] = {}"
    assert table in script.read_text()
    entry = f'EARLIER = {{"requirements/main.txt": [("{before.hexdigest()}", "{held}")]}}'
    script.write_text(script.read_text().replace(table, entry))
    return before.hexdigest()


def test_the_stamp_covers_the_chosen_file_and_what_it_includes(tmp_path: Path) -> None:
    """A stamp from before a comment-only edit of main.txt is up to date for the CPU plan, the
    CUDA plan rebuilds afresh; a change of pins makes both stamps stale."""
    root = project(tmp_path / "p")
    venv = root / ".venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").symlink_to(sys.executable)
    (venv / "pyvenv.cfg").touch()
    stamp = venv / ".requirements.sha256"
    before = earlier_edit(root)
    stamp.write_text(f"{before}\n")  # as an environment built before the edit has it
    env = machine(tmp_path, "13.0", H100) | {"PYTHON": sys.executable}

    def dry_run(*args: str) -> str:
        cmd = ["bash", "scripts/setup.sh", "--dry-run", *args, "main"]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    assert "main environment .venv is up to date" in dry_run("--device", "cpu")
    assert "would be rebuilt afresh (it was built from requirements/main.txt)" in dry_run()
    script = root / "scripts" / "setup_plan.py"
    cuda13 = plan(env, script=script)["main_digest"]
    stamp.write_text(f"{cuda13} requirements/cuda13.txt\n")
    assert "main environment .venv is up to date" in dry_run()
    main = root / "requirements" / "main.txt"
    main.write_text(main.read_text() + "six==1.17.0\n")
    assert plan(env, script=script)["main_digest"] != cuda13
    assert "main environment .venv would be built" in dry_run()
    stamp.write_text(f"{before}\n")
    assert "main environment .venv would be built" in dry_run("--device", "cpu")


def test_mxnet_cuda_files_are_mxnet_txt_with_the_package_swapped() -> None:
    def pins(name: str) -> list[str]:
        lines = (ROOT / "requirements" / name).read_text().splitlines()
        return [ln for ln in lines if ln.strip() and not ln.startswith("#")]

    for cu in ("cu117", "cu112", "cu110"):
        want = [f"mxnet-{cu}==1.9.1" if p == "mxnet==1.9.1" else p for p in pins("mxnet.txt")]
        assert pins(f"mxnet-{cu}.txt") == want and "numpy==1.23.5" in want


def test_a_switch_of_file_rebuilds_afresh_and_says_what_the_gpu_shows(tmp_path: Path) -> None:
    """setup.sh with a python that logs `-m venv`, `-m pip` and `-m benchmarks.devices` (which
    fails, as a devices check may: the set-up still succeeds)."""
    root = project(tmp_path / "p")
    (root / "benchmarks").mkdir()
    (root / "benchmarks" / "devices.py").touch()
    log = tmp_path / "log"
    fake = tmp_path / "fakepy"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$1 $2" in\n'
        f'  "-m venv") echo "venv $3 $4" >>{log}; shift 2; [ "$1" = --clear ] && shift\n'
        '    mkdir -p "$1/bin"; cp "$0" "$1/bin/python"; touch "$1/pyvenv.cfg" ;;\n'
        f'  "-m pip") echo "pip $*" >>{log} ;;\n'
        f'  "-m benchmarks.devices") echo devices >>{log}; exit 3 ;;\n'
        f'  *) exec {sys.executable} "$@" ;;\n'
        "esac\n"
    )
    fake.chmod(0o755)
    venv = root / ".venv"
    (venv / "bin").mkdir(parents=True)
    shutil.copy(fake, venv / "bin" / "python")
    (venv / "pyvenv.cfg").touch()
    (venv / ".requirements.sha256").write_text(f"{MAIN_TXT_BEFORE}\n")
    env = machine(tmp_path, "13.0", H100) | {"PYTHON": str(fake)}

    def setup(*args: str) -> str:
        cmd = ["bash", "scripts/setup.sh", *args, "main"]
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout

    out = setup()
    assert "rebuilding the main environment in .venv from requirements/cuda13.txt" in out
    assert "benchmarks.devices exited 3 (see above); the environment is installed" in out
    assert log.read_text().splitlines() == [
        "venv --clear .venv",
        "pip -m pip install -q --upgrade pip",
        "pip -m pip install -q -r requirements/cuda13.txt",
        "devices",
    ]
    digest = plan(env, script=root / "scripts" / "setup_plan.py")["main_digest"]
    assert (venv / ".requirements.sha256").read_text() == f"{digest} requirements/cuda13.txt\n"
    log.unlink()
    assert "main environment .venv is up to date" in setup() and not log.exists()
    out = setup("--device", "cpu")  # and back: afresh again, no devices check on the CPU plan
    assert "(it was built from requirements/cuda13.txt)" in out
    assert log.read_text().splitlines()[0] == "venv --clear .venv"
    assert log.read_text().splitlines()[-1] == "pip -m pip install -q -r requirements/main.txt"


def test_a_venv_that_is_the_users_own_python_is_used_as_it_is(tmp_path: Path) -> None:
    """.venv/bin/python a script that execs a GPU machine's own python (no pyvenv.cfg): used as
    it is, no pip. With pyvenv.cfg and no stamp it is built as before."""
    root = project(tmp_path / "p")
    log = tmp_path / "log"
    fake = tmp_path / "fakepy"
    fake.write_text(f'#!/bin/sh\necho "$*" >>{log}\nexec {sys.executable} "$@"\n')
    fake.chmod(0o755)
    (root / ".venv" / "bin").mkdir(parents=True)
    wrapper = root / ".venv" / "bin" / "python"
    wrapper.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    wrapper.chmod(0o755)
    env = machine(tmp_path, "13.0", H100) | {"PYTHON": str(fake)}
    cmd = ["bash", "scripts/setup.sh", "main"]
    proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert "is not a virtual environment (no pyvenv.cfg); used as it is" in proc.stdout
    calls = log.read_text() if log.exists() else ""  # the plan runs, nothing installs
    assert "-m venv" not in calls and "-m pip" not in calls, calls
    assert wrapper.read_text().startswith("#!/bin/sh\nexec ")
    (root / ".venv" / "pyvenv.cfg").touch()  # a real (if unstamped) environment: built
    proc = subprocess.run([*cmd[:2], "--dry-run", "main"], cwd=root, env=env,
                          capture_output=True, text=True)  # fmt: skip
    assert "dry run: main environment .venv would be built" in proc.stdout, proc.stdout


def setup_sh(root: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", "scripts/setup.sh", *args], cwd=root, env=env, capture_output=True, text=True
    )


def test_a_311_machine_builds_both_environments_with_python311(tmp_path: Path) -> None:
    env = machine(tmp_path, pythons={"python3.11": "3.11.7", "python3": "3.13.5"})
    p = plan(env)
    assert p["main_python"] == p["mxnet_python"] == str(tmp_path / "bin" / "python3.11")
    assert p["main_python_why"].startswith("Python 3.11.7 (python3.11; torch 2.14.1")
    assert p["mxnet_python_why"].startswith("Python 3.11.7 (python3.11; MXNet 1.9.1's numpy")


def test_debian_13_builds_main_with_python3_and_runs_on_without_mxnet(tmp_path: Path) -> None:
    """Debian 13 (python3 3.13, no 3.11, no uv): .venv from python3; .venv-mxnet not built, one
    line why (also in .venv-mxnet/not-built.txt), exit 0; with a python3.11 it is built."""
    root = project(tmp_path / "p")
    env = machine(tmp_path, pythons={"python3": "3.13.5"})
    dry = setup_sh(root, env, "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "main environment .venv: Python 3.13.5 (python3; torch 2.14.1" in dry.stdout
    assert "dry run: mxnet environment .venv-mxnet cannot be built here" in dry.stdout
    proc = setup_sh(root, env, "all")
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "log").read_text().splitlines()
    assert log == [
        "venv python3 .venv ",
        "pip -m pip install -q --upgrade pip",
        "pip -m pip install -q -r requirements/main.txt",
    ]
    note = (root / ".venv-mxnet" / "not-built.txt").read_text()
    assert note.count("\n") == 1, note
    assert note.startswith("no Python 3.10 or 3.11 here (python3 is 3.13.5)"), note
    assert "install python3.11 or uv" in note and "bash scripts/setup.sh mxnet" in note
    assert f"[setup] mxnet environment .venv-mxnet not built: {note}" in proc.stdout
    assert not (root / ".venv-mxnet" / "bin").exists()
    assert "up to date" in setup_sh(root, env, "all").stdout  # .venv, and the note stays
    assert (root / ".venv-mxnet" / "not-built.txt").read_text() == note

    stand_in_python(tmp_path / "bin" / "python3.11", "3.11.14", tmp_path / "log")
    proc = setup_sh(root, env, "mxnet")
    assert proc.returncode == 0, proc.stderr
    assert "built with Python 3.11.14 (python3.11; MXNet 1.9.1's numpy" in proc.stdout
    assert "venv python3.11 .venv-mxnet " in (tmp_path / "log").read_text()
    assert not (root / ".venv-mxnet" / "not-built.txt").exists()


def test_uv_builds_mxnet_where_no_python_fits(tmp_path: Path) -> None:
    """Ubuntu 24.04 (python3 3.12) with uv: .venv-mxnet from `uv venv --python 3.11`."""
    root = project(tmp_path / "p")
    (root / ".venv-mxnet").mkdir()
    (root / ".venv-mxnet" / "not-built.txt").write_text("no Python 3.10 or 3.11 here\n")
    env = machine(tmp_path, pythons={"python3": "3.12.3", "uv": ""})
    p = plan(env)
    assert p["main_python"].endswith("/bin/python3") and p["mxnet_python"] == "uv"
    assert p["mxnet_python_why"].startswith(
        "uv venv --python 3.11 (no Python 3.10 or 3.11 here (python3 is 3.12.3); uv fetches"
    )
    proc = setup_sh(root, env, "mxnet")
    assert proc.returncode == 0, proc.stderr
    log = (tmp_path / "log").read_text().splitlines()
    assert log[0] == "uv UV_VENV_CLEAR=1 venv -q --no-project --seed --python 3.11 .venv-mxnet"
    assert log[1:] == [
        "pip -m pip install -q --upgrade pip",
        "pip -m pip install -q -r requirements/mxnet.txt",
    ]
    assert not (root / ".venv-mxnet" / "not-built.txt").exists()
    # uv that cannot fetch a Python (offline): not built, in one line, and the rest goes on
    shutil.rmtree(root / ".venv-mxnet")
    (tmp_path / "bin" / "uv").write_text(
        "#!/bin/sh\necho 'error: Failed to download' >&2\nexit 2\n"
    )
    proc = setup_sh(root, env, "mxnet")
    assert proc.returncode == 0, proc.stderr
    note = (root / ".venv-mxnet" / "not-built.txt").read_text()
    assert note.startswith("uv venv --python 3.11 failed (its message above;"), note
    assert note.count("\n") == 1 and f"not built: {note}" in proc.stdout


def test_a_python_named_for_mxnet_is_used_or_refused_in_one_line(tmp_path: Path) -> None:
    env = machine(tmp_path, pythons={"python3": "3.13.5", "py310": "3.10.16", "py313": "3.13.5"})
    p = plan(env | {"DPBENCH_SETUP_MXNET_PYTHON": "py310"})
    assert p["mxnet_python"] == str(tmp_path / "bin" / "py310"), p["mxnet_python_why"]
    assert p["mxnet_python_why"].endswith("named by DPBENCH_SETUP_MXNET_PYTHON")
    refusals = (("py313", "is Python 3.13.5; MXNet 1.9.1's numpy"), ("nowhere", "no python"))
    for named, said in refusals:
        bad = env | {"DPBENCH_SETUP_MXNET_PYTHON": named}
        proc = setup_sh(project(tmp_path / named), bad, "--dry-run")
        assert proc.returncode == 2 and not proc.stdout, proc.stdout
        assert len(proc.stderr.splitlines()) == 1 and said in proc.stderr, proc.stderr


def test_no_python_for_the_main_environment_stops_in_one_line(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    env = machine(tmp_path, pythons={"python3": "3.14.1"})
    proc = setup_sh(root, env, "all")
    assert proc.returncode == 1 and not (tmp_path / "log").exists()
    assert proc.stderr == (
        "[setup] main environment .venv cannot be built: no Python 3.10 to 3.13 here (python3 is "
        "3.14.1); torch 2.14.1 and jax 0.10.2 have wheels for Python 3.10 to 3.13: install one "
        "(e.g. python3.12) or uv\n"
    )
