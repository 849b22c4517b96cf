"""mxnet-gluon on CPU contexts: an N-context step equals the 1-context step (BN on its running
statistics: --bn sync is refused on CPU, so test_contract.py cannot check this), evaluation
counts every test image once at any context count, --bn sync and bf16 refused on CPU."""

from __future__ import annotations

import os

import mxnet as mx
import numpy as np
import pytest

from common.config import ConfigError, preset
from common.datasets import load_for
from common.pipeline import EvalLoader
from frameworks import mxnet_gluon as G
from frameworks.mxnet_models import count_params, create_model, structural_params
from tests.conftest import ok, read_json, relative_update_difference, run_trainer


def run(*args: str, env: dict[str, str] | None = None):
    return run_trainer("mxnet-gluon", *args, env=env)  # .venv-mxnet's interpreter


def trainable(state: G.TrainState, ctx_index: int) -> dict[str, np.ndarray]:
    params = structural_params(state.model).items()
    return {n: p.data(state.ctx[ctx_index]).asnumpy() for n, p in params if p.grad_req != "null"}


def use_running_stats(net: mx.gluon.Block) -> None:
    """BN in eval mode during training (use_global_stats): the N-context step then equals the
    1-context step exactly; with per-context batch statistics it cannot."""

    def fix(block: mx.gluon.Block) -> None:
        if isinstance(block, mx.gluon.nn.BatchNorm):
            block._kwargs["use_global_stats"] = True  # read by hybrid_forward at the first call

    net.apply(fix)


def make_state(n: int) -> G.TrainState:
    cfg = preset("smoke", gpus=n, momentum=0.9, weight_decay=5e-3, lr=0.2)
    model = G.build_model(cfg, 3, 10)
    use_running_stats(model)
    return G.create_train_state(cfg, model, [mx.cpu(i) for i in range(n)], steps_per_epoch=2)


def test_n_context_step_equals_one_context_step(monkeypatch):
    rng = np.random.default_rng(0)
    draw = lambda: (rng.standard_normal((24, 3, 16, 16)).astype(np.float32),  # noqa: E731
                    rng.integers(0, 10, 24).astype(np.int32))  # fmt: skip
    batches = [draw() for _ in range(2)]
    results = {}
    for n in (1, 2, 3):
        state = make_state(n)
        before = trainable(state, 0)
        sums = []
        with monkeypatch.context() as mp:  # no host read inside the step: metrics stay lazy
            mp.setattr(mx.nd.NDArray, "asnumpy", None)  # calling it would raise
            for batch in batches:
                state, metrics = G.train_step(state, G.to_device(batch, state))
                sums.append(metrics["loss_sum"])
        losses = [float(v.asscalar()) for v in sums]
        results[n] = (before, [trainable(state, i) for i in range(n)], losses)
    before, (ref,), ref_losses = results[1]
    assert max(np.abs(ref[k] - before[k]).max() for k in ref) > 1e-3  # the steps did something
    for n in (2, 3):
        _, replicas, losses = results[n]
        for i, got in enumerate(replicas):  # every replica equals the 1-context weights
            # On the relative update (two programs: the gradient sums differ in order), not an
            # absolute tolerance per tensor: measured 8e-7 here; a lost context's gradient or a
            # per-context LR slip moves it by > 1e-1.
            diff = relative_update_difference(before, got, ref)
            assert diff < 1e-4, f"{n} contexts, replica {i}: {diff:.2e}"
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


def test_evaluation_identical_at_1_2_3_contexts():
    cfg = preset("smoke", dataset="digits", image_size=16, test_limit=359, eval_batch_size=64)
    ds = load_for(cfg)
    results = []
    for n in (1, 2, 3):
        ctx = [mx.cpu(i) for i in range(n)]
        state = G.create_train_state(cfg.replace(gpus=n), G.build_model(cfg, 1, 10), ctx, 1)
        # 359 images, batches of 64 padded (weight 0) to a multiple of n: 5 full + 1 partial
        results.append(G.evaluate(state, EvalLoader(ds, 64, 0, 1, layout="NCHW", pad_to=n)))
    for r in results:
        assert r["count"] == 359
        assert r["correct"] == results[0]["correct"]
        assert abs(r["loss_sum"] - results[0]["loss_sum"]) <= 1e-4 * abs(results[0]["loss_sum"])


@pytest.mark.parametrize("n", [1, 2])  # 3 contexts: the in-process test above
def test_runs_evaluate_every_test_image(n, tmp_path):
    out = tmp_path / "r.json"
    ok(run("--preset", "smoke", "--gpus", str(n), "--phase-timing", "--output", str(out)))
    rec = read_json(out)
    assert rec["status"] == "ok" and rec["devices"] == n
    assert rec["device_kind"] == "cpu-simulated" and rec["framework"] == "mxnet-gluon"
    assert rec["test_examples"] == rec["test_set_size"] == 10
    assert len(rec["epochs"]) == 2 and rec["epochs"][0]["images"] == 96  # 4 steps x 24
    assert rec["params"] == count_params(create_model("resnet18", 3, 10, width=0.125))
    per_context = max(1, len(os.sched_getaffinity(0)) // n)  # the contexts share the cores
    assert rec["threads"]["per_device"] == per_context
    assert rec["threads"]["total"] == per_context * n
    assert rec["threads"]["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    phases = rec["phases_ms_per_step"]
    assert set(phases) == {"data_wait", "h2d", "forward_backward", "allreduce", "optimizer"}
    assert phases["forward_backward"] > 0 and phases["optimizer"] > 0
    if n > 1:
        assert phases["allreduce"] > 0
    else:  # one context: no kvstore, nothing to reduce (only the phase timer's two syncs)
        assert phases["allreduce"] < 0.5


@pytest.mark.parametrize(
    "flags,says",
    [({"gpus": 2, "bn": "sync"}, "--bn sync needs GPUs"), ({"precision": "bf16"}, "fp32 only")],
)
def test_what_it_cannot_run_on_a_cpu_is_one_line(flags, says):
    """--bn sync (Gluon's SyncBatchNorm deadlocks on CPU contexts) and bf16 (MXNet trains in
    fp32 only, on a CPU as on a GPU): a ConfigError, which run_main makes exit 2."""
    with pytest.raises(ConfigError, match=says) as refused:
        G.check_config(preset("smoke", framework="mxnet-gluon", **flags))
    assert "\n" not in str(refused.value)
