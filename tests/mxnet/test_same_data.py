"""The MXNet environment (numpy 1.23.5) feeds MXNet the same data the main environment (numpy
2.x) feeds torch and JAX: every record of tests/fixtures/data_fixture.json (digits arrays, draws,
the loaders' first batches, tests/make_data_fixture.py) recomputed here is bit-identical, the
float32 batches included (one multiply and one add per element, correctly rounded anywhere;
the dataset's mean and std are float64 sums in the same order). A difference is a real one."""

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
