"""Reference weights and logits from the PyTorch models, for the cross-framework port tests.

    .venv/bin/python -m tests.port_weights --model resnet18 --width 0.125 --in-channels 3 \
        --classes 10 --image-size 16 --batch 4 --seed 0 --out /tmp/ref.npz

writes every state-dict entry under its torch key (float32, torch layouts: conv (O, I, kH, kW),
linear (out, in); `num_batches_tracked` skipped), `__input__` (B, S, S, C) NHWC float32 and
`__logits__` (B, K), the torch eval-mode output. BN running statistics and affine parameters are
set to seeded non-trivial values first, so a port that ignores any of them gives other logits.
`export(...)` returns the same dict in-process (the JAX tests); the MXNet tests run this script
in the main environment.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np


def export(model_name: str, width: float, in_channels: int, classes: int, image_size: int,
           batch: int, seed: int) -> dict[str, np.ndarray]:  # fmt: skip
    """State dict (torch keys) of the seeded model, plus `__input__` and `__logits__`."""
    import torch

    from frameworks.torch_models import create_model

    torch.manual_seed(seed)
    model = create_model(model_name, in_channels, classes, width).eval()
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm2d):
                c = m.num_features
                m.running_mean.copy_(0.2 * torch.randn(c, generator=g))
                m.running_var.copy_(0.5 + torch.rand(c, generator=g))
                m.weight.copy_(0.8 + 0.4 * torch.rand(c, generator=g))
                m.bias.copy_(0.1 * torch.randn(c, generator=g))
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, image_size, image_size, in_channels)).astype(np.float32)
    with torch.no_grad():
        logits = model(torch.from_numpy(x).permute(0, 3, 1, 2).contiguous())  # NHWC -> NCHW
    state = model.state_dict().items()
    out = {k: v.numpy().astype(np.float32) for k, v in state if "num_batches" not in k}
    return out | {"__input__": x, "__logits__": logits.numpy().astype(np.float32)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.port_weights")
    p.add_argument("--model", choices=("resnet18", "wideresnet"), required=True)
    p.add_argument("--out", required=True)
    for name, default in (("width", 1.0), ("in-channels", 3), ("classes", 10), ("image-size", 32),
                          ("batch", 4), ("seed", 0)):  # fmt: skip
        p.add_argument(f"--{name}", type=type(default), default=default)
    a = p.parse_args(argv)
    arrays = export(a.model, a.width, a.in_channels, a.classes, a.image_size, a.batch, a.seed)
    with open(a.out, "wb") as f:  # a file object: numpy would append ".npz" to a bare path
        np.savez(f, **arrays)
    return 0


if __name__ == "__main__":
    sys.exit(main())
