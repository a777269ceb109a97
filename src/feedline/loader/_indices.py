"""An epoch's indices from PyTorch's ``RandomSampler``, held as one NumPy array.

``RandomSampler`` turns each permutation it draws into a list of Python ints
(``torch.randperm(n).tolist()``): 40 bytes an index (the int, and the list's pointer to it),
77 MiB for an epoch of 2 million. :func:`index_iterator` draws the same permutations, with the
same calls on the same generator at the same points of the iteration, into one int64 array
(8 bytes an index, reused by every permutation of the epoch), and makes Python ints of a few
of them at a time, as they are asked for. The batches are made as ``BatchSampler`` makes them.

Any other sampler (a subclass, with replacement, a custom one) is iterated as it is.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import Any

import numpy as np

from feedline._extras import require_torch

__all__ = ["index_iterator"]

_CHUNK = 1024
"""Indices turned into Python ints at once (a few KiB of them alive at a time)."""


def index_iterator(index_sampler: Any) -> Iterator[Any]:
    """``iter(index_sampler)``: the same indices (or batches of them), in the same order.

    A ``RandomSampler`` without replacement, alone or under a ``BatchSampler`` (both exactly
    PyTorch's classes), is iterated here, holding its permutation as an array (see the
    module's docstring); it draws from its generator as PyTorch's iteration does, so the
    generator's state after each batch, and after the epoch, is PyTorch's.

    Args:
        index_sampler: The loader's sampler of indices (PyTorch's ``_index_sampler``): its
            batch sampler, or its sampler when it does not batch.

    Returns:
        An iterator of indices (Python ints), or of lists of them.

    """
    torch = require_torch("feedline.DataLoader")
    data = torch.utils.data
    if type(index_sampler) is data.BatchSampler and _held_as_array(data, index_sampler.sampler):
        return _batched(
            _shuffled(torch, index_sampler.sampler),
            index_sampler.batch_size,
            index_sampler.drop_last,
        )
    if _held_as_array(data, index_sampler):
        return _shuffled(torch, index_sampler)
    return iter(index_sampler)


def _held_as_array(data: Any, sampler: Any) -> bool:
    # PyTorch's own class only: a subclass may draw otherwise.
    return type(sampler) is data.RandomSampler and sampler.replacement is False


def _shuffled(torch: Any, sampler: Any) -> Iterator[int]:
    """``iter(sampler)`` of a ``RandomSampler`` without replacement, one array for its draws.

    Line for line ``RandomSampler.__iter__``: the length, the generator (a fresh one seeded
    from torch's global generator without one of its own), ``num_samples // n`` permutations,
    then one more cut to ``num_samples % n`` (drawn even when that is 0), each drawn once the
    previous one is used up.
    """
    own = sampler.generator
    if own is not None and own.device.type != "cpu":
        yield from torch.utils.data.RandomSampler.__iter__(sampler)  # its permutation's device
        return
    n = len(sampler.data_source)
    if own is None:
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        generator = torch.Generator()
        generator.manual_seed(seed)
    else:
        generator = own
    # The array's memory is NumPy's, so Python's tracemalloc counts it.
    held = np.empty(n, dtype=np.int64)
    out = torch.from_numpy(held)
    for _ in range(sampler.num_samples // n):
        torch.randperm(n, generator=generator, out=out)  # as torch.randperm(n, generator=...)
        yield from _as_ints(held)
    torch.randperm(n, generator=generator, out=out)
    yield from _as_ints(held[: sampler.num_samples % n])


def _as_ints(indices: np.ndarray[Any, np.dtype[np.int64]]) -> Iterator[int]:
    for start in range(0, len(indices), _CHUNK):
        yield from indices[start : start + _CHUNK].tolist()


def _batched(indices: Iterator[int], size: int, drop_last: bool) -> Iterator[list[int]]:
    """``BatchSampler.__iter__`` over ``indices``: the same batches, drawn as far."""
    if drop_last:
        for full in zip(*([indices] * size), strict=False):
            yield [*full]
        return
    batch = [*itertools.islice(indices, size)]
    while batch:
        yield batch
        batch = [*itertools.islice(indices, size)]
