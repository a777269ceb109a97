"""The tuner (``concurrency="auto"``) in real runs: it decides, respects what it is told, and
carries its settings to the next epoch.

A real run's figures are the machine's: a loaded machine shows a decision later, and may
rightly decide otherwise (more threads of an op that computes pay there). So these tests run
until the decision they are about shows (:func:`run_until`, with a deadline far beyond what
an idle machine needs), and assert what holds on any machine; the decisions themselves, from
figures given by hand, are asserted in ``test_tuner_decisions.py``.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from feedline import Auto, ConfigurationError, Pipeline, PipelineBuilder, PipelineStats

# run_until's deadline, then what a test does around it.
pytestmark = pytest.mark.timeout(180)

WITHIN = 60.0
"""Seconds a real run may take to show a decision (an idle machine: one or two)."""


def run_for(
    pipeline: Pipeline[Any], seconds: float, every: Callable[[float], None] | None = None
) -> PipelineStats:
    """Iterate for ``seconds``; returns the last stats."""
    t0 = time.perf_counter()
    for _ in pipeline:
        t = time.perf_counter() - t0
        if every is not None:
            every(t)
        if t >= seconds:
            return pipeline.stats()
    raise AssertionError("the source ended early")


def run_until(
    pipeline: Pipeline[Any],
    done: Callable[[PipelineStats], bool],
    every: Callable[[float], None] | None = None,
    within: float = WITHIN,
) -> PipelineStats:
    """Iterate until ``done(stats)`` (looked at 20 times a second); returns those stats.

    Fails after ``within`` seconds: a decision that does not come at all is a failure, one
    that a loaded machine shows later is not.
    """
    t0 = time.perf_counter()
    look = 0.0
    for _ in pipeline:
        t = time.perf_counter() - t0
        if every is not None:
            every(t)
        if t >= look:
            stats = pipeline.stats()
            if done(stats):
                return stats
            assert t < within, f"not within {within:.0f} s: {stats}"
            look = t + 0.05
    raise AssertionError("the source ended early")


def decided(pattern: str) -> Callable[[PipelineStats], bool]:
    """For ``run_until``: whether a decision the stats show matches ``pattern``."""
    return lambda stats: any(re.search(pattern, d) for d in stats.tuning)


def sampler(pipeline: Pipeline[Any], stage: str, seen: list[int]) -> Callable[[float], None]:
    """For ``every``: appends ``stage``'s concurrency to ``seen`` 20 times a second."""

    def every(t: float) -> None:
        if len(seen) < t * 20:
            seen.append(pipeline.stats()[stage].concurrency)

    return every


def limited_server(k: int, latency: float) -> Callable[[int], Any]:
    """An async read from a server that serves ``k`` requests at once, each ``latency`` s."""
    gates: dict[asyncio.AbstractEventLoop, asyncio.Semaphore] = {}

    async def read(i: int) -> int:
        # One gate per event loop: each epoch of a pipeline runs its own loop.
        gate = gates.setdefault(asyncio.get_running_loop(), asyncio.Semaphore(k))
        async with gate:
            await asyncio.sleep(latency)
        return i

    return read


def waiting(seconds: float, name: str) -> Callable[[int], int]:
    """An op named ``name`` that waits ``seconds`` (off the cores, the GIL released)."""

    def op(i: int) -> int:
        time.sleep(seconds)
        return i

    op.__name__ = name
    return op


def tuned_read() -> Pipeline[int]:
    """Endless reads from a server that serves 16 at once, 20 ms each, tuned."""
    read = limited_server(16, 0.02)
    return (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(read, concurrency="auto", name="read")
        .add_sink()
        .build()
    )


class Decisions:
    """For ``run_until``: every decision the stats showed (they show the last few)."""

    def __init__(self) -> None:
        self.seen: list[str] = []

    def update(self, stats: PipelineStats) -> None:
        self.seen += [d for d in stats.tuning if d not in self.seen]

    def has(self, pattern: str) -> bool:
        return any(re.search(pattern, d) for d in self.seen)


