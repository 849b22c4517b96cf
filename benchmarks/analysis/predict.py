"""`python -m benchmarks.analysis.predict`: a PREDICTED step time and scaling efficiency.

Nothing is measured here. From a 1-device measurement (a step time, or a breakdown of it), the
gradient bytes as the chosen framework sends them and a description of the interconnect, it
predicts the step time, images/s and weak or strong scaling efficiency for N = 1..64 (#30, items
3 and 4). Every output says "predicted" and echoes every input. The model (step = host + input
wait + compute + the exposed part of the framework's collectives, each a ring all-reduce), the
presets and `--validate` (the model against published multi-GPU measurements, nothing fitted to
them): docs/scaling.md.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from benchmarks import harness
from benchmarks.harness import UsageError
from common.init import TRAINABLE, parameter_spec, trainable_sizes
from common.results import write_json_atomic

PROG = "python -m benchmarks.analysis.predict"
MIB = 1024 * 1024

# ---- links ----


@dataclass(frozen=True)
class Link:
    """One interconnect: nccl-tests' bus bandwidth of a large all-reduce, and α."""

    busbw_gbps: float  # GB/s (1e9 bytes/s), per GPU (intra-node) or per NIC (inter-node)
    latency_us: float  # α: one step of a ring (a send and a receive between neighbours)
    what: str
    source: str


# Sources (stored copies consulted 2026-11; URLs as published):
# [alaya]  https://docs.alayanew.com/en/docs/tech-blog/2026-05-06-nccl-tests : all_reduce_perf
#          busbw at large sizes: 8xH100 SXM5 NVLink 460-480 GB/s, 8xA100 SXM4 NVLink 230-250,
#          8xH100 PCIe (no NVSwitch, PCIe Gen5) 35-45.
# [n1639]  https://github.com/NVIDIA/nccl/issues/1639 : 8 RTX 5090 on PCIe Gen5, busbw 28 GB/s
#          (8 GPUs) and 35 (4 GPUs); NCCL's maintainer: on PCIe the CPU and memory set the limit.
# [n1984]  https://github.com/NVIDIA/nccl/issues/1984 : 4 H800 over NVLink, ring all-reduce of
#          1 KiB without CUDA graphs 3.5 us = 2(N-1) = 6 ring steps -> 0.6 us a step.
# [pcie2]  https://pastebin.com/ne4ipn6K : all_reduce_perf, 2 RTX 4070 Ti SUPER on PCIe, 8 bytes
#          6.2 us = 2 ring steps -> 3.1 us a step.
# [n412]   https://github.com/NVIDIA/nccl/issues/412 (sjeaugey): ~24 GB/s busbw inter-node per
#          200 Gb/s HDR NIC; [n1576] https://github.com/NVIDIA/nccl/issues/1576 quotes 192 GB/s
#          on DGX A100 with 8 HDR NICs (24 a NIC); [n307] https://github.com/NVIDIA/nccl/issues/307
#          and https://github.com/NVIDIA/nccl-tests/issues/29: ~12 GB/s per 100 Gb/s EDR NIC with
#          rings, 47-48 GB/s on DGX-1 (4 NICs).
# Where no busbw was found, nominal rate x an efficiency taken from a published pair:
# NVLink 0.77 (A100: 230 of its nominal 300 GB/s), PCIe 0.55 (H100 PCIe Gen5: 35 of 63 GB/s),
# InfiniBand 0.96 (HDR: 24 of 25 GB/s). Each preset takes the LOW end of its published range.
NVLINK_EFF = 230 / 300
PCIE_EFF = 35 / 63
IB_EFF = 24 / 25
ALPHA_NVLINK = 0.6  # us, [n1984]
ALPHA_PCIE = 3.1  # us, [pcie2]
ALPHA_IB = 5.0  # us: ASSUMED (no published per-step figure found; one IB hop is a few us)

PRESETS: dict[str, Link] = {
    "h100-nvlink": Link(460, ALPHA_NVLINK, "H100 SXM5, NVLink4 through NVSwitch (DGX/HGX H100)",
                        "[alaya] 460-480 GB/s for 8 GPUs; alpha [n1984]"),
    "a100-nvlink": Link(230, ALPHA_NVLINK, "A100 SXM4, NVLink3 through NVSwitch (DGX A100)",
                        "[alaya] 230-250 GB/s for 8 GPUs; alpha [n1984]"),
    "v100-nvlink": Link(round(150 * NVLINK_EFF, 1), ALPHA_NVLINK,
                        "V100 SXM2, NVLink2 hybrid cube mesh (DGX-1V): 6 links x 25 GB/s",
                        "nominal 150 GB/s x 0.77 (A100's published ratio); alpha [n1984]"),
    "pcie5": Link(35, ALPHA_PCIE, "PCIe Gen5 x16, no NVLink (e.g. 8 H100 PCIe)",
                  "[alaya] 35-45 GB/s for 8 H100 PCIe ([n1639]: 28-35); alpha [pcie2]"),
    "pcie4": Link(round(31.5 * PCIE_EFF, 1), ALPHA_PCIE, "PCIe Gen4 x16, no NVLink",
                  "nominal 31.5 GB/s x 0.55 (pcie5's published ratio); alpha [pcie2]"),
    "pcie3": Link(round(15.75 * PCIE_EFF, 1), ALPHA_PCIE, "PCIe Gen3 x16, no NVLink",
                  "nominal 15.75 GB/s x 0.55 (pcie5's published ratio); alpha [pcie2]"),
}  # fmt: skip
INTER_NODE: dict[str, Link] = {
    "ib-edr": Link(12, ALPHA_IB, "InfiniBand EDR 100 Gb/s, per NIC", "[n307]; alpha assumed"),
    "ib-hdr": Link(24, ALPHA_IB, "InfiniBand HDR 200 Gb/s, per NIC",
                   "[n412], [n1576]; alpha assumed"),
    "ib-ndr": Link(round(50 * IB_EFF), ALPHA_IB, "InfiniBand NDR 400 Gb/s, per NIC",
                   "nominal 50 GB/s x 0.96 (HDR's published ratio); alpha assumed"),
}  # fmt: skip


def ring_allreduce_ms(nbytes: float, n: int, busbw_gbps: float, latency_us: float) -> float:
    """t = 2(N-1)·α + 2(N-1)/N · S/B: a ring all-reduce of `nbytes` over `n` ranks, in ms."""
    if n <= 1:
        return 0.0
    return 2 * (n - 1) * latency_us * 1e-3 + 2 * (n - 1) / n * nbytes / (busbw_gbps * 1e9) * 1e3


def link_at(n: int, gpus_per_node: int, intra: Link, inter: Link, nics_per_node: int) -> Link:
    """The link a flat ring over `n` GPUs runs at: the intra-node link within one node; beyond
    it a ring through every node, as fast as its slowest hop (the node's NICs together, each
    ring on its own NIC as NCCL does) and paying the slower α at every step. NCCL's trees cut
    that latency to ~log N at large N: the ring's latency term then overstates."""
    if n <= gpus_per_node:
        return intra
    return Link(
        min(intra.busbw_gbps, nics_per_node * inter.busbw_gbps),
        max(intra.latency_us, inter.latency_us),
        f"ring over {math.ceil(n / gpus_per_node)} nodes",
        "slowest of the intra-node link and the node's NICs",
    )


# ---- models ----


def conv(cin: int, cout: int, k: int) -> int:
    return cin * cout * k * k


def resnet18_cifar(num_classes: int = 10, width: float = 1.0, in_channels: int = 3) -> list[int]:
    """frameworks/torch_models.py's ResNet18 (3x3 stride-1 stem, basic blocks 64..512 x 2, each
    x width), its parameter tensors' sizes in the order model.parameters() lists them (the
    layout every framework loads its initial state in: common/init.parameter_spec)."""
    return trainable_sizes(parameter_spec("resnet18", width, in_channels, num_classes))


def wideresnet(num_classes: int = 10, width: float = 1.0, in_channels: int = 3) -> list[int]:
    """frameworks/torch_models.py's WideResNet (the NVIDIA course's): stem 16, six blocks."""
    return trainable_sizes(parameter_spec("wideresnet", width, in_channels, num_classes))


