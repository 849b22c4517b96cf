"""Launch and cache variables checked first (issue 41, item 5): torch's and JAX's multi-process
variables, the cache directories the frameworks read from the environment and the DPBENCH_*
variables are checked before any work, by every trainer (common/cli.py's parse_args, run_main's
first step) and every tool (harness.run_tool): one line naming the variable and the fix, exit 2
(common/launch_env.py). Before: a framework's message at exit 1, a ValueError traceback at the
end of an epoch, or a rendezvous that timed out at "None:None"."""

from __future__ import annotations

import os

import pytest

from common.config import ConfigError
from common.launch_env import check_launch_env
from tests.conftest import MAIN_PYTHON, SMOKE, one_line_error, run_trainer

# (variables, what the line must name)
BAD = [
    ({"RANK": "abc", "WORLD_SIZE": "2"}, "RANK='abc' must be an integer"),
    ({"RANK": "3", "WORLD_SIZE": "2"}, "RANK=3 is not below WORLD_SIZE=2"),
    ({"RANK": "-1", "WORLD_SIZE": "2"}, "RANK='-1' must be an integer from 0"),
    ({"RANK": "0"}, "RANK is set but WORLD_SIZE is not"),
    ({"RANK": "0", "WORLD_SIZE": "2"}, "but MASTER_ADDR is not"),
    ({"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}, "but MASTER_PORT is not"),
    ({"MASTER_PORT": "99999"}, "MASTER_PORT='99999' needs a port from 1 to 65535"),
    ({"MASTER_PORT": "http"}, "MASTER_PORT='http' needs a port"),
    ({"MASTER_ADDR": " "}, "MASTER_ADDR=' ' is no host name"),
    ({"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"}, "LOCAL_RANK=2 is not below LOCAL_WORLD_SIZE"),
    ({"WORLD_SIZE": "1" + "0" * 30, "RANK": "0"}, "WORLD_SIZE='1000"),
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "4"}, "SLURM_PROCID=4 is not below SLURM_NTASKS=4"),
    ({"JAX_NUM_PROCESSES": "0"}, "JAX_NUM_PROCESSES='0' must be an integer from 1"),
    ({"JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "2"}, "JAX_PROCESS_ID=2 is not below"),
    ({"JAX_COORDINATOR_ADDRESS": "nohost"}, "JAX_COORDINATOR_ADDRESS='nohost' is not host:port"),
    ({"JAX_COORDINATOR_ADDRESS": "h:0"}, "JAX_COORDINATOR_ADDRESS='h:0' needs a port"),
    ({"JAX_COORDINATOR_ADDRESS": "h:1234"}, "JAX_NUM_PROCESSES or JAX_PROCESS_ID is not"),
    ({"JAX_COMPILATION_CACHE_DIR": "/etc/passwd"}, "exists and is not a directory"),
    ({"JAX_COMPILATION_CACHE_DIR": "/etc/passwd/x"}, "JAX_COMPILATION_CACHE_DIR='/etc/passwd/x'"),
    ({"TORCHINDUCTOR_CACHE_DIR": " "}, "TORCHINDUCTOR_CACHE_DIR=' ' cannot be a cache directory"),
    ({"TRITON_CACHE_DIR": "/proc/x"}, "TRITON_CACHE_DIR='/proc/x' cannot be a cache directory"),
    ({"DPBENCH_DEVICES": "tpu"}, "DPBENCH_DEVICES='tpu' is not one of"),
    ({"DPBENCH_FAIL": "torch-dp@x"}, "DPBENCH_FAIL='torch-dp@x' has 'torch-dp@x'"),
    ({"DPBENCH_FAIL": "torch-dp@0"}, "<framework>@<epoch>"),
    ({"DPBENCH_INJECT": "lr-shift"}, "DPBENCH_INJECT='lr-shift'"),
    ({"DPBENCH_INJECT": "no-bug@jax-pmap"}, "not <bug>@<framework>"),
    ({"DPBENCH_PARENT_PID": "abc"}, "DPBENCH_PARENT_PID='abc' is no process id"),
    ({"DPBENCH_PYTHON_TORCH": str(MAIN_PYTHON)}, "names no framework (DPBENCH_PYTHON_ + one of"),
    ({"DPBENCH_TEST_GPU": "yes"}, "DPBENCH_TEST_GPU='yes' must be 1"),
    ({"DPBENCH_USER_DEVICE_ENV": "{{not json"}, "DPBENCH_USER_DEVICE_ENV='{{not json' is not"),
    ({"DPBENCH_USER_DEVICE_ENV": '{"HOME": "/"}'}, "a JSON object of CUDA_VISIBLE_DEVICES"),
    ({"DPBENCH_USER_DEVICE_ENV": '{"JAX_PLATFORMS": 3}'}, "a string or null each"),
]

GOOD = [
    {},
    # a missing interpreter is the runners' to report (that framework skipped, the others run)
    {"DPBENCH_PYTHON_MXNET_GLUON": "/nonexistent/.venv-mxnet/bin/python"},
    {"JAX_COMPILATION_CACHE_DIR": ""},  # empty is unset (tests/trainers/test_jax_pmap.py sets it so)
    {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_ADDR": "node-1",
        "MASTER_PORT": "29500",
    },  # torchrun's  # fmt: skip
    {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"},  # srun's
    {"JAX_COORDINATOR_ADDRESS": "[::1]:1234", "JAX_NUM_PROCESSES": "2", "JAX_PROCESS_ID": "1"},
    {
        "DPBENCH_FAIL": "torch-dp@2,jax-pmap",
        "DPBENCH_INJECT": "crop-shift@device-pipeline",
        "DPBENCH_PARENT_PID": "1",
        "DPBENCH_PYTHON_TORCH_DP": str(MAIN_PYTHON),
        "DPBENCH_USER_DEVICE_ENV": '{"CUDA_VISIBLE_DEVICES": "", "JAX_PLATFORMS": null}',
    },  # fmt: skip
]

LAUNCH_PREFIXES = ("RANK", "WORLD_SIZE", "LOCAL_", "MASTER_", "SLURM_", "JAX_", "DPBENCH_",
                   "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR")  # fmt: skip


def clean(extra: dict[str, str]) -> dict[str, str]:
    """This environment without any launch, cache or DPBENCH_ variable, plus `extra`."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(LAUNCH_PREFIXES)}, **extra}


@pytest.mark.parametrize("env, says", BAD)
def test_a_variable_no_launch_gives_is_one_line_naming_it(env, says):
    with pytest.raises(ConfigError) as caught:
        check_launch_env(clean(env))
    line = str(caught.value)
    assert says in line and "\n" not in line, line


@pytest.mark.parametrize("env", GOOD)
def test_what_launchers_give_passes(env, tmp_path):
    check_launch_env(clean({**env, "JAX_COMPILATION_CACHE_DIR": str(tmp_path / "new" / "jax")}))


# ---- the trainers and the tools check them first ------------------------------------------


@pytest.mark.parametrize(
    "framework, env, says",
    [
        # was: exit 1, "ValueError: invalid literal for int()" at the end of epoch 1
        ("torch-dp", {"DPBENCH_FAIL": "torch-dp@x"}, "DPBENCH_FAIL='torch-dp@x'"),
        # was: a rendezvous at None:None that timed out after --collective-timeout
        ("torch-ddp", {"RANK": "0", "WORLD_SIZE": "2"}, "MASTER_ADDR is not"),
        # was: exit 1 with JAX's FileExistsError / NotADirectoryError
        ("jax-pmap", {"JAX_COMPILATION_CACHE_DIR": "/etc/passwd/x"}, "JAX_COMPILATION_CACHE_DIR"),
    ],
)
def test_a_trainer_refuses_it_before_any_work(framework, env, says, tmp_path):
    out = tmp_path / "r.json"
    bad = run_trainer(framework, *SMOKE, "--collective-timeout", "20", "--output", str(out),
                      env=env, timeout=120)  # fmt: skip
    one_line_error(bad, says)
    assert not out.exists()


@pytest.mark.parametrize("tool", ["compare", "throughput"])
def test_a_tool_refuses_it_before_any_work(tool, tmp_path, monkeypatch, capsys):
    import importlib

    from benchmarks import harness

    monkeypatch.setattr(harness, "unavailable", lambda names: {})
    monkeypatch.setattr(harness, "detect_gpus", lambda: [])
    monkeypatch.setenv("JAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("JAX_PROCESS_ID", "7")
    module = importlib.import_module(f"benchmarks.{tool}")
    monkeypatch.setattr(module, "execute", lambda plan: pytest.fail(f"{tool} started"))
    out = tmp_path / "out"
    rc = module.main(["--frameworks", "torch-dp", "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and "JAX_PROCESS_ID=7 is not below" in err[0], err
    assert not out.exists()


def test_a_rank_whose_rendezvous_never_forms_says_it_in_one_line(tmp_path):
    """RANK=1 of 2 with nothing listening at MASTER_ADDR:MASTER_PORT (rank 0 never started):
    the run failed with its one line, but after c10d's retry warnings and a 50-frame C++
    backtrace on stderr (independent battery for #41). Now that output is held back while the
    rendezvous runs and dropped when it fails: the line alone, exit 1."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = str(closed.getsockname()[1])
    env = {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
    out = tmp_path / "r.json"
    proc = run_trainer(
        "torch-ddp", *SMOKE, "--collective-timeout", "2", "--output", str(out), env=env, timeout=120
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "rendezvous of 2 ranks" in lines[0], proc.stderr[-3000:]
