"""Step-loop variants of jax-pmap / jax-shard / d2l-jax at N simulated devices, alternated in
one process. Usage: python /tmp/prof/jaxprof.py N ROUNDS VARIANTS..."""

import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.getcwd())
from common.runtime import simulate_host_devices  # noqa: E402

N = int(sys.argv[1])
ROUNDS = int(sys.argv[2])
VARIANTS = sys.argv[3:]
simulate_host_devices(N)

import jax  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh  # noqa: E402

from benchmarks.tutorials import d2l_jax as d2l  # noqa: E402
from common.config import preset  # noqa: E402
from common.datasets import load_for  # noqa: E402
from common.pipeline import TrainLoader  # noqa: E402
from common.timing import PhaseTimer  # noqa: E402
from frameworks import jax_pmap, jax_shard  # noqa: E402
from frameworks.jax_support import prefetch_to_devices  # noqa: E402

cfg = preset(
    "digits", batch_size=128, momentum=0.0, weight_decay=0.0, epochs=4, augment=False,
    lr_schedule="constant", warmup_epochs=0.0, gpus=N, framework="jax-pmap",
)
ds = load_for(cfg)
devices = jax.devices()[:N]
mesh = Mesh(np.array(devices), ("batch",))
model = jax_pmap.build_model(cfg, ds.channels, ds.num_classes)


from jax import lax
def local_metrics_step(state, batch):
    psum = lax.psum
    try:
        lax.psum = lambda x, axis_name: x
        return jax_pmap.train_step(state, batch)
    finally:
        lax.psum = psum
def no_metrics_step(state, batch):
    s, m = jax_pmap.train_step(state, batch)
    return s, {}
STEPS = {"ours": jax_pmap.train_step, "local": local_metrics_step, "none": no_metrics_step}
def epoch_pmap(prefetch=2, accumulate=True, put="ours", donate=True, step_kind="ours"):
    state = jax_pmap.create_train_state(cfg, model, ds.image_shape, mesh, 11)
    step = jax.pmap(STEPS[step_kind], "batch", devices=devices,
                    donate_argnums=(0,) if donate else ())
    loader = TrainLoader(ds, cfg.batch_size, cfg.seed, augment=False, prefetch=prefetch)
    phases = PhaseTimer(lambda: None, False)

    def run(epoch):
        nonlocal state
        totals = {}
        if put == "ours":
            it = prefetch_to_devices(loader.epoch(epoch), lambda b: jax_pmap.to_device(b, mesh), phases)
        else:
            it = (tuple(a.reshape(N, -1, *a.shape[1:]) for a in b) for b in loader.epoch(epoch))
        for batch in it:
            state, metrics = step(state, batch)
            if accumulate:
                totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
        jax.block_until_ready(state)
    return run


def epoch_shard(prefetch=2, accumulate=True):
    cfgs = cfg.replace(framework="jax-shard")
    m = jax_shard.build_model(cfgs, ds.channels, ds.num_classes)
    state = jax_shard.create_train_state(cfgs, m, ds.image_shape, mesh, 11)
    step, _ = jax_shard.parallelize(cfgs, mesh)
    loader = TrainLoader(ds, cfg.batch_size, cfg.seed, augment=False, prefetch=prefetch)
    phases = PhaseTimer(lambda: None, False)

    def run(epoch):
        nonlocal state
        totals = {}
        it = prefetch_to_devices(loader.epoch(epoch), lambda b: jax_shard.to_device(b, mesh), phases)
        for batch in it:
            state, metrics = step(state, batch)
            if accumulate:
                totals = {k: totals[k] + v if k in totals else v for k, v in metrics.items()}
        jax.block_until_ready(state)
    return run


def epoch_d2l():
    state = d2l.replicate(d2l.create_train_state(cfg, model, ds.image_shape), N)
    step = jax.pmap(d2l.train_step, axis_name="batch", devices=devices)

    def run(epoch):
        nonlocal state
        for X, y in d2l.get_dataloader(ds, cfg.batch_size, True, cfg.seed, epoch, 11):
            X, y = d2l.reshape_batch(np.array(X), np.array(y), N)
            state, loss = step(state, X, y)
        jax.block_until_ready(state)
    return run


MAKERS = {
    "d2l": epoch_d2l,
    "pmap": lambda: epoch_pmap(),
    "pmap-noacc": lambda: epoch_pmap(accumulate=False),
    "pmap-nopre": lambda: epoch_pmap(prefetch=0),
    "pmap-d2lput": lambda: epoch_pmap(put="d2l"),
    "pmap-nodonate": lambda: epoch_pmap(donate=False),
    "shard": lambda: epoch_shard(),
    "pmap-localm": lambda: epoch_pmap(step_kind="local"),
    "pmap-nom": lambda: epoch_pmap(step_kind="none"),
    "shard-noacc": lambda: epoch_shard(accumulate=False),
    "shard-nopre": lambda: epoch_shard(prefetch=0),
}
runs = {v: MAKERS[v]() for v in VARIANTS}
for v, r in runs.items():  # compile + warm-up
    r(0)
import collections, glob
def thread_cpu():
    out = collections.Counter()
    tick = os.sysconf("SC_CLK_TCK")
    for t in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            name = open(t + "/comm").read().strip()
            f = open(t + "/stat").read().rsplit(")", 1)[1].split()
            out[name.rstrip("0123456789-_ ")] += (int(f[11]) + int(f[12])) / tick
        except OSError:
            pass
    return out
threads = {v: collections.Counter() for v in VARIANTS}
times = {v: [] for v in VARIANTS}
cpu = {v: [] for v in VARIANTS}
for rnd in range(ROUNDS):
    order = VARIANTS if rnd % 2 == 0 else VARIANTS[::-1]
    for v in order:
        r0 = resource.getrusage(resource.RUSAGE_SELF)
        c0 = thread_cpu()
        t0 = time.perf_counter()
        runs[v](rnd + 1)
        c1 = thread_cpu(); c1.subtract(c0); threads[v].update(c1)
        times[v].append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu[v].append(r1.ru_utime + r1.ru_stime - r0.ru_utime - r0.ru_stime)
base = VARIANTS[0]
print(f"N={N} rounds={ROUNDS} load={os.getloadavg()[0]:.2f}")
for v in VARIANTS:
    ratios = [b / t for b, t in zip(times[base], times[v])]
    print(f"{v:14s} epoch {statistics.median(times[v]):.3f}s  cpu {statistics.median(cpu[v]):.3f}s  "
          f"speed vs {base}: {statistics.median(ratios):.3f}  (min {min(times[v]):.3f})")

for v in VARIANTS:
    print(v, {k: round(x / ROUNDS, 3) for k, x in threads[v].most_common(6)})