def resnet50_v15(num_classes: int = 1000) -> list[int]:
    """torchvision's resnet50 (= ResNet-50 v1.5, the model of NVIDIA's DeepLearningExamples)."""
    sizes, cin = [conv(3, 64, 7), 64, 64], 64
    for w, blocks in zip((64, 128, 256, 512), (3, 4, 6, 3)):
        for b in range(blocks):
            sizes += [conv(cin, w, 1), w, w, conv(w, w, 3), w, w, conv(w, 4 * w, 1), 4 * w, 4 * w]
            sizes += [conv(cin, 4 * w, 1), 4 * w, 4 * w] if b == 0 else []
            cin = 4 * w
    return sizes + [2048 * num_classes, num_classes]


def resnet18_mxnet_v2(num_classes: int = 1000) -> list[int]:
    """apache/mxnet example/image-classification/symbols/resnet.py at 3x32x32, num_layers=18
    (issue 14516): pre-activation units, a 3x3 stride-1 stem (height <= 32), every stage's first
    unit with a 1x1 shortcut conv, bn_data in front; the arguments in the symbol's order."""
    sizes, cin = [3, 3, conv(3, 64, 3)], 64  # bn_data gamma, beta; conv0
    for w in (64, 128, 256, 512):
        for u in range(2):
            sizes += [cin, cin, conv(cin, w, 3), w, w, conv(w, w, 3)]
            sizes += [conv(cin, w, 1)] if u == 0 else []  # stageN_unit1_sc
            cin = w
    return sizes + [512, 512, 512 * num_classes, num_classes]  # bn1; fc1


@dataclass(frozen=True)
class Model:
    tensors: tuple[int, ...]  # parameter tensors' element counts, in parameter order
    input_shape: tuple[int, int, int]  # (C, H, W): nn.DataParallel scatters float32 inputs
    num_classes: int
    what: str


MODELS: dict[str, Model] = {
    "resnet18": Model(tuple(resnet18_cifar()), (3, 32, 32), 10,
                      "ResNet-18 CIFAR variant, 10 classes (frameworks/torch_models.py)"),
    "wideresnet": Model(tuple(wideresnet()), (3, 32, 32), 10,
                        "WideResNet of the NVIDIA course, 10 classes (frameworks/torch_models.py)"),
    "resnet50": Model(tuple(resnet50_v15()), (3, 224, 224), 1000,
                      "ResNet-50 v1.5, 1000 classes (torchvision layout)"),
    "resnet18-mxnet": Model(tuple(resnet18_mxnet_v2()), (3, 32, 32), 1000,
                            "MXNet example ResNet-18 v2 at 32x32, 1000 classes (issue 14516)"),
}  # fmt: skip
GRAD_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}

# ---- collectives ----

DDP_FIRST_BUCKET = 1 * MIB  # torch.distributed._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_CAP = 25 * MIB  # DistributedDataParallel(bucket_cap_mb=25), MiB
XLA_COMBINE_THRESHOLD = 30 * MIB + 7  # xla/service/collective_utils.h kDefaultAllReduceCombine..
# Sharded data parallelism: the params all-gathered before the forward (and again before the
# backward where a unit reshards after its forward: FSDP2's default) and the grads reduce-
# scattered, per unit; the gathers each step makes (common/footprint.py, the same counts).
FSDP_GATHERS = {"torch-fsdp": 2, "torch-fsdp+no-reshard": 1, "jax-fsdp": 1}
FRAMEWORKS = ("torch-ddp", "torch-dp", "jax-pmap", "jax-shard", "jax-shardmap", "mxnet-gluon",
              *FSDP_GATHERS)  # fmt: skip


def ddp_buckets(sizes: Sequence[int], first: int = DDP_FIRST_BUCKET, cap: int = DDP_BUCKET_CAP):
    """DDP's buckets (bytes) from the second step on, after the Reducer rebuilds them in the
    order the gradients became ready (assumed: the reverse of the parameters' order): a bucket
    closes once it holds >= its limit, 1 MiB for the first, 25 MiB for every later one."""
    buckets, current, limit = [], 0, first
    for nbytes in reversed(sizes):
        current += nbytes
        if current >= limit:
            buckets.append(current)
            current, limit = 0, cap
    return buckets + ([current] if current else [])


def xla_combined(sizes: Sequence[int], threshold: int = XLA_COMBINE_THRESHOLD) -> list[int]:
    """XLA's all-reduce combiner: consecutive gradients (backward order) joined while the
    group stays within the threshold (30 MiB + 7 bytes by default)."""
    groups: list[int] = []
    for nbytes in reversed(sizes):
        if groups and groups[-1] + nbytes <= threshold:
            groups[-1] += nbytes
        else:
            groups.append(nbytes)
    return groups


def fsdp_units(model: str, sizes: Sequence[int]) -> list[int]:
    """torch-fsdp's units (bytes each, forward order): one per residual block and the rest
    (stem, head) as the root's, first (frameworks/torch_fsdp.py, as torchtitan wraps)."""
    if model not in ("resnet18", "wideresnet"):
        raise UsageError(f"torch-fsdp's units are modelled for resnet18 or wideresnet, not {model}")
    names = [n for n, _, kind in parameter_spec(model, 1.0, 3, 10) if kind in TRAINABLE]
    units: dict[str, int] = {}
    for name, nbytes in zip(names, sizes, strict=True):
        block = ".".join(name.split(".")[:2]) if name.startswith("layer") else ""
        units[block] = units.get(block, 0) + nbytes
    return [units.pop(""), *units.values()]


def messages(framework: str, sizes: Sequence[int], model: str = "resnet18") -> list[int]:
    """The all-reduces (bytes each, in the order they run) a framework's step makes; for the
    sharded ones (FSDP_GATHERS) the units each all-gathered and reduce-scattered; torch-dp:
    none (dp_comm: copies through GPU 0)."""
    if framework == "torch-ddp":
        return ddp_buckets(sizes)
    if framework.startswith("jax-"):  # jax-fsdp: XLA's combiner joins the units
        return xla_combined(sizes)
    if framework == "mxnet-gluon":  # kvstore "device": one pushpull per parameter key
        return list(reversed(sizes))
    return fsdp_units(model, sizes) if framework.startswith("torch-fsdp") else []


@dataclass(frozen=True)
class Comm:
    total_ms: float
    last_ms: float  # the last collective: starts when the backward ends, can never hide
    count: int  # collectives per step
    nbytes: int  # bytes the collectives carry (gradients; DP: + inputs and outputs)
    how: str


def allreduce_comm(msgs: Sequence[int], n: int, link: Link) -> Comm:
    times = [ring_allreduce_ms(m, n, link.busbw_gbps, link.latency_us) for m in msgs]
    return Comm(sum(times), times[-1] if times else 0.0, len(msgs), int(sum(msgs)), "all-reduce")


def sharded_comm(units: Sequence[int], gathers: int, n: int, link: Link) -> Comm:
    """Every unit all-gathered `gathers` times and reduce-scattered once (backward order): on a
    ring each costs half an all-reduce of the unit's full bytes, (N-1)·α + (N-1)/N · S/B."""
    half = [ring_allreduce_ms(u, n, link.busbw_gbps, link.latency_us) / 2 for u in units]
    times = half * gathers + half[::-1]
    how = f"all-gather x{gathers} + reduce-scatter per unit"
    nbytes = (gathers + 1) * sum(units)
    return Comm(sum(times), times[-1] if times else 0.0, len(times), nbytes, how)


def dp_comm(grad_bytes: int, input_bytes: int, output_bytes: int, n: int, link: Link) -> Comm:
    """nn.DataParallel, all through GPU 0, one after another (nothing overlaps): scatter the
    inputs ((N-1)/N of the batch, N-1 copies), broadcast the parameters (replicate) and reduce-
    add the gradients, each t = S/B + (N-1)·α (nccl-tests: broadcast and reduce move S through
    the root's link), gather the outputs. The N-thread host side (one Python process driving
    N replicas under the GIL) is not modelled."""
    if n <= 1:
        return Comm(0.0, 0.0, 0, 0, "none")

    def copy_ms(nbytes: float) -> float:
        return (n - 1) * link.latency_us * 1e-3 + nbytes / (link.busbw_gbps * 1e9) * 1e3

    share = (n - 1) / n
    parts = [copy_ms(share * input_bytes), copy_ms(grad_bytes), copy_ms(share * output_bytes)]
    reduce_ms = copy_ms(grad_bytes)
    total = sum(parts) + reduce_ms
    nbytes = int(share * (input_bytes + output_bytes)) + 2 * grad_bytes
    return Comm(total, reduce_ms, 4, nbytes, "scatter + broadcast + gather + reduce via GPU 0")


