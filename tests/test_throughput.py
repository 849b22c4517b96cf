"""The performance tools: the throughput benchmark, the compute-only loop, the communication
probe (narrow models, tiny images, a few steps, simulated CPU devices), and the Prefetcher's
end-of-iteration behaviour that jax-pmap's device prefetch relies on."""

from __future__ import annotations

import itertools

import pytest

from common.pipeline import Prefetcher


@pytest.mark.parametrize("depth", [0, 2])
def test_prefetcher_stays_exhausted(depth: int) -> None:
    # A consumer that asks again after the end (jax-pmap's prefetch_to_devices refills with
    # islice(batches, 1) after every step) must get StopIteration, not block on the queue.
    batches = Prefetcher(iter(range(3)), depth)
    assert list(itertools.islice(batches, 2)) == [0, 1]
    assert list(itertools.islice(batches, 5)) == [2]
    assert list(itertools.islice(batches, 1)) == []
    assert next(batches, "end") == "end"


def test_prefetcher_stops_after_a_loader_error() -> None:
    def source():  # noqa: ANN202
        yield 1
        raise ValueError("bad batch")

    batches = Prefetcher(source(), 2)
    assert next(batches) == 1
    with pytest.raises(ValueError, match="bad batch"):
        next(batches)
    assert next(batches, "end") == "end"
