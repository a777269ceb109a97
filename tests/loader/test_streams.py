"""Iterable datasets as PyTorch iterates them: one iter() per pass, and the length warning."""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

from feedline import ConfigurationError, DataLoader  # noqa: E402
from feedline.loader import _epoch, _workers  # noqa: E402

from .._system import own_segments, starts_processes, zombies  # noqa: E402
from ._procs import no_children_left  # noqa: E402

pytestmark = starts_processes


class _OwnIterator(IterableDataset[int]):
    """Its own iterator: ``__iter__`` starts the pass over and returns ``self``."""

    def __init__(self, n: int, length: int | None = None) -> None:
        self.n, self.i, self.length = n, 0, length

    def __iter__(self) -> _OwnIterator:
        self.i = 0
        return self

    def __next__(self) -> int:
        if self.i >= self.n:
            raise StopIteration
        self.i += 1
        return self.i - 1

    def __len__(self) -> int:
        if self.length is None:
            raise TypeError("no length")
        return self.length


def _batches(loader: Any, most: int = 50) -> list[list[int]]:
    out = []
    for batch in loader:
        out.append(batch.tolist())
        if len(out) == most:
            break
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_that_is_its_own_iterator_gives_one_pass(workers: int) -> None:
    expected = _batches(TorchLoader(_OwnIterator(10), batch_size=4, num_workers=workers))
    assert len(expected) == 3 * max(1, workers)  # each worker iterates its whole copy
    got = _batches(DataLoader(_OwnIterator(10), batch_size=4, num_workers=workers))
    assert got == expected
    no_children_left()


class _Rows(IterableDataset[Any]):
    """NumPy rows, and items whose ``==`` says True to anything: neither ends a stream."""

    def __iter__(self) -> Iterator[Any]:
        for i in range(5):
            yield np.arange(4) + 4 * i

    class Loose:
        def __init__(self, i: int) -> None:
            self.i = i

        def __eq__(self, other: object) -> bool:
            return True

        __hash__ = object.__hash__


def _loose(n: int) -> IterableDataset[Any]:
    class LooseRows(IterableDataset[Any]):
        def __iter__(self) -> Iterator[Any]:
            return (_Rows.Loose(i) for i in range(n))

    return LooseRows()


@pytest.mark.parametrize("workers", [0, 1])
def test_items_are_never_compared_to_tell_the_end(workers: int) -> None:
    def rows(cls: Any) -> list[Any]:
        return [b.tolist() for b in cls(_Rows(), batch_size=2, num_workers=workers)]

    assert rows(DataLoader) == rows(TorchLoader)
    assert [x.i for x in DataLoader(_loose(5), batch_size=None)] == list(range(5))
    no_children_left()


def test_the_defect_put_back_is_caught_by_the_length_check(monkeypatch: pytest.MonkeyPatch) -> None:
    # iter() called again for each batch (islice does) starts the pass over: the first
    # items for ever. A dataset with a length says so at once.
    def again(dataset: Any) -> Any:
        return iter(dataset)

    monkeypatch.setattr(_epoch, "next_only", again)
    monkeypatch.setattr(_workers, "next_only", again)
    loader = DataLoader(_OwnIterator(10, length=3), batch_size=4)
    assert len(loader) == 1  # PyTorch keeps the dataset's length, 3, to compare with
    with pytest.warns(UserWarning, match=r"reported to be 3 .*but 4 samples have been fetched"):
        got = _batches(loader, most=5)
    assert got == [[0, 1, 2, 3]] * 5


@pytest.mark.parametrize("workers", [0, 2])
def test_more_batches_than_the_length_warn_as_in_pytorch(workers: int) -> None:
    def run(cls: Any) -> list[str]:
        loader = cls(_OwnIterator(12, length=2), batch_size=2, num_workers=workers)
        assert len(loader) == 1
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            batches = list(loader)
        assert len(batches) == 6 * max(1, workers)
        return [str(w.message) for w in record if "Length of IterableDataset" in str(w.message)]

    theirs, ours = run(TorchLoader), run(DataLoader)
    assert len(ours) == len(theirs) > 0
    assert "reported to be 2 " in ours[0]
    # PyTorch's own test of this warning matches its text with this pattern, as a user's
    # warning filter would: both messages must match it.
    pattern = r"but 3 samples have been fetched\."
    if workers:
        pattern += " For multiprocessing data-loading, this"
    assert re.search(pattern, theirs[0]), theirs[0]
    assert re.search(pattern, ours[0]), ours[0]
    if workers:
        assert "get_worker_info()" in ours[0]
    no_children_left()


def test_no_length_warning_unless_the_length_was_asked() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert len(list(DataLoader(_OwnIterator(12, length=6), batch_size=2))) == 6


class _SlowSecondWorker(IterableDataset[tuple[int, int]]):
    # Two workers share 0..9; worker 1 waits a while before its first item.
    def __iter__(self) -> Iterator[tuple[int, int]]:
        info = torch.utils.data.get_worker_info()
        assert info is not None
        if info.id == 1:
            time.sleep(0.4)
        return ((info.id, i) for i in range(5 * info.id, 5 * info.id + 5))


@starts_processes
def test_out_of_order_a_worker_s_batches_do_not_wait_for_a_slow_worker_s_first() -> None:
    # PyTorch's test_out_of_order_iterable_ds: with in_order=False, worker 0's batches come
    # as they are made, all before worker 1's first. (Taken with worker 1's "iterable made"
    # message, its first batch held the others up, in about half of the epochs.)
    kw: dict[str, Any] = {"num_workers": 2, "in_order": False}
    segments = own_segments()
    theirs = [int(w) for w, _ in TorchLoader(_SlowSecondWorker(), **kw)]
    assert theirs == [0] * 5 + [1] * 5
    for _ in range(3):
        assert [int(w) for w, _ in DataLoader(_SlowSecondWorker(), **kw)] == theirs
    no_children_left()
    assert zombies() == []
    assert own_segments() <= segments


def test_datapipes_are_refused_with_workers_rather_than_handed_out_by_each() -> None:
    # PyTorch shards a (deprecated) DataPipe between its workers; feedline does not, so it
    # refuses rather than hand every item out once per worker. Without workers, the same.
    pipes = pytest.importorskip("torch.utils.data.datapipes.iter")
    pipe = pipes.IterableWrapper(range(6))
    expected = [b.tolist() for b in TorchLoader(pipe, batch_size=2)]
    assert [b.tolist() for b in DataLoader(pipe, batch_size=2)] == expected
    for workers in (2, "auto"):
        with pytest.raises(ConfigurationError, match="does not shard DataPipes"):
            DataLoader(pipe, batch_size=2, num_workers=workers)
