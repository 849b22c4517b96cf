"""How far torch.compile's modes move torch-dp's steps from eager ones on one GPU (fp32, TF32
off): the relative update difference and the losses after N steps, modes in the order given.

    python3 docs/results/h100-20261123/profile/compile_parity.py N MODE [MODE ...]
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
import tests.test_gpu_compile as t  # noqa: E402
from tests.conftest import relative_update_difference  # noqa: E402

t.STEPS = int(sys.argv[1])
init, eager, eager_losses = t.steps(None)
before = {k: init[k] for k in init if not k.endswith("num_batches_tracked")}
print(f"eager losses {np.round(eager_losses, 5).tolist()}")
for mode in sys.argv[2:]:
    _, other, losses = t.steps(mode)
    d = relative_update_difference(before, other, eager)
    print(f"{t.STEPS} step(s), {mode}: update difference {d:.2e}, losses "
          f"{np.round(losses, 5).tolist()}")  # fmt: skip
