"""The data fixture: what the shared data layer (common/) gives for the `digits` preset, as
digests of exact bytes, so the MXNet environment (numpy 1.23.5, its own scikit-learn) can prove
it feeds MXNet the same data the main environment feeds torch and JAX.

    .venv/bin/python -m tests.make_data_fixture     # rewrites tests/fixtures/data_fixture.json

Every record is {dtype, shape, sha256, head} (the digest covers dtype.str, shape and the C-order
bytes; `head`, the first values, makes a mismatch readable), for: the dataset's arrays and
normalisation statistics; epochs 0 and 1's order and augmentation parameters; the TrainLoader's
first two batches of those epochs and the EvalLoader's first batch, for world 1 and ranks 0 and
1 of world 2 (indices, augmented uint8 images, labels, normalised NHWC and NCHW batches).
Imports numpy, the standard library and common/ only: it runs in both environments.
"""

from __future__ import annotations

import hashlib
import json
import sys
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
    return {
        "dtype": a.dtype.str,
        "shape": list(a.shape),
        "sha256": digest(a),
        # python ints, bools or floats (a float32 is exact as a python float)
        "head": a.reshape(-1)[: HEAD // 2 if a.dtype.kind == "f" else HEAD].tolist(),
    }


def _first_steps(loader: TrainLoader, epoch: int) -> list[tuple[np.ndarray, np.ndarray]]:
    it = loader.epoch(epoch)
    try:
        return [next(it) for _ in range(STEPS)]
    finally:
        it.close()


def _first_eval(loader: EvalLoader) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    it = iter(loader)  # a Prefetcher: closed so its thread ends
    try:
        return next(it)
    finally:
        it.close()  # type: ignore[attr-defined]


def compute(arrays: dict[str, np.ndarray] | None = None) -> dict[str, Any]:
    """The fixture as this environment computes it. `arrays` (optional) receives the loaders'
    batches themselves, keyed like their records (train/... and eval/...)."""
    cfg = preset(PRESET)
    ds = load_for(cfg)
    out: dict[str, Any] = {
        INFO: {
            "numpy": np.__version__,
            "scikit-learn": __import__("sklearn").__version__,
            "python": sys.version.split()[0],
        },
        "config": {
            "preset": PRESET,
            "seed": cfg.seed,
            "image_size": cfg.image_size,
            "batch_size": cfg.batch_size,
            "eval_batch_size": cfg.eval_batch_size,
            "augment": cfg.augment,
            "epochs": list(EPOCHS),
            "steps": STEPS,
            "worlds": [list(w) for w in WORLDS],
        },
    }
    rec: dict[str, Any] = {}
    for name in ("train_x", "train_y", "test_x", "test_y"):
        rec[f"dataset/{name}"] = record(getattr(ds, name))
    rec["dataset/mean"] = record(np.asarray(ds.mean, np.float64))
    rec["dataset/std"] = record(np.asarray(ds.std, np.float64))
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

        def train(layout: str, world: int = world, rank: int = rank) -> TrainLoader:
            return TrainLoader(
                ds, cfg.batch_size, cfg.seed, rank, world, cfg.augment, layout, prefetch=2
            )

        raw = train("NHWC")
        # the loader's own path, stopped before normalising: the augmented uint8 images
        raw.norm = np.ascontiguousarray  # type: ignore[assignment]
        loaders = {layout: train(layout) for layout in ("NHWC", "NCHW")}
        for e in EPOCHS:
            batches = {"uint8": _first_steps(raw, e)}
            batches.update({lay: _first_steps(ld, e) for lay, ld in loaders.items()})
            for s in range(STEPS):
                p = f"train/{w}/epoch{e}/step{s}"
                keep(f"{p}/indices", raw.indices(e, s))
                keep(f"{p}/y", batches["uint8"][s][1])
                for kind, b in batches.items():
                    keep(f"{p}/{kind}", b[s][0])

        def evaluate(layout: str, world: int = world, rank: int = rank) -> EvalLoader:
            return EvalLoader(ds, cfg.eval_batch_size, rank, world, layout)

        raw_eval = evaluate("NHWC")
        raw_eval.norm = np.ascontiguousarray  # type: ignore[assignment]
        x, y, wt = _first_eval(raw_eval)
        keep(f"eval/{w}/uint8", x)
        keep(f"eval/{w}/y", y)
        keep(f"eval/{w}/w", wt)
        for layout in ("NHWC", "NCHW"):
            keep(f"eval/{w}/{layout}", _first_eval(evaluate(layout))[0])
    out["records"] = rec
    return out


def load() -> dict[str, Any]:
    with open(FIXTURE) as f:
        return json.load(f)


def dumps(fixture: dict[str, Any]) -> str:
    """JSON with one line per record (small diffs when the fixture is regenerated)."""
    lines = ["{"]
    for name in sorted(k for k in fixture if k != "records"):
        lines.append(f" {json.dumps(name)}: {json.dumps(fixture[name], sort_keys=True)},")
    records = fixture["records"]
    lines.append(' "records": {')
    for i, key in enumerate(sorted(records)):
        comma = "," if i < len(records) - 1 else ""
        lines.append(f"  {json.dumps(key)}: {json.dumps(records[key], sort_keys=True)}{comma}")
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


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
            what = [f for f in ("dtype", "shape", "sha256", "head") if e[f] != a[f]]
            lines.append(
                f"{key}: {', '.join(what)} differ: fixture {e['dtype']} {e['shape']} "
                f"head {e['head']} sha256 {e['sha256'][:12]}; here {a['dtype']} {a['shape']} "
                f"head {a['head']} sha256 {a['sha256'][:12]}"
            )
    return lines


def main() -> None:
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    text = dumps(compute())
    FIXTURE.write_text(text)
    print(f"wrote {FIXTURE} ({len(text)} bytes)")


if __name__ == "__main__":
    main()
