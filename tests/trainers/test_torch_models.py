"""The PyTorch models: parameter counts, torchvision equivalence, gradients, the spelled-out
defaults, NovoGrad, and the weight-port reference exporter."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from frameworks.torch_models import count_params, create_model, decay_parameters
from frameworks.torch_support import NovoGrad
from tests.conftest import MAIN_PYTHON, run_module
from tests.port_weights import export


def test_parameter_counts_at_full_width():
    assert count_params(create_model("resnet18", 3, 10)) == 11_173_962
    # 432 + 32 stem; blocks 256,640 + 461,440 + 1,434,880 + 1,844,480 + 5,736,960 + 7,375,360;
    # fc 6,410 (hand count of the course's architecture)
    assert count_params(create_model("wideresnet", 3, 10)) == 17_116_634


def test_torchvision_resnet18_with_cifar_stem_gives_identical_outputs():
    import torchvision  # in the main environment (requirements/main.txt)

    torch.manual_seed(0)
    tv = torchvision.models.resnet18(num_classes=10)
    tv.conv1 = nn.Conv2d(3, 64, 3, stride=1, padding=1, bias=False)
    tv.maxpool = nn.Identity()
    ours = create_model("resnet18", 3, 10)
    assert set(ours.state_dict()) == set(tv.state_dict())
    ours.load_state_dict(tv.state_dict())
    x = torch.randn(2, 3, 32, 32)
    for mode in ("train", "eval"):  # batch statistics and running statistics
        getattr(ours, mode)()
        getattr(tv, mode)()
        with torch.no_grad():
            torch.testing.assert_close(ours(x), tv(x), rtol=0, atol=0)


@pytest.mark.parametrize("name", ["resnet18", "wideresnet"])
def test_every_parameter_receives_a_gradient(name):
    torch.manual_seed(0)
    model = create_model(name, 1, 7, width=0.125, dropout=0.0)
    loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 16, 16)), torch.arange(4))
    loss.backward()
    for key, p in model.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, key


@pytest.mark.parametrize("size", [28, 32])
def test_wideresnet_average_pool_covers_every_pixel(size):
    torch.manual_seed(0)
    model = create_model("wideresnet", 3, 10, width=0.125).eval()
    seen = {}
    model.layer6.register_forward_hook(lambda m, i, out: seen.update(out=out))
    with torch.no_grad():
        logits = model(torch.randn(2, 3, size, size))
        assert seen["out"].shape[-1] == size // 4  # 7 at 28x28, 8 at 32x32
        torch.testing.assert_close(logits, model.fc(seen["out"].mean((2, 3))))


def test_spelled_out_defaults():
    torch.manual_seed(0)
    model = create_model("resnet18", 3, 10)
    bns = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    assert {(m.momentum, m.eps) for m in bns} == {(0.1, 1e-5)}
    assert all(torch.all(m.weight == 1) and torch.all(m.bias == 0) for m in bns)
    w = model.layer4[1].conv2.weight  # (512, 512, 3, 3): He-normal, fan_out = 9 * 512
    assert abs(w.std().item() / math.sqrt(2 / (9 * 512)) - 1) < 0.01
    assert abs(w.mean().item()) < 1e-3
    bound = 1 / math.sqrt(512)
    assert model.fc.weight.abs().max() <= bound and model.fc.bias.abs().max() <= bound
    assert model.fc.weight.abs().max() > 0.9 * bound
    assert all(
        m.padding == (1, 1)
        for m in model.modules()
        if isinstance(m, nn.Conv2d) and m.kernel_size == (3, 3)
    )
    decay, no_decay = decay_parameters(model)
    assert all(p.ndim in (2, 4) for p in decay) and all(p.ndim == 1 for p in no_decay)
    assert len(decay) == 20 + 1  # 17 3x3 convs + 3 projections + fc weight
    assert sum(p.numel() for p in decay + no_decay) == count_params(model)


def test_novograd_matches_the_formula():
    """Per-layer second moment (the first step's squared norm, then beta2-averaged), weight
    decay added to the normalised gradient, in float64 by hand."""
    torch.manual_seed(0)
    params = [nn.Parameter(torch.randn(5, 3)), nn.Parameter(torch.randn(3))]
    decays = [0.01, 0.0]
    groups = [{"params": [p], "weight_decay": wd} for p, wd in zip(params, decays)]
    opt = NovoGrad(groups, lr=0.1, betas=(0.9, 0.5), eps=1e-8)
    ref = [p.detach().numpy().astype(np.float64) for p in params]
    m, v = [0.0, 0.0], [0.0, 0.0]
    for step in range(3):
        for i, p in enumerate(params):
            p.grad = torch.randn(p.shape)
            g = p.grad.numpy().astype(np.float64)
            v[i] = (g**2).sum() if step == 0 else 0.5 * v[i] + 0.5 * (g**2).sum()
            m[i] = 0.9 * m[i] + g / (np.sqrt(v[i]) + 1e-8) + decays[i] * ref[i]
            ref[i] = ref[i] - 0.1 * m[i]
        opt.step()
    for p, want in zip(params, ref):
        np.testing.assert_allclose(p.detach().numpy(), want, rtol=1e-5, atol=1e-6)


def test_port_weights_reference_reloads_and_exercises_bn(tmp_path):
    arrays = export("wideresnet", 0.125, 1, 7, 16, 3, 5)
    model = create_model("wideresnet", 1, 7, width=0.125)
    keys = {k for k in model.state_dict() if not k.endswith("num_batches_tracked")}
    assert set(arrays) == keys | {"__input__", "__logits__"}
    assert arrays["__input__"].shape == (3, 16, 16, 1)
    assert arrays["__logits__"].shape == (3, 7)
    assert arrays["layer1.shortcut.weight"].shape == (20, 2, 1, 1)  # OIHW
    assert arrays["fc.weight"].shape == (7, 80)  # (out, in)
    assert not np.allclose(arrays["bn1.running_var"], 1)  # BN state is not the default
    assert not np.allclose(arrays["layer3.bn2.weight"], 1)
    model.load_state_dict(
        {k: torch.from_numpy(v) for k, v in arrays.items() if not k.startswith("__")}, strict=False
    )
    with torch.no_grad():
        logits = model.eval()(torch.from_numpy(arrays["__input__"]).permute(0, 3, 1, 2))
    np.testing.assert_allclose(logits.numpy(), arrays["__logits__"], rtol=1e-5, atol=1e-5)

    out = tmp_path / "ref"  # no .npz suffix: the file must land exactly here
    args = "--model wideresnet --width 0.125 --in-channels 1 --classes 7 --image-size 16"
    proc = run_module("tests.port_weights", *args.split(), "--batch", "3", "--seed", "5",
                      "--out", str(out), python=MAIN_PYTHON)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    with np.load(out) as saved:
        assert set(saved.files) == set(arrays)
        for k in arrays:
            np.testing.assert_array_equal(saved[k], arrays[k])
