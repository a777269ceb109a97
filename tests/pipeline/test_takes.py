"""Cheap calls go a take at a time: a job takes several items with one lock and one count.

What a take may not change: every item comes out once or is counted as failed, each result
goes on as it is made, what waits behind a full output stays bounded, a stop ends the take,
and a source's values go on as soon as they are made.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import pytest

from feedline import PipelineBuilder, PipelineFailure
from feedline.pipeline._settings import TAKE_MOST, TAKE_SECONDS
from feedline.pipeline._stages import _threaded
from feedline.pipeline._stages._threaded import per_take


def test_a_take_holds_its_share_of_time_of_calls_and_one_until_timed() -> None:
    assert per_take(-1.0) == 1  # not timed yet
    assert per_take(TAKE_SECONDS) == 1
    assert per_take(10 * TAKE_SECONDS) == 1
    assert per_take(TAKE_SECONDS / 4.5) == 4
    assert per_take(0.0) == TAKE_MOST
    assert per_take(1e-9) == TAKE_MOST


def test_items_of_a_take_that_fail_are_counted_and_the_others_come_out_once() -> None:
    def op(x: int) -> int:
        if x % 7 == 0:
            raise ValueError(f"unlucky {x}")
        return x

    p = (
        PipelineBuilder()
        .add_source(range(20_000))
        .pipe(op, concurrency=2, name="op")
        .add_sink()
        .build(max_failures=None)
    )
    with p.auto_stop():
        seen = Counter(p)
        stats = p.stats()
    assert set(seen) == {x for x in range(20_000) if x % 7}
    assert max(seen.values()) == 1
    assert stats["op"].failures == len(range(0, 20_000, 7))


def test_an_op_that_waits_for_the_consumer_to_use_earlier_results_goes_on() -> None:
    # A pool of 6 buffers the consumer gives back: a take that held its results until its last
    # call ended would wait for ever (here: 2 s, then the item fails the run).
    free = threading.BoundedSemaphore(6)

    def fill(x: int) -> int:
        if not free.acquire(timeout=2):
            raise TimeoutError(f"item {x}: no buffer came back")
        return x

    p = PipelineBuilder().add_source(range(500)).pipe(fill).add_sink(2).build()
    out = []
    with p.auto_stop():
        for x in p:
            out.append(x)
            free.release()
    assert sorted(out) == list(range(500))


def test_results_held_behind_a_full_output_stay_within_one_per_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # What the memory budget counts: a result per call in flight, not a take's worth.
    most = [0]
    flush = _threaded.ThreadedStage._flush_ready

    def spy(self: _threaded.ThreadedStage) -> bool:
        most[0] = max(most[0], len(self._ready))
        return flush(self)

    monkeypatch.setattr(_threaded.ThreadedStage, "_flush_ready", spy)
    p = PipelineBuilder().add_source(range(5_000)).pipe(abs, concurrency=1).add_sink(4).build()
    with p.auto_stop():
        for i, _ in enumerate(p):
            if i % 50 == 0:
                time.sleep(0.002)
    assert most[0] <= 1


def test_a_take_makes_no_call_after_the_failure_that_stops_the_run() -> None:
    called: list[int] = []

    def op(x: int) -> int:
        called.append(x)
        if x == 3_000:
            raise ValueError("the budget's one failure")
        return x

    p = PipelineBuilder().add_source(range(10_000)).pipe(op, name="op").add_sink().build()
    with pytest.raises(PipelineFailure), p.auto_stop():
        for _ in p:
            pass
    assert max(called) == 3_000  # one call at a time, in order: none after the failing one


def test_a_full_output_behind_a_slow_consumer_loses_nothing() -> None:
    p = (
        PipelineBuilder()
        .add_source(range(3_000))
        .pipe(lambda x: x * 2, concurrency=4)
        .pipe(lambda x: x + 1, concurrency=3)
        .add_sink(1)
        .build()
    )
    out = []
    with p.auto_stop():
        for i, x in enumerate(p):
            out.append(x)
            if i % 500 == 0:
                time.sleep(0.02)  # the stages fill their outputs while the consumer waits
    assert sorted(out) == [2 * x + 1 for x in range(3_000)]


def test_a_source_that_waits_before_its_next_value_hands_on_those_it_made() -> None:
    # A cheap source (a few values a take) that then waits for the consumer: the values made
    # before the wait must reach the consumer, not wait with it.
    go = threading.Event()

    def source() -> object:
        yield from range(203)  # not a whole number of takes
        if not go.wait(timeout=30):
            raise TimeoutError("the consumer never got the values made before the wait")
        yield from range(203, 210)

    p = PipelineBuilder().add_source(source()).pipe(lambda x: x).add_sink().build()
    out = []
    with p.auto_stop():
        for x in p:
            out.append(x)
            if len(out) == 203:
                go.set()
    assert sorted(out) == list(range(210))


@pytest.mark.parametrize("concurrency", [1, 4])
def test_a_stop_in_the_middle_of_takes_leaves_no_thread(concurrency: int) -> None:
    before = set(threading.enumerate())
    p = PipelineBuilder().add_source(range(10**9)).pipe(abs, concurrency=concurrency).build()
    for n, _ in enumerate(p):
        if n == 5_000:
            break
    p.stop()
    assert set(threading.enumerate()) <= before
