"""--xla-cpu-ynn (XLA:CPU's YNNPACK kernels for dot, elementwise and reduction fusions): the
default is the path measured faster, the flag reaches XLA_FLAGS before JAX starts, a user's own
setting wins, the record names the path, and the step equals XLA's own code to rounding."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from benchmarks.harness import flag
from common.cli import check_args
from common.config import image_side, preset
from common.init import initial_state
from common.runtime import (
    YNN_FLAG,
    set_xla_flag,
    use_xla_cpu_ynn,
    xla_cpu_execution,
    xla_cpu_ynn_wanted,
    xla_flag,
)
from tests.conftest import (
    CONDITIONED_SEED,
    MAIN_PYTHON,
    SMOKE,
    ok,
    read_json,
    relative_update_difference,
    run_python,
    run_trainer,
)

# One step of the same program compiled two ways: only float rounding may differ (measured: 5e-7
# of the update on an Intel Xeon; on a ResNet-18 at width 0.25, 32x32, both differ from torch's
# step by the same 6.0e-3, a ReLU flip or two). 1e-3: the contract tests' bound for two programs.
UPDATE_RTOL = 1e-3


def test_flag_is_set_once_and_a_users_own_setting_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=2")
    use_xla_cpu_ynn(False)
    assert xla_flag(YNN_FLAG) is None and xla_cpu_execution() == "XLA:CPU (its own code)"
    use_xla_cpu_ynn(True)
    use_xla_cpu_ynn(True)  # idempotent: one flag, the device count kept
    flags = ["--xla_force_host_platform_device_count=2", f"--{YNN_FLAG}=dot,eltwise,reduce"]
    assert os.environ["XLA_FLAGS"].split() == flags
    assert xla_cpu_execution() == "XLA:CPU, YNNPACK fusions (dot,eltwise,reduce)"
    set_xla_flag(YNN_FLAG, "dot")  # the user's choice, e.g. in their shell
    use_xla_cpu_ynn(True)
    assert xla_flag(YNN_FLAG) == "dot" and xla_cpu_execution().endswith("(dot)")


@pytest.mark.parametrize("setting, side, devices, wanted", [
    (None, 32, 1, True),  # ResNet-18 x 0.25 at 32x32: 1.68x (measured, docs/performance.md)
    (None, 32, 2, True),  # the same on 2 simulated devices: 1.31x
    (None, 16, 1, True),  # digits: WideResNet 1.44x, ResNet-18 0.99x
    (None, 16, 2, False),  # digits on 2 devices: 0.90x (WideResNet), 0.96x (ResNet-18)
    (None, 28, 4, False),  # Fashion-MNIST's side: under 32
    (True, 16, 2, True),  # --xla-cpu-ynn as given
    (False, 32, 1, False),  # --no-xla-cpu-ynn as given
])  # fmt: skip
def test_the_default_path_is_the_measured_faster_one(
    setting: bool | None, side: int, devices: int, wanted: bool
) -> None:
    assert xla_cpu_ynn_wanted(setting, side, devices) is wanted


def test_the_flag_is_a_switch_with_an_automatic_default() -> None:
    for argv, value in ((["--preset", "digits"], None), (["--xla-cpu-ynn"], True),
                        (["--no-xla-cpu-ynn"], False)):  # fmt: skip
        assert check_args(argv, "jax-pmap").xla_cpu_ynn is value
        # a tool passing the setting on: unset stays unset
        assert check_args(flag("xla_cpu_ynn", value), "jax-shard").xla_cpu_ynn is value
    assert image_side(preset("digits")) == 16  # the preset's --image-size
    assert image_side(preset("digits", image_size=0)) == 8  # the dataset's own side
    assert image_side(preset("smoke", dataset="cifar10", image_size=0)) == 32


def one_step(tmp_path: Path, name: str, *flags: str) -> tuple[dict, dict[str, np.ndarray]]:
    out, state = tmp_path / f"{name}.json", tmp_path / f"{name}.npz"
    args = ("--seed", str(CONDITIONED_SEED), "--epochs", "1", "--max-steps-per-epoch", "1")
    ok(run_trainer("jax-pmap", *SMOKE, *args, *flags, "--output", str(out), "--save-state",
                   str(state), "--no-compile-cache"))  # fmt: skip
    with np.load(state) as f:
        return read_json(out), dict(f)


def test_ynn_step_equals_xlas_own_step(tmp_path: Path) -> None:
    """jax-pmap's step with and without YNNPACK, from the shared start: the same update to
    rounding; the records say which path each took. A 2% slip in the update (what a wrong
    kernel would do at the least) is 10x the bound."""
    ynn_rec, ynn = one_step(tmp_path, "ynn", "--xla-cpu-ynn")
    own_rec, own = one_step(tmp_path, "own", "--no-xla-cpu-ynn")
    assert "YNNPACK fusions (dot,eltwise,reduce)" in ynn_rec["execution"]
    assert "XLA:CPU (its own code)" in own_rec["execution"]
    before, _ = initial_state(preset("smoke", seed=CONDITIONED_SEED), 3, 10)
    diff = relative_update_difference(before, ynn, own)
    assert diff <= UPDATE_RTOL
    slipped = {k: before[k] + 1.02 * (v - before[k]) if k in before else v for k, v in ynn.items()}
    assert relative_update_difference(before, slipped, own) > 10 * UPDATE_RTOL


# A process of N simulated devices on its first core or on all its cores: the size of XLA:CPU's
# intra-op pool (its threads are named tf_XLAEigen) and what the record says of it.
POOL = """
import os, sys
n, cores = int(sys.argv[1]), sorted(os.sched_getaffinity(0))
if sys.argv[2] == "one":
    os.sched_setaffinity(0, cores[:1])
os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={n}"
import jax
import jax.numpy as jnp
from frameworks.jax_support import jax_threads
(jnp.ones((64, 64)) @ jnp.ones((64, 64))).block_until_ready()
tasks = os.listdir("/proc/self/task")
pool = sum(open(f"/proc/self/task/{t}/comm").read().strip() == "tf_XLAEigen" for t in tasks)
print(pool, jax_threads(jax.devices())["total"], jax_threads(jax.devices())["cores"])
"""


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts threads in /proc (Linux)")
@pytest.mark.parametrize(("devices", "cores"), [(3, "one"), (1, "all")])
def test_the_record_says_how_many_threads_xlas_pool_has(devices: int, cores: str) -> None:
    """The record's threads.total for a JAX run on a CPU is XLA:CPU's own pool, counted here:
    as many threads as the cores the process may run on (its affinity: taskset, a Slurm
    allocation), or as its devices where they are more."""
    proc = run_python(MAIN_PYTHON, "-c", POOL, str(devices), cores)
    ok(proc)
    pool, total, recorded_cores = map(int, proc.stdout.split())
    expected_cores = 1 if cores == "one" else len(os.sched_getaffinity(0))
    assert recorded_cores == expected_cores
    assert total == pool == max(expected_cores, devices)
