"""Framework name -> module, interpreter and install command, and whether it can run here.

The runner never imports a framework: it starts `<python> -m frameworks.<module>` in a process
of its own. Whether a framework can run is decided without importing it either: its module file
must be in the checkout, its interpreter must exist, and `importlib.util.find_spec` must find its
packages in that interpreter (one short probe per interpreter, run in parallel).

`DPBENCH_PYTHON_<NAME>` (e.g. `DPBENCH_PYTHON_MXNET_GLUON=/opt/mx/bin/python`) points one
framework at another interpreter; a path that does not exist makes it "not installed".
"""

from __future__ import annotations

import os
import subprocess
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from common.runtime import ROOT

PYTHON_ENV = "DPBENCH_PYTHON_{}"

# Run by the framework's interpreter: prints the packages it cannot find (nothing is imported).
_PROBE = (
    "import importlib.util as u, sys; "
    "print(' '.join(p for p in sys.argv[1:] if u.find_spec(p) is None))"
)


@dataclass(frozen=True)
class Framework:
    name: str  # the name on the command line and in every table, e.g. "torch-ddp"
    module: str  # run as `python -m <module>`
    venv: str  # the environment directory under the project root
    setup: str  # `bash scripts/setup.sh <setup>` builds that environment
    packages: tuple[str, ...]  # must be importable by the interpreter
    # Why device counts > 1 are not applicable without CUDA (None: they are).
    multi_device_needs_cuda: str | None = None

    @property
    def install(self) -> str:
        return f"bash scripts/setup.sh {self.setup}"

    @property
    def python(self) -> Path:
        override = os.environ.get(PYTHON_ENV.format(self.name.upper().replace("-", "_")))
        return Path(override) if override else ROOT / self.venv / "bin" / "python"

    @property
    def source(self) -> Path:
        return ROOT.joinpath(*self.module.split(".")).with_suffix(".py")


REGISTRY: dict[str, Framework] = {
    f.name: f
    for f in (
        Framework(
            "torch-dp",
            "frameworks.torch_dp",
            ".venv",
            "main",
            ("torch",),
            multi_device_needs_cuda="nn.DataParallel needs CUDA; on CPU it runs one replica",
        ),
        Framework("torch-ddp", "frameworks.torch_ddp", ".venv", "main", ("torch",)),
        Framework("jax-pmap", "frameworks.jax_pmap", ".venv", "main", ("jax", "flax", "optax")),
        Framework("jax-shard", "frameworks.jax_shard", ".venv", "main", ("jax", "flax", "optax")),
        Framework("mxnet-gluon", "frameworks.mxnet_gluon", ".venv-mxnet", "mxnet", ("mxnet",)),
    )
}


def _missing_packages(python: Path, packages: tuple[str, ...]) -> str | None:
    """Why `python` cannot import `packages` (None: it can)."""
    try:
        out = subprocess.run(
            [str(python), "-c", _PROBE, *packages], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return f"interpreter {python} does not start ({exc.__class__.__name__})"
    if out.returncode != 0:
        return f"interpreter {python} does not start (exit code {out.returncode})"
    missing = out.stdout.split()
    return f"{', '.join(missing)} not installed in {python}" if missing else None


def unavailable(names: list[str]) -> dict[str, str]:
    """Frameworks among `names` that cannot run here -> why, ending with the install command."""
    reasons: dict[str, str] = {}
    probes: dict[tuple[Path, tuple[str, ...]], list[str]] = {}
    for name in names:
        fw = REGISTRY[name]
        if not fw.source.exists():
            reasons[name] = f"{fw.source.relative_to(ROOT)} is not in this checkout"
        elif not fw.python.exists():
            reasons[name] = f"interpreter {fw.python} not found; install with: {fw.install}"
        else:
            probes.setdefault((fw.python, fw.packages), []).append(name)
    with ThreadPoolExecutor(max_workers=max(1, len(probes))) as pool:
        answers = dict(zip(probes, pool.map(lambda key: _missing_packages(*key), probes)))
    for key, why in answers.items():
        for name in probes[key]:
            if why:
                reasons[name] = f"{why}; install with: {REGISTRY[name].install}"
    return reasons
