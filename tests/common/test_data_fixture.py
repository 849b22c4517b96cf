"""The data fixture (tests/fixtures/data_fixture.json, written by `python -m
tests.make_data_fixture`) is what the main environment's data layer gives now, it describes what
it claims to, and comparing against it can fail. The MXNet environment checks itself against the
same file: tests/mxnet/test_same_data.py."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import preset
from common.datasets import load_for
from common.pipeline import Normalizer, epoch_permutation
from tests.make_data_fixture import (
    FIXTURE,
    INFO,
    compute,
    differences,
    dumps,
    load,
    record,
)


@pytest.fixture(scope="module")
def here() -> tuple[dict, dict[str, np.ndarray]]:
    arrays: dict[str, np.ndarray] = {}
    return compute(arrays), arrays


def test_fixture_is_current(here) -> None:
    fixture, _ = here
    diff = differences(load(), fixture)
    assert not diff, (
        f"{FIXTURE.name} is stale ({len(diff)} fields); if the data layer changed on purpose, "
        "run `.venv/bin/python -m tests.make_data_fixture` and commit it:\n" + "\n".join(diff)
    )
    # The committed text is the generator's own output (versions aside): nothing edited by hand.
    committed = load()
    committed[INFO] = fixture[INFO]
    assert dumps(committed) == dumps(fixture)


def test_fixture_describes_the_loaders(here) -> None:
    """Both layouts hold the same values, world 2's shards are world 1's batch cut in two, and
    the float batches are the normalised uint8 batches."""
    _, a = here
    ds = load_for(preset("digits"))
    norm = Normalizer(ds.mean, ds.std)
    for e in (0, 1):
        for s in (0, 1):
            p = f"train/{{}}/epoch{e}/step{s}/{{}}"
            for kind in ("indices", "y", "uint8", "NHWC", "NCHW"):
                joined = np.concatenate([a[p.format("w2r0", kind)], a[p.format("w2r1", kind)]])
                np.testing.assert_array_equal(joined, a[p.format("w1r0", kind)])
            for w in ("w1r0", "w2r0", "w2r1"):
                nhwc = a[p.format(w, "NHWC")]
                assert nhwc.dtype == np.float32 and a[p.format(w, "uint8")].dtype == np.uint8
                np.testing.assert_array_equal(nhwc, norm(a[p.format(w, "uint8")]))
                np.testing.assert_array_equal(a[p.format(w, "NCHW")], nhwc.transpose(0, 3, 1, 2))
                np.testing.assert_array_equal(
                    a[p.format(w, "y")], ds.train_y[a[p.format(w, "indices")]]
                )
            # augmented: not the raw images (the crops move most of them)
            w1 = p.format("w1r0", "")
            assert not np.array_equal(a[w1 + "uint8"], ds.train_x[a[w1 + "indices"]])
    for w in ("w1r0", "w2r0", "w2r1"):
        np.testing.assert_array_equal(a[f"eval/{w}/NHWC"], norm(a[f"eval/{w}/uint8"]))
        np.testing.assert_array_equal(
            a[f"eval/{w}/NCHW"], a[f"eval/{w}/NHWC"].transpose(0, 3, 1, 2)
        )
    np.testing.assert_array_equal(a["eval/w1r0/uint8"][:180], a["eval/w2r0/uint8"][:180])


def test_the_comparison_can_fail(here) -> None:
    fixture, _ = here
    committed = load()
    ds = load_for(preset("digits"))
    n = len(ds.train_x)
    # another seed: another order
    assert record(epoch_permutation(1, 0, n)) != committed["records"]["epoch0/order"]
    # one pixel, one float32 bit, one dtype: each changes the digest
    x = ds.train_x.copy()
    x[7, 3, 5, 0] ^= 1
    assert record(x)["sha256"] != committed["records"]["dataset/train_x"]["sha256"]
    _, arrays = here
    f = arrays["train/w1r0/epoch1/step1/NCHW"].copy()
    f.reshape(-1)[-1] = np.nextafter(f.reshape(-1)[-1], np.float32(np.inf))
    assert record(f)["sha256"] != committed["records"]["train/w1r0/epoch1/step1/NCHW"]["sha256"]
    assert record(ds.train_y.astype(np.int64))["sha256"] != record(ds.train_y)["sha256"]
    # ... and `differences` names the field, with readable values
    changed = {**fixture, "records": {**fixture["records"], "dataset/train_x": record(x)}}
    (line,) = differences(committed, changed)
    assert line.startswith("dataset/train_x: sha256 differ") and "head [0, 4, 12" in line
    missing = {**fixture, "records": dict(fixture["records"])}
    del missing["records"]["epoch1/order"]
    assert differences(committed, missing) == ["epoch1/order: in the fixture, not computed here"]
