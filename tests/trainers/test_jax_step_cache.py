"""--compile-cache, the tracing half (jax_support.cached_step): the JAX trainers export their
parallel train step once per configuration and later runs load it instead of tracing the model.

What could go wrong, and the test that would see it:
- the loaded program computes something else than the traced step: two steps through a stored
  and then a loaded program equal the trainer's own step bitwise (pmap and jit+shard_map);
- a stale program is served after the configuration changed: a step stored for lr 0.1 is not
  used at lr 0.2, and, with the key made blind to the config (the injected bug), it would be and
  the comparison fails;
- a field left out of the key (NOT_IN_STEP: the seed) does change the program: a step stored
  under seed 0 runs seed 1's state exactly as seed 1's own step does;
- a damaged file: traced again and replaced, with a note;
- off where it cannot work (--no-compile-cache, --no-step-cache, no flatbuffers), returning the
  step untouched, and a step that fails to export falls back to the traced one with a note.
The trainers' runs (cold, warm, off: equal final states, the record's counts) are in
tests/trainers/test_jax_pmap.py::test_a_second_run_loads_its_programs_from_the_compile_cache.

Shares the compiled steps and 4 simulated devices of tests/trainers/test_jax_pmap.py (one pytest process).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from common.config import Config
from common.datasets import load_for
from common.runtime import INJECT_ENV
from common.schedule import lr_table_for
from frameworks import jax_pmap, jax_support
from frameworks.jax_support import CompileMeter, cached_step, device_plan, step_key
from tests.trainers.test_jax_pmap import CFG, MODULES, compiled, host_devices, max_diff, train_batches

STEPS_PER_EPOCH = 4  # what compiled() gives create_train_state


def config(tmp_path: Path, **changes: Any) -> Config:
    return CFG.replace(cache_dir=str(tmp_path / "cache"), **changes)


def run_steps(step: Any, state: Any, mesh: Mesh, mod: Any, steps: int = 2) -> Any:
    """Host state after `steps` training steps of `step` from `state`."""
    for batch in train_batches()[:steps]:
        state, _ = step(state, mod.to_device(batch, mesh))
    return mod.unreplicate(state)


def trainer_parts(framework: str, n: int, cfg: Config) -> tuple[Any, Callable[[], Any], Mesh, Any]:
    """(parallel train step, a maker of fresh copies of the initial device state, mesh, module)
    for `cfg`, as train() builds them (compiled() keeps CFG's; this one takes another lr or
    seed). Fresh copies: on GPUs the steps donate the state they are given."""
    mod = MODULES[framework]
    mesh = Mesh(np.array(host_devices(n)), ("batch",))
    ds = load_for(cfg)
    model = mod.build_model(cfg, ds.channels, ds.num_classes, jnp.float32)
    state = mod.create_train_state(cfg, model, ds.image_shape, mesh, STEPS_PER_EPOCH)
    train, _ = mod.parallelize(device_plan(cfg, "cpu"), mesh)
    host = mod.unreplicate(state)
    return train, lambda: mod.replicate(host, mesh), mesh, mod


def leaf_diff(a: Any, b: Any) -> float:
    """Largest difference between two states' arrays (their treedefs hold each run's own
    model and optimiser objects, which never compare equal)."""
    return max_diff(jax.tree.leaves(a), jax.tree.leaves(b))


def steps_counts() -> dict[str, Any]:
    return dict(CompileMeter.get().steps)


@pytest.mark.parametrize(
    ("framework", "n", "bn"), [("jax-pmap", 2, "local"), ("jax-shard", 2, "local")]
)
def test_a_stored_step_and_a_loaded_one_equal_the_traced_step(
    tmp_path: Path, framework: str, n: int, bn: str
) -> None:
    train, _, initial, mesh, mod = compiled(framework, n, bn)
    cfg = config(tmp_path, gpus=n, bn=bn)
    traced = run_steps(train, mod.replicate(initial, mesh), mesh, mod)
    stored = run_steps(
        cached_step(cfg, train, STEPS_PER_EPOCH), mod.replicate(initial, mesh), mesh, mod
    )
    assert steps_counts() == {"dir": str(tmp_path / "cache" / "jax-steps"), "hits": 0, "misses": 1}
    assert len(list((tmp_path / "cache" / "jax-steps").glob("*.jaxexport"))) == 1
    loaded = run_steps(
        cached_step(cfg, train, STEPS_PER_EPOCH), mod.replicate(initial, mesh), mesh, mod
    )
    assert steps_counts()["hits"] == 1 and steps_counts()["misses"] == 0
    assert max_diff(stored, traced) == 0.0
    assert max_diff(loaded, traced) == 0.0
    assert max_diff(loaded.params, initial.params) > 0  # it did train


def test_a_changed_configuration_is_traced_again_and_a_blind_key_would_serve_a_stale_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fw, n = "jax-shard", 1
    slow, fast = config(tmp_path, gpus=n, lr=0.1), config(tmp_path, gpus=n, lr=0.2)
    train_slow, start_slow, mesh, mod = trainer_parts(fw, n, slow)
    train_fast, start_fast, _, _ = trainer_parts(fw, n, fast)
    want = run_steps(train_fast, start_fast(), mesh, mod)  # lr 0.2, traced
    run_steps(cached_step(slow, train_slow, STEPS_PER_EPOCH), start_slow(), mesh, mod)  # lr 0.1
    got = run_steps(cached_step(fast, train_fast, STEPS_PER_EPOCH), start_fast(), mesh, mod)
    assert steps_counts()["misses"] == 1  # another key: traced, not loaded
    assert leaf_diff(got, want) == 0.0
    # The injected bug: a key that ignores the configuration serves lr 0.1's program at lr 0.2.
    monkeypatch.setattr(jax_support, "step_key", lambda cfg, table, args: "blind")
    run_steps(cached_step(slow, train_slow, STEPS_PER_EPOCH), start_slow(), mesh, mod)
    stale = run_steps(cached_step(fast, train_fast, STEPS_PER_EPOCH), start_fast(), mesh, mod)
    assert steps_counts()["hits"] == 1
    assert leaf_diff(stale, want) > 1e-3


def test_the_seed_is_not_in_the_program(tmp_path: Path) -> None:
    # NOT_IN_STEP leaves the seed out of the key so that `compare --repeat` (seeds s..s+K-1)
    # loads one step: the seed only picks the initial weights and dropout key, both arguments.
    fw, n = "jax-pmap", 2
    seed0, seed1 = config(tmp_path, gpus=n, seed=0), config(tmp_path, gpus=n, seed=1)
    train0, start0, mesh, mod = trainer_parts(fw, n, seed0)
    train1, start1, _, _ = trainer_parts(fw, n, seed1)
    # seed 0's program, stored; what it computes from seed 0's state is seed 0's trajectory
    # (a stored step equals the traced one: the first test), so no third compile for that.
    first = run_steps(cached_step(seed0, train0, STEPS_PER_EPOCH), start0(), mesh, mod)
    want = run_steps(train1, start1(), mesh, mod)
    got = run_steps(cached_step(seed1, train1, STEPS_PER_EPOCH), start1(), mesh, mod)
    assert steps_counts()["hits"] == 1
    assert leaf_diff(got, want) == 0.0
    assert leaf_diff(want.params, first.params) > 0  # the seeds' trajectories differ


def test_the_key_follows_what_the_program_depends_on(monkeypatch: pytest.MonkeyPatch) -> None:
    _, _, initial, mesh, mod = compiled("jax-shard", 2, "local")
    state = mod.replicate(initial, mesh)
    batch = mod.to_device(train_batches()[0], mesh)
    cfg = CFG.replace(gpus=2, bn="local")
    args = (jax.tree.leaves(state), batch)
    table = lr_table_for(cfg, 4)
    key = step_key(cfg, table, args)
    same = [
        cfg.replace(seed=3),
        cfg.replace(output="elsewhere.json", log_every=5, tensorboard="tb", prefetch=0),
    ]
    for other in same:
        assert step_key(other, lr_table_for(other, 4), args) == key
    for other in (cfg.replace(lr=0.2), cfg.replace(epochs=3), cfg.replace(label_smoothing=0.1)):
        assert step_key(other, lr_table_for(other, 4), args) != key
    assert step_key(cfg, lr_table_for(cfg, 5), args) != key  # another LR table
    # The tests' LR bug (DPBENCH_INJECT=lr-shift@...): the same config, another table.
    cosine = cfg.replace(lr_schedule="cosine", framework="jax-shard")
    clean = step_key(cosine, lr_table_for(cosine, 4), args)
    monkeypatch.setenv(INJECT_ENV, "lr-shift@jax-shard")
    assert step_key(cosine, lr_table_for(cosine, 4), args) != clean
    monkeypatch.delenv(INJECT_ENV)
    half = mod.to_device(tuple(a[:12] for a in train_batches()[0]), mesh)
    assert step_key(cfg, table, (args[0], half)) != key  # another batch shape
    monkeypatch.setattr(jax_support, "source_digest", lambda: "edited")
    assert step_key(cfg, table, args) != key  # an edited module


def test_a_damaged_file_is_traced_again_and_replaced(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    train, _, initial, mesh, mod = compiled("jax-shard", 2, "local")
    cfg = config(tmp_path, gpus=2, bn="local")
    want = run_steps(
        cached_step(cfg, train, STEPS_PER_EPOCH), mod.replicate(initial, mesh), mesh, mod
    )
    (path,) = (tmp_path / "cache" / "jax-steps").glob("*.jaxexport")
    good = path.read_bytes()
    args = (jax.tree.leaves(mod.replicate(initial, mesh)), mod.to_device(train_batches()[0], mesh))
    assert jax_support.load_exported(path, args) is not None
    flipped = good[:-100] + bytes([good[-100] ^ 1]) + good[-99:]  # one bit: still parses
    for damage in (b"not an exported program", flipped):
        path.write_bytes(damage)
        got = run_steps(
            cached_step(cfg, train, STEPS_PER_EPOCH), mod.replicate(initial, mesh), mesh, mod
        )
        assert "note: ignoring the exported step" in capsys.readouterr().err
        assert steps_counts()["misses"] == 1 and max_diff(got, want) == 0.0
        assert path.read_bytes() != damage  # replaced by a good one
        assert jax_support.load_exported(path, args) is not None


def test_off_returns_the_step_untouched(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    train, *_ = compiled("jax-shard", 2, "local")
    assert cached_step(config(tmp_path, compile_cache=False), train, 4) is train
    assert steps_counts()["off"] == "--no-compile-cache"
    assert cached_step(config(tmp_path, step_cache=False), train, 4) is train
    assert steps_counts()["off"] == "--no-step-cache"
    real = jax_support.importlib.util.find_spec
    monkeypatch.setattr(
        jax_support.importlib.util,
        "find_spec",
        lambda name, *a: None if name == "flatbuffers" else real(name, *a),
    )
    assert cached_step(config(tmp_path), train, 4) is train
    assert "flatbuffers" in steps_counts()["off"]
    monkeypatch.undo()
    monkeypatch.setenv(INJECT_ENV, "lr-shift@jax-shard")  # a test's bug: neither stored nor hidden
    assert cached_step(config(tmp_path), train, 4) is train
    assert steps_counts()["off"] == f"{INJECT_ENV} is set"
    assert not (tmp_path / "cache").exists()


def test_a_step_that_fails_to_export_falls_back_to_the_traced_step(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    train, _, initial, mesh, mod = compiled("jax-pmap", 2, "local")
    want = run_steps(train, mod.replicate(initial, mesh), mesh, mod)

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise ValueError("cannot export this\nsecond line")

    monkeypatch.setattr(jax_support.jax.export, "export", refuse)
    step = cached_step(config(tmp_path, gpus=2, bn="local"), train, STEPS_PER_EPOCH)
    got = run_steps(step, mod.replicate(initial, mesh), mesh, mod)
    assert "note: train step not exported (cannot export this)" in capsys.readouterr().err
    assert steps_counts()["off"] == "failed: cannot export this"
    assert max_diff(got, want) == 0.0


def test_a_donated_state_is_donated_and_the_step_unchanged(tmp_path: Path) -> None:
    # On GPUs the trainers donate the state (jax_support.donate_state); the exported call keeps
    # it. XLA:CPU honours donation too, so the GPUs' path runs here.
    train, _, initial, mesh, mod = compiled("jax-shard", 2, "local")
    want = run_steps(train, mod.replicate(initial, mesh), mesh, mod)
    step = cached_step(config(tmp_path, gpus=2, bn="local"), train, STEPS_PER_EPOCH, (0,))
    state = mod.replicate(initial, mesh)
    new, _ = step(state, mod.to_device(train_batches()[0], mesh))
    assert all(x.is_deleted() for x in jax.tree.leaves(state))  # donated
    new, _ = step(new, mod.to_device(train_batches()[1], mesh))
    assert max_diff(mod.unreplicate(new), want) == 0.0


@pytest.mark.parametrize("n", [1, 2])
def test_no_recompilation_across_an_epoch_boundary(tmp_path: Path, n: int) -> None:
    # jax-pmap --bn local averages the replicas' statistics at every epoch's end (p_mean). The
    # state that comes back must look like the exported call's own outputs, or the call leaves
    # its fast path (a retrace, ~10 ms on a CPU, twice per epoch): the new state keeps the
    # shardings of the state given, as the traced step's does (at 1 device a call left to
    # itself returned P() where p_mean returns P("batch"): this test failed then), and no
    # lowering happens. The listener is shown to see one: a state moved to other shardings.
    train, _, initial, mesh, mod = compiled("jax-pmap", n, "local")
    p_mean = jax_pmap.cross_replica_mean(mesh)
    step = cached_step(config(tmp_path, gpus=n, bn="local"), train, STEPS_PER_EPOCH)
    lowered: list[str] = []
    listening = [True]

    def listen(event: str, duration: float, **kwargs: Any) -> None:
        if listening[0] and event == "/jax/core/compile/jaxpr_to_mlir_module_duration":
            lowered.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        batch = mod.to_device(train_batches()[0], mesh)
        state, _ = step(mod.replicate(initial, mesh), batch)  # first call: exports, compiles
        traced, _ = train(mod.replicate(initial, mesh), batch)
        assert [x.sharding for x in jax.tree.leaves(state)] == [
            x.sharding for x in jax.tree.leaves(traced)
        ]
        jax_pmap.sync_batch_stats(state, p_mean)  # p_mean's own first compile
        lowered.clear()
        state, _ = step(state, batch)
        state = jax_pmap.sync_batch_stats(state, p_mean)  # the epoch's end
        state, _ = step(state, batch)
        jax.block_until_ready(state)
        assert lowered == []
        if n > 1:  # (on one device every sharding is the same layout: nothing to move)
            step(jax.device_put(state, NamedSharding(mesh, P())), batch)  # every leaf whole
            assert lowered, "the listener saw no lowering: it could not have caught a recompile"
    finally:
        listening[0] = False
