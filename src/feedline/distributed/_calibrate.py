"""The exchange's cost model terms, measured on a process group: ``L_b`` and ``R_b``.

Every rank sends to the next rank and receives from the previous one (a ring), through the
loader's own :class:`Exchange` (headers, CRC-checked payloads), first one sample per rank and
round, then ``samples`` per rank and round. The extra samples' time gives the rate ``R_b``
(all ranks together, as the cost model has it), and what the one-sample round takes beyond
its bytes gives ``L_b``. Every rank returns the same figures: the slowest rank's.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from feedline.errors import ConfigurationError

from ._exchange import Exchange

__all__ = ["ExchangeCost", "measure_exchange"]

_TAG = (1 << 28) + 1
"""Tags above the loader's (which wrap below 2**28), should a loader share the group."""


@dataclass(frozen=True)
class ExchangeCost:
    """What balancing exchanges cost on a group, for :class:`CostModel`'s ``L_b`` and ``R_b``.

    Attributes:
        L_b: Seconds one exchange round takes beyond moving its bytes.
        R_b: Samples per second the ranks exchange, all ranks together.
        sample_bytes: The size of the samples it was measured with.
        world: The number of ranks.

    """

    L_b: float
    R_b: float
    sample_bytes: int
    world: int


def measure_exchange(
    sample_bytes: int,
    *,
    samples: int = 4,
    rounds: int = 20,
    group: Any = None,
    timeout: float = 60.0,
) -> ExchangeCost:
    """Measure ``L_b`` and ``R_b`` on this process group; every rank must call it alike.

    Args:
        sample_bytes: The size of a sample, as the loader would move them (the mean).
        samples: Samples each rank sends per round in the second measurement (>= 2).
        rounds: Rounds per measurement (>= 1); the first round of each is not timed.
        group: The group to measure (gloo); default: a new gloo group of all ranks.
        timeout: Seconds to wait for a peer before :class:`ExchangeTimeout`.

    Raises:
        ConfigurationError: torch.distributed is not initialised, or has a single rank, or
            an argument is out of range.

    """
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        raise ConfigurationError(
            "measure_exchange() needs a torch.distributed group of 2 ranks or more: call "
            "torch.distributed.init_process_group() first (torchrun sets its variables)"
        )
    if sample_bytes < 1 or samples < 2 or rounds < 1:
        raise ConfigurationError(
            f"sample_bytes must be >= 1, samples >= 2 and rounds >= 1; got {sample_bytes}, "
            f"{samples}, {rounds}"
        )
    if group is None:
        group = dist.new_group(backend="gloo")
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    exchange = Exchange(group, rank, timeout)
    blob = bytes(sample_bytes)
    nxt, prev = (rank + 1) % world, (rank - 1) % world
    seconds = []
    for count in (1, samples):
        indices = np.arange(count, dtype=np.int64)
        for k in range(rounds + 1):
            if k == 1:  # the first round sets the pairs up
                dist.barrier(group)
                start = time.perf_counter()
            tag = _TAG + (count * (rounds + 1) + k) % (1 << 20)
            sends = [(nxt, indices, [blob] * count)]
            exchange.swap(tag, "measure_exchange", sends, [(prev, count)])
        dist.barrier(group)
        seconds.append((time.perf_counter() - start) / rounds)
    slowest = torch.tensor(seconds, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    one, many = (float(x) for x in slowest)
    extra = world * (samples - 1)  # samples the bigger rounds move beyond the smaller ones
    rate = extra / (many - one) if many > one else extra / many
    return ExchangeCost(
        L_b=max(0.0, one - world / rate), R_b=rate, sample_bytes=sample_bytes, world=world
    )
