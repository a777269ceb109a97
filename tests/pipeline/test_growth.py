"""Default-sized queues grow when their size, not their producer, keeps their consumer waiting."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from feedline import PipelineBuilder
from feedline.errors import ConfigurationError
from feedline.pipeline._growth import Growth, approx_nbytes
from feedline.pipeline._queue import EMPTY, Channel
from feedline.pipeline._resume import Tagged
from feedline.pipeline._settings import MAX_DEFAULT_QUEUE, NUMBER_BYTES
from feedline.pipeline._stages._sink import SinkReader

MiB = 1 << 20


def _reader(capacity: int, grow_to: int, grow_bytes: int = 64 * MiB) -> SinkReader:
    growth = Growth(capacity, grow_to, grow_bytes) if grow_to > capacity else None
    channel = Channel("sink", capacity, growth)
    reader = SinkReader(channel, spin=False)
    channel.connect(_Producer(), reader)
    return reader


class _Producer:
    def on_data(self) -> None:
        pass

    def on_space(self) -> None:
        pass


def _channel(reader: SinkReader) -> Channel:
    return reader._channel


def _put_once_waiting(reader: SinkReader, item: Any) -> threading.Thread:
    """Put ``item`` from another thread once the reader sleeps waiting for it."""

    def put() -> None:
        deadline = time.monotonic() + 10
        while not reader._waiting and time.monotonic() < deadline:
            time.sleep(0.001)
        _channel(reader).try_put(item)

    thread = threading.Thread(target=put)
    thread.start()
    return thread


def _fill_drain_then_wait(reader: SinkReader, item: Any) -> Any:
    """Fill the channel, take everything, then wait for one more put by another thread."""
    channel = _channel(reader)
    while channel.try_put(item):
        pass
    while len(channel):
        reader.get(timeout=1)
    late = _put_once_waiting(reader, item)
    try:
        return reader.get(timeout=10)  # empty: it waits
    finally:
        late.join()


def test_a_sink_that_was_full_and_then_kept_the_consumer_waiting_doubles() -> None:
    reader = _reader(3, grow_to=64)
    sizes = []
    for _ in range(6):
        assert _fill_drain_then_wait(reader, 7) == 7
        sizes.append(_channel(reader).capacity)
    assert sizes == [6, 12, 24, 48, 64, 64]  # doubling, then the item limit


def test_a_sink_that_was_never_full_does_not_grow() -> None:
    reader = _reader(3, grow_to=64)
    channel = _channel(reader)
    for _ in range(5):
        channel.try_put(1)
        channel.try_put(2)
        assert reader.get(timeout=1) == 1
        assert reader.get(timeout=1) == 2
        late = _put_once_waiting(reader, 3)
        assert reader.get(timeout=10) == 3
        late.join()
    assert channel.capacity == 3


def test_one_fill_grows_the_sink_once_however_often_the_consumer_then_waits() -> None:
    reader = _reader(3, grow_to=64)
    assert _fill_drain_then_wait(reader, 1) == 1
    assert _channel(reader).capacity == 6
    for i in range(4):  # waits on a channel that was not full since the last wait
        late = _put_once_waiting(reader, i)
        assert reader.get(timeout=10) == i
        late.join()
    assert _channel(reader).capacity == 6


def test_a_fixed_sink_never_grows() -> None:
    reader = _reader(3, grow_to=0)
    for _ in range(3):
        _fill_drain_then_wait(reader, 1)
    assert _channel(reader).capacity == 3


def test_the_byte_budget_caps_growth_by_the_size_of_the_items() -> None:
    reader = _reader(2, grow_to=64, grow_bytes=10 * MiB)
    item = np.zeros(2 * MiB, dtype=np.uint8)
    sizes = []
    for _ in range(4):
        _fill_drain_then_wait(reader, item)
        sizes.append(_channel(reader).capacity)
    assert sizes == [4, 5, 5, 5]  # 10 MiB holds five such items
    big = _reader(3, grow_to=64, grow_bytes=10 * MiB)
    _fill_drain_then_wait(big, np.zeros(4 * MiB, dtype=np.uint8))  # only two would fit
    assert _channel(big).capacity == 3


@dataclasses.dataclass
class _Sample:
    image: Any
    label: int


class _Sparse:
    """Like a sparse torch tensor: asking for its nbytes raises."""

    @property
    def nbytes(self) -> int:
        raise RuntimeError("nbytes is not defined for sparse tensors")


def test_approx_nbytes_counts_arrays_buffers_containers_and_plain_objects() -> None:
    a = np.zeros((4, 8), dtype=np.float32)  # 128 bytes
    assert approx_nbytes(a) == 128
    assert approx_nbytes(b"abcd") == 4
    assert approx_nbytes(memoryview(b"abcdef")) == 6
    assert approx_nbytes({"x": a, "y": (a, b"12"), "n": 3, "f": None}) == 258 + NUMBER_BYTES
    assert approx_nbytes([a] * 1000) == 128_000  # extrapolated from the first 16
    assert approx_nbytes(Tagged(5, [a, a])) == 256
    assert approx_nbytes(_Sample(a, 7)) == 128 + NUMBER_BYTES  # a dataclass: its fields
    assert approx_nbytes(3) == approx_nbytes(2.5) == NUMBER_BYTES
    assert approx_nbytes(None) == approx_nbytes(True) == 0  # one object each
    # Token ids: numbers count, so that a queue of them stays within its byte budget.
    assert approx_nbytes({"ids": list(range(2048)), "mask": [1] * 2048}) == 4096 * NUMBER_BYTES
    assert approx_nbytes([]) == 0
    # What it cannot tell: None, not 0, so that a budget does not count it as free.
    assert approx_nbytes(object()) is None
    assert approx_nbytes([1, object()]) is None
    assert approx_nbytes([[[[a]]]]) is None  # deeper than it looks
    assert approx_nbytes(_Sparse()) is None


def test_an_item_that_cannot_be_measured_is_still_delivered_and_caps_growth() -> None:
    for item in (_Sparse(), object(), [[[[np.zeros(4)]]]]):
        reader = _reader(3, grow_to=64)
        for _ in range(5):
            assert _fill_drain_then_wait(reader, item) is item
        assert _channel(reader).capacity == 16, item  # 3, 6, 12, then the unknown-size cap


def test_a_grown_sink_shrinks_when_its_items_get_larger() -> None:
    reader = _reader(3, grow_to=64, grow_bytes=10 * MiB)
    for _ in range(4):
        _fill_drain_then_wait(reader, 1)
    channel = _channel(reader)
    assert channel.capacity == 48
    big = np.zeros(2 * MiB, dtype=np.uint8)  # five fit in the budget
    taken = 0
    while channel.capacity == 48 and taken < 1000:
        while channel.try_put(big):
            pass
        while len(channel):
            assert reader.get(timeout=1) is not EMPTY
            taken += 1
    assert channel.capacity == 5
    assert taken <= 64 + 48  # measured once every 64 items taken


async def _anoop(x: int) -> int:
    return x


def _sink_capacity(sink: int | None, n: int) -> tuple[int, list[int]]:
    b = PipelineBuilder().add_source(range(n))
    for i in range(3):
        b.pipe(_anoop, name=f"s{i}")
    p = b.add_sink(sink).build()
    with p.auto_stop():
        got = list(p)
        capacity = p.stats()["s2"].queue.capacity
    return capacity, got


@pytest.mark.parametrize("sink", [None, 3])
def test_a_default_sink_grows_behind_fast_async_stages_and_an_explicit_one_does_not(
    sink: int | None,
) -> None:
    # Each item the loop makes wakes the consumer; with 3 places the loop fills them before
    # the consumer runs and then sleeps until it drains them, over and over.
    capacity, got = _sink_capacity(sink, 20_000)
    assert sorted(got) == list(range(20_000))
    if sink is None:
        assert 3 < capacity <= 64
    else:
        assert capacity == 3


def test_a_default_sink_does_not_grow_for_a_consumer_slower_than_the_pipeline() -> None:
    p = PipelineBuilder().add_source(range(40)).pipe(_anoop, name="f").build()
    seen = []
    with p.auto_stop():
        for x in p:
            seen.append(x)
            threading.Event().wait(0.02)  # the pipeline refills the sink meanwhile
        capacity = p.stats()["f"].queue.capacity
    assert sorted(seen) == list(range(40))
    assert capacity == 3


def _drain(channel: Channel) -> list[Any]:
    got = []
    while (item := channel.try_get()) is not EMPTY:
        got.append(item)
    return got


def _fill(channel: Channel, item: Any) -> None:
    while channel.try_put(item):
        pass


def test_a_channel_doubles_at_the_first_item_after_it_was_found_empty_since_a_fill() -> None:
    channel = Channel("q", 4, Growth(4, 64, 64 * MiB))
    channel.try_put(1)
    assert _drain(channel) == [1]  # found empty, but it was never full
    channel.try_put(2)
    assert channel.try_get() == 2
    assert channel.capacity == 4
    _fill(channel, 3)
    assert _drain(channel) == [3] * 4  # full, then found empty
    assert channel.capacity == 4  # nothing taken since: nothing measured yet
    channel.try_put(4)
    assert channel.try_get() == 4
    assert channel.capacity == 8


def test_a_batched_get_measures_the_item_at_the_measure_point() -> None:
    channel = Channel("q", 4, Growth(4, 64, 10 * MiB))
    small, big = np.zeros(MiB, dtype=np.uint8), np.zeros(8 * MiB, dtype=np.uint8)
    assert channel.try_put_many([small] * 5) == 4  # full
    assert len(channel.try_get_many(8)) == 4
    assert channel.try_get_many(8) == []  # found empty after a fill: the next item is measured
    assert channel.try_put_many([small, big, big]) == 3
    assert len(channel.try_get_many(8)) == 3
    # The first of the batch was measured: ten such items fit the budget, so the channel
    # doubles. Measuring any other would have allowed one item, and shrunk it instead.
    assert channel.capacity == 8


def test_a_channel_grows_only_while_its_growth_allows() -> None:
    allow = False
    channel = Channel("q", 2, Growth(2, 64, 64 * MiB, lambda _n: allow))

    def three_turns() -> int:
        for _ in range(3):  # each: full, found empty, one more item taken
            _fill(channel, 1)
            _drain(channel)
            channel.try_put(1)
            channel.try_get()
        return channel.capacity

    assert three_turns() == 2
    allow = True
    assert three_turns() == 16


def _refill_turns(channel: Channel, turns: int) -> None:
    """A producer that refills the channel each time the consumer takes half of it.

    The consumer never finds it empty: what a cheap source run on the consumer's own thread
    does.
    """
    for _ in range(turns):
        _fill(channel, 1)
        for _ in range(max(1, channel.capacity // 2)):
            assert channel.try_get() == 1


def test_a_channel_that_grows_on_fills_doubles_though_never_found_empty() -> None:
    allow = False
    channel = Channel("q", 4, Growth(4, 64, 64 * MiB, lambda _n: allow, on_fill=True))
    _refill_turns(channel, 5)
    assert channel.capacity == 4  # not while its neighbours forbid it
    allow = True
    _refill_turns(channel, 5)
    assert channel.capacity == 64  # 8, 16, 32, 64, then the item limit
    fixed = Channel("q", 4, Growth(4, 64, 64 * MiB, on_fill=False))
    _refill_turns(fixed, 10)
    assert fixed.capacity == 4  # found empty never: no growth without on_fill


def test_one_fill_doubles_a_channel_once_whether_or_not_it_is_then_found_empty() -> None:
    channel = Channel("q", 4, Growth(4, 64, 64 * MiB, on_fill=True))
    _fill(channel, 1)  # a fill: the next item taken is measured, and doubles the channel
    _drain(channel)  # found empty after that same fill: no second doubling
    channel.try_put(1)
    channel.try_get()
    assert channel.capacity == 8


def test_a_channel_growing_on_fills_at_its_byte_limit_backs_off() -> None:
    channel = Channel("q", 4, Growth(4, 64, 4 * MiB, on_fill=True))  # four such items fit
    item = _Counted()
    _Counted.asked = 0
    for _ in range(2000):  # about 4,000 items taken, 2,000 fills that each ask to grow
        _fill(channel, item)
        _drain(channel)
    assert channel.capacity == 4
    # Quiet for 64, 128, ... 4,096 items after each doubling that changed nothing.
    assert 3 <= _Counted.asked <= 10


def test_the_allowance_is_asked_for_the_capacity_to_double_from() -> None:
    asked: list[int] = []

    def below_16(n: int) -> bool:
        asked.append(n)
        return n < 16

    channel = Channel("q", 4, Growth(4, 64, 64 * MiB, below_16, on_fill=True))
    _refill_turns(channel, 6)
    assert channel.capacity == 16  # 4 -> 8 -> 16, not from 16
    assert {4, 8, 16} <= set(asked)


def test_items_of_mixed_sizes_size_a_channel_for_the_large_ones() -> None:
    growth = Growth(2, 64, 16 * MiB)
    large, small = np.zeros(4 * MiB, np.uint8), np.zeros(64, np.uint8)
    assert growth.limit(large) == 4
    # One small item measured after a large one must not open the channel to 64 of them:
    # the size falls by an eighth of the way per item measured.
    assert growth.limit(small) == 4
    assert [growth.limit(small) for _ in range(3)][-1] <= 8
    assert max(growth.limit(small) for _ in range(100)) == 64  # in the end it does fall


def _spin(seconds: float) -> Callable[[int], int]:
    def spin(x: int) -> int:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass
        return x

    return spin


def test_the_queue_from_a_cheap_source_to_an_op_of_real_work_grows_to_a_span_of_its_calls() -> None:
    # 150 us per call (or more, on a loaded machine), one slot: the doubled queue may hold up
    # to QUEUE_SPAN (8 ms) of it, so the source's queue grows from 4 to 32 at the most. It
    # grows only while the source's calls time as cheap, which a loaded machine can upset for
    # a whole run: up to three runs.
    for _ in range(3):
        p = PipelineBuilder().add_source(range(3000)).pipe(_spin(150e-6), name="work").build()
        with p.auto_stop():
            assert sorted(p) == list(range(3000))
            queue = p.stats()["source"].queue
        assert 4 <= queue.capacity <= 32, queue
        if queue.capacity > 4:
            break
    assert queue.capacity > 4, queue


def test_an_explicit_source_buffer_is_fixed() -> None:
    rows = [json.dumps([{"a": i, "b": 2 * i, "c": str(i)} for i in range(40)])] * 4000
    p = (
        PipelineBuilder()
        .add_source(rows, buffer_size=3)
        .pipe(_parse, concurrency=1, name="parse")
        .build()
    )
    with p.auto_stop():
        assert sum(1 for _ in p) == 4000
        stats = p.stats()
    assert stats["source"].queue.capacity == 3
    with pytest.raises(ConfigurationError, match="buffer_size must be an int >= 1"):
        PipelineBuilder().add_source(rows, buffer_size=0)


def _parse(text: str) -> int:
    # Pure Python of about 30 us: light, not cheap, and it holds the GIL.
    total = 0
    for row in json.loads(text):
        total += sum(int(v) for v in row.values())
    return total


def test_the_queue_from_a_cheap_source_to_a_light_op_grows() -> None:
    # Each refill of a 4-item queue is a turn of the source's job for two items; grown, the
    # turns are few (measured: a 30 us op went from 22k to 24.7k items/s at one call, as
    # fast as at eight). How far it grows depends on the call times measured, which a
    # loaded machine makes longer: the rule is below, from call times given.
    rows = [json.dumps([{"a": i, "b": 2 * i, "c": str(i)} for i in range(40)])] * 10_000
    p = PipelineBuilder().add_source(rows).pipe(_parse, concurrency=1, name="parse").build()
    with p.auto_stop():
        assert sum(p) == 10_000 * sum(3 * i + i for i in range(40))
        stats = p.stats()
    assert 4 <= stats["source"].queue.capacity <= 256, stats["source"].queue


def test_a_queue_after_a_cheap_stage_doubles_while_it_holds_less_than_a_span_of_the_next() -> None:
    from feedline.pipeline._engine import Run

    p = PipelineBuilder().add_source(range(3)).pipe(_parse, concurrency=1, name="parse").build()
    run = Run(p._config, lambda source, run: source)
    try:
        source, parse = run.stages
        growth = run.channels[0].growth
        assert growth is not None
        source.counters.ewma, parse.counters.ewma = 1e-6, 30e-6  # a cheap source, a light op
        sizes = (4, 8, 16, 32, 64, 128, 256)
        # Up to QUEUE_SPAN (8 ms) of the op's calls: 256 items of 30 us.
        assert [n for n in sizes if growth.allowed(n)] == [4, 8, 16, 32, 64, 128]
        parse.counters.ewma = 130e-6  # the same op on a loaded machine
        assert [n for n in sizes if growth.allowed(n)] == [4, 8, 16]
        parse.counters.set_concurrency(4)  # four slots drain the queue four times as fast
        assert [n for n in sizes if growth.allowed(n)] == [4, 8, 16, 32, 64]
        parse.counters.set_concurrency(1)
        parse.counters.ewma = 2e-3  # an op of real work: one doubling holds 16 ms
        assert not growth.allowed(4)
        parse.counters.ewma = 5e-6  # a cheap op: up to the item limit
        assert growth.allowed(256)
        source.counters.ewma = 1e-3  # a source that is not cheap: it never doubles
        assert not growth.allowed(4)
    finally:
        run.stop()


def test_a_growing_channel_wakes_its_refused_producer() -> None:
    spaces = []

    class Producer:
        def on_data(self) -> None:
            pass

        def on_space(self) -> None:
            spaces.append(1)

    channel = Channel("q", 2, Growth(2, 64, 64 * MiB))
    channel.connect(Producer(), Producer())
    _fill(channel, 1)
    _drain(channel)
    _fill(channel, 1)  # two items in, then a refused put
    spaces.clear()
    assert channel.try_get() == 1  # measured: the channel doubles to 4 and holds 1
    assert channel.capacity == 4
    assert spaces  # the refused producer is told of the room


def _queue_capacities(n: int, **pipe: Any) -> dict[str, int]:
    b = PipelineBuilder().add_source(range(n))
    for i in range(3):
        b.pipe(_anoop, name=f"s{i}", **pipe)
    p = b.build()
    with p.auto_stop():
        assert sorted(p) == list(range(n))
        return {s.name: s.queue.capacity for s in p.stats().stages}


def test_default_queues_between_cheap_stages_grow_and_explicit_ones_do_not() -> None:
    # Which queue finds itself empty after a fill depends on how the loop interleaves the
    # stages; that some of them do, and none passes the limit, does not. A loaded machine
    # (a CI run beside other tests) can interleave one run so that only the sink's grows:
    # up to three runs.
    starts = {"source": 4, "s0": 8, "s1": 8}
    for _ in range(3):
        grown = _queue_capacities(20_000)
        if any(grown[name] > start for name, start in starts.items()):
            break
    assert any(grown[name] > start for name, start in starts.items()), grown
    assert all(start <= grown[name] <= MAX_DEFAULT_QUEUE for name, start in starts.items()), grown
    fixed = _queue_capacities(20_000, buffer_size=8)
    assert fixed["s0"] == fixed["s1"] == 8, fixed


def test_a_queue_after_an_expensive_stage_does_not_grow_and_one_before_it_holds_a_span() -> None:
    # The source outruns the slow stage, whose queue fills and is drained over and over, and
    # the fast stage after it drains its input at once: both would grow after a cheap stage.
    # Before the slow stage, four slots of 1.5 ms (more on a loaded machine, up to 2 ms for
    # the same sizes): 16 items are 6 ms of its calls, 32 would be 12 ms, over QUEUE_SPAN (8
    # ms), so the source's queue grows from 8 to 16 at the most.
    p = (
        PipelineBuilder()
        .add_source(range(300))
        .pipe(_slower, concurrency=4, name="slow")
        .pipe(_anoop, name="fast")
        .build()
    )
    with p.auto_stop():
        assert sorted(p) == list(range(300))
        stats = p.stats()
    assert stats["source"].queue.capacity in (8, 16)  # from max(4, 2 * concurrency)
    assert stats["slow"].queue.capacity == 8


async def _slower(x: int) -> int:
    await asyncio.sleep(0.0015)
    return x


def _turn(channel: Channel, item: Any) -> None:
    """Fill the channel, drain it (finding it empty), then pass one more item through."""
    _fill(channel, item)
    _drain(channel)
    channel.try_put(item)
    channel.try_get()


def test_a_channel_the_tuner_resizes_up_keeps_to_its_byte_budget_from_the_next_item() -> None:
    # The tuner sizes a queue for the stage beside it (256 reads in flight): the next item
    # taken is measured, and 1 MiB items bring it back to what 16 MiB of them hold.
    growth = Growth(4, MAX_DEFAULT_QUEUE, 16 * MiB)
    channel = Channel("q", 4, growth)
    assert growth.within_bytes(256) == 256  # no item measured yet
    growth.rebase(256)
    channel.resize(256)
    assert channel.capacity == 256
    mib = np.zeros(MiB, dtype=np.uint8)
    channel.try_put(mib)
    channel.try_get()
    assert channel.capacity == 16
    assert growth.within_bytes(256) == 16  # what the tuner sizes it to from now on
    channel.resize(4)  # back to its first size: nothing to measure
    channel.try_put(mib)
    channel.try_get()
    assert channel.capacity == 4


def test_a_grown_channel_shrinks_when_items_get_larger_even_if_every_turn_asks_to_grow() -> None:
    channel = Channel("q", 2, Growth(2, 64, 16 * MiB))

    def turn(item: Any) -> None:  # the producer fills it, the consumer drains it
        _fill(channel, item)
        _drain(channel)

    for _ in range(10):
        turn(np.zeros(8, dtype=np.uint8))
    assert channel.capacity == 64
    big = np.zeros(4 * MiB, dtype=np.uint8)  # four fit in the budget
    for _ in range(3):
        turn(big)  # every turn asks to double, at the first item after the last one
    assert channel.capacity == 4


class _Counted:
    """An item that counts how often its size is asked for."""

    asked = 0

    @property
    def nbytes(self) -> int:
        _Counted.asked += 1
        return 1 * MiB


def test_a_channel_at_its_limit_backs_off_instead_of_measuring_every_turn() -> None:
    channel = Channel("q", 4, Growth(4, 64, 4 * MiB))  # four such items fill the budget
    item = _Counted()
    _Counted.asked = 0
    for _ in range(1000):  # 5,000 items taken, 1,000 turns that each ask to grow
        _turn(channel, item)
    assert channel.capacity == 4
    # Quiet for 64, 128, ... 4,096 items after each doubling that changed nothing.
    assert 3 <= _Counted.asked <= 10


def test_a_grown_channel_no_longer_allowed_shrinks_back_to_its_start() -> None:
    allow = True
    channel = Channel("q", 2, Growth(2, 64, 64 * MiB, lambda _n: allow))
    for _ in range(4):
        _turn(channel, 1)
    assert channel.capacity == 32
    allow = False
    for _ in range(70):  # the next recheck comes within 64 items taken
        channel.try_put(1)
        channel.try_get()
    assert channel.capacity == 2


class _TunerResizes:
    """An item whose measuring (outside the channel's lock) sees the tuner resize the channel
    to 48, as a raise of the stage before it to 48 calls does, once armed."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.armed = self.resized = False

    @property
    def nbytes(self) -> int:
        if self.armed and not self.resized:
            self.resized = True
            growth = self.channel.growth
            assert growth is not None
            growth.rebase(48)
            self.channel.resize(48)
        return 8


def test_a_size_set_while_an_item_is_measured_is_kept() -> None:
    channel = Channel("q", 4, Growth(4, 64, 64 * MiB))
    item = _TunerResizes(channel)
    _fill(channel, item)
    _drain(channel)  # found empty after a fill: the next item taken is measured, to double
    channel.try_put(item)
    item.armed = True
    assert channel.try_get() is item
    assert item.resized
    assert channel.capacity == 48  # not the 8 measured for the capacity of 4 it had


def test_a_size_the_tuner_set_keeps_the_byte_limit() -> None:
    growth = Growth(2, 64, 16 << 20, allowed=lambda _n: False)  # stages not cheap: no doubling
    growth.rebase(48)  # the tuner raised the stage to 48
    small, large = np.zeros(1000, np.uint8), np.zeros(4 << 20, np.uint8)
    assert growth.target(small, 48, doubling=False) == 48  # stays where the tuner put it
    assert growth.target(large, 48, doubling=False) == 4  # 16 MiB of 4 MiB items
    growth.rebase(1)
    assert growth.start == 2  # never below the build's size
    growth.rebase(1000)
    assert growth.start == 64  # nor above what it may grow to
