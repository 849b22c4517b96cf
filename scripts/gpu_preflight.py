"""gpu_check.sh's pre-flight, in seconds: the interpreter it was given holds what the check
needs (torch and JAX that see the GPU; Flax, Optax, pytest, pytest-xdist), and which optional
packages it has. Prints two lines, the last starting "optional:"; where the check cannot run
(a package missing, no GPU seen), one line that says why, exit 2. A file of its own, not a
string in the shell script: the quotes of a bash string once ended inside this code (NameError
on the first GPU machine)."""

import importlib
import importlib.util
import sys

NEEDED = ("flax", "jax", "optax", "pytest", "torch", "xdist")  # the order the check imports them
OPTIONAL = ("sklearn", "matplotlib", "rich", "tensorboardX", "mxnet")


def main() -> str:
    """The reason the check cannot run on this interpreter, or "" (and the two lines printed)."""
    for name in NEEDED:
        try:
            importlib.import_module(name)
        except Exception as exc:  # ImportError, or a package that fails as it loads
            return f"{sys.executable} cannot import {name} ({type(exc).__name__}: {exc})"
    import jax
    import torch

    if not torch.cuda.is_available():
        return f"torch sees no GPU (torch {torch.__version__}): run the check on a GPU machine"
    if jax.default_backend() != "gpu":
        return f"JAX runs on {jax.default_backend()}, not a GPU (jax {jax.__version__})"
    print("python", sys.version.split()[0], "torch", torch.__version__, "jax", jax.__version__)
    have = ", ".join(f"{m} {'yes' if importlib.util.find_spec(m) else 'NO'}" for m in OPTIONAL)
    print("optional:", have)
    return ""


if __name__ == "__main__":
    why = main()
    if why:
        print(f"gpu_preflight: {why}", file=sys.stderr)
        sys.exit(2)
