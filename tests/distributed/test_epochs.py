"""Which samples each iteration of a DistributedLoader gives, beside DistributedSampler's."""

from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader, DistributedSampler  # noqa: E402

from feedline.distributed import DistributedLoader  # noqa: E402

from .._system import starts_processes  # noqa: E402
from . import _ranks  # noqa: E402
from ._ranks import Samples, index_of, run_ranks  # noqa: E402

pytestmark = starts_processes


def pytorch_after_break(
    count: int, world: int, batch: int, seed: int, epoch: int, stop_after: int, again: bool
) -> list[list[list[int]]]:
    """Per iteration, each step's samples over all ranks (sorted), as DistributedSampler and a
    DataLoader per rank give them when the loop breaks after ``stop_after`` steps and
    iterates again (after ``set_epoch(epoch)`` if ``again``)."""
    iterations: list[list[list[int]]] = [[], []]
    for rank in range(world):
        sampler = DistributedSampler(range(count), num_replicas=world, rank=rank, seed=seed)
        loader = DataLoader(range(count), batch_size=batch, sampler=sampler)
        sampler.set_epoch(epoch)
        first = []
        for step, b in enumerate(loader):
            first.append(b.tolist())
            if step + 1 == stop_after:
                break
        if again:
            sampler.set_epoch(epoch)
        for k, batches in enumerate([first, [b.tolist() for b in loader]]):
            for j, b in enumerate(batches):
                if j == len(iterations[k]):
                    iterations[k].append([])
                iterations[k][j] += b
    return [[sorted(s) for s in steps] for steps in iterations]


def feedline_steps(results: list[Any], iteration: int) -> list[list[int]]:
    steps = {len(r["batches"][iteration]) for r in results}
    assert len(steps) == 1, steps
    return [
        sorted(x for r in results for x in r["batches"][iteration][k]) for k in range(steps.pop())
    ]


@pytest.mark.parametrize("again", [True, False], ids=["set_epoch", "no_set_epoch"])
def test_iterating_again_after_a_break_starts_the_epoch_over_as_pytorch(again: bool) -> None:
    count, world, batch, seed, epoch = 40, 2, 4, 5, 1
    results = run_ranks(
        world,
        _ranks.break_then_iterate_again,
        count=count,
        batch_size=batch,
        seed=seed,
        epoch=epoch,
        stop_after=2,
        again=again,
    )
    expected = pytorch_after_break(count, world, batch, seed, epoch, 2, again)
    assert len(expected[1]) == 5  # the whole epoch, not its last 3 steps
    assert feedline_steps(results, 0) == expected[0]
    assert feedline_steps(results, 1) == expected[1]


def _loader() -> DistributedLoader[list[int]]:
    return DistributedLoader(Samples(20), batch_size=4, transform=index_of, collate_fn=list, seed=3)


def test_a_loaded_state_resumes_even_after_set_epoch_of_its_epoch() -> None:
    # set_epoch(e) then iter() starts e over, unless a state was loaded: that iteration
    # resumes it (a loop that resumes from a checkpoint calls set_epoch too), the next not.
    with _loader() as loader:
        loader.set_epoch(1)
        whole = list(loader)
    with _loader() as loader:
        loader.set_epoch(1)
        for step, _ in enumerate(loader):
            if step == 1:
                break
        state = json.loads(json.dumps(loader.state_dict()))
    with _loader() as loader:
        loader.load_state_dict(state)
        loader.set_epoch(1)
        assert list(loader) == whole[2:]
    with _loader() as loader:
        loader.load_state_dict(state)
        for step, _ in enumerate(loader):
            if step == 0:
                break
        loader.set_epoch(1)
        assert list(loader) == whole  # the resumed iteration broke: the epoch over
    with _loader() as loader:
        loader.load_state_dict(state)
        loader.set_epoch(2)  # another epoch than the state's: from its start
        assert len(list(loader)) == 5
