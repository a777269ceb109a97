"""The exchange's cost model terms, measured on a process group: ``L_b`` and ``R_b``.

Every rank sends to the next rank and receives from the previous one (a ring), through the
loader's own :class:`Exchange` (headers, CRC-checked payloads), first one sample per rank and
round, then ``samples`` per rank and round. The extra samples' time gives the rate ``R_b``
(all ranks together, as the cost model has it), and what the one-sample round takes beyond
its bytes gives ``L_b``. A round's time is the slowest rank's; each figure is the median
over the rounds; every rank returns the same figures.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from feedline.errors import ConfigurationError

from ._exchange import Exchange

__all__ = ["ExchangeCost", "measure_exchange"]

_log = logging.getLogger("feedline.distributed")

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
    samples: int = 8,
    rounds: int = 20,
    group: Any = None,
    timeout: float = 60.0,
) -> ExchangeCost:
    """Measure ``L_b`` and ``R_b`` on a process group; every rank of it must call it alike.

    Each figure is the median over the rounds of the slowest rank's time, so that a round
    held up by another process on the machine does not count.

    Args:
        sample_bytes: The size of a sample, as the loader would move them (the mean).
        samples: Samples each rank sends per round in the second measurement (>= 2); more
            make ``R_b`` steadier.
        rounds: Rounds per measurement (>= 1), after one that sets the connections up.
        group: The group to measure (gloo); default: a new gloo group of all ranks, destroyed
            before returning.
        timeout: Seconds to wait for a peer before :class:`ExchangeTimeout`.

    Raises:
        ConfigurationError: torch.distributed is not initialised, the group has a single
            rank, or an argument is out of range.

    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ConfigurationError(
            "measure_exchange() needs torch.distributed: call "
            "torch.distributed.init_process_group() first (torchrun sets its variables)"
        )
    if sample_bytes < 1 or samples < 2 or rounds < 1:
        raise ConfigurationError(
            f"sample_bytes must be >= 1, samples >= 2 and rounds >= 1; got {sample_bytes}, "
            f"{samples}, {rounds}"
        )
    own = group is None
    if own:
        if dist.get_world_size() < 2:
            raise ConfigurationError(
                "measure_exchange() needs 2 ranks or more; this torch.distributed group has 1"
            )
        group = dist.new_group(backend="gloo")
    try:
        world = dist.get_world_size(group)
        if world < 2:
            raise ConfigurationError(
                f"measure_exchange() needs a group of 2 ranks or more, got {world}"
            )
        one, many = (
            _round_times(group, world, sample_bytes, count, rounds, timeout)
            for count in (1, samples)
        )
    finally:
        if own:
            dist.destroy_process_group(group)
    extra = world * (samples - 1)  # samples the bigger rounds move beyond the smaller ones
    if many > one:
        rate = extra / (many - one)
    else:  # the bytes cost nothing measurable: a bound from the bigger rounds alone
        rate = world * samples / many
        _log.info("measure_exchange: %d more samples took no longer; R_b is a lower bound", extra)
    latency = one - world / rate
    if latency < 0:
        _log.info("measure_exchange: one-sample rounds took less than their bytes; L_b = 0")
    return ExchangeCost(L_b=max(0.0, latency), R_b=rate, sample_bytes=sample_bytes, world=world)


def _round_times(
    group: Any, world: int, sample_bytes: int, count: int, rounds: int, timeout: float
) -> float:
    # The median over the rounds of the slowest rank's time for one round of the ring, each
    # rank sending ``count`` samples to the next rank and receiving as many from the last.
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (me + 1) % world)
    prev = dist.get_global_rank(group, (me - 1) % world)
    exchange = Exchange(group, dist.get_rank(), timeout)
    blob = bytes(sample_bytes)
    indices = np.arange(count, dtype=np.int64)
    times = torch.zeros(rounds + 1, dtype=torch.float64)
    dist.barrier(group)
    for k in range(rounds + 1):  # the first round sets the pairs up: not counted
        tag = _TAG + (count * (rounds + 1) + k) % (1 << 20)
        start = time.perf_counter()
        exchange.swap(tag, "measure_exchange", [(nxt, indices, [blob] * count)], [(prev, count)])
        times[k] = time.perf_counter() - start
    dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
    return float(times[1:].median())
