"""torch.profiler over 16 steps of a torch trainer's own loop (epoch 2 of the throughput preset)
on a GPU: where the host spends a step, and whether it ever waits for the device.

    python3 docs/results/h100-20261123/profile/torch_loop_profile.py torch-dp OUT [flags]
"""

import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
sys.path.insert(0, str(Path(__file__).parent))
from work import WORK  # noqa: E402

from frameworks import torch_ddp, torch_dp  # noqa: E402

name, out = sys.argv[1], Path(sys.argv[2])
out.mkdir(parents=True, exist_ok=True)
module = {"torch-dp": torch_dp, "torch-ddp": torch_ddp}[name]
original = module.train_step
FIRST, LAST = 17, 32  # the second epoch's 16 steps (16 per epoch)
calls = 0
prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])


def profiled_step(state, batch):
    global calls
    calls += 1
    if calls == FIRST:
        torch.cuda.synchronize()
        prof.__enter__()
        profiled_step.t0 = time.perf_counter()
    result = original(state, batch)
    if calls == LAST:
        torch.cuda.synchronize()
        wall = time.perf_counter() - profiled_step.t0
        prof.__exit__(None, None, None)
        avg = prof.key_averages()
        cpu = avg.table(sort_by="self_cpu_time_total", row_limit=40)
        (out / f"{name}-cpu.txt").write_text(cpu)
        gpu = avg.table(sort_by="self_device_time_total", row_limit=25)
        (out / f"{name}-cuda.txt").write_text(gpu)
        # The GPU's own work (kernels, memsets, copies), not the GPU-side ranges of the
        # profiler's user annotations (DataParallel.forward, Optimizer.step), which span them.
        kernels = [
            e
            for e in prof.events()
            if e.device_type == torch.autograd.DeviceType.CUDA
            and not getattr(e, "is_user_annotation", False)
        ]
        busy = sum(e.time_range.elapsed_us() for e in kernels) / 1e6
        steps = LAST - FIRST + 1
        summary = (
            f"{name}: {steps} steps in {wall:.4f} s wall (profiled), GPU operations "
            f"{busy:.4f} s ({busy / wall:.2f} of the wall), {len(kernels) / steps:.0f} "
            f"GPU operations (kernels, memsets, copies) per step"
        )
        print(summary)
        (out / f"{name}-summary.txt").write_text(summary + "\n")
        prof.export_chrome_trace(str(out / f"{name}-trace.json"))
    return result


module.train_step = profiled_step
flags = [*WORK, "--epochs", "3"]
sys.exit(module.main(flags + sys.argv[3:]))