# ---- step ----


@dataclass(frozen=True)
class Breakdown:
    """A 1-device step and what it is made of (ms per step). The JSON that --breakdown reads has
    these keys; only step_ms and batch are required (docs/scaling.md, 'breakdown schema')."""

    step_ms: float  # wall time of one 1-device training step
    batch: int  # the per-device batch of that step
    compute_ms: float | None = None  # forward + backward + optimiser on the device; default:
    # step_ms - input_wait_ms (everything but waiting for data scales with the batch)
    backward_ms: float | None = None  # default: 2/3 of compute_ms (backward ~ 2x forward FLOPs)
    input_wait_ms: float = 0.0  # waiting for the next batch (per device, linear in its batch)
    comm_ms: float | None = None  # a MEASURED multi-device step's collectives, with
    exposed_comm_ms: float | None = None  # the part of them not hidden: gives the overlap
    source: str = ""

    @property
    def compute(self) -> float:
        return self.compute_ms if self.compute_ms is not None else self.step_ms - self.input_wait_ms

    @property
    def backward(self) -> float:
        return self.backward_ms if self.backward_ms is not None else 2 / 3 * self.compute

    @property
    def host_ms(self) -> float:
        """What is neither compute nor input wait (the loop's own host time): per step, does not
        scale with the batch."""
        return self.step_ms - self.compute - self.input_wait_ms


BREAKDOWN_KEYS = {f.name for f in Breakdown.__dataclass_fields__.values()}

OVERLAP = {  # framework -> (the fraction of the backward that can hide communication, why)
    "torch-ddp": (0.5, "DDP all-reduces each bucket once its gradients are ready, during "
                  "backward(); ASSUMED (conservative, not measured): at most half the backward "
                  "hides it"),
    "mxnet-gluon": (0.5, "the engine runs each key's pushpull (priority -index) as soon as its "
                    "gradient is written; the same assumption as DDP's"),
    "jax-pmap": (0.0, "XLA combines the gradients into <= 30 MiB all-reduces and, with its "
                 "latency-hiding scheduler off by default, runs them after the backward"),
    "torch-dp": (0.0, "nn.DataParallel broadcasts before the forward and reduce-adds after the "
                 "whole backward"),
    "torch-fsdp": (0.5, "FSDP2 prefetches the next unit's all-gather during this one's compute "
                   "and reduce-scatters each unit once its backward is done; the same "
                   "assumption as DDP's (the forward's gathers count against the same bound)"),
    "jax-fsdp": (0.0, "XLA combines the gathers and reduce-scatters (<= 30 MiB each) and, with "
                 "its latency-hiding scheduler off by default, runs them apart from compute; "
                 "ASSUMED: one gather, kept for the backward"),
}  # fmt: skip
OVERLAP["jax-shard"] = OVERLAP["jax-shardmap"] = OVERLAP["jax-fsdp"] = OVERLAP["jax-pmap"]
OVERLAP["torch-fsdp+no-reshard"] = OVERLAP["torch-fsdp"]


def overlap_for(framework: str, bd: Breakdown, given: float | None) -> tuple[float, str]:
    """(overlap, where it comes from): --overlap, else a measured breakdown's (comm - exposed)
    / backward, else the framework's default."""
    if given is not None:
        return given, "given (--overlap)"
    if bd.comm_ms is not None and bd.exposed_comm_ms is not None:
        hidden = max(0.0, bd.comm_ms - bd.exposed_comm_ms)
        return min(1.0, hidden / bd.backward), "from a measured breakdown"
    return OVERLAP[framework][0], f"default: {OVERLAP[framework][1]}"


def exposed_ms(comm: Comm, hideable_ms: float) -> float:
    """The communication left on the step: what the hideable backward time cannot cover, and
    never less than the last collective."""
    return min(comm.total_ms, max(comm.total_ms - hideable_ms, comm.last_ms))


@dataclass(frozen=True)
class Setup:
    framework: str
    model: str
    grad_dtype: str
    intra: str  # a PRESETS name, or "custom"
    intra_link: Link
    inter_link: Link
    gpus_per_node: int = 8
    nics_per_node: int = 1
    overlap: float | None = None  # None: overlap_for decides


def step_comm(s: Setup, n: int, per_device_batch: float, model: Model | None = None) -> Comm:
    """The step's communication at `n` devices; `model`: its tensors (default MODELS[s.model])."""
    model = model or MODELS[s.model]
    grad = [t * GRAD_BYTES[s.grad_dtype] for t in model.tensors]
    link = link_at(n, s.gpus_per_node, s.intra_link, s.inter_link, s.nics_per_node)
    if s.framework == "torch-dp":
        c, h, w = model.input_shape
        inputs = n * per_device_batch * c * h * w * 4  # float32 images of the global batch
        outputs = n * per_device_batch * model.num_classes * 4  # float32 logits
        return dp_comm(sum(grad), int(inputs), int(outputs), n, link)
    msgs = messages(s.framework, grad, s.model)
    if s.framework in FSDP_GATHERS:
        return sharded_comm(msgs, FSDP_GATHERS[s.framework], n, link)
    return allreduce_comm(msgs, n, link)


def predict(
    bd: Breakdown, s: Setup, n: int, per_device_batch: float, model: Model | None = None
) -> dict[str, Any]:
    """One predicted row: the step at `n` devices of `per_device_batch` images each. Compute,
    backward and input wait scale linearly with the per-device batch (this overstates small
    batches' speed: below a few hundred 32x32 images a GPU is launch-bound); host time does not."""
    if s.framework == "torch-dp" and n > s.gpus_per_node:
        return {"devices": n, "per_device_batch": per_device_batch, "note": "n/a: one process"}
    scale = per_device_batch / bd.batch
    overlap, _ = overlap_for(s.framework, bd, s.overlap)
    comm = step_comm(s, n, per_device_batch, model)
    hidden_room = overlap * bd.backward * scale
    exposed = exposed_ms(comm, hidden_room) if n > 1 else 0.0
    step = bd.host_ms + (bd.compute + bd.input_wait_ms) * scale + exposed
    return {
        "devices": n, "per_device_batch": per_device_batch, "step_ms": step,
        "images_per_sec": n * per_device_batch / step * 1e3, "comm_ms": comm.total_ms,
        "exposed_comm_ms": exposed, "collectives": comm.count, "comm_bytes": comm.nbytes,
    }  # fmt: skip


def curve(bd: Breakdown, s: Setup, ns: Sequence[int], scaling: str, global_batch: float):
    """Predicted rows for every N; efficiency = images/s over N x the 1-device images/s (weak:
    = step(1)/step(N))."""
    one = predict(bd, s, 1, bd.batch if scaling == "weak" else global_batch)
    rows = []
    for n in ns:
        b = bd.batch if scaling == "weak" else global_batch / n
        row = predict(bd, s, n, b)
        if "step_ms" in row:
            row["efficiency"] = row["images_per_sec"] / (n * one["images_per_sec"])
        rows.append(row)
    return rows


# ---- validation ----


@dataclass(frozen=True)
class Published:
    """A published multi-GPU measurement. The prediction reads ONLY images_per_sec[1], batch,
    model, grad_dtype, framework and link: nothing in it is a per-row constant."""

    name: str
    framework: str
    model: str
    grad_dtype: str
    batch: int  # per GPU at 1 GPU; weak: per GPU at every N, strong: the global batch
    scaling: str
    link: str
    images_per_sec: dict[int, float]
    source: str
    left_out: str
    why: str = ""  # why this framework, dtype, scaling and link


