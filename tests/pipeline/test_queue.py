"""The channel between stages: bounds, wake-ups and the statistics it keeps."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from feedline.pipeline import _queue
from feedline.pipeline._queue import EMPTY, Channel


class _Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


class _Ends:
    def __init__(self) -> None:
        self.data = 0
        self.space = 0

    def on_data(self) -> None:
        self.data += 1

    def on_space(self) -> None:
        self.space += 1


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> _Clock:
    c = _Clock()
    monkeypatch.setattr(_queue, "_now", c)
    return c


def test_fill_level_and_shares_follow_the_items_held_over_time(clock: _Clock) -> None:
    ch = Channel("q", 2)
    # t=0..1 empty, 1..3 one item, 3..4 full (two), 4..6 one, 6..8 empty, closed at 8,
    # then 2 more seconds closed and empty (not counted as starving the consumer).
    clock.t += 1
    assert ch.try_put("a")
    clock.t += 2
    assert ch.try_put("b")
    assert not ch.try_put("c")  # full
    clock.t += 1
    assert ch.try_get() == "a"
    clock.t += 2
    assert ch.try_get() == "b"
    assert ch.try_get() is EMPTY
    clock.t += 2
    ch.close()
    clock.t += 2
    s = ch.stats()
    assert s.life == pytest.approx(10.0)
    # items held over time: 1 for 2 s, 2 for 1 s, 1 for 2 s = 6 item-seconds
    assert s.mean_occupancy == pytest.approx(6.0 / 10.0 / 2)
    assert s.empty_fraction == pytest.approx((1.0 + 2.0) / 10.0)
    assert s.full_fraction == pytest.approx(1.0 / 10.0)
    assert (s.puts, s.gets, s.size) == (2, 2, 0)


def test_shares_count_up_to_the_snapshot_while_a_state_lasts(clock: _Clock) -> None:
    ch = Channel("q", 1)
    clock.t += 3  # empty and open for 3 s
    assert ch.stats().empty_fraction == pytest.approx(1.0)
    ch.try_put(1)
    clock.t += 1  # full for 1 s, and still full when the snapshot is taken
    s = ch.stats()
    assert s.empty_fraction == pytest.approx(0.75)
    assert s.full_fraction == pytest.approx(0.25)
    assert s.mean_occupancy == pytest.approx(0.25)
    assert s.size == 1


def test_abort_drops_the_items_and_ends_every_state(clock: _Clock) -> None:
    ch = Channel("q", 2)
    ends = _Ends()
    ch.connect(ends, ends)
    ch.try_put(1)
    ch.try_put(2)
    clock.t += 2
    ch.abort()
    clock.t += 2
    s = ch.stats()
    assert ch.exhausted
    assert ch.try_get() is EMPTY
    assert s.mean_occupancy == pytest.approx(2 * 2 / 4 / 2)  # held two items for 2 of 4 s
    assert s.full_fraction == pytest.approx(0.5)
    assert s.empty_fraction == 0.0
    assert (ends.space, ends.data) == (1, 3)  # two puts, then the abort


def test_since_gives_the_window_between_two_snapshots(clock: _Clock) -> None:
    ch = Channel("q", 1)
    clock.t += 4  # empty
    first = ch.stats()
    ch.try_put(1)
    clock.t += 4  # full
    window = ch.stats().since(first)
    assert window.life == pytest.approx(4.0)
    assert window.empty_fraction == pytest.approx(0.0)
    assert window.full_fraction == pytest.approx(1.0)
    assert window.mean_occupancy == pytest.approx(1.0)
    assert (window.puts, window.gets) == (1, 0)


def test_a_refused_producer_is_told_once_the_channel_drains_to_half() -> None:
    ch = Channel("q", 4)
    ends = _Ends()
    ch.connect(ends, ends)
    for i in range(4):
        assert ch.try_put(i)
    assert not ch.try_put(4)
    assert (ch.try_get(), ends.space) == (0, 0)  # three left: above half
    assert (ch.try_get(), ends.space) == (1, 1)  # two left: half
    assert (ch.try_get(), ends.space) == (2, 1)  # told once per refusal
    assert ch.request_space()  # at most half full: room now, no call to come


def test_batches_put_what_fits_in_order_and_wake_each_side_once() -> None:
    ch = Channel("q", 4)
    ends = _Ends()
    ch.connect(ends, ends)
    assert ch.try_put_many([]) == 0
    assert ch.try_put_many([0, 1, 2, 3, 4, 5]) == 4  # the first four; the rest are refused
    assert (ends.data, ch.puts, ch.fills) == (1, 4, 1)  # one wake-up for the whole batch
    assert ch.try_get_many(1) == [0]
    assert ends.space == 0  # three left: above half
    assert ch.try_get_many(10) == [1, 2, 3]  # no more than it holds
    assert ends.space == 1  # drained: the refused producer is told, once
    assert ch.try_get_many(10) == []
    ch.close()
    assert ch.try_put_many([6]) == 0
    assert ch.exhausted


def test_closed_channel_refuses_puts_and_capacity_must_be_positive() -> None:
    ch = Channel("q", 1)
    ch.close()
    assert not ch.try_put(1)
    assert ch.exhausted
    with pytest.raises(ValueError, match="capacity must be >= 1"):
        Channel("bad", 0)


def test_a_get_tells_an_ended_channel_from_an_empty_one_in_one_call() -> None:
    ended = object()
    ch = Channel("q", 2)
    assert ch.try_get(ended) is EMPTY  # empty, and more may come
    ch.try_put("a")
    ch.close()
    assert ch.try_get(ended) == "a"  # closed, but an item is left
    assert ch.try_get(ended) is ended
    assert ch.try_get() is EMPTY  # without ``ended``: EMPTY, as before


_OPS = st.lists(
    st.one_of(
        st.tuples(st.just("put"), st.just(0.0)),
        st.tuples(st.just("get"), st.just(0.0)),
        st.tuples(st.just("put_many"), st.integers(0, 5).map(float)),
        st.tuples(st.just("get_many"), st.integers(1, 5).map(float)),
        # steps of 1/64 s: exact in binary, so that the reference adds no rounding of its own
        st.tuples(st.just("wait"), st.integers(0, 320).map(lambda k: k / 64)),
        st.tuples(st.just("stats"), st.just(0.0)),
        st.tuples(st.just("close"), st.just(0.0)),
        st.tuples(st.just("abort"), st.just(0.0)),
    ),
    max_size=60,
)


@settings(max_examples=300, deadline=None)
@given(capacity=st.integers(1, 4), ops=_OPS)
def test_statistics_match_a_step_by_step_integration(
    capacity: int, ops: list[tuple[str, float]]
) -> None:
    # The reference walks time in the steps the test makes and adds up the state it sees.
    # Items are numbered as they are put, so that every get checks the order too.
    clock = _Clock()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(_queue, "_now", clock)
        ch = Channel("q", capacity)
        n, closed, held, empty, full = 0, False, 0.0, 0.0, 0.0
        put, got = 0, 0  # items numbered so far, and the next one a get must return
        for op, arg in ops:
            if op == "wait":
                clock.t += arg
                held += n * arg
                empty += arg if n == 0 and not closed else 0.0
                full += arg if n == capacity and not closed else 0.0
            elif op == "put":
                accepted = ch.try_put(put)
                assert accepted == (not closed and n < capacity)
                n += accepted
                put += accepted
            elif op == "put_many":
                batch = list(range(put, put + int(arg)))
                taken = ch.try_put_many(batch)
                assert taken == (0 if closed else min(len(batch), capacity - n))
                n += taken
                put += taken
            elif op == "get":
                item = ch.try_get()
                assert item == (EMPTY if n == 0 else got)
                n -= item is not EMPTY
                got += item is not EMPTY
            elif op == "get_many":
                items = ch.try_get_many(int(arg))
                assert items == list(range(got, got + min(n, int(arg))))
                n -= len(items)
                got += len(items)
            elif op == "close":
                ch.close()
                closed = True
            elif op == "abort":
                ch.abort()
                closed, n, got = True, 0, put
            else:
                ch.stats()  # folds the running sums; must change nothing
        s = ch.stats()
    life = clock.t - 100.0
    if life <= 0:
        return
    assert s.size == n
    assert s.mean_occupancy == pytest.approx(held / life / capacity, abs=1e-9)
    assert s.empty_fraction == pytest.approx(empty / life, abs=1e-9)
    assert s.full_fraction == pytest.approx(full / life, abs=1e-9)
    assert 0.0 <= s.empty_fraction + s.full_fraction <= 1.0 + 1e-9


def test_resize_wakes_a_refused_producer_and_ends_or_starts_a_full_period(clock: _Clock) -> None:
    ch = Channel("q", 2)
    ends = _Ends()
    ch.connect(ends, ends)
    assert ch.try_put(1)
    assert ch.try_put(2)
    assert not ch.try_put(3)  # refused: it waits for on_space
    clock.t += 1
    ch.resize(4)  # room now, and 2 <= the new low-water mark
    assert ends.space == 1
    clock.t += 1
    assert ch.try_put(3)
    assert ch.try_put(4)
    assert not ch.try_put(5)
    assert (ch.capacity, ch.fills) == (4, 2)
    clock.t += 1
    ch.resize(2)  # smaller: what it holds stays, and it is full
    assert len(ch) == 4
    assert not ch.try_put(5)
    clock.t += 2
    s = ch.stats()
    # Full from 0 to 1 (capacity 2), not from 1 to 2 (capacity 4, two held), then full
    # from the second fill on, through the shrink: 1 + 3 seconds of 5.
    assert s.full_fraction == pytest.approx(4 / 5)
    assert [ch.try_get() for _ in range(4)] == [1, 2, 3, 4]
    with pytest.raises(ValueError, match=">= 1"):
        ch.resize(0)


def test_occupancy_counts_each_moment_against_the_capacity_it_had(clock: _Clock) -> None:
    ch = Channel("q", 4)
    assert ch.try_put(1)
    assert ch.try_put(2)
    clock.t += 2  # half full for 2 s
    ch.resize(8)
    before = ch.stats()
    clock.t += 2  # a quarter full for 2 s
    s = ch.stats()
    assert s.mean_occupancy == pytest.approx((0.5 * 2 + 0.25 * 2) / 4)
    assert s.since(before).mean_occupancy == pytest.approx(0.25)
