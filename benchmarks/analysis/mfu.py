"""`python -m benchmarks.analysis.mfu TABLE...`: model FLOP utilisation of throughput tables.

MFU = images/s x FLOP per training image / the device's peak FLOP/s: how much of the GPU's
arithmetic the loop keeps busy with the model's own work. Reads benchmarks.throughput's
throughput.json files (one per global batch, as gpu_suite.sh's step 9 writes them) and writes
one table, a row per (framework, global batch), with the real loop's and the compute-only step's
images/s and MFU, to --out DIR (mfu.md and mfu.json) and stdout.

The defaults are ResNet-18 at 32x32 in bf16 on one H100 or H200:
- --gflop-per-image 3.33: forward and backward of one 32x32 image through ResNet-18 (width 1),
  counted with torch.utils.flop_counter.FlopCounterMode on the H200 (2026-11-27): convolutions
  and the final matmul, 2 FLOP per multiply-add; BN, ReLU and the optimiser are not counted.
- --peak-tflops 989: the H100/H200 SXM dense bf16 tensor-core peak (NVIDIA's data sheets; 1979
  is the figure with 2:4 sparsity). Per device: the table's images/s are divided by its device
  count.

Bad input (a file that is missing, not a table, or of another model or image size than the
FLOP count) is one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from benchmarks import harness
from common.results import write_json_atomic

PROG = "python -m benchmarks.analysis.mfu"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0])
    p.add_argument("tables", nargs="+", type=Path, metavar="TABLE", help="throughput.json files")
    harness.add_numbers(
        p,
        ("--gflop-per-image", float, 3.33,
         "training FLOP per image, in GFLOP (default 3.33: ResNet-18, 32x32)"),
        ("--peak-tflops", float, 989.0,
         "the device's peak, TFLOP/s (default 989: H100/H200 dense bf16)"),
        ("--model", str, "resnet18", "the model the FLOP count is for; another's table is refused"),
        ("--image-size", int, 32, "likewise (default 32)"),
    )  # fmt: skip
    p.add_argument("--out", type=Path, help="write mfu.md and mfu.json into this folder")
    return p  # fmt: skip


def mfu(
    images_per_sec: float | None, devices: int, gflop: float, peak_tflops: float
) -> float | None:
    """The fraction of `devices` x the peak that `images_per_sec` x `gflop` is (None: no
    measurement)."""
    if images_per_sec is None or images_per_sec <= 0:
        return None
    return images_per_sec * gflop * 1e9 / (devices * peak_tflops * 1e12)


def rows_of(ns: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    for path in ns.tables:
        table = harness.read_throughput(path)
        s = table["settings"]
        if (s["model"], s["image_size"], s["width"]) != (ns.model, ns.image_size, 1.0):
            raise harness.UsageError(
                f"{path}: a table of {s['model']} at width {s['width']}, {s['image_size']}x"
                f"{s['image_size']}, where the FLOP count is for {ns.model} at width 1, "
                f"{ns.image_size}x{ns.image_size}; give --model, --image-size and "
                "--gflop-per-image of its model"
            )
        for r in table["rows"]:
            real, compute = r.get("real_images_per_sec"), r.get("compute_images_per_sec")
            rows.append(dict(
                framework=r["framework"], mode=r.get("mode") or "", devices=r["devices"],
                global_batch=r["global_batch"], precision=s["precision"],
                status=r.get("status") or "", real_images_per_sec=real,
                compute_images_per_sec=compute,
                real_mfu=mfu(real, r["devices"], ns.gflop_per_image, ns.peak_tflops),
                compute_mfu=mfu(compute, r["devices"], ns.gflop_per_image, ns.peak_tflops),
                table=str(path),
            ))  # fmt: skip
    return sorted(rows, key=lambda r: (r["framework"], r["global_batch"]))


def markdown(rows: list[dict[str, Any]], ns: argparse.Namespace) -> str:
    head = ["framework", "mode", "devices", "global batch", "precision", "real img/s", "real MFU",
            "compute-only img/s", "compute-only MFU"]  # fmt: skip
    body = [[r["framework"], r["mode"], str(r["devices"]), str(r["global_batch"]), r["precision"],
             harness.cell(r["real_images_per_sec"], ",.0f"), harness.cell(r["real_mfu"], ".1%"),
             harness.cell(r["compute_images_per_sec"], ",.0f"),
             harness.cell(r["compute_mfu"], ".1%")] for r in rows]  # fmt: skip
    return (
        f"MFU = images/s x {ns.gflop_per_image} GFLOP per training image / "
        f"{ns.peak_tflops:g} TFLOP/s per device\n\n"
        + harness.markdown_table(head, body, "llrrlrrrr")
        + "\n"
    )


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    if not (ns.gflop_per_image > 0 and ns.peak_tflops > 0):
        print(f"{PROG}: error: --gflop-per-image and --peak-tflops must be above 0",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        rows = rows_of(ns)
    except harness.UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    text = markdown(rows, ns)
    print(text, end="")
    if ns.out:
        ns.out.mkdir(parents=True, exist_ok=True)
        settings = {"gflop_per_image": ns.gflop_per_image, "peak_tflops": ns.peak_tflops}
        write_json_atomic(ns.out / "mfu.json", {"settings": settings, "rows": rows})
        harness.write_atomic(ns.out / "mfu.md", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
