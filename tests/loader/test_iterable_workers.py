"""An IterableDataset with worker processes: PyTorch's batches, order and failures."""

from __future__ import annotations

import collections
import json
import multiprocessing
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader as TorchLoader  # noqa: E402

from feedline import ConfigurationError, DataLoader  # noqa: E402

from .._system import own_segments, starts_processes  # noqa: E402
from .._system import zombies as _zombies  # noqa: E402
from ._datasets import LambdaStream, ResumableStream, ShardedStream, Stream, keep_as_is  # noqa: E402
from ._procs import no_children_left  # noqa: E402

pytestmark = starts_processes


def _lists(loader: Any) -> list[Any]:
    return [b.tolist() for b in loader]


def _both(dataset: Any, **options: Any) -> tuple[list[Any], list[Any]]:
    """PyTorch's batches and feedline's, with the same seed and options."""
    found = []
    for cls in (TorchLoader, DataLoader):
        generator = torch.Generator().manual_seed(3)
        found.append(_lists(cls(dataset, generator=generator, **options)))
    return found[0], found[1]


@pytest.mark.parametrize("workers", [1, 2, 3])
@pytest.mark.parametrize(
    ("batch_size", "drop_last"), [(4, False), (4, True), (None, False), (30, False)]
)
def test_each_worker_takes_its_share_and_the_batches_come_as_pytorchs(
    workers: int, batch_size: int | None, drop_last: bool
) -> None:
    # 23 items: the workers' shares differ in length, so some run out before the others;
    # the draws show each worker seeded as PyTorch seeds it.
    theirs, ours = _both(
        ShardedStream(23), batch_size=batch_size, num_workers=workers, drop_last=drop_last
    )
    assert ours == theirs
    assert ours  # not vacuous


def test_a_stream_that_ignores_worker_info_is_repeated_per_worker_as_in_pytorch() -> None:
    theirs, ours = _both(Stream(10), batch_size=3, num_workers=2)
    assert ours == theirs
    assert collections.Counter(x for b in ours for x in b) == collections.Counter(
        list(range(10)) * 2
    )


def test_an_empty_stream_and_batches_as_they_come() -> None:
    assert _lists(DataLoader(Stream(0), batch_size=4, num_workers=2)) == []
    theirs, ours = _both(ShardedStream(41), batch_size=4, num_workers=2, in_order=False)
    assert sorted(ours) == sorted(theirs)
    no_children_left()


def test_the_streams_exception_is_raised_as_it_is_and_no_worker_is_left() -> None:
    for cls in (TorchLoader, DataLoader):
        it = iter(cls(ShardedStream(30, fail_at=9), batch_size=2, num_workers=2))
        with pytest.raises(KeyError, match="item 9 is missing"):
            list(it)
        # The iterator goes on after the error, so its workers live until it is closed:
        # PyTorch's when it is collected (which the traceback's reference can put off).
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()
        else:
            it.close()
            no_children_left()
        del it
    no_children_left()
    assert _zombies() == []


@pytest.mark.parametrize("workers", [0, 2])
def test_a_loop_that_catches_the_streams_exception_gets_what_pytorch_gives(workers: int) -> None:
    # A worker whose iterator raised is done; the other workers' batches still come.
    shm = own_segments()
    outcomes = []
    for cls in (TorchLoader, DataLoader):
        it = iter(cls(ShardedStream(30, fail_at=9), batch_size=2, num_workers=workers))
        seen: list[Any] = []
        while True:
            try:
                seen.append(next(it)[:, 0].tolist())
            except StopIteration:
                break
            except KeyError as error:
                # PyTorch's text from a worker holds its traceback; feedline's is the original.
                seen.append("KeyError: item 9" if "item 9 is missing" in str(error) else "?")
        outcomes.append(seen)
        del it
    assert outcomes[1] == outcomes[0]
    assert "KeyError: item 9" in outcomes[1]
    no_children_left()
    assert _zombies() == []
    assert own_segments() - shm == set()


