import os, sys, time, statistics
sys.path.insert(0, os.getcwd())
from common.runtime import simulate_host_devices
N = int(sys.argv[1]); simulate_host_devices(N)
import jax, numpy as np
from benchmarks.tutorials import d2l_jax as d2l
from common.config import preset
from common.datasets import load_for
from frameworks import jax_pmap
cfg = preset("digits", batch_size=128, momentum=0.0, weight_decay=0.0, epochs=4, augment=False,
             lr_schedule="constant", warmup_epochs=0.0, gpus=N, framework="jax-pmap")
ds = load_for(cfg); devices = jax.devices()[:N]
model = jax_pmap.build_model(cfg, ds.channels, ds.num_classes)
state = d2l.replicate(d2l.create_train_state(cfg, model, ds.image_shape), N)
step = jax.pmap(d2l.train_step, axis_name="batch", devices=devices)
res = {"d2l's block (unrelated array)": [], "then the state's block": [], "whole epoch, state block": []}
for epoch in range(7):
    t0 = time.perf_counter()
    for X, y in d2l.get_dataloader(ds, cfg.batch_size, True, cfg.seed, epoch, 11):
        X, y = d2l.reshape_batch(np.array(X), np.array(y), N)
        state, loss = step(state, X, y)
    jax.random.normal(jax.random.PRNGKey(0), ()).block_until_ready()
    t1 = time.perf_counter()
    jax.block_until_ready(state)
    t2 = time.perf_counter()
    if epoch:
        res["d2l's block (unrelated array)"].append(t1 - t0); res["then the state's block"].append(t2 - t1); res["whole epoch, state block"].append(t2 - t0)
print(N, os.getloadavg()[0], {k: round(statistics.median(v), 3) for k, v in res.items()})
