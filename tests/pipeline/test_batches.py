"""Cheap coroutine stages take their input in batches, and a batch never holds work back."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import pytest

from feedline import PipelineBuilder, PipelineFailure
from feedline.pipeline._queue import Channel

from .test_failures import pipeline_threads


async def _anoop(x: int) -> int:
    return x


@pytest.fixture
def batch_sizes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The sizes of the batches every channel hands out, in the order taken."""
    sizes: list[int] = []
    take = Channel.try_get_many

    def counted(self: Channel, limit: int) -> list[Any]:
        got = take(self, limit)
        sizes.append(len(got))
        return got

    monkeypatch.setattr(Channel, "try_get_many", counted)
    return sizes


def test_cheap_coroutine_stages_take_batches_and_keep_order_at_concurrency_one(
    batch_sizes: list[int],
) -> None:
    n = 3000
    b = PipelineBuilder().add_source(range(n))
    for i in range(3):
        b.pipe(_anoop, name=f"s{i}")
    p = b.build()
    with p.auto_stop():
        assert list(p) == list(range(n))
        stats = p.stats()
    assert max(batch_sizes) > 1
    for stage in stats.stages[1:]:
        assert (stage.items_in, stage.items_out, stage.max_in_flight) == (n, n, 1)
        assert stage.in_flight == 0
        assert 0 < stage.task_p50 < 0.01  # each call timed on its own, not the batch


def test_a_failure_inside_a_batch_skips_that_item_alone(batch_sizes: list[int]) -> None:
    async def odd_sevens(x: int) -> int:
        if x % 100 == 7:
            raise ValueError(f"bad item {x}")
        return x

    n = 3000
    p = PipelineBuilder().add_source(range(n)).pipe(odd_sevens).build(max_failures=1000)
    with p.auto_stop():
        assert list(p) == [x for x in range(n) if x % 100 != 7]
        stage = p.stats().stages[1]
    assert max(batch_sizes) > 1
    assert (stage.failures, stage.items_in, stage.items_out) == (30, n, n - 30)


def test_a_failure_inside_a_batch_past_the_budget_raises_from_the_loop() -> None:
    async def fails_late(x: int) -> int:
        if x >= 500 and x % 3 == 0:
            raise ValueError(f"bad item {x}")
        return x

    b = PipelineBuilder().add_source(range(3000)).pipe(fails_late, name="late")
    p = b.build(max_failures=4)
    got = []
    with pytest.raises(PipelineFailure, match="late") as raised:
        for x in p:
            got.append(x)
    assert (raised.value.stage, raised.value.num_failures) == ("late", 5)
    # Nothing lost or reordered before the failure (the failures within the budget skipped).
    assert got == [x for x in range(3000) if x < 500 or x % 3][: len(got)]
    assert pipeline_threads() == []


def _wait_for(ready: Any, what: str) -> Any:
    """A coroutine that polls ``ready()`` on the loop, or raises after 2 seconds."""

    async def wait() -> None:
        deadline = time.monotonic() + 2
        while not ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"waited 2 s for {what}")
            await asyncio.sleep(0.0005)

    return wait()


def test_a_call_that_waits_inside_a_batch_first_hands_on_the_results_before_it(
    batch_sizes: list[int],
) -> None:
    # Every 100th item waits until the consumer has received the item before it: a batch
    # that held its results until its last call returned would never let that happen.
    seen = -1

    async def rendezvous(x: int) -> int:
        if x % 100 == 99:
            await _wait_for(lambda: seen == x - 1, f"the consumer to receive item {x - 1}")
        return x

    n = 2000
    p = PipelineBuilder().add_source(range(n)).pipe(rendezvous, name="meet").build()
    with p.auto_stop():
        for x in p:
            seen = x
        stage = p.stats().stages[1]
    assert seen == n - 1
    assert (stage.failures, stage.items_out) == (0, n)
    assert max(batch_sizes) > 1


