"""torch-ddp's own loop at bf16 on one GPU (throughput preset, 512 per step): eager, --compile
(Inductor's default mode), and --compile with CUDA graphs (what mode="reduce-overhead" turns on).

    python3 docs/results/h100-20261123/profile/compile_modes.py eager|compile|cudagraphs OUT.json
"""

import sys
from pathlib import Path

import torch._inductor.config

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
sys.path.insert(0, str(Path(__file__).parent))
from work import WORK  # noqa: E402

from frameworks import torch_ddp  # noqa: E402

mode, out = sys.argv[1], sys.argv[2]
flags = [*WORK, "--epochs", "6", "--output", out]
if mode != "eager":
    flags.append("--compile")
if mode == "cudagraphs":
    torch._inductor.config.triton.cudagraphs = True
sys.exit(torch_ddp.main(flags))
