import sys, time, statistics
sys.path.insert(0, '/work/main')
from common.config import preset
n = int(sys.argv[2])
cfg = preset('digits', gpus=n, cache_dir='/tmp/exp/dispcache3')
from frameworks.jax_support import setup_process, cached_step
setup_process(cfg)
import jax, numpy as np
from jax.sharding import Mesh
from common.datasets import load_for
from common.pipeline import TrainLoader
import frameworks.jax_pmap as pm, frameworks.jax_shard as sh
fw = pm if sys.argv[1] == 'pmap' else sh
mesh = Mesh(np.array(jax.devices()[:n]), ('batch',))
ds = load_for(cfg)
model = fw.build_model(cfg, ds.channels, ds.num_classes)
loader = TrainLoader(ds, cfg.batch_size, cfg.seed, 0, 1, layout='NHWC')
state0 = fw.create_train_state(cfg, model, ds.image_shape, mesh, len(loader))
train, _ = fw.parallelize(cfg, mesh)
cached = cached_step(cfg, train, len(loader))
batches = [fw.to_device(b, mesh) for b in list(loader.epoch(0))[:8]]
def bench(f, reps=3):
    st = state0
    st, m = f(st, batches[0]); jax.block_until_ready(st)
    t = time.perf_counter()
    for _ in range(reps):
        for b in batches:
            st, m = f(st, b)
    jax.block_until_ready(st)
    return (time.perf_counter() - t) / (reps * len(batches)) * 1e3
ratios = []
for r in range(10):
    a = bench(train); b = bench(cached)
    if r % 2: b2 = bench(cached); a2 = bench(train); a, b = (a + a2) / 2, (b + b2) / 2
    ratios.append(a / b)
    print(f'round {r}: plain {a:.2f} ms, cached {b:.2f} ms, speed cached/plain {a/b:.3f}', flush=True)
print('median', round(statistics.median(ratios), 3))