DLE = (
    "https://github.com/NVIDIA/DeepLearningExamples/blob/master/PyTorch/Classification/"
    "ConvNets/resnet50v1.5/README.md (Training performance; batch per GPU from configs.yml)"
)
ISSUE = "https://github.com/apache/mxnet/issues/14516 (batch 256, kv_store device, float16)"
DLE_LEFT_OUT = (
    "the input pipeline (8 data loaders decoding ImageNet JPEGs on one host's CPUs), host "
    "and launch time, clocks and power at 8 busy GPUs"
)
DLE_WHY = (
    "PyTorch DDP, default buckets; gradients fp32 (AMP keeps fp32 parameters); per-GPU batch "
    "fixed (weak scaling: the README's 'strong scaling' column is speed-up at a fixed per-GPU "
    "batch)"
)
PUBLISHED = (
    Published("DGX A100, ResNet-50 v1.5, TF32", "torch-ddp", "resnet50", "fp32", 256, "weak",
              "a100-nvlink", {1: 938, 8: 7248}, DLE, DLE_LEFT_OUT, DLE_WHY),
    Published("DGX A100, ResNet-50 v1.5, AMP", "torch-ddp", "resnet50", "fp32", 256, "weak",
              "a100-nvlink", {1: 2470, 8: 16621}, DLE, DLE_LEFT_OUT, DLE_WHY),
    Published("DGX-1 V100 16GB, ResNet-50 v1.5, FP32", "torch-ddp", "resnet50", "fp32", 112,
              "weak", "v100-nvlink", {1: 367, 8: 2855}, DLE, DLE_LEFT_OUT, DLE_WHY),
    Published("DGX-1 V100 16GB, ResNet-50 v1.5, AMP", "torch-ddp", "resnet50", "fp32", 256,
              "weak", "v100-nvlink", {1: 1200, 8: 8322}, DLE, DLE_LEFT_OUT, DLE_WHY),
    Published("MXNet #14516, ResNet-18 32x32, fp16, kvstore device", "mxnet-gluon",
              "resnet18-mxnet", "fp16", 256, "strong", "pcie3",
              {1: 6982.74, 2: 9908.78, 4: 9128.08}, ISSUE,
              "a global batch of 256 split into 128 and 64 images per GPU (launch-bound, not "
              "linear in the batch), one process's engine driving every GPU, the CPU data "
              "iterator; a throughput that FALLS from 2 to 4 GPUs is no communication cost",
              "train_imagenet.py's --batch-size is the whole batch, split across the GPUs by "
              "Module (strong scaling); the Module API pushes and pulls one kvstore key per "
              "parameter as Gluon does; fp16 gradients (the symbol casts the data to fp16); "
              "the issue names no GPU or interconnect: PCIe Gen3 ASSUMED (a 2019 4-GPU server)"),
)  # fmt: skip


def validate(rows: Sequence[Published] = PUBLISHED) -> list[dict[str, Any]]:
    """Predicted against published, per row and N: the default overlap of the row's framework
    and the no-overlap bound. 'explained' = the predicted loss of efficiency over the published
    loss (1 = the communication model accounts for all of it)."""
    out = []
    for p in rows:
        one = p.images_per_sec[1]
        bd = Breakdown(step_ms=p.batch / one * 1e3, batch=p.batch, source=p.source)
        base = Setup(p.framework, p.model, p.grad_dtype, p.link, PRESETS[p.link],
                     INTER_NODE["ib-hdr"])  # fmt: skip
        for n, published in sorted(p.images_per_sec.items()):
            if n == 1:
                continue
            pub_eff = published / (n * one)
            got = {}
            for tag, setup in (("default", base), ("no_overlap", replace(base, overlap=0.0))):
                row = curve(bd, setup, [n], p.scaling, p.batch)[0]
                loss = 1 - pub_eff
                got[tag] = {k: row[k] for k in ("images_per_sec", "efficiency", "exposed_comm_ms")}
                got[tag]["explained"] = (1 - row["efficiency"]) / loss if loss > 0 else None
            out.append({
                "name": p.name, "devices": n, "published_images_per_sec": published,
                "published_efficiency": pub_eff, "one_gpu_images_per_sec": one,
                "predicted": got["default"], "predicted_no_overlap": got["no_overlap"],
                "residual_pp": 100 * (got["default"]["efficiency"] - pub_eff),
                "overlap": overlap_for(p.framework, bd, base.overlap)[0],
                "framework": p.framework, "model": p.model, "grad_dtype": p.grad_dtype,
                "batch": p.batch, "scaling": p.scaling, "link": p.link,
                "link_busbw_gbps": PRESETS[p.link].busbw_gbps,
                "link_latency_us": PRESETS[p.link].latency_us,
                "source": p.source, "left_out": p.left_out, "why": p.why,
            })  # fmt: skip
    return out


def validation_markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "# Predicted against published multi-GPU throughput (the prediction is a model)", "",
        "Each prediction reads only the row's published 1-GPU images/s, the model's gradient "
        "tensors and the preset of that machine's interconnect; the overlap is the framework's "
        "default, the same for every row of a framework. No constant is fitted to these rows.", "",
    ]  # fmt: skip
    head = ["published row", "N", "published img/s (eff.)", "predicted img/s (eff.)", "residual",
            "comm. explains", "no-overlap bound: eff. (explains)"]  # fmt: skip
    body = []
    for r in rows:
        d, z = r["predicted"], r["predicted_no_overlap"]
        body.append([
            r["name"], str(r["devices"]),
            f"{r['published_images_per_sec']:,.0f} ({r['published_efficiency']:.1%})",
            f"{d['images_per_sec']:,.0f} ({d['efficiency']:.1%})", f"{r['residual_pp']:+.1f} pp",
            harness.cell(d["explained"], ".0%"),
            f"{z['efficiency']:.1%} ({harness.cell(z['explained'], '.0%')})",
        ])  # fmt: skip
    lines.append(harness.markdown_table(head, body, "lrrrrrr"))
    lines += ["", "## What each row's model uses, and what it leaves out", ""]
    rows_of: dict[tuple[str, ...], list[str]] = {}
    for r in rows:
        key = (r["framework"], r["model"], r["grad_dtype"], r["scaling"], r["why"], r["left_out"])
        link = f"{r['link']}: {r['link_busbw_gbps']:g} GB/s, α {r['link_latency_us']:g} us"
        name = f"{r['name']} ({link})"
        if name not in rows_of.setdefault(key, []):
            rows_of[key].append(name)
    for (fw, model, dtype, scaling, why, left_out), names in rows_of.items():
        lines.append(f"- **{'; '.join(names)}**: {fw}'s collectives (overlap {OVERLAP[fw][0]:g}), "
                     f"{model} with {dtype} gradients, {scaling} scaling. {why}. **Leaves out**: "
                     f"{left_out}.")  # fmt: skip
    sources = dict.fromkeys(r["source"] for r in rows)
    lines += ["", "Sources: " + "; ".join(sources) + "."]
    return "\n".join(lines) + "\n"


# ---- measured against predicted: a compare sweep ----

# cpu-simulated devices have no interconnect preset: they exchange gradients as copies between
# processes (torch-ddp: gloo over loopback TCP) or threads (JAX, MXNet) on one host. No compare
# record carries a measured all-reduce, so this link is an ASSUMPTION, named as one wherever it
# is used; `benchmarks.analysis.comm_probe` measures the real figure on a host (pass it as `link`).
HOST_LINK = Link(
    1.0,
    50.0,
    "cpu-simulated devices copy gradients between processes or threads of one host",
    "ASSUMED: a round figure, of the order benchmarks.analysis.comm_probe reports for 2 "
    "cpu-simulated devices (docs/results/cpu-2core-20261122/comm.md); not measured for this sweep",
)
GPU_LINK = "pcie4"  # a GPU sweep's records do not say how its GPUs are joined: ASSUMED


def default_link(device_kind: str) -> tuple[str, Link, str]:
    """(name, link, where it comes from) when the caller gives none: HOST_LINK for simulated
    devices, else the GPU_LINK preset; both ASSUMED."""
    if not device_kind.startswith("cuda"):
        return "host memory", HOST_LINK, HOST_LINK.source
    why = "ASSUMED: the records do not say how the GPUs are joined; preset " + GPU_LINK
    return GPU_LINK, PRESETS[GPU_LINK], f"{why} ({PRESETS[GPU_LINK].source})"


def model_of(record: dict[str, Any]) -> tuple[Model | None, str]:
    """The gradient tensors of the model a run trained (its model, width, input channels and
    classes, as frameworks/torch_models.py builds it) and a description; (None, why) when the
    model is not one predict knows or the record's parameter count says otherwise."""
    from types import SimpleNamespace

    from common.config import data_dims, image_side

    cfg = record.get("config") or {}
    name = record.get("model") or cfg.get("model")
    build = {"resnet18": resnet18_cifar, "wideresnet": wideresnet}.get(name or "")
    if build is None:
        return None, f"no gradient tensors modelled for model {name!r}"
    keys = ("dataset", "synthetic_channels", "synthetic_classes", "image_size")
    data: Any = SimpleNamespace(**{k: cfg.get(k) for k in keys})  # the fields Config reads
    channels, classes = data_dims(data)
    width = float(cfg.get("width") or 1.0)
    tensors = tuple(build(classes, width, channels))
    counted = record.get("params")
    if counted is not None and int(counted) != sum(tensors):
        return None, (
            f"the record counts {int(counted):,} parameters, the modelled {name} (width "
            f"{width:g}, {channels} channels, {classes} classes) {sum(tensors):,}"
        )
    side = image_side(data)
    what = f"{name}, width {width:g}, {channels}x{side}x{side} inputs, {classes} classes"
    return Model(tensors, (channels, side, side), classes, what), what