def test_a_read_is_raised_while_it_pays_and_a_raise_that_does_not_is_undone() -> None:
    log = Decisions()

    def both(stats: PipelineStats) -> bool:
        log.update(stats)
        return log.has(r"read: \d+ -> \d+ kept \(") and log.has(r"read: \d+ did not pay")

    stats = run_until(tuned_read(), both)
    assert stats["read"].concurrency >= 1


def test_a_threaded_stage_that_waits_is_raised() -> None:
    gate = threading.BoundedSemaphore(6)

    def fetch(i: int) -> int:
        with gate:
            time.sleep(0.01)
        return i

    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(fetch, concurrency=Auto(start=2))
        .add_sink()
        .build()
    )
    stats = run_until(pipeline, decided(r"fetch: 2 -> \d+ kept"))
    assert stats.stages[1].kind == "pipe"


def test_a_read_raised_on_a_cold_start_is_not_tried_back() -> None:
    # Calls that wait leave the cores idle: a raise kept against the first window stands.
    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(waiting(0.02, "read"), concurrency=Auto(start=2, high=64))
        .add_sink()
        .build()
    )
    stats = run_until(pipeline, lambda s: s["read"].concurrency >= 16)
    assert not any("again" in d for d in stats.tuning), stats.tuning


@pytest.mark.skipif(
    getattr(sys, "_is_gil_enabled", lambda: True)(),
    reason="under the GIL a second thread of Python code pays only on a loaded machine",
)
def test_python_code_on_free_threaded_python_gets_a_thread_per_core() -> None:
    # A loop of Python bytecode: without the GIL a second thread doubles its rate, and the
    # tuner keeps it (judging what the raise did, as it does under the GIL, where a second
    # thread only makes each call longer: see the decisions' table and its simulations).
    def parse(i: int) -> int:
        total = 0
        for k in range(3000):
            total += k * k % 7
        return total

    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(parse, concurrency=Auto(start=1, high=2))
        .add_sink()
        .build()
    )
    try:
        run_until(pipeline, decided(r"parse: (back to 2|1 -> 2 kept \()"))
    except AssertionError:
        # A shared machine may have had its second core busy the whole time: then two plain
        # threads do not scale either, and there was nothing for the tuner to find.
        scale = _plain_threads_scale(parse)
        if scale < 1.4:
            pytest.skip(f"the second core was busy: two plain threads ran {scale:.2f}x one")
        raise
    assert pipeline.settled_concurrency()["parse"] == 2


def _plain_threads_scale(fn: Callable[[int], object], rounds: int = 5) -> float:
    """The median over ``rounds`` of how many more calls of ``fn`` two threads end than one."""

    def rate(threads: int, seconds: float = 0.3) -> float:
        counts = [0] * threads
        deadline = time.perf_counter() + seconds

        def loop(k: int) -> None:
            while time.perf_counter() < deadline:
                fn(0)
                counts[k] += 1

        workers = [threading.Thread(target=loop, args=(k,)) for k in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return sum(counts) / seconds

    ratios = sorted(rate(2) / max(rate(1), 1.0) for _ in range(rounds))
    return ratios[rounds // 2]


def test_explicit_concurrency_is_never_changed_and_bounds_hold() -> None:
    seen: list[int] = []
    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(limited_server(64, 0.02), concurrency=Auto(low=2, high=6), name="read")
        .pipe(limited_server(64, 0.01), concurrency=3, name="fixed")
        .add_sink()
        .build()
    )
    # The read limits the output: it goes to its bound.
    stats = run_until(
        pipeline, lambda s: s["read"].concurrency == 6, every=sampler(pipeline, "read", seen)
    )
    assert stats["fixed"].concurrency == 3
    assert not any(d.startswith("fixed") or " fixed:" in d for d in stats.tuning)
    assert seen
    assert all(2 <= c <= 6 for c in seen)


def test_the_tuner_does_not_raise_when_the_consumer_is_the_slower_side() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(limited_server(64, 0.005), concurrency="auto", name="read")
        .add_sink()
        .build()
    )
    seen: list[int] = []
    watch = sampler(pipeline, "read", seen)

    def slow_consumer(t: float) -> None:  # 50 items/s, where 4 reads of 5 ms make 800
        watch(t)
        time.sleep(0.02)

    stats = run_for(pipeline, 2.0, every=slow_consumer)
    assert max(seen) <= 4, stats  # only lowered (while as fast), never raised
    raised = [d for d in stats.tuning if "kept" in d and "as fast" not in d]
    assert not raised, stats.tuning


