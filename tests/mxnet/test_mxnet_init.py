"""mxnet-gluon starts from the shared initial arrays (common/init.py) on every one of 2
contexts, for both models (torch and JAX: tests/common/test_init.py)."""

from __future__ import annotations

import mxnet as mx
import numpy as np
import pytest

from common.config import preset
from common.init import initial_state
from frameworks import mxnet_gluon as G
from frameworks.mxnet_models import structural_params, torch_key


@pytest.mark.parametrize("model", ["resnet18", "wideresnet"])
def test_every_context_starts_from_the_shared_arrays(model: str, tmp_path) -> None:
    n = 2
    cfg = preset("smoke", model=model, width=0.125, gpus=n, data_dir=str(tmp_path))
    arrays, _ = initial_state(cfg, 3, 10)
    ctx = [mx.cpu(i) for i in range(n)]
    state = G.create_train_state(cfg, G.build_model(cfg, 3, 10), ctx, steps_per_epoch=2)
    params = structural_params(state.model)
    assert {torch_key(k) for k in params} == {
        k for k in arrays if not k.endswith("num_batches_tracked")
    }
    for name, p in params.items():
        for copy in p.list_data():  # one per context
            assert np.array_equal(copy.asnumpy(), arrays[torch_key(name)]), name
    # The comparison can fail: MXNet's own generator (--init native) draws other weights.
    native = G.create_train_state(
        cfg.replace(init="native"), G.build_model(cfg, 3, 10), ctx, steps_per_epoch=2
    )
    conv = structural_params(native.model)["conv1.weight"].data(ctx[0]).asnumpy()
    assert not np.array_equal(conv, arrays["conv1.weight"])
