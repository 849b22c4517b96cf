"""One initial state for every framework (`--init shared`, the default): each framework's own
generator draws different weights from the same seed, so a comparison of accuracies would
partly compare seeds. The parameters and BatchNorm buffers are drawn once, with numpy, in
torch's state-dict names and layouts (conv OIHW, linear (out, in)); every framework loads them
by structural name, and every run record carries `init: {mode, sha256}`.

The initialisers (the same as in torch_models.py, jax_models.py, mxnet_models.py):
- conv weight (O, I, kH, kW): He-normal, untruncated, std = sqrt(2 / fan_out),
  fan_out = O * kH * kW (torchvision's kaiming_normal_(mode="fan_out", nonlinearity="relu"));
- linear weight (out, in) and bias (out,): uniform in +-1/sqrt(in) (torch's nn.Linear);
- BN weight 1, bias 0, running_mean 0, running_var 1, num_batches_tracked 0.

Every tensor is drawn from its own stream, seeded by (seed, crc32 of its name): its values do
not depend on the order in which a framework lists its parameters. The arrays are cached as
`.npz` under `<data_dir>/init/`; `sha256` digests the arrays (names, dtypes, shapes, bytes),
and the file's zip comment holds its key (the configuration and that digest): a file whose
key is not this configuration's, or whose arrays do not match it, is drawn again and replaced.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import math
import sys
import zipfile
import zlib
from pathlib import Path
from typing import Any

import numpy as np

from common.config import Config
from common.runtime import atomic_write_bytes

VERSION = 2  # part of the cache file name and key: bump it when an initialiser changes

# (name, shape, kind): kind is one of conv, linear_weight, linear_bias, bn_weight, bn_bias,
# bn_mean, bn_var, bn_count.
Spec = list[tuple[str, tuple[int, ...], str]]


def scaled(channels: int, width: float) -> int:
    """`channels` x width multiplier, rounded, at least 1 (as every framework's models do)."""
    return max(1, int(round(channels * width)))


def _bn(name: str, c: int) -> Spec:
    return [
        (f"{name}.weight", (c,), "bn_weight"),
        (f"{name}.bias", (c,), "bn_bias"),
        (f"{name}.running_mean", (c,), "bn_mean"),
        (f"{name}.running_var", (c,), "bn_var"),
        (f"{name}.num_batches_tracked", (), "bn_count"),
    ]


def _conv(name: str, out_c: int, in_c: int, k: int) -> Spec:
    return [(f"{name}.weight", (out_c, in_c, k, k), "conv")]


def parameter_spec(model: str, width: float, in_channels: int, num_classes: int) -> Spec:
    """Every parameter and BN buffer of `model` in torch's state-dict order, names and layouts."""
    spec: Spec = []
    if model == "resnet18":
        widths = [scaled(c, width) for c in (64, 128, 256, 512)]
        spec += _conv("conv1", widths[0], in_channels, 3) + _bn("bn1", widths[0])
        in_c = widths[0]
        for i, out_c in enumerate(widths):
            for j in range(2):
                p = f"layer{i + 1}.{j}"
                stride = 2 if (i > 0 and j == 0) else 1
                spec += _conv(f"{p}.conv1", out_c, in_c, 3) + _bn(f"{p}.bn1", out_c)
                spec += _conv(f"{p}.conv2", out_c, out_c, 3) + _bn(f"{p}.bn2", out_c)
                if stride != 1 or in_c != out_c:
                    spec += _conv(f"{p}.downsample.0", out_c, in_c, 1)
                    spec += _bn(f"{p}.downsample.1", out_c)
                in_c = out_c
    elif model == "wideresnet":
        stem = scaled(16, width)
        widths = [scaled(c, width) for c in (160, 160, 320, 320, 640, 640)]
        spec += _conv("conv1", stem, in_channels, 3) + _bn("bn1", stem)
        in_c = stem
        for i, out_c in enumerate(widths):
            p = f"layer{i + 1}"
            spec += _conv(f"{p}.conv1", out_c, in_c, 3) + _bn(f"{p}.bn1", out_c)
            spec += _conv(f"{p}.conv2", out_c, out_c, 3) + _bn(f"{p}.bn2", out_c)
            if in_c != out_c:
                spec += _conv(f"{p}.shortcut", out_c, in_c, 1)
            in_c = out_c
    else:
        raise ValueError(f"unknown model {model!r}; choose resnet18 or wideresnet")
    spec += [("fc.weight", (num_classes, in_c), "linear_weight")]
    spec += [("fc.bias", (num_classes,), "linear_bias")]
    return spec


TRAINABLE = ("conv", "linear_weight", "linear_bias", "bn_weight", "bn_bias")


def trainable_sizes(spec: Spec) -> list[int]:
    """The trainable tensors' element counts (BN buffers excluded), in the order torch's
    model.parameters() lists them."""
    return [math.prod(shape) for _, shape, kind in spec if kind in TRAINABLE]


def draw(spec: Spec, seed: int) -> dict[str, np.ndarray]:
    """The initial arrays of `spec` for `seed` (float32; num_batches_tracked int64)."""
    out: dict[str, np.ndarray] = {}
    for name, shape, kind in spec:
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        if kind == "conv":
            fan_out = shape[0] * shape[2] * shape[3]
            value = rng.standard_normal(shape) * math.sqrt(2.0 / fan_out)
        elif kind in ("linear_weight", "linear_bias"):
            weight = name.rsplit(".", 1)[0] + ".weight"  # fan_in: its second dimension
            bound = 1.0 / math.sqrt(next(s[1] for n, s, _ in spec if n == weight))
            value = rng.uniform(-bound, bound, shape)
        elif kind in ("bn_weight", "bn_var"):
            value = np.ones(shape)
        elif kind == "bn_count":
            out[name] = np.zeros(shape, np.int64)
            continue
        else:  # bn_bias, bn_mean
            value = np.zeros(shape)
        out[name] = np.asarray(value, np.float32)
    return out


def digest(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over the arrays (sorted names, dtypes, shapes, bytes): the same arrays give the
    same digest whatever file they came from."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}|{a.dtype.str}|{a.shape}|".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def cache_path(cfg: Config, in_channels: int, num_classes: int) -> Path:
    return (
        Path(cfg.data_dir)
        / "init"
        / f"v{VERSION}-{cfg.model}-w{cfg.width:g}-c{in_channels}-k{num_classes}-s{cfg.seed}.npz"
    )


def initial_state(
    cfg: Config, in_channels: int, num_classes: int
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The shared initial arrays of `cfg`'s model (torch names and layouts) and the record's
    `init` entry {mode, sha256, file}. Drawn once, then read from the cache (written atomically,
    so concurrent runs may share it); a cache file that is not this configuration's (see the
    module docstring) is drawn again and replaced. Callers must not modify the arrays (they are
    shared within the process)."""
    path = cache_path(cfg, in_channels, num_classes)
    return _initial_state(cfg.model, cfg.width, in_channels, num_classes, cfg.seed, path)


@functools.lru_cache(maxsize=4)
def _initial_state(
    model: str, width: float, in_channels: int, num_classes: int, seed: int, path: Path
) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    spec = parameter_spec(model, width, in_channels, num_classes)
    key = functools.partial(cache_key, model, width, in_channels, num_classes, seed)
    arrays: dict[str, np.ndarray] | None = None
    if path.exists():
        try:
            arrays = read_cache(path, key)
        except (ValueError, OSError, EOFError, zipfile.BadZipFile) as exc:
            print(f"note: init cache {path} drawn again ({exc})", file=sys.stderr)
    if arrays is None:
        arrays = draw(spec, seed)
        buf = io.BytesIO()
        np.savez(buf, **arrays)  # type: ignore[arg-type]  # numpy's stub: allow_pickle in **kwds
        with zipfile.ZipFile(buf, "a") as archive:  # the key: the archive's comment
            archive.comment = key(digest(arrays))
        try:
            atomic_write_bytes(path, buf.getvalue())
        except OSError:
            pass  # a read-only data directory: draw again next time
    return arrays, {"mode": "shared", "sha256": digest(arrays), "file": str(path)}


def cache_key(
    model: str, width: float, in_channels: int, num_classes: int, seed: int, sha256: str
) -> bytes:
    """The key an init cache file holds (its zip comment, so that np.load sees the arrays
    only): what it was drawn for and the digest of its arrays."""
    fields = {"version": VERSION, "model": model, "width": width, "in_channels": in_channels,
              "num_classes": num_classes, "seed": seed, "sha256": sha256}  # fmt: skip
    return json.dumps(fields, sort_keys=True).encode()


def read_cache(path: Path, key: Any) -> dict[str, np.ndarray]:
    """The arrays of init cache `path` if it is this configuration's (`key(sha256)` gives its
    key, their digest); ValueError when it holds anything else (damaged, another's)."""
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
        saved = f.zip.comment
    if saved != key(digest(arrays)):
        raise ValueError(f"not this configuration's arrays (its key: {saved[:200]!r})")
    return arrays


def init_record(cfg: Config, in_channels: int, num_classes: int) -> dict[str, Any]:
    """The run record's `init` entry: {mode, sha256 of the shared arrays, their cache file};
    `--init native` (the framework's own generator) has no digest."""
    if cfg.init == "native":
        return {"mode": "native", "sha256": None, "file": None}
    return initial_state(cfg, in_channels, num_classes)[1]