BREAKDOWN_PARTS = ("step_ms", "compute_ms", "input_wait_ms")  # what the prediction takes from one
ALL_COMPUTE = "no breakdown: the whole step is compute"


def one_device_breakdown(records: Sequence[dict[str, Any]]) -> tuple[Breakdown, str]:
    """The 1-device step of a cell's ok records: step = batch / median images/s (timed epochs).
    A measured "breakdown" gives compute and input wait (medians) as fractions of its own step,
    the rest host time; without one the whole step is compute. Its communication is not used
    (at 1 device nothing overlaps), so the framework's default overlap stays."""
    batch = int(records[0]["global_batch_size"])
    step = batch / statistics.median([float(r["images_per_sec"]) for r in records]) * 1e3
    measured = [r["breakdown"] for r in records if isinstance(r.get("breakdown"), dict)]
    timed = f"{len(records)} run(s)' timed epochs: {batch} / median images/s"
    all_compute = Breakdown(step_ms=step, batch=batch, source=f"{timed}; {ALL_COMPUTE}")
    if not measured:
        return all_compute, ""

    def med(key: str) -> float | None:
        xs = [float(b[key]) for b in measured if b.get(key) is not None]
        return statistics.median(xs) if xs else None

    bd_step, compute, wait = (med(k) for k in BREAKDOWN_PARTS)
    if not bd_step or compute is None:
        return all_compute, "breakdown without step_ms"
    share = step / bd_step  # the breakdown's parts, in proportion, on the timed step
    bd = replace(
        all_compute,
        compute_ms=compute * share,
        input_wait_ms=(wait or 0.0) * share,
        source=f"{timed}; compute and input wait in the proportions of the measured breakdown "
        f"({len(measured)} record(s): step {bd_step:.3f} ms, compute {compute:.3f} ms, input "
        f"wait {wait or 0.0:.3f} ms)",
    )
    try:
        check_breakdown(bd)
    except UsageError as exc:
        return all_compute, f"breakdown not used: {exc}"
    return bd, ""


def shared_cores(bd: Breakdown, k: float) -> Breakdown:
    """The same step with its compute (and backward) k times slower, host and input wait as
    they were: N cpu-simulated devices split the cores that the 1-device run used alone."""
    if k == 1:
        return bd
    return replace(bd, step_ms=bd.step_ms + bd.compute * (k - 1), compute_ms=bd.compute * k,
                   backward_ms=bd.backward * k)  # fmt: skip


SHARED_CORES = (
    "cpu-simulated: the N devices share the cores the 1-device run used alone (THREADS RULE, "
    "common/runtime.py), so each computes N x slower; host time and input wait as at 1 device"
)
OWN_DEVICE = "each GPU computes on its own, as fast as the 1-GPU run's"


def _cells(records: Sequence[dict[str, Any]]) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """ok records with a throughput, by row (the name compare ran them as) and device count."""
    cells: dict[str, dict[int, list[dict[str, Any]]]] = {}
    for r in records:
        if r.get("status") != "ok" or not all(
            r.get(k) for k in ("images_per_sec", "devices", "global_batch_size")
        ):
            continue
        if not math.isfinite(float(r["images_per_sec"])):  # as the report's own table drops it
            continue
        cells.setdefault(harness.row_key(r), {}).setdefault(int(r["devices"]), []).append(r)
    return cells


def measured_vs_predicted(
    records: Sequence[dict[str, Any]],
    link: tuple[str, Link, str] | None = None,
    overlap: float | None = None,
    grad_dtype: str = "fp32",
) -> list[dict[str, Any]]:
    """Measured and PREDICTED scaling efficiency, one row per (framework, N > 1) of compare's
    `records` with ok 1- and N-device runs. The prediction reads ONLY the 1-device records and
    the stated inputs (`link`: name, Link, source, default `default_link`, ASSUMED; `overlap`:
    default the framework's; our trainers' gradients are fp32); of an N-device record only its
    devices and global batch, never its time. Compute: SHARED_CORES or OWN_DEVICE."""
    out = []
    for key, by_n in _cells(records).items():
        if 1 not in by_n:
            continue
        ones = by_n[1]
        first = ones[0]
        framework, kind = first["framework"], first.get("device_kind") or ""
        bd, bd_note = one_device_breakdown(ones)
        model, model_what = model_of(first)
        blocked = [] if model else [model_what]
        if framework not in FRAMEWORKS:
            blocked.append(f"no collectives modelled for framework {framework!r}")
        name, lk, lk_source = link or default_link(kind)
        ips1 = statistics.median([float(r["images_per_sec"]) for r in ones])
        for n in sorted(m for m in by_n if m > 1):
            cell = by_n[n]
            global_batch = int(cell[0]["global_batch_size"])
            ips = statistics.median([float(r["images_per_sec"]) for r in cell])
            scaling = {bd.batch: "strong", bd.batch * n: "weak"}.get(global_batch, "")
            row: dict[str, Any] = {
                "framework": key, "mode": harness.mode_label(first.get("execution")),
                "devices": n, "scaling": scaling or f"neither (global batch {global_batch} at {n})",
                "device_kind": kind, "global_batch": global_batch,
                "per_device_batch": global_batch / n, "runs_one_device": len(ones),
                "runs": len(cell), "measured_one_device_images_per_sec": ips1,
                "measured_images_per_sec": ips, "measured_step_ms": global_batch / ips * 1e3,
                "measured_efficiency": ips / (n * ips1),
                **dict.fromkeys(("predicted_step_ms", "predicted_efficiency", "difference_pp")),
            }  # fmt: skip
            kinds = sorted({str(r.get("device_kind")) for r in cell})
            why = [*blocked]
            if kinds != [kind]:
                why.append(f"device kinds differ: {kind} at 1 device, {', '.join(kinds)} at {n}")
            if not scaling:
                why.append("neither weak nor strong scaling")
            row["note"] = "; ".join([bd_note, *why] if bd_note else why)
            if why or model is None:
                out.append(row)
                continue
            simulated = not kind.startswith("cuda")
            k = n if simulated else 1
            setup = Setup(framework, first.get("model") or "", grad_dtype, name, lk,
                          INTER_NODE["ib-ndr"], gpus_per_node=n, overlap=overlap)  # fmt: skip
            one = predict(bd, setup, 1, bd.batch, model)
            # gpus_per_node=n: one node, so even torch-dp gets a step (predict's "n/a" is beyond it)
            got = predict(shared_cores(bd, k), setup, n, global_batch / n, model)
            over, over_source = overlap_for(framework, bd, overlap)
            grads = [t * GRAD_BYTES[grad_dtype] for t in model.tensors]
            msgs = messages(framework, grads, setup.model)
            eff = got["images_per_sec"] / (n * one["images_per_sec"])
            row.update(
                predicted_step_ms=got["step_ms"], predicted_images_per_sec=got["images_per_sec"],
                predicted_efficiency=eff, difference_pp=100 * (row["measured_efficiency"] - eff),
                predicted_comm_ms=got["comm_ms"], predicted_exposed_comm_ms=got["exposed_comm_ms"],
                inputs={
                    "one_device": {**asdict(bd), "compute_ms": bd.compute,
                                   "backward_ms": bd.backward, "host_ms": bd.host_ms},
                    "compute_factor": k,
                    "compute_factor_source": SHARED_CORES if simulated else OWN_DEVICE,
                    "link": {"name": name, "busbw_gbps": lk.busbw_gbps,
                             "latency_us": lk.latency_us, "what": lk.what, "source": lk_source},
                    "overlap": over, "overlap_source": over_source, "model": model_what,
                    "grad_dtype": grad_dtype, "grad_bytes": sum(grads),
                    "collectives": got["collectives"], "collective_bytes": msgs,
                    "comm_bytes": got["comm_bytes"],
                },
            )  # fmt: skip
            out.append(row)
    return out


