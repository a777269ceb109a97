"""Resumable pipelines: state_dict() mid-epoch, load_state_dict() in a new pipeline."""

from __future__ import annotations

import asyncio
import gc
import itertools
import json
import logging
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from feedline import ConfigurationError, LedgerError, PipelineBuilder

from .._interrupts import ctrl_c_after, where_the_ctrl_c_lands
from ._helpers import fail_on_three, square


class Calls:
    """Counts the calls of an op per input, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: Counter[Any] = Counter()

    def add(self, x: Any) -> None:
        with self.lock:
            self.count[x] += 1


def _jitter(x: int) -> None:
    time.sleep(random.Random(x).random() * 0.003)


def mixed_builder(n: int, calls: Calls, order: str, concurrency: int) -> PipelineBuilder[Any]:
    """Sync and async stages with random durations, then groups of 3."""

    def decode(x: int) -> int:
        calls.add(x)
        _jitter(x)
        return x * 10

    async def fetch(x: int) -> int:
        await asyncio.sleep(random.Random(-x).random() * 0.003)
        return x + 1

    def total(group: list[int]) -> tuple[int, ...]:
        return tuple(group)

    return (
        PipelineBuilder()
        .add_source(range(n))
        .pipe(decode, concurrency=concurrency, output_order=order)
        .pipe(fetch, concurrency=concurrency, output_order=order)
        .aggregate(3)
        .pipe(total)
    )


def take(pipeline: Any, count: int) -> list[Any]:
    """The first ``count`` items of an epoch; the epoch is then stopped."""
    out: list[Any] = []
    if count == 0:
        pipeline.start()
    else:
        for item in pipeline:
            out.append(item)
            if len(out) == count:
                break
    pipeline.stop()
    return out


def test_resume_from_every_step_equals_an_uninterrupted_run() -> None:
    n = 20  # 7 groups, the last of 2
    full = list(mixed_builder(n, Calls(), "input", 4).build(resumable=True))
    assert len(full) == 7
    assert [x for group in full for x in group] == [i * 10 + 1 for i in range(n)]
    for k in range(len(full) + 1):
        first = mixed_builder(n, Calls(), "input", 4).build(resumable=True)
        before = take(first, k)
        # Saved mid-epoch and sent through JSON, as a checkpoint would be.
        state = json.loads(json.dumps(first.state_dict()))
        calls = Calls()
        second = mixed_builder(n, calls, "input", 4).build(resumable=True)
        second.load_state_dict(state)
        after = list(second)
        assert before + after == full, f"resumed after {k} group(s)"
        # Only what was not delivered is decoded again, each item once.
        assert sorted(calls.count) == list(range(3 * k, n))
        assert set(calls.count.values()) <= {1}


@pytest.mark.parametrize("stop_after", [1, 5, 17, 33])
def test_completion_order_resume_loses_and_repeats_nothing(stop_after: int) -> None:
    n = 100
    first = mixed_builder(n, Calls(), "completion", 8).build(resumable=True)
    before = take(first, stop_after)
    state = first.state_dict()
    calls = Calls()
    second = mixed_builder(n, calls, "completion", 8).build(resumable=True)
    second.load_state_dict(state)
    after = list(second)
    received = Counter(x for group in before + after for x in group)
    assert received == Counter(i * 10 + 1 for i in range(n))
    delivered = {(x - 1) // 10 for group in before for x in group}
    assert set(calls.count) == set(range(n)) - delivered
    assert set(calls.count.values()) == {1}


def _position(state: dict[str, Any]) -> dict[str, Any]:
    # The state without its ledger (see test_the_ledger_* below).
    return {k: v for k, v in state.items() if k != "ledger"}


def test_state_between_epochs_starts_from_the_beginning() -> None:
    pipeline = PipelineBuilder().add_source(range(5)).pipe(square).build(resumable=True)
    fresh = {"version": 1, "done_below": 0, "done_ahead": []}
    assert _position(pipeline.state_dict()) == fresh  # never run
    assert list(pipeline) == [0, 1, 4, 9, 16]
    assert _position(pipeline.state_dict()) == fresh  # the epoch ended
    assert take(pipeline, 2) == [0, 1]
    mid = pipeline.state_dict()
    assert _position(mid) == {"version": 1, "done_below": 2, "done_ahead": []}
    # Iterating again without loading a state starts a new epoch, as a DataLoader does.
    assert list(pipeline) == [0, 1, 4, 9, 16]
    pipeline.load_state_dict(mid)
    assert pipeline.state_dict() == mid  # loaded, not yet used
    assert list(pipeline) == [4, 9, 16]
    assert _position(pipeline.state_dict()) == fresh


def test_failed_items_count_as_done_and_are_not_retried(caplog: pytest.LogCaptureFixture) -> None:
    calls = Calls()

    def picky(x: int) -> int:
        calls.add(x)
        if x % 5 == 0:
            raise ValueError(f"cannot take {x}")
        return x

    def build() -> Any:
        builder = PipelineBuilder().add_source(range(12)).pipe(picky, output_order="input")
        return builder.build(resumable=True, max_failures=None)

    with caplog.at_level(logging.WARNING, logger="feedline.pipeline"):
        first = build()
        assert take(first, 6) == [1, 2, 3, 4, 6, 7]
    # The sample is named by its value and its place in the source.
    assert "failed on sample 0 (source item 0)" in caplog.text
    state = first.state_dict()
    assert state["done_below"] == 8  # 5 failed, and counts as done
    # The stage may have run ahead of the consumer and failed on 10 already: done too.
    assert set(state["done_ahead"]) <= {10}
    calls.count.clear()
    second = build()
    second.load_state_dict(state)
    assert list(second) == [8, 9, 11]
    assert sorted(calls.count) == [i for i in range(8, 12) if i not in state["done_ahead"]]
    assert second.stats().stages[1].failures == len({10} - set(state["done_ahead"]))


def test_failure_past_the_budget_names_the_source_item() -> None:
    from feedline import PipelineFailure

    pipeline = PipelineBuilder().add_source(["a", "b", "c"]).pipe(str.upper)
    pipeline = pipeline.pipe(lambda s: 1 / (s != "B")).build(resumable=True)
    with pytest.raises(PipelineFailure) as caught:
        list(pipeline)
    assert "'B' (source item 1: 'b')" in str(caught.value)


def test_process_pool_stage_resumes() -> None:
    def build(pool: ProcessPoolExecutor) -> Any:
        return (
            PipelineBuilder()
            .add_source(range(10))
            .pipe(fail_on_three, executor=pool, concurrency=2, output_order="input")
            .pipe(square, executor=pool, concurrency=2, output_order="input")
            .build(resumable=True, max_failures=1)
        )

    with ProcessPoolExecutor(2) as pool:
        first = build(pool)
        assert take(first, 4) == [0, 1, 4, 16]  # 3 failed in a worker process
        state = first.state_dict()
        assert state["done_below"] == 5
        second = build(pool)
        second.load_state_dict(state)
        assert list(second) == [25, 36, 49, 64, 81]


def test_async_source_and_get_item_resume() -> None:
    async def numbers() -> AsyncIterator[int]:
        for i in range(8):
            await asyncio.sleep(0)
            yield i

    async def double(x: int) -> int:
        return 2 * x

    def build() -> Any:
        builder = PipelineBuilder().add_source(numbers()).pipe(double).aggregate(2)
        return builder.build(resumable=True)

    first = build()
    first.start()
    assert first.get_item(timeout=5) == [0, 2]
    assert first.get_item(timeout=5) == [4, 6]
    state = first.state_dict()
    first.stop()
    second = build()
    second.load_state_dict(state)
    second.start()
    assert second.get_item(timeout=5) == [8, 10]
    assert second.get_item(timeout=5) == [12, 14]
    with pytest.raises(EOFError):
        second.get_item(timeout=5)
    assert second.state_dict()["done_below"] == 0  # the epoch ended


def _gen(x: int) -> Iterator[int]:
    yield x


async def _agen(x: int) -> AsyncIterator[int]:
    yield x


@pytest.mark.parametrize(
    ("extend", "needle"),
    [
        (lambda b: b.pipe(_gen), "generator"),
        (lambda b: b.pipe(_agen), "async generator"),
        (lambda b: b.aggregate(2).disaggregate(), "disaggregate()"),
    ],
)
def test_build_refuses_stages_that_cannot_resume(extend: Any, needle: str) -> None:
    builder = extend(PipelineBuilder().add_source(range(3)))
    with pytest.raises(ConfigurationError, match="one item into one") as caught:
        builder.build(resumable=True)
    assert needle in str(caught.value)
    assert sorted(builder.build()) == [0, 1, 2]  # fine without resumable=True


def test_build_refuses_a_pipeline_source() -> None:
    inner = PipelineBuilder().add_source(range(3)).build()
    with pytest.raises(ConfigurationError, match="another Pipeline"):
        PipelineBuilder().add_source(inner).build(resumable=True)


def test_misuse_says_how_to_fix_it() -> None:
    plain = PipelineBuilder().add_source(range(3)).build()
    with pytest.raises(ConfigurationError, match=r"build\(resumable=True\)"):
        plain.state_dict()
    with pytest.raises(ConfigurationError, match=r"build\(resumable=True\)"):
        plain.load_state_dict({"version": 1, "done_below": 0, "done_ahead": []})
    pipeline = PipelineBuilder().add_source(range(3)).build(resumable=True)
    for bad in (None, {}, {"version": 2}, [1, 2]):
        with pytest.raises(ValueError, match="not a feedline pipeline state"):
            pipeline.load_state_dict(bad)  # type: ignore[arg-type]
    for below, ahead in ((-1, []), (True, []), (0, None), (0, ["1"])):
        with pytest.raises(ValueError, match="damaged"):
            pipeline.load_state_dict({"version": 1, "done_below": below, "done_ahead": ahead})
    with pipeline.auto_stop(), pytest.raises(RuntimeError, match="stop"):
        pipeline.load_state_dict(pipeline.state_dict())


def test_resume_skips_done_items_above_the_watermark() -> None:
    # Delivering item 1 moves 2 and 3 from 'ahead' to 'below' while the source runs; a
    # number that was done when the pass began must stay skipped.
    first = PipelineBuilder().add_source(range(6)).build(resumable=True)
    first.load_state_dict({"version": 1, "done_below": 1, "done_ahead": [2, 3]})
    assert list(first) == [1, 4, 5]


def test_stopping_part_way_keeps_the_position() -> None:
    # stop() from the loop body (or another thread, or a preemption handler) ends the loop
    # like the end of the epoch does, but the epoch did not end: its position stays.
    pipeline = PipelineBuilder().add_source(range(50)).pipe(square).build(resumable=True)
    got = []
    for x in pipeline:
        got.append(x)
        if len(got) == 7:
            pipeline.stop()
    assert got == [i * i for i in range(7)]
    assert pipeline.state_dict()["done_below"] == 7

    stopper = PipelineBuilder().add_source(range(50)).pipe(square).build(resumable=True)
    stopper.start()
    assert [stopper.get_item(timeout=5) for _ in range(3)] == [0, 1, 4]
    stopping = threading.Thread(target=stopper.stop)
    stopping.start()
    # Ends with EOFError if the stop lands while waiting, RuntimeError if before the call.
    with pytest.raises((EOFError, RuntimeError)):
        while True:
            stopper.get_item(timeout=5)
    stopping.join()
    assert stopper.state_dict()["done_below"] >= 3


def test_the_item_that_stops_the_run_is_not_counted_as_done() -> None:
    broken = threading.Event()
    broken.set()

    def flaky(x: int) -> int:
        if x == 3 and broken.is_set():
            raise OSError("the disk went away")
        return x

    def build() -> Any:
        builder = PipelineBuilder().add_source(range(8)).pipe(flaky, output_order="input")
        return builder.build(resumable=True)  # max_failures=0: the first failure stops it

    from feedline import PipelineFailure

    first = build()
    got: list[int] = []
    with pytest.raises(PipelineFailure):
        for x in first:
            got.append(x)
    # The failure is raised as soon as it happens, maybe before items already finished.
    assert got == list(range(len(got)))
    assert len(got) <= 3
    state = first.state_dict()
    assert _position(state) == {"version": 1, "done_below": len(got), "done_ahead": []}
    broken.clear()  # fixed: the resumed run reads item 3 again
    second = build()
    second.load_state_dict(state)
    assert list(second) == list(range(len(got), 8))


def test_state_dict_never_misses_a_loaded_state_while_epochs_start() -> None:
    pipeline = PipelineBuilder().add_source(range(10)).build(resumable=True)
    loaded = {"version": 1, "done_below": 5, "done_ahead": []}
    seen: list[int] = []
    running = True

    def save() -> None:
        while running:
            seen.append(pipeline.state_dict()["done_below"])
            time.sleep(0)  # let the epochs start

    pipeline.load_state_dict(loaded)
    saver = threading.Thread(target=save)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: widen any race
    saver.start()
    try:
        for _ in range(100):
            pipeline.load_state_dict(loaded)
            pipeline.start()  # nothing is received: the position stays 5 throughout
            pipeline.stop()
    finally:
        running = False
        saver.join()
        sys.setswitchinterval(interval)
    assert seen
    assert set(seen) == {5}


def test_a_resumable_pipeline_cannot_feed_another() -> None:
    inner = PipelineBuilder().add_source(range(3)).build(resumable=True)
    with pytest.raises(ConfigurationError, match="cannot be the source of another"):
        PipelineBuilder().add_source(inner)


def test_resumable_must_be_a_bool() -> None:
    with pytest.raises(ConfigurationError, match="True or False"):
        PipelineBuilder().add_source(range(3)).build(resumable="no")  # type: ignore[arg-type]


def test_stop_closes_a_generator_source() -> None:
    closed = threading.Event()

    def numbers() -> Iterator[int]:
        try:
            yield from range(1000)
        finally:
            closed.set()

    pipeline = PipelineBuilder().add_source(numbers()).build(resumable=True)
    assert take(pipeline, 2) == [0, 1]
    assert closed.is_set()


def test_stop_does_not_wait_for_a_long_skip() -> None:
    # Resuming far into an endless source: the skip is cut short by stop(), not finished.
    pipeline = PipelineBuilder().add_source(itertools.count()).build(resumable=True)
    pipeline.load_state_dict({"version": 1, "done_below": 10**15, "done_ahead": []})
    pipeline.start()
    time.sleep(0.1)
    pipeline.stop()  # hangs (and the test times out) if the skip ignores the stop


def test_the_ledger_counts_an_epoch_and_refuses_a_position_that_moved() -> None:
    def flaky(x: int) -> int:
        if x in (3, 7):
            raise ValueError(f"no {x}")
        return x

    pipeline = (
        PipelineBuilder().add_source(range(12)).pipe(flaky).build(resumable=True, max_failures=5)
    )
    assert take(pipeline, 4) == [0, 1, 2, 4]
    state = json.loads(json.dumps(pipeline.state_dict()))
    pipeline.stop()
    stats = pipeline.stats().ledger
    assert stats is not None
    assert stats.delivered == 4
    assert stats.failed in (1, 2)  # 3, and 7 if it failed ahead of the consumer before stop
    for moved, pattern in (
        (7, r"2 source item\(s\) passed over by the saved position .*first: source item 5"),
        (3, r"resumes at source item 3 but 2 source item\(s\) .*first: source item 3"),
    ):
        with pytest.raises(LedgerError, match=pattern):
            pipeline.load_state_dict(dict(state, done_below=moved))
    pipeline.load_state_dict(state)
    assert list(pipeline) == [5, 6, 8, 9, 10, 11]  # the rest, 7 failing again


def test_the_ledger_catches_an_item_delivered_twice_at_the_epochs_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A defect put in on purpose: the source passes on an item the saved state had done.
    from feedline.pipeline import _resume

    pipeline = PipelineBuilder().add_source(range(6)).build(resumable=True)
    assert take(pipeline, 3) == [0, 1, 2]
    state = pipeline.state_dict()
    pipeline.stop()
    real = _resume.Progress.skipper

    def leaky(self: Any) -> Any:
        done = real(self)
        return lambda number: number != 1 and done(number)

    monkeypatch.setattr(_resume.Progress, "skipper", leaky)
    pipeline.load_state_dict(state)
    with pytest.raises(LedgerError, match=r"1 source item\(s\) handed out twice .*source item 1"):
        list(pipeline)


def test_a_ctrl_c_while_an_item_is_counted_comes_after_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # A Ctrl-C that lands as the consumer counts an item (the position moved on, the ledger's
    # record made) left the item counted and not handed out: lost on resume. It comes a
    # moment after the item is handed out, and the state saved then resumes exactly.
    import signal

    from feedline._ledger import Ledger

    handler = signal.getsignal(signal.SIGINT)
    pipeline = PipelineBuilder().add_source(range(20)).pipe(square).build(resumable=True)
    it = iter(pipeline)
    got = [next(it)]
    monkeypatch.setattr(Ledger, "deliver", ctrl_c_after(Ledger.deliver))
    with pytest.raises(KeyboardInterrupt):
        got.append(next(it))
        time.sleep(2)  # the loop's body, where the Ctrl-C comes
    monkeypatch.undo()
    state = json.loads(json.dumps(pipeline.state_dict()))
    it.close()
    assert signal.getsignal(signal.SIGINT) is handler  # the epoch's relay is gone with it
    resumed = PipelineBuilder().add_source(range(20)).pipe(square).build(resumable=True)
    resumed.load_state_dict(state)
    assert sorted(got + list(resumed)) == [i * i for i in range(20)]


def test_a_ctrl_c_while_get_item_counts_an_item_comes_after_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same window without a for loop: start(), get_item() on the main thread, stop().
    import signal

    from feedline._ledger import Ledger

    handler = signal.getsignal(signal.SIGINT)
    pipeline = PipelineBuilder().add_source(range(20)).pipe(square).build(resumable=True)
    pipeline.start()
    got = [pipeline.get_item()]
    monkeypatch.setattr(Ledger, "deliver", ctrl_c_after(Ledger.deliver))
    with pytest.raises(KeyboardInterrupt):
        got.append(pipeline.get_item())
        time.sleep(2)  # the consumer's own code, where the Ctrl-C comes
    monkeypatch.undo()
    state = json.loads(json.dumps(pipeline.state_dict()))
    pipeline.stop()
    assert signal.getsignal(signal.SIGINT) is handler  # stop() gave the relay back
    resumed = PipelineBuilder().add_source(range(20)).pipe(square).build(resumable=True)
    resumed.load_state_dict(state)
    assert sorted(got + list(resumed)) == [i * i for i in range(20)]
    # A pipeline dropped without stop() gives it back too.
    dropped = PipelineBuilder().add_source(range(20)).pipe(square).build(resumable=True)
    dropped.start()
    assert dropped.get_item() == 0
    assert signal.getsignal(signal.SIGINT) is not handler
    del dropped
    gc.collect()
    assert signal.getsignal(signal.SIGINT) is handler


def test_a_ctrl_c_held_by_get_item_comes_once_stop_has_ended(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The consumer stops at once after the item a Ctrl-C was held on: the Ctrl-C comes as
    # stop() ends, not part-way through it (which left the run held and its threads up).
    from feedline._ledger import Ledger

    def slow(x: int) -> int:
        time.sleep(0.3)
        return x

    pipeline = PipelineBuilder().add_source(range(40)).pipe(slow, concurrency=4)
    built = pipeline.build(resumable=True)
    built.start()
    got = [built.get_item()]
    monkeypatch.setattr(Ledger, "deliver", ctrl_c_after(Ledger.deliver))
    got.append(built.get_item())
    monkeypatch.undo()
    with pytest.raises(KeyboardInterrupt):
        built.stop()  # ops under way for up to 0.3 s: the held Ctrl-C is due within it
    assert [t.name for t in threading.enumerate() if t.name.startswith("feedline-")] == []
    state = json.loads(json.dumps(built.state_dict()))
    built.load_state_dict(state)  # no epoch runs
    assert sorted(got + list(built)) == list(range(40))


@pytest.mark.parametrize("leave", ["break", "end"])
def test_a_held_ctrl_c_reaches_the_loop_however_it_is_left(
    monkeypatch: pytest.MonkeyPatch, leave: str
) -> None:
    # Held back as an item is counted, it is sent again once the item is out: not into the
    # close that a loop left with break runs in __del__ (Python would print it and go on),
    # and into the loop's except when that item was the last.
    from feedline._ledger import Ledger

    which = 0 if leave == "break" else 4  # the first item, or the last of 5
    monkeypatch.setattr(Ledger, "deliver", ctrl_c_after(Ledger.deliver, lambda n: n == which))
    pipeline = PipelineBuilder().add_source(range(5)).pipe(square).build(resumable=True)
    where = where_the_ctrl_c_lands(pipeline, leave)
    assert where == (("after the loop", 1) if leave == "break" else ("the loop", 5))
