"""What one device KEEPS between steps and SENDS per step, the same record in every framework.

`state_record` sums the parts each framework's support module reads from its own arrays
(torch: a DTensor's local shard; JAX: each device's addressable shards; MXNet: a context's
copy); `collective_bytes` computes from those parts what the strategy's collectives send.
Ring algorithms (NCCL's, and the model of benchmarks/analysis/predict.py), for B bytes in full:
each device sends 2(N-1)/N x B in an all-reduce and (N-1)/N x B in an all-gather or a
reduce-scatter. Each kind is the busiest device's; `total` is their sum."""

from __future__ import annotations

from typing import Any

STATE_PARTS = ("params", "grads", "optimizer", "buffers")
COLLECTIVES = ("allreduce", "allgather", "reducescatter", "broadcast", "reduce")
# Strategies whose gradients are all-reduced whole, every device holding every parameter.
ALLREDUCE = ("torch-ddp", "jax-pmap", "jax-shard", "jax-shardmap")
SHARDED = ("torch-fsdp", "jax-fsdp")


def state_record(**parts: int) -> dict[str, int]:
    """The record's `state_bytes_per_device`: the parts (STATE_PARTS, bytes) and their total."""
    assert set(parts) == set(STATE_PARTS), sorted(parts)
    record = {k: int(parts[k]) for k in STATE_PARTS}
    return {**record, "total": sum(record.values())}


def collective_bytes(
    strategy: str, state: dict[str, int], n: int, reshard: bool | None = None
) -> dict[str, Any]:
    """The record's `collective_bytes_per_step`: bytes one device sends per training step by
    `strategy`'s collectives over `n` devices, from `state` (`state_record`'s, per device).
    - torch-ddp, jax-pmap / jax-shard / jax-shardmap: the gradients all-reduced (BN statistics
      stay per device; --bn sync's activation statistics are not state and not counted);
    - torch-fsdp / jax-fsdp: every device keeps 1/N of params and grads, so the full tensors
      are N x the shard: params all-gathered for the forward and, where the unit reshards after
      it (`reshard`: FSDP2's reshard_after_forward, its default), again for the backward;
      grads reduce-scattered (FSDP2 keeps the root unit, stem and head, gathered from its
      forward to its backward: counted twice here: under 0.1% of ResNet-18's params). jax-fsdp's
      default (None) is one gather: ASSUMED that XLA keeps the gathered params of the one
      jitted step for its backward;
    - torch-dp: every step replicate() broadcasts device 0's params and buffers, and the
      replicas' grads are reduce-added onto device 0; NCCL pipelines both along a ring, so the
      busiest device sends the full B of each (the inputs' scatter and the outputs' gather are
      data, not state: not counted);
    - mxnet-gluon: kvstore "device" reduces each key's grads on the context that owns the key
      (keys spread evenly) and broadcasts the sum back: a device sends the (N-1)/N of the
      grads it does not own, and (N-1) copies of the 1/N it does.
    One device sends nothing. The numbers assume ring algorithms (NCCL's tree or MXNet's
    copies move the same bytes per device, in other steps)."""
    out = dict.fromkeys(COLLECTIVES, 0)
    share = (n - 1) / n
    if n > 1 and strategy in ALLREDUCE:
        out["allreduce"] = round(2 * share * state["grads"])
    elif n > 1 and strategy in SHARDED:
        gathers = 2 if (reshard if reshard is not None else strategy == "torch-fsdp") else 1
        out["allgather"] = round(gathers * share * n * state["params"])
        out["reducescatter"] = round(share * n * state["grads"])
    elif n > 1 and strategy == "torch-dp":
        out["broadcast"] = state["params"] + state["buffers"]
        out["reduce"] = state["grads"]
    elif n > 1 and strategy == "mxnet-gluon":
        out["reduce"] = out["broadcast"] = round(share * state["grads"])
    elif n > 1:
        raise ValueError(f"no collectives known for strategy {strategy!r}")
    return {**out, "total": sum(out.values()), "source": "computed from the shardings"}