# ---- measured against predicted: benchmarks.report's section and plot ----

SECTION_TITLE = "Measured and predicted scaling efficiency"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f} ms"


def _bytes(n: float) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def section(records: list[dict[str, Any]], is_busy: Callable[[dict[str, Any]], bool]) -> list[str]:
    """benchmarks.report's Markdown lines: each framework's measured N-device efficiency beside
    the one PREDICTED from its 1-device run alone, and every input of the prediction; no lines
    when no framework has both (measured_vs_predicted). `is_busy`: a run timed on a busy machine."""
    table = measured_vs_predicted(records)
    if not table:
        return []
    lines = [
        "", f"## {SECTION_TITLE}", "",
        "Measured: the N-device runs above (efficiency = images/s / (N x the 1-device "
        "images/s), medians over the seeds). PREDICTED: benchmarks/analysis/predict.py's model "
        "(docs/scaling.md: step = host + input wait + compute + exposed ring all-reduce) from "
        "each framework's 1-device run and the inputs listed below, nothing taken from the "
        "N-device runs but their device count and global batch. measured - predicted is in "
        "percentage points (pp).", "",
    ]  # fmt: skip
    head = ["framework", "mode", "devices", "scaling", "batch/device", "measured step",
            "PREDICTED step", "measured eff.", "PREDICTED eff.", "measured - predicted",
            "PREDICTED comm (exposed)", "compute/device"]  # fmt: skip
    body = []
    for r in table:
        inputs = r.get("inputs") or {}
        comm = (f"{r['predicted_comm_ms']:.2f} ms ({r['predicted_exposed_comm_ms']:.2f} ms)"
                if "predicted_comm_ms" in r else "-")  # fmt: skip
        diff = "-" if r["difference_pp"] is None else f"{r['difference_pp']:+.1f} pp"
        factor = inputs.get("compute_factor")
        body.append([
            r["framework"], r["mode"] or "-", str(r["devices"]), r["scaling"],
            f"{r['per_device_batch']:g} images", _ms(r["measured_step_ms"]),
            _ms(r["predicted_step_ms"]), harness.cell(r["measured_efficiency"], ".1%"),
            harness.cell(r["predicted_efficiency"], ".1%"), diff, comm,
            "-" if factor is None else f"{factor:g}x the 1-device compute",
        ])  # fmt: skip
    lines += [harness.markdown_table(head, body), "", "Inputs of the prediction:", ""]
    given = [r["inputs"] for r in table if r.get("inputs")]
    for lk in {json.dumps(i["link"], sort_keys=True): i["link"] for i in given}.values():
        lines.append(
            f"- link {lk['name']}: busbw {lk['busbw_gbps']:g} GB/s, α {lk['latency_us']:g} us: "
            f"{lk['what']} ({lk['source']})"
        )
    for why in dict.fromkeys(i["compute_factor_source"] for i in given):
        lines.append(f"- compute/device: {why}")
    seen = set()
    for r in table:
        inputs = r.get("inputs")
        if not inputs or r["framework"] in seen:
            continue
        seen.add(r["framework"])
        one, msgs = inputs["one_device"], inputs["collective_bytes"]
        how = f"{inputs['collectives']} collective(s)"
        if len(msgs) > 4:
            how += f" of {_bytes(min(msgs))} to {_bytes(max(msgs))}"
        elif msgs:
            how += f" of {', '.join(_bytes(m) for m in msgs)}"
        lines.append(
            f"- **{r['framework']}**: 1-device step {one['step_ms']:.2f} ms at {one['batch']} "
            f"images: compute {one['compute_ms']:.2f} ms (backward {one['backward_ms']:.2f} ms), "
            f"input wait {one['input_wait_ms']:.2f} ms, host {one['host_ms']:.2f} ms "
            f"({one['source']}); {inputs['model']}: {inputs['grad_bytes']:,} bytes of "
            f"{inputs['grad_dtype']} gradients in {how}; overlap {inputs['overlap']:g} "
            f"({inputs['overlap_source']})"
        )
    for r in table:
        if r["note"]:  # why there is no prediction, or what the one shown could not use
            what = "no prediction" if r.get("predicted_efficiency") is None else "note"
            lines.append(f"- {r['framework']} x{r['devices']}: {what}: {r['note']}.")
    shown = {r["framework"] for r in table}
    busy = [f"{key} x{r['devices']}" for r in records
            if (key := harness.row_key(r)) in shown and is_busy(r)]  # fmt: skip
    if busy:
        lines.append(
            f"- Busy machine (load average above the core count) during {', '.join(busy)}: a "
            "1-device run timed on a busy machine moves the prediction as much as a busy "
            "N-device run moves the measurement."
        )
    return lines


def sweep_plot(plt: Any, counts: list[int], order: list[str], records: list[dict[str, Any]],
               title: str) -> Any:  # fmt: skip
    """The figure of `section`: measured efficiency as points, the PREDICTED as dashed lines, one
    colour per framework (`order`: the sweep's); None when there is nothing to compare."""
    from matplotlib.ticker import PercentFormatter

    table = [r for r in measured_vs_predicted(records)
             if r["predicted_efficiency"] is not None]  # fmt: skip
    if not table:
        return None
    fig, ax = harness.device_axes(plt, counts, "Scaling efficiency: measured (points) and "
                                  "PREDICTED from the 1-device run (dashed, "
                                  f"benchmarks/analysis/predict.py)\n{title}")  # fmt: skip
    frameworks = list(dict.fromkeys(r["framework"] for r in table))
    colours = {fw: f"C{order.index(fw) if fw in order else i}"
               for i, fw in enumerate(frameworks)}  # fmt: skip
    for fw in frameworks:
        pts = [r for r in table if r["framework"] == fw]
        xs = [1] + [r["devices"] for r in pts]
        ax.plot(xs, [1.0] + [r["measured_efficiency"] for r in pts], "o", color=colours[fw],
                label=f"{fw}, measured")  # fmt: skip
        ax.plot(xs, [1.0] + [r["predicted_efficiency"] for r in pts], "--", color=colours[fw],
                label=f"{fw}, PREDICTED")  # fmt: skip
    ax.set_ylim(bottom=0)
    ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    ax.legend(fontsize=7)
    return fig


# ---- inputs ----


def read_breakdown(path: str) -> Breakdown:
    """--breakdown FILE: a JSON object with Breakdown's keys (unknown keys are an error)."""
    data = harness.read_json_file(Path(path), "--breakdown", "give a JSON object of numbers")
    if not isinstance(data, dict):
        raise UsageError(
            f"--breakdown {path}: not a JSON object; known keys: {sorted(BREAKDOWN_KEYS)}"
        )
    unknown = sorted(set(data) - BREAKDOWN_KEYS)
    if unknown:
        raise UsageError(
            f"--breakdown {path}: unknown keys {unknown}; known: {sorted(BREAKDOWN_KEYS)}"
        )
    if "step_ms" not in data or "batch" not in data:
        raise UsageError(f"--breakdown {path}: step_ms and batch are required")
    if not all(isinstance(v, int | float | None) for k, v in data.items() if k != "source"):
        raise UsageError(f"--breakdown {path}: a value that is not a number")
    return Breakdown(**data)


def read_throughput_table(path: str) -> list[tuple[str, str, Breakdown]]:
    """--throughput-table FILE: a benchmarks.throughput throughput.json. Each ok 1-device row
    becomes (row, mode, breakdown): step = batch / real img/s, compute = batch / compute-only
    img/s (the same step without the loop), the rest the loop's host time."""
    table = harness.read_throughput(Path(path), "--throughput-table")
    s = table["settings"]
    if (s["model"], s["width"], s["image_size"]) != ("resnet18", 1.0, 32):
        raise UsageError(f"--throughput-table {path}: only ResNet-18 width 1 at 32x32 is modelled")
    out = []
    for r in table["rows"]:
        fw, batch = r["framework"], r["global_batch"]
        real, compute = r.get("real_images_per_sec"), r.get("compute_images_per_sec")
        if r["devices"] != 1 or (r.get("status") or "ok") != "ok" or not (real and compute):
            continue
        note = r.get("precision_note") or ""  # a table older than its mode column: the note
        mode = r.get("mode") or (
            "CUDA graphs" if "reduce-overhead" in note else "torch.compile"
            if "torch.compile" in note else "XLA" if fw.startswith("jax-") else "eager"
        )  # fmt: skip
        step, comp = batch / real * 1e3, batch / compute * 1e3
        source = f"{path}: {fw} real {real:,.0f} img/s, compute-only {compute:,.0f} img/s"
        out.append((fw, mode, Breakdown(step_ms=step, batch=batch, compute_ms=min(comp, step),
                                        source=source)))  # fmt: skip
    return out