def test_it_reconverges_when_the_latency_rises_tenfold() -> None:
    latency = [0.01]
    gate: list[asyncio.Semaphore] = []

    async def read(i: int) -> int:
        if not gate:
            gate.append(asyncio.Semaphore(128))
        async with gate[0]:
            await asyncio.sleep(latency[0])
        return i

    def decode(i: int) -> int:  # a fixed rate downstream: at most ~600 items/s
        time.sleep(0.0015)
        return i

    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(read, concurrency="auto", name="read")
        .pipe(decode, concurrency=1)
        .add_sink()
        .build()
    )
    held: list[int] = []

    def change(t: float) -> None:
        if pipeline.settled_concurrency()["read"] > 4:  # raised once for 10 ms
            latency[0] = 0.1
        if latency[0] == 0.1:
            held.append(pipeline.stats()["read"].concurrency)

    # At 100 ms a read needs ~10x the calls in flight to feed the same decode (a trial
    # under way may hold it lower at any one moment: the most it held counts).
    stats = run_until(pipeline, lambda s: max(held, default=0) >= 32, every=change)
    assert stats["decode"].concurrency == 1


@pytest.mark.parametrize("size", [1 << 10, 1 << 20, 64 << 20])
def test_items_in_queues_and_in_flight_stay_within_the_memory_budget(size: int) -> None:
    live = [0, 0]  # bytes alive, peak
    # Re-entrant: on free-threaded Python an array is freed by the thread that made it, the
    # next time that thread runs Python code, which can be inside make's block below.
    lock = threading.RLock()

    def gone(n: int) -> None:
        with lock:
            live[0] -= n

    async def make(i: int) -> np.ndarray[Any, Any]:
        await asyncio.sleep(0.01)
        array = np.empty(size, dtype=np.uint8)
        with lock:
            live[0] += size
            live[1] = max(live[1], live[0])
        weakref.finalize(array, gone, size)
        return array

    budget = max(1 << 16, 16 * size)
    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(make, concurrency="auto")
        .add_sink()
        .build(memory_budget=budget)
    )
    run_for(pipeline, 2.0)
    pipeline.stop()
    # The consumer holds one item beyond the budget (the one its loop has).
    assert live[1] <= budget + size, (live[1], budget)


def test_a_tuned_stage_is_lowered_when_items_grow_past_the_budget() -> None:
    size = [1 << 10]

    async def make(i: int) -> bytes:
        await asyncio.sleep(0.02)
        return bytes(size[0])

    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(make, concurrency="auto")
        .add_sink()
        .build(memory_budget=4 << 20)
    )

    def grow(t: float) -> None:
        if pipeline.settled_concurrency()["make"] > 4:  # raised while the items were small
            size[0] = 1 << 20

    stats = run_until(pipeline, decided("for the memory budget"), every=grow)
    assert stats["make"].concurrency <= 4, stats


def test_the_tuner_ends_with_the_pipeline_and_leaves_no_thread(
    caplog: pytest.LogCaptureFixture,
) -> None:
    before = threading.active_count()
    caplog.set_level(logging.DEBUG, logger="feedline.pipeline")
    pipeline = tuned_read()

    def logged(stats: PipelineStats) -> bool:  # one DEBUG line per change
        return any("tuner:" in r.getMessage() for r in caplog.records)

    for _epoch in range(2):
        run_until(pipeline, logged)  # break mid-epoch: the run (and its tuner) stops
    pipeline.stop()
    deadline = time.monotonic() + 2
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before


