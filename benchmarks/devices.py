"""Device counts on the command line and the GPUs this machine has: shared by the benchmark
scripts (compare, throughput, comm_probe, tutorial_loops), so `--gpus` means one thing in all."""

from __future__ import annotations

import os
import re
import shutil
import subprocess


class UsageError(Exception):
    """Bad input found before any run starts; the message names the problem and the fix."""


def parse_gpus(text: str) -> list[int]:
    """'4' -> [1, 2, 4]; '6' -> [1, 2, 4, 6]; '1,2,3' -> [1, 2, 3]."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise UsageError(
            f"--gpus {text!r} is not a count or a list of counts; use e.g. --gpus 4 or --gpus 1,2,3"
        ) from None
    if not values or min(values) < 1:
        raise UsageError(
            f"--gpus {text} asks for {min(values, default=0)} devices; every device count must "
            "be >= 1 (e.g. --gpus 1)"
        )
    if "," in text:
        return sorted(set(values))
    n = values[0]
    return [2**k for k in range(n.bit_length()) if 2**k < n] + [n]


def detect_gpus() -> list[str]:
    """GPU names from `nvidia-smi -L` (honours CUDA_VISIBLE_DEVICES); [] without a working one."""
    if shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return []
    if out.returncode != 0:
        return []
    names = []
    for line in out.stdout.splitlines():
        m = re.match(r"GPU \d+: (.+?)(?: \(UUID: [^)]*\))?$", line.strip())
        if m:
            names.append(m.group(1))
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        names = names[: len([v for v in visible.split(",") if v.strip()])]
    return names
