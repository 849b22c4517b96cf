"""The data fixture (tests/fixtures/data_fixture.json, written by `python -m
tests.make_data_fixture`) is what the main environment's data layer gives now, and comparing
against it can fail. The MXNet environment checks itself against the same file
(tests/mxnet/test_same_data.py); the loaders' own properties are tests/common/test_pipeline.py's."""

from __future__ import annotations

import numpy as np
import pytest

from common.config import preset
from common.datasets import load_for
from common.pipeline import epoch_permutation
from tests.make_data_fixture import FIXTURE, INFO, compute, differences, dumps, load, record


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