# ---- output ----


def inputs_table(scenarios, setups, args) -> list[str]:
    lines = ["| input | value |", "|---|---|"]
    for label, _, bd in scenarios:
        lines.append(
            f"| 1-device step: {label} | {bd.step_ms:.3f} ms at batch {bd.batch} = "
            f"{bd.batch / bd.step_ms * 1e3:,.0f} img/s; compute {bd.compute:.3f} ms, backward "
            f"{bd.backward:.3f} ms, input wait {bd.input_wait_ms:.3f} ms, host "
            f"{bd.host_ms:.3f} ms ({bd.source or 'given on the command line'}) |"
        )
    fws = dict.fromkeys(s.framework for s in setups)
    bd0 = scenarios[0][2]
    for fw in fws:
        value, why = overlap_for(fw, bd0, args.overlap)
        lines.append(f"| overlap bound, {fw} | {value:g}: {why} |")
    model = MODELS[args.model]
    grad = [t * GRAD_BYTES[args.grad_dtype] for t in model.tensors]
    lines.append(
        f"| model | {args.model}: {model.what}; {len(grad)} parameter tensors, "
        f"{sum(model.tensors):,} parameters, {args.grad_dtype} gradients = {sum(grad):,} bytes |"
    )
    for fw in fws:
        if fw == "torch-dp":
            how = "broadcast + reduce of all gradients, scatter/gather of the batch, via GPU 0"
        else:
            msgs, kind = messages(fw, grad, args.model), "all-reduces"
            if fw in FSDP_GATHERS:
                kind = f"units (all-gathered x{FSDP_GATHERS[fw]}, reduce-scattered once)"
            how = f"{len(msgs)} {kind} of {', '.join(f'{m / MIB:.2f}' for m in msgs[:8])}"
            how += f"{' ...' if len(msgs) > 8 else ''} MiB"
        lines.append(f"| collectives, {fw} | {how} |")
    for s in dict((s.intra, s) for s in setups).values():
        lk = s.intra_link
        lines.append(
            f"| interconnect {s.intra} | {lk.busbw_gbps:g} GB/s busbw, α {lk.latency_us:g} us: "
            f"{lk.what} ({lk.source}) |"
        )
    s = setups[0]
    lines.append(
        f"| beyond {s.gpus_per_node} GPUs a node | {s.nics_per_node} x {args.inter_node}: "
        f"{s.inter_link.busbw_gbps:g} GB/s a NIC, α {s.inter_link.latency_us:g} us "
        f"({s.inter_link.what}; {s.inter_link.source}); ring over the slowest link |"
    )
    lines.append(
        f"| scaling | {args.scaling}"
        + (f", global batch {args.global_batch:g}" if args.scaling == "strong" else "")
        + "; compute linear in the per-device batch |"
    )
    return lines


def results_markdown(title: str, input_lines: list[str], results: list[dict]) -> str:
    head = ["predicted for", "interconnect", "N", "batch/GPU", "step ms", "img/s", "efficiency",
            "comm ms", "exposed comm ms"]  # fmt: skip
    body = []
    for r in results:
        row = [r["label"], r["interconnect"], str(r["devices"]), f"{r['per_device_batch']:g}"]
        if "step_ms" not in r:
            body.append([*row, r["note"], "", "", "", ""])
            continue
        body.append([*row, f"{r['step_ms']:.3f}", f"{r['images_per_sec']:,.0f}",
                     f"{r['efficiency']:.1%}", f"{r['comm_ms']:.3f}",
                     f"{r['exposed_comm_ms']:.3f}"])  # fmt: skip
    lines = [f"# {title}", "", "PREDICTED by benchmarks/analysis/predict.py (a model, not a "
             "measurement).", "", "## Inputs", "", *input_lines, "", "## Predicted", "",
             harness.markdown_table(head, body, "llrrrrrrr")]  # fmt: skip
    return "\n".join(lines) + "\n"


