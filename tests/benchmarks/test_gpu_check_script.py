"""scripts/gpu_check.sh, the whole GPU check in one call, on the CPU: its own plumbing, not the
GPU work. In a copy of the scripts, with a stand-in for the MACHINE, not for the code: the
tests' interpreter with fake CUDA packages first on its path, so that the real pre-flight
(scripts/gpu_preflight.py) answers as on a CUDA machine."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

from tests.conftest import MAIN_PYTHON, ROOT

# A CUDA machine's packages, as far as the pre-flight asks them.
FAKE_CUDA = {
    "torch/__init__.py": '__version__ = "2.11.0+cu130"\n\n\nclass cuda:\n'
                         "    @staticmethod\n    def is_available():\n        return True\n",
    "jax/__init__.py": '__version__ = "0.10.2"\n\n\ndef default_backend():\n    return "gpu"\n',
    "flax/__init__.py": "", "optax/__init__.py": "",
}  # fmt: skip


def stand_in(path: Path) -> Path:
    """The tests' interpreter with the fake CUDA packages first on its path."""
    fakes = path.parent / "fake-cuda"
    for rel, text in FAKE_CUDA.items():
        (fakes / rel).parent.mkdir(parents=True, exist_ok=True)
        (fakes / rel).write_text(text)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nPYTHONPATH="{fakes}" exec "{MAIN_PYTHON}" "$@"\n')
    path.chmod(0o755)
    return path


# What the scripts run of the project: the pre-flight, the suite, the judge and what it imports
# (every module of common/ and benchmarks/: a list of the judge's imports went stale once).
COPIED = (
    *("scripts/gpu_check.sh", "scripts/gpu_preflight.py", "benchmarks/gpu_suite.sh"),
    *(str(p.relative_to(ROOT)) for d in ("common", "benchmarks", "benchmarks/analysis")
      for p in (ROOT / d).glob("*.py")),
)  # fmt: skip


def project(where: Path) -> Path:
    for rel in COPIED:
        (where / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / rel, where / rel)
    return where


def check(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "scripts/gpu_check.sh", *args], cwd=root, capture_output=True,
                          text=True, timeout=120, env=os.environ | {"TESTS_SEC": "60"})  # fmt: skip


def prefix(python: Path | str) -> str:
    run = [str(python), "-c", "import sys, numpy; print(sys.prefix)"]
    return subprocess.run(run, capture_output=True, text=True, check=True).stdout.strip()


def test_the_interpreter_is_wrapped_and_everything_is_one_archive(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    python = stand_in(tmp_path / "it's here" / "python")  # a quote and a space in the path
    archive = tmp_path / "out" / "gpu.tar.xz"
    (root / ".venv").symlink_to(tmp_path / "another checkout" / ".venv")  # copied with a tree
    # no tests, a step the budget cannot hold (it needs 40 s): skipped, listed, exit 1
    proc = check(root, "--python", str(python), "--no-tests", "--steps", "1",
                 "--archive", str(archive), str(tmp_path / "run"), "60")  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr
    wrapper = root / ".venv" / "bin" / "python"
    assert not (root / ".venv").is_symlink() and not (tmp_path / "another checkout").exists()
    assert not wrapper.is_symlink() and wrapper.read_text().startswith("#!/bin/sh\nexec ")
    assert prefix(wrapper) == prefix(MAIN_PYTHON)  # its environment, packages and all
    assert not (tmp_path / "run").exists()  # packed, not left loose
    with tarfile.open(archive) as tar:
        names = {Path(n).name: n for n in tar.getnames()}
        read = lambda name: tar.extractfile(names[name]).read().decode()  # noqa: E731
        commands, machine = read("commands.txt"), read("machine.txt")
    assert "- skipped (time budget): env STEPS=1 bash benchmarks/gpu_suite.sh" in commands
    assert "(exit 1)" in commands
    assert "torch 2.11.0+cu130 jax 0.10.2" in machine  # what the real pre-flight printed
    assert "optional: sklearn yes" in machine and "mxnet NO" in machine
    assert proc.stdout.splitlines()[-1].startswith("gpu_verdicts: no throughput.json")  # judged


def test_a_run_ends_with_the_verdicts_on_what_it_wrote(tmp_path: Path) -> None:
    """The GPU suite's work stood in for by its output (the H200 fixture); the judge runs."""
    root = project(tmp_path / "p")
    fixture = ROOT / "tests" / "fixtures" / "gpu_check" / "suite"
    (root / "benchmarks" / "gpu_suite.sh").write_text(f'cp -r "{fixture}/." "$3"\n')
    python = stand_in(tmp_path / "bin" / "python")
    archive = tmp_path / "gpu.tar.xz"
    proc = check(root, "--python", str(python), "--no-tests", "--steps", "8,1",
                 "--archive", str(archive), str(tmp_path / "run"), "100")  # fmt: skip
    assert proc.returncode == 1, proc.stdout + proc.stderr  # what the judge failed
    last = proc.stdout.splitlines()
    assert last[-1] == "gpu_verdicts: 6 of 11 checks pass, 5 FAIL", proc.stdout
    assert any(ln.startswith("FAIL  precision jax-pmap x1") for ln in last[-13:])
    with tarfile.open(archive) as tar:
        names = {Path(n).name: n for n in tar.getnames()}
        assert tar.extractfile(names["verdicts.txt"]).read().decode().endswith("5 FAIL\n")
    again = check(root, "--judge", str(archive))  # the same verdicts, from the archive
    assert again.returncode == 1 and again.stdout.splitlines()[-1] == last[-1], again.stderr
    proc = check(root, "--judge", str(tmp_path / "nope.tar.xz"))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "no file" in proc.stderr


def test_the_default_plan_measures_every_headline_row_first_in_cifar_epochs(tmp_path: Path) -> None:
    """DRY_RUN=1 on a stand-in GPU machine (a fake nvidia-smi, the fake CUDA packages): the
    plan's commands in order, none run. The 8 headline rows, 98 steps an epoch, come first; the
    JAX rows without command buffers, the GPU tests, then the CPU-pinned suite."""
    root = project(tmp_path / "p")
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\necho "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"\n')
    smi.chmod(0o755)
    python = stand_in(tmp_path / "py" / "python")
    env = os.environ | {"DRY_RUN": "1", "PATH": f"{smi.parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "scripts/gpu_check.sh", "--python", str(python),
                           str(tmp_path / "run")], cwd=root, capture_output=True, text=True,
                          timeout=120, env=env)  # fmt: skip
    plan = [ln for ln in (tmp_path / "run" / "suite" / "commands.txt").read_text().splitlines()]
    plan += (tmp_path / "run" / "commands.txt").read_text().splitlines()
    runs = [ln for ln in plan if ln.startswith("+ ")]
    headline = "torch-ddp+reduce-overhead,jax-pmap,torch-ddp,torch-dp,jax-shard,jax-shardmap,"
    assert f"--frameworks {headline}torch-fsdp,jax-fsdp " in runs[0], proc.stdout + proc.stderr
    assert "--steps 98 --epochs 3" in runs[0] and "GPU 0: NVIDIA H100" in proc.stdout
    assert "xla_gpu_enable_command_buffer=" in runs[1] and "--steps 98" in runs[1]
    assert "-m pytest" in runs[2] and "-m gpu" in runs[2]
    assert "--ignore=tests/mxnet" in runs[-1] and "-m gpu" not in runs[-1]  # the suite, last


