"""The exchange's cost model terms, measured on a process group: ``L_b`` and ``R_b``.

Every rank sends to the next rank and receives from the previous one (a ring), through the
loader's own :class:`Exchange` (headers, CRC-checked payloads), first one sample per rank and
round, then ``samples`` per rank and round. The extra samples' time gives the rate ``R_b``
(all ranks together, as the cost model has it), and what the one-sample round takes beyond
its bytes gives ``L_b``. Rounds go back to back, as a loader's steps do; a round's time is
the slowest rank's, the median of three timed runs of rounds; every rank returns the same
figures.
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

_TAG = 1 << 28
"""Tags from here up (the loader's wrap below it), should a loader share the group."""

_TAGS = (1 << 29) - 1
"""Exchange tags stay below 2**29."""

_RUNS = 3
"""Timed runs of rounds per measurement; their median is taken."""


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

    Rounds run back to back, as a loader's steps do, in three timed runs per measurement: the
    median run counts (the slowest rank's), so that one held up by another process on the
    machine does not.

    Args:
        sample_bytes: The size of a sample, as the loader would move them (the mean).
        samples: Samples each rank sends per round in the second measurement (>= 2); more
            make ``R_b`` steadier.
        rounds: Rounds per timed run (>= 1), after one that sets the connections up.
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
    # Seconds per round of the ring, each rank sending ``count`` samples to the next rank and
    # receiving as many from the last: rounds back to back, as a loader's steps go, timed
    # between two barriers; the median of three such runs, the slowest rank's.
    import torch
    import torch.distributed as dist

    me = dist.get_rank(group)
    nxt = dist.get_global_rank(group, (me + 1) % world)
    prev = dist.get_global_rank(group, (me - 1) % world)
    exchange = Exchange(group, dist.get_rank(), timeout)
    sends = [(nxt, np.arange(count, dtype=np.int64), [bytes(sample_bytes)] * count)]
    tag = _TAG + count * (_RUNS * rounds + 1)
    exchange.swap(tag % _TAGS, "measure_exchange", sends, [(prev, count)])  # sets pairs up
    runs = torch.zeros(_RUNS, dtype=torch.float64)
    for run in range(_RUNS):
        dist.barrier(group)
        start = time.perf_counter()
        for _ in range(rounds):
            tag += 1
            exchange.swap(tag % _TAGS, "measure_exchange", sends, [(prev, count)])
        dist.barrier(group)
        runs[run] = (time.perf_counter() - start) / rounds
    dist.all_reduce(runs, op=dist.ReduceOp.MAX, group=group)
    return float(runs.median())
