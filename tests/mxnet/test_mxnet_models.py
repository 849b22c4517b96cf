"""The Gluon models and optimisers: parameter counts and names equal torch's, torch weights give
torch's logits, the spelled-out defaults, the loss, the update rules. Torch's reference values
come from the main environment's interpreter (MAIN_PYTHON) in a subprocess."""

from __future__ import annotations

import json
import math
import subprocess

import mxnet as mx
import numpy as np
import pytest
from mxnet import autograd

from frameworks.mxnet_models import (
    count_params,
    create_model,
    load_torch_state,
    structural_params,
    torch_key,
)
from frameworks.mxnet_support import NovoGrad, SoftmaxCrossEntropy, TorchSGD
from tests.conftest import MAIN_PYTHON, ROOT


def main_env(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """Run the main environment's python (torch) from the project root; fail clearly without it."""
    if not MAIN_PYTHON.exists():
        pytest.fail(
            f"the main environment ({MAIN_PYTHON}) is missing; these tests compare with "
            "torch there: build it with `bash scripts/setup.sh main`"
        )
    proc = subprocess.run(
        [str(MAIN_PYTHON), *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


TORCH_COUNTS = """
import json
from frameworks.torch_models import count_params, create_model
print(json.dumps([count_params(create_model(*shape)) for shape in %r]))
"""
SHAPES = [("resnet18", 3, 10, 1.0), ("wideresnet", 3, 10, 1.0), ("wideresnet", 1, 7, 0.25)]


def test_parameter_counts_equal_torch():
    torch_counts = json.loads(main_env("-c", TORCH_COUNTS % SHAPES).stdout.splitlines()[-1])
    ours = [count_params(create_model(*shape)) for shape in SHAPES]
    assert ours[0] == 11_173_962 and ours == torch_counts


@pytest.mark.parametrize(
    "model, in_channels, classes, image_size",
    [("resnet18", 3, 10, 16), ("wideresnet", 1, 7, 18)],  # 18: floor-mode max-pools 18 -> 9 -> 4
)
def test_torch_weights_give_torch_logits(model, in_channels, classes, image_size, tmp_path):
    out = tmp_path / f"{model}.npz"
    args = f"--width 0.125 --in-channels {in_channels} --classes {classes} --batch 4 --seed 3"
    main_env("-m", "tests.port_weights", "--model", model, *args.split(),
             "--image-size", str(image_size), "--out", str(out))  # fmt: skip
    with np.load(out) as f:
        flat = {k: f[k] for k in f.files}
    net = create_model(model, in_channels, classes, width=0.125)
    net.initialize()
    net.hybridize(static_alloc=True, static_shape=True)
    # Gluon's structural names are torch's state-dict keys (BN gamma/beta = weight/bias).
    assert {torch_key(n) for n in structural_params(net)} == {
        k for k in flat if not k.startswith("__")
    }
    load_torch_state(net, flat)
    x = mx.nd.array(flat["__input__"].transpose(0, 3, 1, 2))  # NHWC -> NCHW
    logits = net(x).asnumpy()  # not recording: eval mode, running statistics
    assert logits.shape == flat["__logits__"].shape
    assert np.abs(logits - flat["__logits__"]).max() <= 1e-4
    assert np.abs(flat["__logits__"]).max() > 0.1  # a real signal, not near-zero outputs


def test_load_torch_state_rejects_a_mismatch():
    net = create_model("resnet18", 3, 10, width=0.125)
    net.initialize()
    flat = {torch_key(n): p.data().asnumpy() for n, p in structural_params(net).items()}
    del flat["layer2.0.downsample.1.bias"]
    with pytest.raises(ValueError, match="layer2.0.downsample.1.bias"):
        load_torch_state(net, flat)


def test_spelled_out_defaults():
    net = create_model("resnet18", 3, 10, width=0.5)
    mx.random.seed(0)
    net.initialize()
    params = structural_params(net)
    w = params["layer4.1.conv2.weight"].data().asnumpy()  # (256, 256, 3, 3), fan_out = 9 * 256
    assert w.shape == (256, 256, 3, 3)
    assert abs(w.std() / math.sqrt(2 / (9 * 256)) - 1) < 0.01
    assert abs(w.mean()) < 1e-3
    bound = 1 / math.sqrt(256)
    for name in ("fc.weight", "fc.bias"):  # torch's nn.Linear: both uniform in +-1/sqrt(fan_in)
        a = np.abs(params[name].data().asnumpy())
        assert a.max() <= bound and a.max() > 0.5 * bound, name  # not Gluon's zero bias
    blocks: list = []
    net.apply(blocks.append)
    bns = [b for b in blocks if isinstance(b, mx.gluon.nn.BatchNorm)]
    assert len(bns) == 20  # Gluon's momentum 0.9 = torch's 0.1:
    assert {(b._kwargs["momentum"], b._kwargs["eps"]) for b in bns} == {(0.9, 1e-5)}
    for name, p in params.items():
        leaf = name.rsplit(".", 1)[-1]
        value = p.data().asnumpy()
        if leaf in ("gamma", "running_var"):
            assert np.all(value == 1), name
        if leaf in ("beta", "running_mean"):
            assert np.all(value == 0), name
        # weight decay on conv and linear weights only
        assert p.wd_mult == (1.0 if leaf == "weight" else 0.0), name
    convs = [b for b in blocks if isinstance(b, mx.gluon.nn.Conv2D)]
    shapes = {(b._kwargs["kernel"], b._kwargs["pad"]) for b in convs}
    assert shapes == {((3, 3), (1, 1)), ((1, 1), (0, 0))}


@pytest.mark.parametrize("name", ["resnet18", "wideresnet"])
def test_every_parameter_receives_a_gradient(name):
    net = create_model(name, 1, 7, width=0.125, dropout=0.0)
    mx.random.seed(0)
    net.initialize()
    x = mx.nd.random.normal(shape=(4, 1, 16, 16))
    with autograd.record():
        loss = SoftmaxCrossEntropy()(net(x), mx.nd.array([0, 1, 2, 3])).mean()
    loss.backward()
    for key, p in structural_params(net).items():
        if p.grad_req != "null":
            assert np.abs(p.grad().asnumpy()).sum() > 0, key


def test_loss_is_torch_cross_entropy_with_label_smoothing():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((5, 4)).astype(np.float32)
    labels = np.array([0, 3, 1, 1, 2])
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    for s in (0.0, 0.1):
        # torch: (1 - s) * nll + s * mean over classes of -log p
        want = (1 - s) * -logp[np.arange(5), labels] - s * logp.mean(1)
        got = SoftmaxCrossEntropy(s)(mx.nd.array(logits), mx.nd.array(labels)).asnumpy()
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


LRS = [0.05, 0.1, 0.2, 0.2, 0.13, 0.01]  # warm-up, then decay: the LR changes most steps


def run_optimizer(
    opt: mx.optimizer.Optimizer, w0: np.ndarray, grads: list[np.ndarray]
) -> np.ndarray:
    updater = mx.optimizer.get_updater(opt)
    w = mx.nd.array(w0)
    for g, lr in zip(grads, LRS):
        opt.lr = lr  # what Trainer.set_learning_rate does
        updater(0, mx.nd.array(g), w)
    return w.asnumpy()


def problem(seed: int, shape: tuple[int, int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """A start and a gradient for each of LRS' steps."""
    rng = np.random.default_rng(seed)
    w0, *grads = [rng.standard_normal(shape).astype(np.float32) for _ in range(len(LRS) + 1)]
    return w0, grads


@pytest.mark.parametrize("nesterov", [False, True])
def test_torch_sgd_follows_torch_rule_under_a_changing_lr(nesterov):
    w0, grads = problem(1, (3, 4))
    m, wd, scale = 0.9, 1e-2, 0.5
    ref, buf = w0.astype(np.float64), np.zeros((3, 4))
    for g, lr in zip(grads, LRS):  # torch.optim.SGD, dampening 0
        d = scale * g + wd * ref
        buf = m * buf + d
        ref = ref - lr * (d + m * buf if nesterov else buf)
    opt = TorchSGD(momentum=m, nesterov=nesterov, wd=wd, learning_rate=0.1, rescale_grad=scale)
    np.testing.assert_allclose(run_optimizer(opt, w0, grads), ref, rtol=1e-5, atol=1e-6)
    if not nesterov:  # MXNet's built-in keeps lr inside the buffer: a real difference
        builtin = mx.optimizer.SGD(momentum=m, wd=wd, learning_rate=0.1, rescale_grad=scale)
        assert np.abs(run_optimizer(builtin, w0, grads) - ref).max() > 0.1


def test_novograd_matches_the_formula():
    w0, grads = problem(2, (5, 3))
    b1, b2, wd, eps = 0.9, 0.5, 0.01, 1e-8
    ref, m, v = w0.astype(np.float64), 0.0, 0.0
    for step, (g, lr) in enumerate(zip(grads, LRS)):  # = frameworks.torch_models.NovoGrad
        v = (g**2).sum() if step == 0 else b2 * v + (1 - b2) * (g**2).sum()
        m = b1 * m + g / (np.sqrt(v) + eps) + wd * ref
        ref = ref - lr * m
    opt = NovoGrad(beta1=b1, beta2=b2, epsilon=eps, wd=wd, learning_rate=0.1)
    np.testing.assert_allclose(run_optimizer(opt, w0, grads), ref, rtol=1e-5, atol=1e-6)
