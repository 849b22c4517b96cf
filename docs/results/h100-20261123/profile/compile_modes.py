"""torch-ddp's own loop at bf16 on one GPU (throughput preset, 512 per step): eager, --compile
(Inductor's default mode), and --compile with CUDA graphs (what mode="reduce-overhead" turns on).

    python3 docs/results/h100-20261123/profile/compile_modes.py eager|compile|cudagraphs OUT.json
"""

import sys
from pathlib import Path

import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from frameworks import torch_ddp  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
flags = [
    "--preset",
    "throughput",
    "--dataset",
    "synthetic",
    "--model",
    "resnet18",
    "--width",
    "1",
    "--image-size",
    "32",
    "--batch-size",
    "512",
    "--lr",
    "0.01",
    "--precision",
    "bf16",
    "--channels-last",
    "--gpus",
    "1",
    "--epochs",
    "6",
    "--max-steps-per-epoch",
    "16",
    "--output",
    out,
]
if mode != "eager":
    flags.append("--compile")
if mode == "cudagraphs":
    torch._inductor.config.triton.cudagraphs = True
sys.exit(torch_ddp.main(flags))
