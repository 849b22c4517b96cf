"""gpu_check.sh's pre-flight, in seconds: the interpreter it was given holds what the check
needs (torch and JAX that see the GPU; Flax, Optax, pytest, pytest-xdist), and which optional
packages it has. Prints three lines, the last starting "optional:"; fails (exit 1, the reason
last) where the check cannot run. A file of its own, not a string in the shell script: the
quotes of a bash string once ended inside this code (NameError on the first GPU machine)."""

import importlib.util
import sys

import flax  # noqa: F401
import jax
import optax  # noqa: F401
import pytest  # noqa: F401
import torch
import xdist  # noqa: F401  (pytest-xdist: the suite's parallel workers)

OPTIONAL = ("sklearn", "matplotlib", "rich", "flatbuffers", "tensorboardX", "mxnet")

assert torch.cuda.is_available(), f"torch sees no GPU (torch {torch.__version__})"
assert jax.default_backend() == "gpu", f"JAX runs on {jax.default_backend()}, not a GPU"
print("python", sys.version.split()[0], "torch", torch.__version__, "jax", jax.__version__)
have = ", ".join(f"{m} {'yes' if importlib.util.find_spec(m) else 'NO'}" for m in OPTIONAL)
print("optional:", have)
