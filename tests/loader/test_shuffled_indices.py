"""A shuffled epoch's indices: PyTorch's order and draws, held in a few bytes an index."""

from __future__ import annotations

import gc
import itertools
import tracemalloc
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import BatchSampler, RandomSampler, SequentialSampler  # noqa: E402

from feedline import DataLoader  # noqa: E402
from feedline.loader._indices import index_iterator  # noqa: E402

from .._system import starts_processes  # noqa: E402

MIB = 2**20


class _Sized:
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def _draws(sampler: Any, seed: int | None, iterate: Any) -> list[tuple[Any, Any, Any]]:
    """Each item of ``iterate(sampler)`` with the sampler's and torch's generator states after
    it, and a last entry for the end of the iteration."""
    torch.manual_seed(11)
    if seed is not None:
        _generator(sampler).manual_seed(seed)
    out = [(item, _state(sampler), torch.get_rng_state()) for item in iterate(sampler)]
    out.append((None, _state(sampler), torch.get_rng_state()))
    return out


def _generator(sampler: Any) -> Any:
    inner = sampler.sampler if isinstance(sampler, BatchSampler) else sampler
    return inner.generator


def _state(sampler: Any) -> Any:
    generator = _generator(sampler)
    return None if generator is None else generator.get_state()


def _assert_same(ours: list[Any], theirs: list[Any]) -> None:
    assert len(ours) == len(theirs)
    for (a, a_gen, a_rng), (b, b_gen, b_rng) in zip(ours, theirs, strict=True):
        assert a == b
        for x in a if isinstance(a, list) else [] if a is None else [a]:
            assert type(x) is int  # dataset[i] gets a Python int, as from PyTorch
        assert (a_gen is None) == (b_gen is None)
        if a_gen is not None:
            assert a_gen.equal(b_gen)  # the same draws, made at the same point
        assert a_rng.equal(b_rng)


@pytest.mark.parametrize("seed", [None, 0, 7, 2024])
@pytest.mark.parametrize(
    ("n", "num_samples"), [(1, None), (53, None), (4096, None), (53, 20), (53, 106), (53, 140)]
)
@pytest.mark.parametrize(("batch_size", "drop_last"), [(None, False), (8, False), (7, True)])
def test_the_indices_and_the_draws_are_pytorchs_random_samplers(
    seed: int | None, n: int, num_samples: int | None, batch_size: int | None, drop_last: bool
) -> None:
    def make() -> Any:
        generator = torch.Generator() if seed is not None else None
        sampler = RandomSampler(_Sized(n), num_samples=num_samples, generator=generator)
        return sampler if batch_size is None else BatchSampler(sampler, batch_size, drop_last)

    _assert_same(_draws(make(), seed, index_iterator), _draws(make(), seed, iter))


def test_an_epoch_of_two_million_matches_pytorchs_permutation() -> None:
    def make() -> Any:
        return BatchSampler(
            RandomSampler(_Sized(2_000_000), generator=torch.Generator()), 32, False
        )

    ours, theirs = make(), make()
    ours.sampler.generator.manual_seed(3)
    theirs.sampler.generator.manual_seed(3)
    for a, b in itertools.zip_longest(index_iterator(ours), iter(theirs)):
        assert a == b
    assert ours.sampler.generator.get_state().equal(theirs.sampler.generator.get_state())


class _Reversed(RandomSampler):
    def __iter__(self) -> Any:
        return iter(range(len(self.data_source) - 1, -1, -1))


@pytest.mark.parametrize(
    "sampler",
    [
        _Reversed(_Sized(10)),  # a subclass draws as it says
        RandomSampler(_Sized(10), replacement=True, num_samples=25),
        SequentialSampler(_Sized(10)),
    ],
    ids=["subclass", "replacement", "sequential"],
)
def test_other_samplers_are_iterated_as_they_are(sampler: Any) -> None:
    torch.manual_seed(5)
    theirs = list(BatchSampler(sampler, 4, False))
    torch.manual_seed(5)
    assert list(index_iterator(BatchSampler(sampler, 4, False))) == theirs


def _epoch_peak(workers: int) -> float:
    """MiB traced at most while a shuffled epoch of 2 million indices starts and hands out
    batches (the dataset and the loader made before)."""
    loader = DataLoader(
        _Sized(2_000_000),
        batch_size=32,
        shuffle=True,
        num_workers=workers,
        generator=torch.Generator().manual_seed(0),
        collate_fn=list,
        fetch_concurrency=4,
    )
    gc.collect()
    tracemalloc.start()
    try:
        iterator = iter(loader)
        batches = [next(iterator) for _ in range(50)]
        loader.state_dict()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        loader.close()
    assert all(type(i) is int for batch in batches for i in batch)
    return peak / MIB


def test_a_shuffled_epoch_of_two_million_indices_holds_under_20_mib() -> None:
    # The permutation is 15.3 MiB of int64 (as a list of Python ints: 76 MiB).
    assert _epoch_peak(workers=0) < 20


@starts_processes
def test_with_workers_the_parent_holds_under_20_mib_too() -> None:
    assert _epoch_peak(workers=2) < 20
