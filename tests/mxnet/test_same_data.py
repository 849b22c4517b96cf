"""The MXNet environment feeds MXNet the same data the main environment feeds torch and JAX.

This environment (numpy 1.23.5, scikit-learn 1.7.2) recomputes, with the shared data layer
(common/), every record of tests/fixtures/data_fixture.json, which the main environment (numpy
2.x, its own scikit-learn) wrote: the digits arrays, the order and augmentation parameters of
epochs 0 and 1, the real TrainLoader's first two batches of each (indices, augmented uint8
images, labels, normalised float32 batches in NHWC and NCHW) for world 1 and ranks 0 and 1 of
world 2, and the EvalLoader's first batch (tests/make_data_fixture.py lists them).

Every record must be bit-identical (sha256 of dtype, shape and bytes), the float32 batches
included, with no tolerance: measured, numpy 1.23.5 / scikit-learn 1.7.2 here and numpy 2.4.6 /
scikit-learn 1.9.1 there agree exactly on all of them (max abs difference 0). That is expected:
normalising is one float32 multiply and one add per element (correctly rounded in IEEE
arithmetic on any SIMD path, and numpy does not fuse them), and the only reductions (the
dataset's mean and std) are float64 sums over the same uint8 values in the same pairwise order.
A difference here is a real one (a changed data path or library), not rounding noise.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.make_data_fixture import FIXTURE, INFO, compute, differences, load

COMMITTED = load()


@pytest.fixture(scope="module")
def here() -> dict:
    return compute()


def _versions(here: dict) -> str:
    return f"fixture written with {COMMITTED[INFO]}, computed here with {here[INFO]}"


def test_same_configuration(here) -> None:
    assert here["config"] == COMMITTED["config"], _versions(here)


def test_same_fields(here) -> None:
    assert sorted(here["records"]) == sorted(COMMITTED["records"]), _versions(here)


@pytest.mark.parametrize("key", sorted(COMMITTED["records"]))
def test_same_record(here, key: str) -> None:
    """One field: dataset/..., epoch{e}/order and aug_..., train/..., eval/..."""
    expected = COMMITTED["records"][key]
    got = here["records"].get(key)
    assert got is not None, f"{key} is in {FIXTURE.name} but not computed here"
    if got != expected:
        only = {"records": {key: expected}}
        (line,) = differences(only, {"records": {key: got}})
        pytest.fail(f"{line}\n{_versions(here)}")


def test_this_is_the_other_environment(here) -> None:
    """The comparison means something only across environments: say which ones met."""
    assert here[INFO]["numpy"] == np.__version__
    if here[INFO] == COMMITTED[INFO]:
        pytest.skip(f"same library versions as the fixture's generator: {here[INFO]}")
