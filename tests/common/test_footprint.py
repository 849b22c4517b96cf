"""common/footprint.py: the bytes each strategy's collectives send, from the state each device
keeps (the readers of each framework's arrays: tests/trainers/test_state_bytes.py)."""

from __future__ import annotations

import pytest

from common.footprint import collective_bytes, state_record

MIB = 2**20
REPLICATED = state_record(params=4 * MIB, grads=4 * MIB, optimizer=4 * MIB, buffers=MIB)


def sharded(n: int) -> dict[str, int]:  # FSDP: every part 1/N of the replicated one
    return state_record(**{k: REPLICATED[k] // n for k in ("params", "grads", "optimizer")},
                        buffers=MIB)  # fmt: skip


def test_state_record_totals_its_parts() -> None:
    assert REPLICATED["total"] == 13 * MIB


@pytest.mark.parametrize("strategy", ["torch-ddp", "jax-pmap", "jax-shard", "jax-shardmap"])
def test_an_all_reduce_of_the_grads_sends_2_n_minus_1_over_n_of_them(strategy: str) -> None:
    for n, sent in ((1, 0), (2, 4 * MIB), (4, 6 * MIB), (8, 7 * MIB)):
        c = collective_bytes(strategy, REPLICATED, n)
        assert c["allreduce"] == c["total"] == sent, n
        assert c["source"] == "computed from the shardings"


def test_fsdp_sends_one_and_a_half_ddp_resharded_and_as_much_without() -> None:
    for n in (2, 4, 8):
        ddp = collective_bytes("torch-ddp", REPLICATED, n)["total"]
        fsdp = collective_bytes("torch-fsdp", sharded(n), n)
        assert fsdp["total"] == 1.5 * ddp and fsdp["allgather"] == 2 * fsdp["reducescatter"]
        assert collective_bytes("torch-fsdp", sharded(n), n, reshard=False)["total"] == ddp
        assert collective_bytes("jax-fsdp", sharded(n), n)["total"] == ddp  # one gather
        assert collective_bytes("jax-fsdp", sharded(n), n, reshard=True)["total"] == 1.5 * ddp
    assert collective_bytes("torch-fsdp", REPLICATED, 1)["total"] == 0


def test_torch_dp_broadcasts_params_and_buffers_and_reduces_grads() -> None:
    c = collective_bytes("torch-dp", REPLICATED, 4)
    assert (c["broadcast"], c["reduce"], c["total"]) == (5 * MIB, 4 * MIB, 9 * MIB)
    assert collective_bytes("torch-dp", REPLICATED, 1)["total"] == 0


def test_mxnet_kvstore_reduces_and_broadcasts_what_a_ring_all_reduce_sends() -> None:
    c = collective_bytes("mxnet-gluon", REPLICATED, 4)
    assert c["reduce"] == c["broadcast"] == 3 * MIB
    assert c["total"] == collective_bytes("torch-ddp", REPLICATED, 4)["total"]


def test_an_unknown_strategy_is_refused() -> None:
    with pytest.raises(ValueError, match="tf-mirrored"):
        collective_bytes("tf-mirrored", REPLICATED, 2)
