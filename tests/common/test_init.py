"""One initial state for every framework (common/init.py): the arrays are a function of the seed
and the tensor names only, match every framework's architecture, and torch, jax-pmap and
jax-shard start from them exactly on every device (MXNet: tests/mxnet/test_mxnet_init.py)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from jax.sharding import Mesh

from common import init as init_module
from common.config import preset
from common.init import digest, draw, init_record, initial_state, parameter_spec, trainable_sizes
from common.runtime import simulate_host_devices
from frameworks import jax_pmap, jax_shard
from frameworks.jax_models import count_params as jax_count
from frameworks.torch_models import count_params as torch_count, create_model
from frameworks.torch_support import initialize

simulate_host_devices(4)  # before the first device query (as tests/trainers/test_jax_pmap.py)

MODELS = ("resnet18", "wideresnet")


def cfg_for(model: str, tmp_path, **kw):
    return preset("smoke", model=model, width=0.125, data_dir=str(tmp_path), **kw)


@pytest.mark.parametrize("model", MODELS)
def test_spec_is_torch_state_dict(model: str) -> None:
    """Names, order and shapes are torch's state dict; the trainable count is the model's."""
    for width, c, k in ((1.0, 3, 10), (0.25, 1, 10), (0.3, 3, 7)):
        net, spec = create_model(model, c, k, width), parameter_spec(model, width, c, k)
        want = [(n, tuple(v.shape)) for n, v in net.state_dict().items()]
        assert [(n, s) for n, s, _ in spec] == want
        assert sum(trainable_sizes(spec)) == torch_count(net)


def test_draws_depend_on_seed_and_name_only() -> None:
    spec = parameter_spec("resnet18", 0.125, 3, 10)
    a, b = draw(spec, 0), draw(list(reversed(spec)), 0)
    assert digest(a) == digest(b)  # the order a framework lists its tensors does not matter
    assert digest(draw(spec, 1)) != digest(a)
    assert all(np.array_equal(a[k], b[k]) for k in a)
    conv = a["layer1.0.conv1.weight"]  # He-normal, fan_out = O * 3 * 3
    assert conv.dtype == np.float32
    assert conv.std() == pytest.approx(np.sqrt(2 / (conv.shape[0] * 9)), rel=0.1)
    bound = 1 / np.sqrt(a["fc.weight"].shape[1])
    assert np.abs(a["fc.weight"]).max() <= bound and np.abs(a["fc.bias"]).max() <= bound
    assert (a["bn1.weight"] == 1).all() and (a["bn1.running_var"] == 1).all()
    assert (a["bn1.bias"] == 0).all() and (a["bn1.running_mean"] == 0).all()


def test_cache_is_used_and_a_wrong_file_is_replaced(tmp_path) -> None:
    cfg = cfg_for("resnet18", tmp_path, seed=3)
    arrays, info = initial_state(cfg, 3, 10)
    assert info["mode"] == "shared" and info["sha256"] == digest(arrays)
    assert init_record(cfg, 3, 10) == info
    assert init_record(cfg.replace(init="native"), 3, 10)["sha256"] is None
    path = tmp_path / "init" / info["file"].rsplit("/", 1)[-1]
    good = path.read_bytes()
    other = init_module.cache_path(cfg.replace(seed=4), 3, 10)
    initial_state(cfg.replace(seed=4), 3, 10)
    for wrong in (other.read_bytes(), good[: len(good) // 2]):  # another seed's; cut short
        path.write_bytes(wrong)
        init_module._initial_state.cache_clear()  # a new process would read the file
        _, info2 = initial_state(cfg, 3, 10)
        assert info2["sha256"] == info["sha256"]  # redrawn, not the wrong file's contents


@pytest.mark.parametrize("model", MODELS)
def test_torch_starts_from_the_shared_arrays(model: str, tmp_path) -> None:
    cfg = cfg_for(model, tmp_path)
    arrays, _ = initial_state(cfg, 3, 10)
    torch.manual_seed(123)
    net = create_model(model, 3, 10, cfg.width)
    native = {k: v.clone() for k, v in net.state_dict().items()}
    initialize(cfg, net)
    for key, value in net.state_dict().items():
        assert np.array_equal(value.numpy(), arrays[key]), key
    # The check sees a difference: torch's own generator draws other weights.
    assert not np.array_equal(native["conv1.weight"].numpy(), arrays["conv1.weight"])
    initialize(cfg.replace(init="native"), net)  # native: nothing loaded


def _to_torch_layout(variables: dict) -> dict[str, np.ndarray]:
    """Flax variables -> torch names and layouts (the inverse of jax_models.from_torch_state)."""
    from flax import traverse_util

    leaves = {"kernel": "weight", "scale": "weight", "mean": "running_mean", "var": "running_var"}
    out: dict[str, np.ndarray] = {}
    for group in (variables["params"], variables["batch_stats"]):
        for (*mods, leaf), v in traverse_util.flatten_dict(group).items():
            v = np.asarray(v)
            if leaf == "kernel":
                v = v.transpose(3, 2, 0, 1) if v.ndim == 4 else v.T
            out[".".join(m.replace("_", ".") for m in mods) + "." + leaves.get(leaf, leaf)] = v
    return out


@pytest.mark.parametrize("framework", ["jax-pmap", "jax-shard"])
@pytest.mark.parametrize("model", MODELS)
def test_jax_starts_from_the_shared_arrays(model: str, framework: str, tmp_path) -> None:
    """On every one of 2 devices (init_variables: the same at any count)."""
    mod, n = {"jax-pmap": jax_pmap, "jax-shard": jax_shard}[framework], 2
    cfg = cfg_for(model, tmp_path, gpus=n)
    arrays, _ = initial_state(cfg, 3, 10)
    mesh = Mesh(np.array(jax.devices()[:n]), ("batch",))
    net = mod.build_model(cfg, 3, 10, jnp.float32)
    state = mod.create_train_state(cfg, net, (16, 16, 3), mesh, steps_per_epoch=2)
    for leaf in jax.tree.leaves(state.params):  # every device's copy
        assert len(leaf.addressable_shards) == n
    replicas = [
        jax.tree.map(lambda a, i=i: np.asarray(a.addressable_shards[i].data), state)
        for i in range(n)
    ]
    for replica in replicas:
        if framework == "jax-pmap":  # a stacked device axis of length 1 per shard
            replica = jax.tree.map(lambda a: a[0], replica)
        got = _to_torch_layout({"params": replica.params, "batch_stats": replica.batch_stats})
        want = {k: v for k, v in arrays.items() if not k.endswith("num_batches_tracked")}
        assert set(got) == set(want)
        for key in want:
            assert np.array_equal(got[key], want[key]), key
    assert jax_count(replicas[0].params) == sum(
        trainable_sizes(parameter_spec(model, cfg.width, 3, 10))
    )
    # The comparison can fail: JAX's own generator (--init native) draws other weights.
    native = mod.create_train_state(cfg.replace(init="native"), net, (16, 16, 3), mesh, 2)
    kernel = np.asarray(native.params["conv1"]["kernel"].addressable_shards[0].data)
    kernel = kernel[0] if framework == "jax-pmap" else kernel
    assert not np.array_equal(kernel.transpose(3, 2, 0, 1), arrays["conv1.weight"])