def test_a_real_environment_is_left_alone_and_the_tests_step_is_timed(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    (root / ".venv" / "pyvenv.cfg").parent.mkdir()
    (root / ".venv" / "pyvenv.cfg").write_text("home = /usr/bin\n")  # an environment of its own
    own = stand_in(root / ".venv" / "bin" / "python")
    (root / "tests").mkdir()
    (root / "tests" / "test_one.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    out = tmp_path / "run"
    proc = check(root, "--steps", "", str(out), "130")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert own.read_text().startswith('#!/bin/sh\nPYTHONPATH="')  # not replaced
    assert "1 passed" in (out / "tests.log").read_text()
    assert (out / "tests.xml").is_file()
    commands = (out / "commands.txt").read_text()
    assert "-n " in commands and "--dist loadfile" in commands and "exit 0 after" in commands
    assert proc.stdout.splitlines()[-1].startswith("gpu_check: no verdicts")  # no step 1 asked


def test_a_python_that_sees_no_gpu_stops_the_call_in_one_line(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    proc = check(root, "--python", sys.executable, str(tmp_path / "run"))  # CPU torch, or none
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.count("\n") == 1 and "cannot run the check" in proc.stderr
    assert not (tmp_path / "run" / "commands.txt").exists()  # nothing ran
    # the pre-flight's own answer: one line with the reason, no traceback
    machine = (tmp_path / "run" / "machine.txt").read_text()
    assert "Traceback" not in machine, machine
    assert machine.splitlines()[-1].startswith("gpu_preflight: "), machine


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path) -> None:
    root = project(tmp_path / "p")
    loop = root / ".venv" / "bin" / "python"
    for args, says in (
        (["--steps", "one", "out"], "--steps takes step numbers 1-9 such as 1,7,8, not one"),
        (["--steps", ",8", "out"], "not ,8"),  # an empty entry would mean every step
        (["--fast", "out"], "unknown option --fast"),
        (["--python", str(tmp_path / "nope"), "out"], "no interpreter"),
        (["out", "soon"], "SECONDS must be a whole number, not soon"),
        ([str(tmp_path)], "holds the repository"),  # removed once packed: never the checkout
        (["--archive", "out/a.tar.xz", "out"], "is inside OUT_DIR"),
    ):
        proc = check(root, *args)
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and says in proc.stderr, (
            args, proc.stderr)  # fmt: skip
        assert not (root / "out" / "commands.txt").exists(), args  # nothing ran
    stand_in(loop)  # a wrapper that would exec itself
    proc = check(root, "--python", str(loop), "out")
    assert proc.returncode == 2 and "is the script this call writes" in proc.stderr