def test_autotune_tunes_the_stages_without_a_number() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(limited_server(16, 0.02), name="read")
        .pipe(limited_server(64, 0.001), concurrency=2, name="fixed")
        .add_sink()
        .build(autotune=True)
    )
    stats = run_until(pipeline, lambda s: s["read"].concurrency >= 8)
    assert stats["fixed"].concurrency == 2
    plain = PipelineBuilder().add_source(range(3)).pipe(limited_server(1, 0)).add_sink().build()
    assert list(plain) == [0, 1, 2]
    assert plain.stats().stages[1].concurrency == 1  # no autotune: one call at a time


def test_stats_show_the_tuner_s_decisions_and_the_bottleneck_s_next_slot() -> None:
    stats = run_until(tuned_read(), decided(r"read: \d+ -> \d+ kept \("))
    text = str(stats)
    assert re.search(r"tuner: [\d.]+s read: \d+ -> \d+ kept \(", text), text
    assert "one more slot would add up to" in text


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"memory_budget": 100}, "64 KiB at least"),
        ({"memory_budget": 1.5e9}, "an int"),
        ({"cpu_budget": 0}, "positive number of cores"),
        ({"autotune": "yes"}, "True or False"),
    ],
)
def test_bad_budgets_are_refused(kwargs: dict[str, Any], message: str) -> None:
    builder = PipelineBuilder().add_source(range(3)).pipe(str)
    with pytest.raises(ConfigurationError, match=message):
        builder.build(**kwargs)


def test_bad_auto_settings_are_refused() -> None:
    with pytest.raises(ConfigurationError, match="high < low"):
        Auto(low=4, high=2)
    with pytest.raises(ConfigurationError, match="within low"):
        Auto(low=2, high=4, start=8)
    with pytest.raises(ConfigurationError, match="int >= 1"):
        Auto(low=0)
    with pytest.raises(ConfigurationError, match="'auto'"):
        PipelineBuilder().add_source(range(3)).pipe(str, concurrency="fast")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="output_order='input'"):

        def gen(x: int) -> Any:
            yield x

        PipelineBuilder().add_source(range(3)).pipe(gen, concurrency="auto", output_order="input")


def test_an_ordered_tuned_stage_keeps_the_order() -> None:
    async def jitter(i: int) -> int:
        await asyncio.sleep(0.001 * (i % 7))
        return i

    pipeline = (
        PipelineBuilder()
        .add_source(range(3000))
        .pipe(jitter, concurrency="auto", output_order="input")
        .add_sink()
        .build()
    )
    assert list(pipeline) == list(range(3000))


def test_the_next_epoch_starts_where_the_tuner_left_the_last() -> None:
    pipeline = tuned_read()
    run_until(pipeline, lambda s: pipeline.settled_concurrency()["read"] >= 8)  # from 4
    settled = pipeline.settled_concurrency()["read"]  # a trial under way is left out
    for _ in pipeline:  # the next epoch, at its first item
        assert pipeline.stats()["read"].concurrency >= settled
        break
    pipeline.stop()


def test_two_stages_at_the_same_rate_are_raised_in_turn(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="feedline.pipeline")
    read, decode = waiting(0.01, "read"), waiting(0.002, "decode")
    pipeline = (
        PipelineBuilder().add_source(range(10**9)).pipe(read).pipe(decode).build(autotune=True)
    )

    # Both go past where they would stall (read 8, decode 2), and are kept there (a raise
    # under trial is left out).
    def both(stats: PipelineStats) -> bool:
        settled = pipeline.settled_concurrency()
        return settled["read"] >= 16 and settled["decode"] >= 4

    run_until(pipeline, both)
    lines = [r.getMessage() for r in caplog.records if " kept" in r.getMessage()]
    assert {line.split()[1] for line in lines} == {"read:", "decode:"}, lines


