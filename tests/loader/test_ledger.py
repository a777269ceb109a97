"""The DataLoader's epoch ledger: each batch handed out once, and each defect it must catch."""

from __future__ import annotations

import json
from typing import Any

import pytest

torch = pytest.importorskip("torch")

from feedline import DataLoader, LedgerError  # noqa: E402
from feedline.loader import _epoch  # noqa: E402

from .._system import starts_processes, zombies  # noqa: E402
from ._datasets import ShardedStream  # noqa: E402
from ._procs import no_children_left  # noqa: E402

pytestmark = starts_processes


def _items(batches: list[Any]) -> list[int]:
    return [int(row[0]) for batch in batches for row in batch]


def _after_an_error_in_a_workers_first_batch() -> tuple[list[int], dict[str, Any], Any]:
    # Worker 0's first batch raises (item 0); a checkpoint is saved on the error, as a job
    # about to stop saves one. Returns what came before, the state and the iterator.
    loader = DataLoader(ShardedStream(32, fail_at=0), batch_size=4, num_workers=2)
    got: list[int] = []
    it = iter(loader)
    with pytest.raises(KeyError, match="item 0 is missing"):
        for batch in it:
            got += _items([batch])
    return got, json.loads(json.dumps(loader.state_dict())), it


def test_a_workers_batch_that_raised_is_fetched_again_on_resume() -> None:
    got, state, it = _after_an_error_in_a_workers_first_batch()
    assert state["worker_batches"] == [0, 0]
    rest_of_run = _items(list(it))  # the loop that caught it goes on: worker 0's stream ended
    assert rest_of_run == [i for i in range(32) if i % 2]
    resumed = DataLoader(ShardedStream(32), batch_size=4, num_workers=2)
    resumed.load_state_dict(state)
    rest = _items(list(resumed))
    assert sorted(got + rest) == list(range(32))  # the restarted job loses nothing
    no_children_left()
    assert zombies() == []


def test_the_ledger_catches_a_workers_raised_batch_counted_as_handed_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The defect, put back: the batch that raised counts in its worker's position, so a
    # resumed worker passes over its items (4 samples lost). The ledger refuses the state,
    # and the epoch that goes on ends with the ledger's error.
    monkeypatch.setattr(_epoch, "stream_batch_taken", lambda outcome: True)
    _, state, it = _after_an_error_in_a_workers_first_batch()
    assert state["worker_batches"] == [1, 0]
    lost = r"worker 0's stream: 1 batch\(s\) passed over .*never handed out \(first: batch 0\)"
    with pytest.raises(LedgerError, match=lost):
        list(it)
    resumed = DataLoader(ShardedStream(32), batch_size=4, num_workers=2)
    with pytest.raises(LedgerError, match=lost):
        resumed.load_state_dict(state)
    no_children_left()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_saved_position_that_moved_is_refused_naming_the_batch(workers: int) -> None:
    loader = DataLoader(list(range(40)), batch_size=4, num_workers=workers)
    for k, _ in enumerate(loader):
        if k == 5:
            break
    state = loader.state_dict()
    assert state["batches_yielded"] == 6
    for moved, pattern in (
        (8, r"2 batch\(s\) passed over by the saved position but never handed out .*batch 6"),
        (4, r"resumes at batch 4 but 2 batch\(s\) .*handed out already \(first: batch 4\)"),
    ):
        tampered = dict(state, batches_yielded=moved)
        with pytest.raises(LedgerError, match=pattern):
            DataLoader(list(range(40)), batch_size=4, num_workers=workers).load_state_dict(tampered)
    resumed = DataLoader(list(range(40)), batch_size=4, num_workers=workers)
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [
        [24, 25, 26, 27],
        [28, 29, 30, 31],
        [32, 33, 34, 35],
        [36, 37, 38, 39],
    ]
    stats = resumed.stats()
    assert stats is not None
    assert stats.ledger is not None
    assert (stats.ledger.planned, stats.ledger.delivered, stats.ledger.repeated) == (10, 10, 0)
    resumed.close()
    no_children_left()


class _Flaky(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, i: int) -> int:
        if i in (3, 9, 10, 11):
            raise OSError(f"no item {i}")
        return i


def test_failures_within_the_budget_and_raised_batches_are_counted_not_missing() -> None:
    loader = DataLoader(_Flaky(), batch_size=2, max_failures=None)
    assert [b.tolist() for b in loader] == [
        [0, 1],
        [2],
        [4, 5],
        [6, 7],
        [8],
        [12, 13],
        [14, 15],
        [16, 17],
        [18, 19],
    ]
    stats = loader.stats()
    assert stats is not None
    assert stats.ledger is not None
    assert stats.ledger.planned == 10
    assert stats.ledger.failed == 1  # batch 5 (items 10, 11) came out empty
    assert stats.ledger.missing == 0
    strict = DataLoader(_Flaky(), batch_size=2)
    it, raised = iter(strict), 0
    while True:
        try:
            next(it)
        except OSError:
            raised += 1
        except StopIteration:
            break
    assert raised == 3  # batches 1, 4 and 5 raised, and the loop went on: no ledger error
    stats = strict.stats()
    assert stats is not None
    assert stats.ledger is not None
    assert (stats.ledger.delivered, stats.ledger.failed, stats.ledger.missing) == (7, 3, 0)
