"""Flax models and Optax optimisers against their PyTorch references: parameter counts, a torch
weight port (same logits), initialisers, weight-decay masks, SGD / NovoGrad updates and the
label-smoothed loss."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch

from common.config import preset
from frameworks import torch_models, torch_support
from frameworks.jax_models import (
    count_params,
    create_model,
    decay_mask,
    from_torch_state,
    init_variables,
)
from frameworks.jax_support import cross_entropy, make_optimizer
from tests.port_weights import export

MODELS = ("resnet18", "wideresnet")


@pytest.mark.parametrize("name", MODELS)
def test_parameter_count_and_weight_decay_mask_are_torchs(name: str) -> None:
    model = create_model(name, 10)
    # eval_shape traces init without computing it: full width costs nothing.
    params = jax.eval_shape(
        lambda: model.init(jax.random.PRNGKey(0), jnp.zeros((1, 32, 32, 3)), train=False)
    )["params"]
    net = torch_models.create_model(name, 3, 10)
    assert count_params(params) == torch_models.count_params(net)
    if name == "resnet18":
        assert count_params(params) == 11_173_962  # the published CIFAR ResNet-18
    leaves = zip(jax.tree.leaves(params), jax.tree.leaves(decay_mask(params)))
    decayed = sum(int(np.prod(p.shape)) for p, m in leaves if m)
    assert decayed == sum(p.numel() for p in torch_models.decay_parameters(net)[0])


@pytest.mark.parametrize("name", MODELS)
def test_torch_weights_give_torch_logits(name: str) -> None:
    # Narrow model, 1 channel and 7 classes, 18x18 images: odd sizes so that a wrong stride,
    # padding or pooling cannot agree by accident. BN statistics and affines are non-trivial.
    ref = export(name, 0.125, 1, 7, 18, 4, seed=3)
    variables = from_torch_state(ref)
    model = create_model(name, 7, width=0.125)
    fresh = jax.eval_shape(lambda: model.init(jax.random.PRNGKey(0), ref["__input__"], train=False))
    # The port fills exactly the Flax variables, with the Flax shapes.
    assert jax.tree.map(np.shape, variables) == jax.tree.map(np.shape, fresh)
    logits = np.asarray(
        jax.jit(model.apply, static_argnames="train")(variables, ref["__input__"], train=False)
    )
    assert logits.shape == ref["__logits__"].shape
    assert np.abs(logits - ref["__logits__"]).max() <= 1e-4


def test_initialisers_are_torchs() -> None:
    model = create_model("resnet18", 10, width=0.5)
    v = init_variables(model, 1, (16, 16, 3))
    p = v["params"]
    k = np.asarray(p["layer3_0"]["conv1"]["kernel"])  # (3, 3, 64, 128): fan_out = 9 * 128
    assert k.shape == (3, 3, 64, 128)
    assert abs(k.std() / np.sqrt(2.0 / (9 * 128)) - 1) < 0.03  # He-normal, fan_out
    assert np.abs(k).max() > 3.5 * np.sqrt(2.0 / (9 * 128))  # untruncated
    fc_bound = 1 / np.sqrt(256)
    w, b = np.asarray(p["fc"]["kernel"]), np.asarray(p["fc"]["bias"])  # (256, 10), (10,)
    # torch's nn.Linear: weight AND bias uniform in +-1/sqrt(fan_in) (Flax: zero bias).
    assert fc_bound * 0.95 < np.abs(w).max() <= fc_bound
    assert np.abs(b).max() <= fc_bound and np.count_nonzero(b) == 10
    assert np.all(np.asarray(p["bn1"]["scale"]) == 1) and np.all(np.asarray(p["bn1"]["bias"]) == 0)
    assert np.all(np.asarray(v["batch_stats"]["bn1"]["var"]) == 1)


def _run_optax(tx: optax.GradientTransformation, params: dict, grads: list[dict]) -> dict:
    params = jax.tree.map(jnp.asarray, params)
    state = tx.init(params)
    for g in grads:
        updates, state = tx.update(g, state, params)
        params = optax.apply_updates(params, updates)
    return params


def _run_torch(make: Any, params: dict, grads: list[dict]) -> dict:
    """The same steps with a torch optimiser over the (decay, no decay) groups."""
    tp = jax.tree.map(lambda a: torch.nn.Parameter(torch.tensor(np.array(a))), params)
    no_decay = {"params": [tp["bn"]["scale"], tp["bn"]["bias"]], "weight_decay": 0.0}
    opt = make([{"params": [tp["conv"]["kernel"]]}, no_decay])
    for g in grads:
        for p, gv in zip(jax.tree.leaves(tp), jax.tree.leaves(g)):
            p.grad = torch.tensor(np.array(gv))
        opt.step()
    return jax.tree.map(lambda p: p.detach().numpy(), tp)


BETAS = preset("smoke").novograd_betas
OPTIMIZERS = {  # Config fields (constant LR: torch needs no scheduler) -> the torch optimiser
    "sgd": (dict(lr=0.1, momentum=0.9, weight_decay=0.05),
            lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, weight_decay=0.05)),
    "nesterov": (dict(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
                 lambda g: torch.optim.SGD(g, lr=0.1, momentum=0.9, nesterov=True,
                                           weight_decay=0.05)),
    "novograd": (dict(lr=0.05, optimizer="novograd", weight_decay=0.01),
                 lambda g: torch_support.NovoGrad(g, lr=0.05, betas=BETAS, weight_decay=0.01)),
}  # fmt: skip


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_takes_torchs_steps_with_masked_weight_decay(name: str) -> None:
    fields, make = OPTIMIZERS[name]
    cfg = preset("smoke", lr_schedule="constant", epochs=1, **fields)
    rng = np.random.default_rng(0)
    shapes = {"conv": {"kernel": (3, 3, 2, 4)}, "bn": {"scale": (4,), "bias": (4,)}}
    draw = lambda shape: rng.standard_normal(shape).astype(np.float32)  # noqa: E731
    is_shape = lambda x: isinstance(x, tuple)  # noqa: E731
    params = jax.tree.map(draw, shapes, is_leaf=is_shape)
    grads = [jax.tree.map(draw, shapes, is_leaf=is_shape) for _ in range(4)]
    got = _run_optax(make_optimizer(cfg, params, steps_per_epoch=4), params, grads)
    want = _run_torch(make, params, grads)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_schedule_follows_the_shared_lr_table() -> None:
    # Plain SGD without momentum or decay: each step moves a weight by exactly lr[step] * g.
    sgd = dict(momentum=0.0, weight_decay=0.0)
    cfg = preset("smoke", lr=0.2, lr_schedule="cosine", warmup_epochs=1, epochs=2, **sgd)
    from common.schedule import lr_table_for

    table = lr_table_for(cfg, 3)
    params = {"w": {"kernel": jnp.zeros(())}}
    tx = make_optimizer(cfg, params, steps_per_epoch=3)
    state = tx.init(params)
    seen = []
    for _ in range(len(table)):
        updates, state = tx.update({"w": {"kernel": jnp.ones(())}}, state, params)
        seen.append(-float(updates["w"]["kernel"]))
    np.testing.assert_allclose(seen, table, rtol=1e-6)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cross_entropy_is_torchs(smoothing: float) -> None:
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((6, 5)).astype(np.float32)
    labels = rng.integers(0, 5, 6).astype(np.int32)
    got = np.asarray(cross_entropy(jnp.asarray(logits), jnp.asarray(labels), smoothing))
    want = torch.nn.functional.cross_entropy(
        torch.tensor(logits),
        torch.tensor(labels).long(),
        reduction="none",
        label_smoothing=smoothing,
    )
    np.testing.assert_allclose(got, want.numpy(), rtol=1e-5, atol=1e-6)