def test_while_a_call_waits_the_rest_of_its_batch_goes_to_the_other_workers(
    batch_sizes: list[int],
) -> None:
    # Every 20th item waits until the item after it is done, which only another worker can
    # do while this one waits: a batch that kept its unstarted items would never let it.
    done: set[int] = set()

    async def after_next(x: int) -> int:
        if x % 20 == 10:
            await _wait_for(lambda: x + 1 in done, f"item {x + 1}")
        done.add(x)
        return x

    n = 2000
    p = PipelineBuilder().add_source(range(n)).pipe(after_next, concurrency=2).build()
    with p.auto_stop():
        assert sorted(p) == list(range(n))
        stage = p.stats().stages[1]
    assert (stage.failures, stage.max_in_flight) == (0, 2)
    assert max(batch_sizes) > 1


def test_a_consumer_that_stops_early_or_a_stop_mid_epoch_leaves_no_thread() -> None:
    def build() -> Any:
        b = PipelineBuilder().add_source(range(1_000_000))
        for _ in range(3):
            b.pipe(_anoop, concurrency=4)
        return b.build()

    p = build()
    for i, _ in enumerate(p):
        if i == 5000:
            break
    assert pipeline_threads() == []

    p = build()
    stopper = threading.Timer(0.2, p.stop)
    stopper.start()
    received = sum(1 for _ in p)  # ends quietly when stopped from another thread
    stopper.join()
    assert 0 < received < 1_000_000
    assert pipeline_threads() == []


def _ident(x: Any) -> Any:
    return x


@pytest.mark.parametrize("op", [_ident, _anoop])
def test_a_cheap_source_passes_every_value_once_in_order(op: Any) -> None:
    n = 5000
    p = PipelineBuilder().add_source(range(n)).pipe(op).build()
    with p.auto_stop():
        assert list(p) == list(range(n))
        source = p.stats().stages[0]
    assert (source.items_in, source.items_out, source.in_flight) == (n, n, 0)


def test_a_source_error_after_many_values_propagates() -> None:
    def source() -> Any:
        yield from range(1000)
        raise KeyError("broken source")

    got: list[int] = []
    p = PipelineBuilder().add_source(source()).pipe(_anoop).build()
    with pytest.raises(KeyError, match="broken source"):
        for x in p:
            got.append(x)
    assert got == list(range(len(got)))
    assert pipeline_threads() == []


def test_a_cheap_source_that_stalls_counts_every_value_it_handed_on() -> None:
    # Its job counts a few calls as one task; a value it put before the call that stalls is
    # counted in already (the stall watchdog and stats() show "N in, M out" then).
    stall = threading.Event()

    def source() -> Any:
        yield from range(301)
        stall.wait(10)
        yield 301

    p = PipelineBuilder().add_source(source()).pipe(_ident).add_sink(512).build()
    with p.auto_stop():
        try:
            got = [p.get_item(timeout=10) for _ in range(301)]
            assert got == list(range(301))
            stats = p.stats().stages[0]
            assert stats.items_in >= stats.items_out == 301, stats
        finally:
            stall.set()  # before the stop, which waits for the source's call
    assert pipeline_threads() == []


def test_values_of_a_cheap_source_that_turns_slow_are_not_held_back() -> None:
    # 300 instant values make the source cheap; once a value takes 0.15 s, each must go on
    # as soon as it is made, not with the ones after it.
    def source() -> Any:
        yield from range(300)
        for _ in range(5):
            time.sleep(0.15)
            yield time.perf_counter()

    p = PipelineBuilder().add_source(source()).pipe(_ident).add_sink(64).build()
    delays = [time.perf_counter() - x for x in p if isinstance(x, float)]
    assert len(delays) == 5
    assert max(delays) < 0.1, delays  # held back, the first would wait 0.6 s


def test_results_of_a_coroutine_op_that_turns_slow_without_waiting_are_not_held_back() -> None:
    # 300 instant calls make the op cheap, so that it runs in bursts; once each call blocks
    # for 10 ms without awaiting (no chance for the loop to flush), the burst must end after
    # that call rather than hold the next 15 results behind it.
    async def turns_slow(x: int) -> Any:
        if x < 300:
            return x
        time.sleep(0.01)
        return time.perf_counter()

    p = PipelineBuilder().add_source(range(340)).pipe(turns_slow).add_sink(64).build()
    delays = [time.perf_counter() - x for x in p if isinstance(x, float)]
    assert len(delays) == 40
    # Held back in bursts, a result would wait up to 150 ms for the rest of its burst.
    assert sorted(delays)[-3] < 0.05, delays