@pytest.mark.parametrize("stop_after", [1, 4, 7])
def test_break_then_resume_gives_the_rest_of_the_epoch(stop_after: int) -> None:
    def options() -> dict[str, Any]:  # the same base seed for each loader
        return {"batch_size": 2, "num_workers": 2, "generator": torch.Generator().manual_seed(8)}

    shm = own_segments()
    whole = _lists(DataLoader(ShardedStream(19), **options()))
    loader = DataLoader(ShardedStream(19), **options())
    first = []
    for batch in loader:
        first.append(batch.tolist())
        if len(first) == stop_after:
            break
    state = json.loads(json.dumps(loader.state_dict()))  # plain data
    resumed = DataLoader(ShardedStream(19), **options())
    resumed.load_state_dict(state)
    assert first + _lists(resumed) == whole
    no_children_left()
    assert _zombies() == []
    assert own_segments() - shm == set()


def test_a_stateful_stream_resumes_itself_in_each_worker() -> None:
    options: dict[str, Any] = {"batch_size": 3, "num_workers": 2}
    whole = _lists(DataLoader(ResumableStream(12), **options))
    loader = DataLoader(ResumableStream(12), **options)
    first = []
    for batch in loader:
        first.append(batch.tolist())
        if len(first) == 3:
            break
    state = loader.state_dict()
    assert state["dataset_state"] is not None
    resumed = DataLoader(ResumableStream(12), **options)
    resumed.load_state_dict(state)
    assert first + _lists(resumed) == whole


def test_persistent_workers_serve_every_epoch() -> None:
    loader = DataLoader(Stream(7), batch_size=2, num_workers=2, persistent_workers=True)
    epochs = [_lists(loader) for _ in range(3)]
    assert epochs[0] == epochs[1] == epochs[2] == _lists(TorchLoader(Stream(7), 2, num_workers=2))
    assert len(multiprocessing.active_children()) == 2  # the same two, kept
    loader.close()
    no_children_left()


def test_a_batch_that_cannot_cross_to_this_process_raises_not_vanishes() -> None:
    loader = DataLoader(LambdaStream(12, bad=5), batch_size=2, num_workers=2, collate_fn=keep_as_is)
    with pytest.raises(Exception, match="cannot be sent to the parent process"):
        list(loader)
    no_children_left()


@pytest.mark.parametrize(("before", "after"), [(2, 3), (3, 2), (2, 0), (0, 2)])
def test_resuming_with_another_worker_count_is_refused(before: int, after: int) -> None:
    loader = DataLoader(ShardedStream(30), batch_size=2, num_workers=before)
    for k, _ in enumerate(loader):
        if k == 2:
            break
    state = loader.state_dict()
    resumed = DataLoader(ShardedStream(30), batch_size=2, num_workers=after)
    resumed.load_state_dict(state)
    with pytest.raises(ConfigurationError, match=f"num_workers={before}"):
        list(resumed)
    no_children_left()


class _Counting(torch.utils.data.IterableDataset[int]):
    """Counts how far it has been read."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.read = 0

    def __iter__(self) -> Any:
        for i in range(self.n):
            self.read = i + 1
            yield i


def test_an_iterable_dataset_in_the_loaders_process_is_read_only_a_few_batches_ahead() -> None:
    # A cheap dataset feeding a cheap collation: the queue between them must not grow to 64
    # batches, as a pipeline's default queue would. Prefetching asks for a few.
    dataset = _Counting(20_000)
    loader = DataLoader(dataset, batch_size=4)
    ahead = []
    for k, batch in enumerate(loader):
        if k in (200, 1000, 3000):
            ahead.append(dataset.read - (int(batch[-1]) + 1))
    assert len(ahead) == 3
    assert max(ahead) <= 4 * (4 + loader.in_flight + 2), ahead
