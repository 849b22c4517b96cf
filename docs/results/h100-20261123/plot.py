"""The H100 figure of the README: training-loop and compute-only images/s per module, ResNet-18
at 32x32, global batch 512, one GPU (the throughput.json files of runs 2, 3 and 7).

    .venv/bin/python docs/results/h100-20261123/plot.py   # writes throughput.png beside it
"""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).parent
SETS = [  # (label, file)
    ("bf16, device pipeline", "run2-4d2b8b2/throughput-bf16"),
    ("bf16, host pipeline", "run2-4d2b8b2/throughput-bf16-host-pipeline"),
    ("bf16 + torch.compile", "run3-4d2b8b2/throughput-bf16-compile"),
    ("bf16 + torch.compile with CUDA graphs", "run7-dda7d26/throughput-bf16-reduce-overhead"),
    ("fp32 (TF32 off)", "run2-4d2b8b2/throughput-fp32"),
]
FRAMEWORKS = ["torch-ddp", "torch-dp", "jax-pmap", "jax-shard"]

fig, ax = plt.subplots(figsize=(10, 5.6))
width = 0.16
for i, (label, folder) in enumerate(SETS):
    table = json.loads((HERE / folder / "throughput.json").read_text())
    rows = {r["framework"]: r for r in table["rows"]}
    xs = [j + (i - (len(SETS) - 1) / 2) * width for j, fw in enumerate(FRAMEWORKS) if fw in rows]
    real = [rows[fw]["real_images_per_sec"] for fw in FRAMEWORKS if fw in rows]
    comp = [rows[fw]["compute_images_per_sec"] for fw in FRAMEWORKS if fw in rows]
    bars = ax.bar(xs, real, width * 0.9, label=f"{label}: training loop")
    ax.scatter(xs, comp, marker="_", s=300, color="black", zorder=3,
               label="compute-only loop (one resident batch)" if i == 0 else None)
    for x, r, c in zip(xs, real, comp):
        ax.text(x, r + 800, f"{r / 1000:.0f}k\n{r / c:.2f}", ha="center", fontsize=6)
ax.axhline(30_000, color="grey", ls=":", lw=1)
ax.text(3.55, 30_500, "30k target", fontsize=7, color="grey", ha="right")
ax.set_xticks(range(len(FRAMEWORKS)), FRAMEWORKS)
ax.set_ylabel("training images/s")
ax.set_title("ResNet-18, 32x32, global batch 512, 1x NVIDIA H100 80GB HBM3 (labels: k img/s, "
             "loop / compute-only)", fontsize=9)
ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.07), ncol=3)
ax.set_ylim(0, 90_000)
fig.tight_layout()
fig.savefig(HERE / "throughput.png", dpi=110)
print(HERE / "throughput.png")
