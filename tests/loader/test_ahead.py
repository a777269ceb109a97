"""How far ahead of the consumer batches are drawn (``_ahead.FetchAhead``).

The rules are tested by driving a :class:`FetchAhead` as the source stage and the fetcher do;
the DataLoader's behaviour behind a late item, and before a slow consumer, with real threads.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

pytest.importorskip("torch")

from feedline import DataLoader
from feedline.loader._ahead import ITEMS_PER_CALL, FetchAhead

from ._datasets import Slow


class _Source:
    """Draws from a :class:`FetchAhead` as the pipeline's source stage does."""

    def __init__(self, ahead: FetchAhead) -> None:
        self.ahead = ahead
        self.wakes = 0
        ahead.wake_with(self._wake)
        self._iterator = iter(ahead)
        self.drawn: list[Any] = []

    def _wake(self) -> None:
        self.wakes += 1

    def draw(self) -> int:
        """Draw while ready; how many were drawn."""
        n = 0
        while self.ahead.ready():
            task = next(self._iterator, None)
            if task is None:
                break
            self.drawn.append(task)
            n += 1
        return n


def _ahead(limit: list[int], ready_most: int = 2, held_most: int = 1000) -> FetchAhead:
    tasks = ((n, list(range(4 * n, 4 * n + 4))) for n in range(10_000))
    return FetchAhead(tasks, lambda: limit[0], 4, ready_most, held_most)


def test_a_consumer_that_does_not_wait_has_prefetch_factor_batches_ahead() -> None:
    ahead = _ahead([100])
    source = _Source(ahead)
    assert source.draw() == 2  # prefetch_factor, though the threads have room for 25
    ahead.fetched(8)
    assert source.draw() == 0  # fetched, but not taken
    ahead.took()
    assert source.wakes == 1
    assert source.draw() == 1
    assert [n for n, _ in source.drawn] == [0, 1, 2]  # in order


def test_while_the_consumer_waits_batches_are_drawn_as_the_threads_have_room() -> None:
    limit = [8]
    ahead = _ahead(limit)
    source = _Source(ahead)
    source.draw()
    ahead.waits()
    assert source.wakes == 1
    # Items under way: up to the calls at once plus a batch (the next queues for a thread).
    assert source.draw() == 1
    assert ahead.items == 12
    ahead.fetched(4)
    assert source.draw() == 1
    limit[0] = 16  # more calls at once
    ahead.poke()
    assert source.draw() == 2
    assert ahead.items == 20
    ahead.took()  # it took one: it does not wait now
    ahead.fetched(20)
    assert source.draw() == 0  # 5 ahead, more than prefetch_factor
    assert ahead.drawn - ahead.taken == 5


def test_what_is_ahead_holds_items_per_call_and_never_more_than_held_most() -> None:
    ahead = _ahead([4])
    source = _Source(ahead)
    ahead.waits()
    for _ in range(100):
        source.draw()
        ahead.fetched(ahead.items)  # everything drawn is fetched at once; nothing taken
    assert ahead.drawn == ITEMS_PER_CALL * 4 // 4  # items per call at once, in batches of 4
    capped = _ahead([400], held_most=30)
    source = _Source(capped)
    capped.waits()
    for _ in range(100):
        source.draw()
        capped.fetched(capped.items)
    assert capped.drawn == 30


def test_the_source_stage_is_woken_once_per_stop() -> None:
    ahead = _ahead([100])
    source = _Source(ahead)
    ahead.took()  # nothing stopped yet: nothing to wake
    assert source.wakes == 0
    source.draw()  # stops at prefetch_factor
    ahead.fetched(4)  # still 2 ahead: stays stopped
    assert source.wakes == 0
    ahead.took()
    ahead.took()
    assert source.wakes == 1  # woken once, though it may go on twice over
    source.draw()
    assert source.wakes == 1