def plot(results: list[dict], title: str, path: Path) -> str | None:
    """Predicted efficiency (left) and images/s (right) against N: one colour per measured
    1-device loop, one line style per interconnect."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import PercentFormatter
    except ImportError:
        return "plot skipped: matplotlib is not installed in this interpreter (use .venv)"
    fig, (eff_ax, ips_ax) = plt.subplots(1, 2, figsize=(12, 5))
    styles = ["-", "--", ":", "-."]
    links = list(dict.fromkeys(r["interconnect"] for r in results))
    labels = list(dict.fromkeys(r["label"] for r in results))
    done = [r for r in results if "efficiency" in r]  # rows with a prediction (not n/a)
    for i, label in enumerate(labels):
        for j, link in enumerate(links):
            pts = [r for r in done if (r["label"], r["interconnect"]) == (label, link)]
            ns = [r["devices"] for r in pts]
            style = dict(linestyle=styles[j % len(styles)], marker="o", color=f"C{i}")
            eff_ax.plot(ns, [r["efficiency"] for r in pts], label=f"{label}, {link}", **style)
            ips_ax.plot(ns, [r["images_per_sec"] for r in pts], **style)
    for ax in (eff_ax, ips_ax):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({r["devices"] for r in results}))
        ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
        ax.set_xlabel("GPUs (N)")
        ax.grid(True, alpha=0.3)
    eff_ax.set_ylabel("PREDICTED scaling efficiency")
    eff_ax.yaxis.set_major_formatter(PercentFormatter(1.0))
    eff_ax.legend(fontsize=7)
    ips_ax.set_yscale("log")
    ips_ax.set_ylabel("PREDICTED images/s")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


# ---- main ----


def positive(flag: str, value: float | None, *, allow_zero: bool = False) -> None:
    if value is None:
        return
    if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
        raise UsageError(f"{flag} must be a positive number (got {value:g})")


def build_parser() -> harness.Parser:
    p = harness.Parser("predict", prog=PROG, description=__doc__.split("\n\n")[0])
    src = p.add_argument_group("the 1-device measurement (one of)")
    src.add_argument("--throughput-table", action="append", default=[], metavar="JSON",
                     help="a benchmarks.throughput throughput.json (repeatable): every ok "
                     "1-device row")  # fmt: skip
    src.add_argument("--breakdown", metavar="JSON", help="a breakdown (docs/scaling.md schema)")
    harness.add_numbers(
        src,
        ("--step-ms", float, None, "1-device step time, ms"),
        ("--images-per-sec", float, None, "1-device images/s (with --batch-per-device)"),
        ("--batch-per-device", int, None, "the 1-device step's batch"),
        ("--compute-ms", float, None, "device compute per step (default: the step - input wait)"),
        ("--backward-ms", float, None, "backward per step (default 2/3 of compute)"),
        ("--input-wait-ms", float, 0.0, "waiting for data per step"),
    )
    src.add_argument("--framework", default="torch-ddp", metavar="LIST",
                     help=f"how the gradients are sent, comma-separated, each beside the others: "
                     f"{', '.join(FRAMEWORKS)} (not with --throughput-table)")  # fmt: skip
    src.add_argument("--frameworks", metavar="LIST", help="--throughput-table rows to keep")
    m = p.add_argument_group("model and communication")
    m.add_argument("--model", default="resnet18", choices=sorted(MODELS))
    m.add_argument("--grad-dtype", default="fp32", choices=sorted(GRAD_BYTES),
                   help="dtype the gradients are all-reduced in (ours: fp32 under bf16 "
                   "autocast)")  # fmt: skip
    m.add_argument("--overlap", type=float, help="fraction of the backward that can hide "
                   "communication (default: the framework's, docs/scaling.md)")  # fmt: skip
    m.add_argument("--interconnect", default="h100-nvlink", metavar="LIST",
                   help=f"presets, comma-separated: {', '.join(PRESETS)}")  # fmt: skip
    harness.add_numbers(
        m,
        ("--bus-bandwidth", float, None, "a custom link's busbw", "GBPS"),
        ("--latency-us", float, None, "a custom link's α (with --bus-bandwidth)"),
        ("--gpus-per-node", int, 8, None),
        ("--nics-per-node", int, 1, None),
    )
    m.add_argument("--inter-node", default="ib-ndr", choices=sorted(INTER_NODE))
    s = p.add_argument_group("scaling and output")
    s.add_argument("--scaling", default="weak", choices=("weak", "strong"))
    batch_help = "strong scaling: the fixed global batch (default: the 1-device batch)"
    s.add_argument("--global-batch", type=float, help=batch_help)
    s.add_argument("-N", "--gpus", default="1,2,4,8,16,32,64", metavar="LIST")
    s.add_argument("--out", metavar="DIR", help="write predicted-<scaling>.md/.json/.png here")
    s.add_argument("--no-plot", action="store_true")
    s.add_argument("--validate", action="store_true",
                   help="predicted vs published multi-GPU throughput "
                   "(docs/scaling.md)")  # fmt: skip
    return p


def parse_ns(text: str) -> list[int]:
    try:
        ns = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"-N takes whole numbers, comma-separated (got {text!r})") from None
    if not ns or any(n < 1 for n in ns):
        raise UsageError(f"-N takes GPU counts >= 1 (got {text!r})")
    return sorted(set(ns))


def scenarios_from(args) -> list[tuple[str, str, Breakdown]]:
    """(label, framework, breakdown) for every 1-device measurement given."""
    given = [bool(args.throughput_table), bool(args.breakdown),
             args.step_ms is not None or args.images_per_sec is not None]  # fmt: skip
    if sum(given) != 1:
        raise UsageError(
            "give one 1-device measurement: --throughput-table, --breakdown, or --step-ms / "
            "--images-per-sec with --batch-per-device"
        )
    if args.throughput_table:
        keep = set(args.frameworks.split(",")) if args.frameworks else None
        out = []
        for path in args.throughput_table:
            for row, mode, bd in read_throughput_table(path):
                fw = row.partition("+")[0]  # a variant (torch-ddp+reduce-overhead): its trainer's
                if keep is not None and row not in keep:
                    continue
                if fw == "torch-dp" and mode.partition(",")[0] != "eager":
                    continue  # the trainers refuse torch-dp with torch.compile at 2+ GPUs
                out.append((f"{row}, {mode}", fw, bd))
        if not out:
            raise UsageError("no 1-device row left in --throughput-table (see --frameworks)")
        return out
    if args.breakdown:
        bd = read_breakdown(args.breakdown)
    else:
        if args.batch_per_device is None or args.batch_per_device < 1:
            raise UsageError("--batch-per-device (>= 1) is needed with --step-ms/--images-per-sec")
        if args.step_ms is not None and args.images_per_sec is not None:
            raise UsageError("give --step-ms or --images-per-sec, not both")
        positive("--step-ms", args.step_ms)
        positive("--images-per-sec", args.images_per_sec)
        step = args.step_ms or args.batch_per_device / args.images_per_sec * 1e3
        bd = Breakdown(step_ms=step, batch=args.batch_per_device, compute_ms=args.compute_ms,
                       backward_ms=args.backward_ms, input_wait_ms=args.input_wait_ms)  # fmt: skip
    check_breakdown(bd)
    fws = harness.pick(args.framework, FRAMEWORKS, "--framework", "")
    return [(fw, fw, bd) for fw in fws]


def check_breakdown(bd: Breakdown) -> None:
    for name in ("step_ms", "compute_ms", "backward_ms", "input_wait_ms", "comm_ms"):
        positive(name, getattr(bd, name), allow_zero=name != "step_ms")
    positive("exposed_comm_ms", bd.exposed_comm_ms, allow_zero=True)
    if not isinstance(bd.batch, int) or bd.batch < 1:
        raise UsageError(f"batch must be a whole number >= 1 (got {bd.batch!r})")
    if bd.host_ms < -1e-9:
        raise UsageError(
            f"compute ({bd.compute:g} ms) + input wait ({bd.input_wait_ms:g} ms) exceed the "
            f"step ({bd.step_ms:g} ms)"
        )
    if bd.backward > bd.compute + 1e-9:
        raise UsageError(f"backward ({bd.backward:g} ms) exceeds compute ({bd.compute:g} ms)")


def links_from(args) -> list[tuple[str, Link]]:
    if args.bus_bandwidth is not None or args.latency_us is not None:
        if args.bus_bandwidth is None or args.latency_us is None:
            raise UsageError("a custom link needs both --bus-bandwidth and --latency-us")
        positive("--bus-bandwidth", args.bus_bandwidth)
        positive("--latency-us", args.latency_us, allow_zero=True)
        return [("custom", Link(args.bus_bandwidth, args.latency_us, "given", "command line"))]
    hint = " (presets; or --bus-bandwidth GBPS --latency-us US)"
    names = harness.pick(args.interconnect, list(PRESETS), "--interconnect", hint)
    return [(x, PRESETS[x]) for x in names]


def make_plan(argv: list[str]) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    if args.validate:
        return {"args": args, "validate": True}
    ns = parse_ns(args.gpus)
    if args.overlap is not None and not 0 <= args.overlap <= 1:
        raise UsageError(f"--overlap must be in [0, 1] (got {args.overlap:g})")
    harness.check_positive(gpus_per_node=args.gpus_per_node, nics_per_node=args.nics_per_node)
    links = links_from(args)
    scenarios = scenarios_from(args)
    if any(fw.startswith("torch-fsdp") for _, fw, _ in scenarios):
        fsdp_units(args.model, MODELS[args.model].tensors)  # UsageError: no units modelled
    positive("--global-batch", args.global_batch)
    if args.scaling == "strong" and args.global_batch is None:
        args.global_batch = float(scenarios[0][2].batch)
    return {"args": args, "argv": argv, "ns": ns, "links": links, "scenarios": scenarios,
            "validate": False}  # fmt: skip


def run(plan: dict[str, Any]) -> int:
    args = plan["args"]
    out = Path(args.out) if args.out else None
    if out:
        out.mkdir(parents=True, exist_ok=True)
    if plan["validate"]:
        rows = validate()
        text = validation_markdown(rows)
        print(text, end="")
        if out:
            (out / "validation.md").write_text(text)
            write_json_atomic(out / "validation.json", {"predicted": True, "rows": rows})
        return 0
    inter = INTER_NODE[args.inter_node]
    results, setups = [], []  # setups: (Setup, the 1-device breakdown it predicts from)
    for label, fw, bd in plan["scenarios"]:
        for name, link in plan["links"]:
            s = Setup(fw, args.model, args.grad_dtype, name, link, inter, args.gpus_per_node,
                      args.nics_per_node, args.overlap)  # fmt: skip
            setups.append((s, bd))
            for row in curve(bd, s, plan["ns"], args.scaling, args.global_batch or bd.batch):
                results.append({"label": label, "interconnect": name, **row})
    batches = sorted({str(bd.batch) for _, _, bd in plan["scenarios"]})
    strong = args.scaling == "strong"
    batch = f"global batch {args.global_batch:g}" if strong else f"{', '.join(batches)} a GPU"
    links = ", ".join(n for n, _ in plan["links"])
    title = f"Predicted {args.scaling} scaling: {args.model}, {batch}, {links}"
    lines = inputs_table(plan["scenarios"], [s for s, _ in setups], args)
    text = results_markdown(title, lines, results)
    print(text, end="")
    if out:
        stem = f"predicted-{args.scaling}"
        (out / f"{stem}.md").write_text(text)
        write_json_atomic(out / f"{stem}.json", {
            "predicted": True,
            "command": f"{PROG} {' '.join(plan['argv'])}".strip(),
            "inputs": {
                "scenarios": [{"label": lb, "framework": fw, **asdict(bd)}
                              for lb, fw, bd in plan["scenarios"]],
                "setups": [asdict(s) | {"overlap_used": overlap_for(s.framework, bd, s.overlap)}
                           for s, bd in setups],
                "scaling": args.scaling, "global_batch": args.global_batch,
            },
            "rows": results,
        })  # fmt: skip
        if not args.no_plot:
            note = plot(results, f"{title} (PREDICTED, not measured)", out / f"{stem}.png")
            if note:
                print(note, file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m benchmarks.analysis.predict --help`. Exit 0 ok, 2 bad input."""
    return harness.run_tool("predict", argv, make_plan, run)


if __name__ == "__main__":
    sys.exit(main())
