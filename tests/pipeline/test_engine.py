from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import AsyncIterator, Iterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import pytest

from feedline import PipelineBuilder

from . import _helpers


def ident(x: Any) -> Any:
    return x


class InFlight:
    """Counts concurrent calls of an op and remembers the peak."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.now = 0
        self.peak = 0

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.peak = max(self.peak, self.now)

    def exit(self) -> None:
        with self.lock:
            self.now -= 1


def test_sync_pipeline_yields_every_item() -> None:
    p = PipelineBuilder().add_source(range(100)).pipe(_helpers.square, concurrency=4).build()
    assert sorted(p) == [i * i for i in range(100)]


def test_empty_source() -> None:
    p = PipelineBuilder().add_source([]).pipe(ident, concurrency=3).aggregate(4).build()
    assert list(p) == []


@pytest.mark.parametrize("concurrency", [1, 4])
def test_input_order_kept_under_random_durations(concurrency: int) -> None:
    rng = random.Random(0)
    delays = [rng.random() * 0.004 for _ in range(200)]

    def slow(i: int) -> int:
        time.sleep(delays[i])
        return i

    async def aslow(i: int) -> int:
        await asyncio.sleep(delays[i])
        return i

    p = (
        PipelineBuilder()
        .add_source(range(200))
        .pipe(slow, concurrency=concurrency, output_order="input")
        .pipe(aslow, concurrency=concurrency, output_order="input")
        .build()
    )
    assert list(p) == list(range(200))


def test_completion_order_differs_under_random_durations() -> None:
    def slow(i: int) -> int:
        time.sleep(0.02 if i % 2 == 0 else 0.0)
        return i

    out = list(PipelineBuilder().add_source(range(20)).pipe(slow, concurrency=4).build())
    assert sorted(out) == list(range(20))
    assert out != list(range(20))


@pytest.mark.parametrize("concurrency", [1, 3, 8])
def test_sync_stage_reaches_and_never_exceeds_concurrency(concurrency: int) -> None:
    meter = InFlight()

    def op(x: int) -> int:
        meter.enter()
        time.sleep(0.005)
        meter.exit()
        return x

    p = PipelineBuilder().add_source(range(60)).pipe(op, concurrency=concurrency).build()
    assert sorted(p) == list(range(60))
    assert meter.peak == concurrency
    assert p.stats()["op"].max_in_flight == concurrency


@pytest.mark.parametrize("concurrency", [1, 5, 16])
def test_async_stage_reaches_and_never_exceeds_concurrency(concurrency: int) -> None:
    meter = InFlight()

    async def op(x: int) -> int:
        meter.enter()
        await asyncio.sleep(0.005)
        meter.exit()
        return x

    p = PipelineBuilder().add_source(range(80)).pipe(op, concurrency=concurrency).build()
    assert sorted(p) == list(range(80))
    assert meter.peak == concurrency


def test_a_source_that_waits_leaves_every_thread_of_the_pool_to_the_stages() -> None:
    # The source blocks in next() until both slots of the stage run at once: read on a
    # thread of the pool (two threads, so one for each slot), it would hold one of them and
    # the two calls could never meet.
    both = threading.Barrier(2, timeout=10)
    met = threading.Event()

    def source() -> Iterator[int]:
        yield 0
        yield 1
        assert met.wait(10), "the stage's two calls never ran at once"
        yield 2

    def meet(x: int) -> str:
        if x < 2:
            both.wait()
            met.set()
        return threading.current_thread().name

    p = PipelineBuilder().add_source(source()).pipe(meet, concurrency=2).build(num_threads=2)
    names = list(p)
    assert len(names) == 3
    assert all(name.startswith("feedline-worker") for name in names), names
    source_stats = p.stats().stages[0]
    assert (source_stats.items_in, source_stats.items_out) == (3, 3)
    assert [t.name for t in threading.enumerate() if t.name.startswith("feedline")] == []


def test_blocked_consumer_bounds_what_the_source_produces() -> None:
    produced = 0

    def source() -> Iterator[int]:
        nonlocal produced
        for i in range(10_000):
            produced += 1
            yield i

    p = (
        PipelineBuilder()
        .add_source(source())
        .pipe(ident, concurrency=2)
        .pipe(ident, concurrency=2)
        .add_sink(3)
        .build()
    )
    with p.auto_stop():
        assert p.get_item(timeout=5) is not None
        # The consumer stalls; the pipeline must stall too: wait until the source has made
        # nothing for 0.2 s (a machine that pauses the process may take a while to fill the
        # queues), then check it stays stalled.
        deadline = time.monotonic() + 10
        first = -1
        while produced != first:
            assert time.monotonic() < deadline, f"the source never stopped: {produced} items"
            first = produced
            time.sleep(0.2)
        time.sleep(0.2)
        assert produced == first, "the source kept producing while nobody consumed"
        # What may be held: the queues (as grown), and per stage of 2 slots two calls and two
        # results waiting for room, the source's value waiting for room, the item taken.
        queues = sum(s.queue.capacity for s in p.stats().stages)
        assert produced <= queues + 2 * (2 + 2) + 1 + 1, (produced, queues)
        assert queues <= 3 * 64  # and the queues themselves are bounded


def test_mixed_sync_async_and_generator_stages() -> None:
    def split(x: int) -> Iterator[int]:
        yield x
        yield -x

    async def double(x: int) -> int:
        await asyncio.sleep(0)
        return 2 * x

    async def explode(x: int) -> AsyncIterator[int]:
        for k in range(3):
            await asyncio.sleep(0)
            yield x * 10 + k

    p = (
        PipelineBuilder()
        .add_source(range(1, 11))
        .pipe(split, concurrency=2)
        .pipe(double, concurrency=3)
        .pipe(explode, concurrency=2)
        .pipe(ident, concurrency=2)
        .build()
    )
    expected = sorted(2 * s * x * 10 + k for x in range(1, 11) for s in (1, -1) for k in range(3))
    assert sorted(p) == expected


def test_async_source() -> None:
    async def source() -> AsyncIterator[int]:
        for i in range(50):
            await asyncio.sleep(0)
            yield i

    p = PipelineBuilder().add_source(source()).pipe(_helpers.square, concurrency=2).build()
    assert sorted(p) == [i * i for i in range(50)]


def test_aggregate_and_disaggregate() -> None:
    p = PipelineBuilder().add_source(range(10)).aggregate(4).build()
    assert list(p) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    p = PipelineBuilder().add_source(range(10)).aggregate(4, drop_last=True).build()
    assert list(p) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    p = PipelineBuilder().add_source(range(10)).aggregate(3).disaggregate().build()
    assert list(p) == list(range(10))


def test_pipeline_as_source_of_another() -> None:
    inner = PipelineBuilder().add_source(range(30)).pipe(_helpers.square, concurrency=3).build()
    outer = PipelineBuilder().add_source(inner).pipe(ident, concurrency=2).aggregate(10).build()
    batches = list(outer)
    assert sorted(x for b in batches for x in b) == [i * i for i in range(30)]


def test_each_iteration_is_one_epoch() -> None:
    p = PipelineBuilder().add_source(range(5)).pipe(ident, output_order="input").build()
    assert [list(p) for _ in range(3)] == [[0, 1, 2, 3, 4]] * 3


def test_two_iterators_at_once_are_refused() -> None:
    p = PipelineBuilder().add_source(range(5)).build()
    it = iter(p)
    next(it)
    with pytest.raises(RuntimeError, match="already being iterated"):
        iter(p)
    it.close()  # type: ignore[attr-defined]


def test_get_item_timeout_and_end() -> None:
    def slow(x: int) -> int:
        time.sleep(0.5)
        return x

    p = PipelineBuilder().add_source([1]).pipe(slow).build()
    with pytest.raises(RuntimeError, match="not running"):
        p.get_item()
    with p.auto_stop():
        with pytest.raises(TimeoutError):
            p.get_item(timeout=0.05)
        assert p.get_item(timeout=5) == 1
        with pytest.raises(EOFError):
            p.get_item(timeout=5)


def test_get_item_after_another_threads_stop_says_the_epoch_ended() -> None:
    # A consumer thread reading with get_item() while another thread stops the pipeline
    # ends its loop on EOFError, whether the stop came during a wait or between two calls.
    p = PipelineBuilder().add_source(range(10**9)).pipe(ident).build()
    p.start()
    assert p.get_item(timeout=5) == 0
    stopper = threading.Thread(target=p.stop)
    stopper.start()
    stopper.join(10)
    for _ in range(2):
        with pytest.raises(EOFError, match="stopped"):
            p.get_item(timeout=5)
    p.start()  # the next epoch
    assert p.get_item(timeout=5) == 0
    p.stop()


def test_stop_is_idempotent_and_restartable() -> None:
    p = PipelineBuilder().add_source(range(100)).pipe(ident).build()
    p.stop()
    p.start()
    p.start()
    assert p.get_item(timeout=5) == 0
    p.stop()
    p.stop()
    assert sorted(p) == list(range(100))


def test_process_pool_stage() -> None:
    with ProcessPoolExecutor(2) as pool:
        p = (
            PipelineBuilder()
            .add_source(range(20))
            .pipe(_helpers.pid_and_square, executor=pool, concurrency=2)
            .build()
        )
        out = list(p)
    assert sorted(v for _, v in out) == [i * i for i in range(20)]
    import os

    assert all(pid != os.getpid() for pid, _ in out)


def test_dedicated_thread_executor_runs_stage_in_its_thread() -> None:
    names: set[str] = set()

    def where(x: int) -> int:
        names.add(threading.current_thread().name)
        return x

    with ThreadPoolExecutor(1, thread_name_prefix="transfer") as ex:
        p = (
            PipelineBuilder()
            .add_source(range(50))
            .pipe(ident, concurrency=2)
            .pipe(where, executor=ex)
            .build()
        )
        assert sorted(p) == list(range(50))
    assert len(names) == 1
    assert names.pop().startswith("transfer")


def test_stats_report_every_stage() -> None:
    def slow(x: int) -> int:
        time.sleep(0.002)
        return x

    p = (
        PipelineBuilder()
        .add_source(range(100))
        .pipe(ident, name="fast")
        .pipe(slow, concurrency=2, name="slow")
        .build()
    )
    assert len(list(p)) == 100
    stats = p.stats()
    assert [s.name for s in stats.stages] == ["source", "fast", "slow"]
    slow_stats = stats["slow"]
    assert slow_stats.items_in == slow_stats.items_out == 100
    assert slow_stats.task_p50 >= 0.0015
    assert slow_stats.task_p50 <= slow_stats.task_p90 <= slow_stats.task_p99
    assert stats.bottleneck == "slow"
    assert "slow" in str(stats)
    assert "\n100 items in " in str(stats)
    with pytest.raises(KeyError, match="no stage named"):
        stats["missing"]


def test_stats_count_batches_as_batches() -> None:
    batched = PipelineBuilder().add_source(range(100)).aggregate(10).build()
    assert len(list(batched)) == 10
    assert "\n10 batches from 100 source items in " in str(batched.stats())
    assert " batches/s); bottleneck" in str(batched.stats())
    flat = PipelineBuilder().add_source(range(100)).aggregate(10).disaggregate().build()
    assert len(list(flat)) == 100
    assert "\n100 items in " in str(flat.stats())


def test_stats_name_the_consumer_when_it_is_slowest() -> None:
    p = PipelineBuilder().add_source(range(40)).pipe(ident).add_sink(2).build()
    with p.auto_stop():
        for _ in range(40):
            p.get_item(timeout=5)
            time.sleep(0.01)
        assert p.stats().bottleneck == "consumer"


def test_stats_since_an_earlier_snapshot_name_the_bottleneck_of_that_window() -> None:
    # The op is slow for the first 60 items, then the consumer is: over the whole run the op
    # was busier, but since the earlier snapshot the consumer limits the pipeline.
    def op(x: int) -> int:
        if x < 60:
            time.sleep(0.01)
        return x

    p = PipelineBuilder().add_source(range(80)).pipe(op, name="op").add_sink(2).build()
    with p.auto_stop():
        for _ in range(60):
            p.get_item(timeout=10)
        before = p.stats()
        for _ in range(15):
            time.sleep(0.02)
            p.get_item(timeout=10)
        after = p.stats()
    recent = after.since(before)
    assert after.bottleneck == "op", str(after)
    assert recent.bottleneck == "consumer", str(recent)
    assert recent["op"].blocked > 0.5
    assert recent["op"].busy < after["op"].busy
    assert recent.elapsed == pytest.approx(after.elapsed - before.elapsed)
    assert recent["op"].items_in == after["op"].items_in - before["op"].items_in
    assert 0 < recent.items_out <= 15 + 2  # what the consumer took, and the sink refilled
    with pytest.raises(ValueError, match="earlier snapshot"):
        before.since(after)


def test_report_stats_interval_logs(caplog: pytest.LogCaptureFixture) -> None:
    def slow(x: int) -> int:
        time.sleep(0.01)
        return x

    p = PipelineBuilder().add_source(range(30)).pipe(slow).build(report_stats_interval=0.05)
    with caplog.at_level("INFO", logger="feedline.pipeline"):
        assert len(list(p)) == 30
    reports = [r.getMessage() for r in caplog.records if "pipeline statistics" in r.message]
    assert reports
    assert all("over the last" in r for r in reports)
    # The first window may end before the first call does (threads start slowly on a busy
    # machine); the stage is the bottleneck of the windows after.
    assert any("bottleneck: slow" in r for r in reports), reports


@pytest.mark.parametrize("concurrency", [2, 4])
def test_input_order_kept_for_cheap_ops_run_inline(concurrency: int) -> None:
    # Cheap ops are run inline by neighbouring threads and stolen by a waiting consumer; an
    # ordered stage must number each item as it takes it, whoever takes it.
    for _ in range(60):
        p = (
            PipelineBuilder()
            .add_source(range(60))
            .pipe(_helpers.square, concurrency=concurrency, output_order="input")
            .pipe(ident, concurrency=concurrency, output_order="input")
            .add_sink(4)
            .build(num_threads=concurrency)
        )
        assert list(p) == [i * i for i in range(60)]


def test_stats_before_any_run_and_repr() -> None:
    p = PipelineBuilder().add_source(range(3)).pipe(ident, name="f").build()
    with pytest.raises(RuntimeError, match="has not run yet"):
        p.stats()
    assert repr(p) == "Pipeline(source -> f, idle)"
    with p.auto_stop():
        assert repr(p) == "Pipeline(source -> f, running)"
    assert "f" in repr(PipelineBuilder().add_source([1]).pipe(ident, name="f"))


@pytest.mark.parametrize(
    ("concurrency", "sink", "expected"),
    [(1, None, 3), (4, None, 8), (4, "default", 8), (4, 3, 3), (1, 5, 5), (40, None, 64)],
)
def test_sink_holds_two_results_per_slot_of_a_wide_last_stage_by_default(
    concurrency: int, sink: Any, expected: int
) -> None:
    b = PipelineBuilder().add_source(range(200)).pipe(ident, concurrency=concurrency, name="f")
    if sink == "default":
        b = b.add_sink()
    elif sink is not None:
        b = b.add_sink(sink)
    p = b.build()
    with p.auto_stop():
        assert p.get_item(timeout=10) in range(200)  # (in completion order: any of them)
        # The consumer stops taking: the last stage fills the sink and stops there (a cheap
        # stage is refilled once the consumer drains the sink to half, so one slot may stay
        # free). Wait until it holds still.
        deadline = time.monotonic() + 10
        while p.stats()["f"].queue.size < expected - 1 and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(0.1)  # time to overfill, were the bound not kept
        queue = p.stats()["f"].queue
    assert queue.capacity == expected
    assert expected - 1 <= queue.size <= expected


def test_default_sink_after_aggregate_disaggregate_or_no_stage_holds_three() -> None:
    wide = PipelineBuilder().add_source(range(40)).pipe(ident, concurrency=4)
    pipelines = {
        "aggregate": wide.aggregate(2, name="last").build(),
        "disaggregate": PipelineBuilder()
        .add_source([[1, 2]] * 20)
        .pipe(ident, concurrency=4)
        .disaggregate(name="last")
        .build(),
        "source": PipelineBuilder().add_source(range(40), name="last").build(),
    }
    for kind, p in pipelines.items():
        with p.auto_stop():
            p.get_item(timeout=10)
            assert p.stats()["last"].queue.capacity == 3, kind