class _Late(Slow):
    """Items of ``delay`` seconds, but item ``index`` takes ``late`` more; records when each
    was fetched."""

    def __init__(self, n: int, delay: float, index: int, late: float) -> None:
        super().__init__(n, delay)
        self.index, self.late = index, late
        self.done: dict[int, float] = {}

    def __getitem__(self, i: int) -> int:
        if i == self.index:
            time.sleep(self.late)
        value = super().__getitem__(i)
        with self.lock:
            self.done[i] = time.monotonic()
        return value


def test_a_late_item_does_not_leave_the_threads_idle() -> None:
    # Batch 1 waits 0.5 s for its item 4, and the consumer for it. With prefetch_factor
    # batches in flight, one more batch would be fetched meanwhile; the threads fetch many.
    dataset = _Late(400, 0.005, 4, 0.5)
    batches = [b.tolist() for b in DataLoader(dataset, batch_size=4)]
    assert batches == [list(range(k, k + 4)) for k in range(0, 400, 4)]  # in order, all
    before = sum(1 for t in dataset.done.values() if t < dataset.done[4])
    assert before > 10 * 4, before


def test_threads_that_draw_ahead_end_with_the_epoch() -> None:
    # A loop left while batches are drawn ahead: the epoch's threads stop (the conftest
    # counts them after every test), and a new epoch starts afresh.
    loader = DataLoader(Slow(400, 0.002), batch_size=4)
    for k, _ in enumerate(loader):
        if k == 5:
            break
    assert [b.tolist() for b in loader][:2] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_batch_sampler_that_does_not_say_its_size_is_measured() -> None:
    # Batches of 8 from a plain list of lists (no batch_size to read): counted as 8 items
    # each once drawn, not 1, so that what is ahead while the consumer waits stays at 16
    # items per call at once.
    tasks = ((n, list(range(8 * n, 8 * n + 8))) for n in range(1000))
    ahead = FetchAhead(tasks, lambda: 4, 1, 2, 10_000)
    source = _Source(ahead)
    ahead.waits()
    for _ in range(100):
        source.draw()
        ahead.fetched(ahead.items)
    assert ahead.drawn == ITEMS_PER_CALL * 4 // 8


def test_the_fetch_stage_starts_its_workers_as_batches_come() -> None:
    # Batches of one item: the stage may hold 2,048 of them, but starts a coroutine per
    # batch under way, not 2,048 as the epoch begins (that took 40 ms before the first).
    loader = DataLoader(list(range(64)), batch_size=1)
    it = iter(loader)
    assert next(it).item() == 0
    loop = it._fetcher.loop  # type: ignore[attr-defined]
    assert loop is not None

    async def tasks() -> int:
        return len(asyncio.all_tasks())

    assert asyncio.run_coroutine_threadsafe(tasks(), loop).result(timeout=10) < 100
    assert [b.item() for b in it] == list(range(1, 64))
    stats = loader.stats()
    assert stats is not None
    assert stats["fetch"].concurrency >= 2048


def test_batches_start_in_the_order_drawn_once_the_first_is_delivered() -> None:
    # Batches held back until the first is delivered are woken together; one drawn just
    # then (its stage worker already woken) must not start before them.
    from feedline.loader._fetch import BatchFetcher

    calls: list[int] = []

    class Recording:
        def __getitem__(self, i: int) -> int:
            calls.append(i)
            return i

    fetcher = BatchFetcher(Recording(), 4, wait_for_delivery=True, start=1)

    async def main() -> None:
        gate = asyncio.get_running_loop().create_future()

        async def drawn_later() -> Any:
            await gate
            return await fetcher.fetch((2, [2]))

        first = asyncio.ensure_future(fetcher.fetch((0, [0])))
        second = asyncio.ensure_future(fetcher.fetch((1, [1])))
        third = asyncio.ensure_future(drawn_later())
        await first
        # The first is delivered (its callback runs next), and the third's worker wakes
        # (scheduled behind it, but before the second, which that callback wakes).
        fetcher.first_delivered()
        gate.set_result(None)
        await asyncio.gather(second, third)

    try:
        asyncio.run(main())
    finally:
        fetcher.close()
    assert calls == [0, 1, 2]