def test_autotune_leaves_an_ordered_generator_at_one_call_and_the_builder_as_it_was() -> None:
    def twice(i: int) -> Any:
        yield i
        yield -i

    builder = PipelineBuilder().add_source(range(200)).pipe(twice, output_order="input")
    tuned = builder.build(autotune=True)
    assert list(tuned) == [x for i in range(200) for x in (i, -i)]  # in order, and it ends
    assert tuned.stats()["twice"].concurrency == 1
    plain = PipelineBuilder().add_source(range(50)).pipe(limited_server(64, 0.001), name="read")
    plain.build(autotune=True)
    again = plain.build()  # without autotune: not tuned, though built with it before
    assert len(list(again)) == 50
    assert again.stats()["read"].concurrency == 1
    assert not again.stats().tuning


def test_items_the_budget_cannot_measure_are_named_once(caplog: pytest.LogCaptureFixture) -> None:
    class Opaque:
        __slots__ = ("data",)

        def __init__(self) -> None:
            self.data = bytes(1000)

    async def make(i: int) -> Opaque:
        await asyncio.sleep(0.005)
        return Opaque()

    pipeline = (
        PipelineBuilder()
        .add_source(range(400))
        .pipe(make, concurrency="auto")
        .build(memory_budget=1 << 20)
    )
    assert len(list(pipeline)) == 400  # about half a second: the tuner looks a few times
    warnings = [r.getMessage() for r in caplog.records if "cannot be measured" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "Opaque" in warnings[0]


def test_busy_over_a_window_is_a_share_of_the_slots_the_stage_had(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from feedline.pipeline.stats import StageCounters

    now = [100.0]  # the counters' clock, moved by hand: a stalled test thread moves nothing
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    counters = StageCounters("s", "pipe", 256)
    now[0] += 1.0  # 1 s at 256 slots
    counters.busy_time = 128.0  # half of them busy
    before = counters.snapshot(None, _channel_stats())
    counters.set_concurrency(4)
    now[0] += 1.0  # then 1 s at 4 slots
    counters.busy_time += 4.0  # every one of them busy
    after = counters.snapshot(None, _channel_stats())
    window = after.since(before)
    assert window.slot_seconds == pytest.approx(4.0)
    assert window.busy == pytest.approx(1.0)
    assert before.busy == pytest.approx(0.5)


def _channel_stats() -> Any:
    from feedline.pipeline import ChannelStats

    return ChannelStats(1, 0, 0, 0, 0.0, 0.0, 0.0, 1.0)


def test_a_low_bound_the_pool_cannot_hold_is_refused() -> None:
    builder = PipelineBuilder().add_source(range(3)).pipe(str, concurrency=Auto(low=8))
    with pytest.raises(ConfigurationError, match="low=8"):
        builder.build(num_threads=4)


def test_a_read_raised_at_once_has_the_queue_after_it_grow_with_it() -> None:
    # A read of 30 ms feeding a check of 2 ms goes up several times at once (see
    # test_tuner_decisions); the queue after it grows with it, past its first size.
    read, check = waiting(0.03, "read"), waiting(0.002, "check")
    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(read, concurrency=Auto(start=2, high=64), output_order="input", name="read")
        .pipe(check, concurrency=Auto(start=2, high=4), name="check")
        .add_sink()
        .build()
    )
    run_until(pipeline, lambda s: s["read"].concurrency > 8)
    stats = pipeline.stats()  # the run stopped: the tuner changes nothing while it is read
    assert stats["read"].queue.capacity >= min(stats["read"].concurrency, 64), stats


def test_the_next_epoch_builds_the_queue_after_a_tuned_stage_for_its_calls() -> None:
    # Reads tuned up from 4 in one epoch start the next at that concurrency; the queue after
    # them must hold a result per call then, as the build sizes it (it was built at the
    # first epoch's size, and the reads waited on it).
    pipeline = (
        PipelineBuilder()
        .add_source(range(10**9))
        .pipe(limited_server(16, 0.02), concurrency="auto", name="read")
        .pipe(lambda i: i, concurrency=1, name="check")
        .add_sink()
        .build()
    )
    # Raised from 4, past the queue's first size of 8. (A trial under way is left out: the
    # next epoch starts where the tuner kept the stage.)
    run_until(pipeline, lambda s: pipeline.settled_concurrency()["read"] >= 12)
    settled = pipeline.settled_concurrency()["read"]
    for _ in pipeline:  # the next epoch, at its first item
        stats = pipeline.stats()
        assert stats["read"].queue.capacity >= stats["read"].concurrency >= settled, stats
        break
    pipeline.stop()


class _Counters:
    """What the tuner reads of a stage's counters, set by hand."""

    def __init__(self, concurrency: int) -> None:
        self.lock = threading.Lock()
        self.concurrency = concurrency
        self.busy_time = 0.0
        self.calls = 0
        self.ewma = 0.0

    def slots(self, t: float) -> float:
        return 0.0


class _Stage:
    """A stage as the tuner sees it: a name, counters, a concurrency to set."""

    def __init__(self, concurrency: int, name: str = "s") -> None:
        self.name = name
        self.counters = _Counters(concurrency)

    def set_concurrency(self, concurrency: int) -> None:
        self.counters.concurrency = concurrency


def test_a_queue_between_two_tuned_stages_keeps_room_for_the_larger() -> None:
    # 64 reads feed 2 decodes: a trial of the decode at 4, put back at 2, must leave the
    # queue between them at 64 (it went down to the build's size, and the reads waited).
    from feedline.pipeline._growth import Growth
    from feedline.pipeline._queue import Channel
    from feedline.pipeline._tuner import Knob, Tuner
    from feedline.pipeline._tuning import Tuning

    stages = [_Stage(1), _Stage(4), _Stage(2)]
    channels = [Channel(f"{i}->", 4, Growth(4, 1024, 1 << 30) if i < 2 else None) for i in range(3)]
    read, decode = Knob(stages[1], 1, 1, 128), Knob(stages[2], 2, 1, 8)
    tuner = Tuner([read, decode], channels, Tuning(cpu_budget=2), stages)
    tuner._set(read, 64)
    assert channels[0].capacity == channels[1].capacity == 64
    tuner._set(decode, 4)
    tuner._set(decode, 2)
    assert channels[1].capacity == 64
    tuner._set(read, 8)  # and the read lowered: the queue shrinks to what it needs
    assert channels[1].capacity == 8


def test_a_stage_halved_for_the_memory_budget_frees_the_queue_before_it() -> None:
    # 64 reads of 100 KiB feed 8 decodes of 4 MiB results, 40 MiB allowed: halving the
    # decode to 4 fits, with the queue between them at its first size (sized for the reads
    # instead, it took 6 MiB back, and the decode was halved once more).
    from feedline.pipeline._growth import Growth
    from feedline.pipeline._queue import Channel
    from feedline.pipeline._tuner import Knob, Tuner
    from feedline.pipeline._tuning import Tuning

    stages = [_Stage(1), _Stage(4), _Stage(8)]
    channels = [Channel(f"{i}->", 4, Growth(4, 1024, 1 << 40) if i < 2 else None) for i in range(3)]
    read, decode = Knob(stages[1], 1, 1, 128), Knob(stages[2], 2, 1, 8)
    tuning = Tuning(cpu_budget=2, memory_budget=40 << 20)
    tuner = Tuner([read, decode], channels, tuning, stages)
    tuner._set(read, 64)
    tuner._sizes[1].nbytes, tuner._sizes[2].nbytes = 100 << 10, 4 << 20
    tuner._keep_within(40 << 20)
    assert tuner._held_bytes() <= 40 << 20
    assert (read.concurrency, decode.concurrency) == (64, 4), tuner.decisions
    assert channels[1].capacity == 4
