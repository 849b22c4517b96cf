"""The data fixture (`.venv/bin/python -m tests.make_data_fixture` rewrites it): what the data
layer (common/) gives for the `digits` preset as digests of exact bytes ({dtype, shape, sha256
of dtype.str, shape and C-order bytes, head: the first values}), so the MXNet environment (numpy
1.23.5) can prove it feeds MXNet the data torch and JAX get: the dataset and its statistics,
epochs 0 and 1's order and augmentation, the loaders' first batches for world 1 and ranks 0 and
1 of world 2. numpy, the standard library and common/ only: it runs in both environments."""

from __future__ import annotations

import hashlib
import json
import sys
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from common.config import preset
from common.datasets import load_for
from common.pipeline import EvalLoader, TrainLoader, augmentation_params, epoch_permutation

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "data_fixture.json"
PRESET = "digits"
EPOCHS = (0, 1)
STEPS = 2
WORLDS = ((1, 0), (2, 0), (2, 1))  # (world, rank)
HEAD = 8  # values kept per record for readable messages (4 of a float array)
INFO = "generated_with"  # informational, never compared


def digest(a: np.ndarray) -> str:
    a = np.ascontiguousarray(a)
    h = hashlib.sha256(f"{a.dtype.str}|{tuple(a.shape)}|".encode())
    h.update(a.tobytes())
    return h.hexdigest()


def record(a: np.ndarray) -> dict[str, Any]:
    a = np.asarray(a)
    # python ints, bools or floats (a float32 is exact as a python float)
    head = a.reshape(-1)[: HEAD // 2 if a.dtype.kind == "f" else HEAD].tolist()
    return {"dtype": a.dtype.str, "shape": list(a.shape), "sha256": digest(a), "head": head}


def first(it: Any, k: int) -> list[Any]:
    """The first k items of a loader's iterator, closed after (a Prefetcher's thread ends)."""
    try:
        return [next(it) for _ in range(k)]
    finally:
        it.close()


def compute(arrays: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The fixture as computed here; `arrays` (optional) receives the batches, keyed alike."""
    cfg = preset(PRESET)
    ds = load_for(cfg)
    versions = {"numpy": np.__version__, "scikit-learn": __import__("sklearn").__version__}
    config = {"preset": PRESET, "epochs": list(EPOCHS), "steps": STEPS,
              "worlds": [list(w) for w in WORLDS]}  # fmt: skip
    for name in ("seed", "image_size", "batch_size", "eval_batch_size", "augment"):
        config[name] = getattr(cfg, name)
    out = {INFO: {**versions, "python": sys.version.split()[0]}, "config": config}
    rec: dict[str, Any] = {}
    for name in ("train_x", "train_y", "test_x", "test_y"):
        rec[f"dataset/{name}"] = record(getattr(ds, name))
    for name in ("mean", "std"):
        rec[f"dataset/{name}"] = record(np.asarray(getattr(ds, name), np.float64))
    n = len(ds.train_x)
    for e in EPOCHS:
        rec[f"epoch{e}/order"] = record(epoch_permutation(cfg.seed, e, n))
        pad = TrainLoader(ds, cfg.batch_size, cfg.seed, prefetch=0).pad
        for key, a in zip(("dy", "dx", "flip"), augmentation_params(cfg.seed, e, n, pad, ds.flip)):
            rec[f"epoch{e}/aug_{key}"] = record(a)

    def keep(key: str, a: np.ndarray) -> None:
        rec[key] = record(a)
        if arrays is not None:
            arrays[key] = a

    for world, rank in WORLDS:
        w = f"w{world}r{rank}"
        train = partial(TrainLoader, ds, cfg.batch_size, cfg.seed, rank, world, cfg.augment)
        raw = train("NHWC", prefetch=2)
        # the loader's own path, stopped before normalising: the augmented uint8 images
        raw.norm = np.ascontiguousarray  # type: ignore[assignment]
        loaders = {"uint8": raw, **{lay: train(lay, prefetch=2) for lay in ("NHWC", "NCHW")}}
        for e in EPOCHS:
            batches = {kind: first(ld.epoch(e), STEPS) for kind, ld in loaders.items()}
            for s in range(STEPS):
                p = f"train/{w}/epoch{e}/step{s}"
                keep(f"{p}/indices", raw.indices(e, s))
                keep(f"{p}/y", batches["uint8"][s][1])
                for kind, b in batches.items():
                    keep(f"{p}/{kind}", b[s][0])

        evaluate = partial(EvalLoader, ds, cfg.eval_batch_size, rank, world)
        raw_eval = evaluate("NHWC")
        raw_eval.norm = np.ascontiguousarray  # type: ignore[assignment]
        for key, a in zip(("uint8", "y", "w"), first(iter(raw_eval), 1)[0], strict=True):
            keep(f"eval/{w}/{key}", a)
        for layout in ("NHWC", "NCHW"):
            keep(f"eval/{w}/{layout}", first(iter(evaluate(layout)), 1)[0][0])
    out["records"] = rec
    return out


def load() -> dict[str, Any]:
    with open(FIXTURE) as f:
        return json.load(f)


def dumps(fixture: dict[str, Any]) -> str:
    """JSON with one line per record (small diffs when the fixture is regenerated)."""
    top = [f" {json.dumps(k)}: {json.dumps(v, sort_keys=True)}," for k, v in sorted(fixture.items())
           if k != "records"]  # fmt: skip
    records = sorted(fixture["records"].items())
    lines = ",\n".join(f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in records)
    return "\n".join(["{", *top, ' "records": {', lines, " }", "}"]) + "\n"


def differences(expected: dict[str, Any], actual: dict[str, Any]) -> list[str]:
    """One readable line per differing field (the `generated_with` versions are not compared)."""
    lines = []
    if expected.get("config") != actual.get("config"):
        lines.append(f"config: fixture {expected.get('config')} != here {actual.get('config')}")
    exp, act = expected.get("records", {}), actual.get("records", {})
    for key in sorted(exp.keys() | act.keys()):
        if key not in act:
            lines.append(f"{key}: in the fixture, not computed here")
        elif key not in exp:
            lines.append(f"{key}: computed here, not in the fixture (regenerate it)")
        elif exp[key] != act[key]:
            e, a = exp[key], act[key]
            what = ", ".join(f for f in ("dtype", "shape", "sha256", "head") if e[f] != a[f])
            fixture, here = (f"{r['dtype']} {r['shape']} head {r['head']} sha256 {r['sha256'][:12]}"
                             for r in (e, a))  # fmt: skip
            lines.append(f"{key}: {what} differ: fixture {fixture}; here {here}")
    return lines


def main() -> None:
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(compute())
    FIXTURE.write_text(text)
    print(f"wrote {FIXTURE} ({len(text)} bytes)")


if __name__ == "__main__":
    main()
