"""Mixtures of sources: in turn, with weights that hold in every window, or as items come."""

from __future__ import annotations

import collections
import gc
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from feedline import ConfigurationError, Mixture, PipelineBuilder, PipelineFailure

from .._system import own_segments
from . import _helpers

SPAN = 1_000_000


def _sources(sizes: tuple[int, ...]) -> list[range]:
    """Source ``k`` is ``k * SPAN + range(size)``: an item says its source."""
    return [range(k * SPAN, k * SPAN + n) for k, n in enumerate(sizes)]


def test_in_turn_until_the_first_or_every_source_runs_out() -> None:
    first = Mixture(_sources((3, 2, 4)))
    assert list(first) == [0, SPAN, 2 * SPAN, 1, SPAN + 1, 2 * SPAN + 1, 2]
    assert len(first) == 7
    every = Mixture(_sources((3, 2, 4)), stop="all")
    assert list(every) == [
        0,
        SPAN,
        2 * SPAN,
        1,
        SPAN + 1,
        2 * SPAN + 1,
        2,
        2 * SPAN + 2,
        2 * SPAN + 3,
    ]
    assert len(every) == 9
    assert list(Mixture([[], [1, 2]])) == []
    assert list(Mixture([[], [1, 2]], stop="all")) == [1, 2]
    assert list(first) == list(first)  # iterable again: the next epoch


@pytest.mark.parametrize("weights", [(0.5, 0.3, 0.2), (7.0, 1.0, 2.0), (1.0, 1.0, 1.0)])
def test_weighted_proportions_hold_in_every_window(weights: tuple[float, ...]) -> None:
    mix = Mixture(_sources((6000, 6000, 6000)), weights=weights, seed=3)
    drawn = [x // SPAN for x in mix]
    assert len(drawn) == len(mix)
    shares = [w / sum(weights) for w in weights]
    for window in (40, 300):
        counts = collections.Counter(drawn[:window])
        for start in range(len(drawn) - window):
            for k, share in enumerate(shares):  # each source within two items of its share
                assert abs(counts[k] - window * share) <= 2, (window, start, k, counts)
            counts[drawn[start]] -= 1
            counts[drawn[start + window]] += 1


def test_seeds_and_epochs_interleave_differently_and_repeat_exactly() -> None:
    def order(seed: int, epoch: int) -> list[int]:
        mix = Mixture(_sources((50, 50, 50)), weights=[3, 2, 1], seed=seed)
        mix.set_epoch(epoch)
        return list(mix)

    assert order(0, 0) == order(0, 0)
    assert len({tuple(order(s, e)) for s in range(3) for e in range(3)}) > 4
    # Every item of every source that was reached comes once, in its source's order.
    items = order(1, 2)
    for k in range(3):
        mine = [x for x in items if x // SPAN == k]
        assert mine == list(range(k * SPAN, k * SPAN + len(mine)))


class _EpochShuffled:
    """A source that shuffles its items for the epoch that ``set_epoch`` gave it."""

    def __init__(self, items: range) -> None:
        self.items = items
        self.epochs: list[int] = []

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)

    def order(self, epoch: int) -> list[int]:
        import random

        order = list(self.items)
        random.Random(epoch).shuffle(order)
        return order

    def __iter__(self) -> Iterator[int]:
        return iter(self.order(self.epochs[-1] if self.epochs else 0))


def test_set_epoch_reaches_every_source_through_a_continuous_pipeline() -> None:
    sources = [_EpochShuffled(r) for r in _sources((20, 10))]
    inner = Mixture([sources[1]])  # a nested mixture passes it on too
    mix = Mixture([sources[0], inner], weights=[2, 1], seed=0)
    pipeline = PipelineBuilder[int]().add_source(mix).add_sink(4).build(continuous=True)
    try:
        epochs = [list(pipeline) for _ in range(3)]
    finally:
        pipeline.stop()
    for source in sources:  # the run may have begun the next epoch's pass already
        assert source.epochs[:3] == [0, 1, 2]
    for epoch, items in enumerate(epochs):  # each epoch: each source's shuffle for it
        for k, source in enumerate(sources):
            assert [x for x in items if x // SPAN == k] == source.order(epoch)
    assert epochs[0] != epochs[1]


def test_a_source_that_runs_out_leaves_the_others_their_weights() -> None:
    mix = Mixture(_sources((30, 1000, 1000)), weights=[1, 1, 2], stop="all", seed=0)
    drawn = [x // SPAN for x in mix]
    assert collections.Counter(drawn) == {0: 30, 1: 1000, 2: 1000}
    after = drawn[drawn.index(0, 0) :]
    last_zero = len(drawn) - 1 - drawn[::-1].index(0)
    tail = collections.Counter(drawn[last_zero + 1 : last_zero + 301])
    assert abs(tail[2] - 200) <= 2  # 2:1 between the other two
    assert abs(tail[1] - 100) <= 2
    assert after  # not vacuous


def test_a_resumable_pipeline_resumes_a_weighted_mixture_exactly_from_every_step() -> None:
    def build() -> Any:
        mix = Mixture(_sources((20, 15, 10)), weights=[2, 1, 1], seed=5, stop="all")
        return (
            PipelineBuilder()
            .add_source(mix)
            .pipe(lambda x: x * 2, concurrency=3, output_order="completion")
            .add_sink()
            .build(resumable=True)
        )

    whole = list(build())
    assert len(whole) == 45
    for stop in range(1, len(whole)):
        pipeline = build()
        got = []
        for item in pipeline:
            got.append(item)
            if len(got) == stop:
                break
        state = pipeline.state_dict()
        pipeline.stop()
        resumed = build()
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert collections.Counter(got + rest) == collections.Counter(whole), stop


def _slow(items: list[int], delay: float) -> Iterator[int]:
    for item in items:
        time.sleep(delay)
        yield item


class _Again:
    """A slow source that can be iterated again."""

    def __init__(self, items: list[int], delay: float) -> None:
        self.items, self.delay = items, delay

    def __iter__(self) -> Iterator[int]:
        return _slow(self.items, self.delay)


def _mix_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("feedline-mix")]


def test_as_ready_yields_what_comes_first_and_leaves_no_thread() -> None:
    fast, slow = list(range(20)), [1000, 1001]
    mix = Mixture([_Again(slow, 0.2), fast], as_ready=True, stop="all")
    items = list(mix)
    assert sorted(items) == sorted(fast + slow)
    assert items.index(19) < items.index(1000)  # the slow source held up nobody
    assert _mix_threads() == []
    # Leaving early stops the threads too.
    for k, _ in enumerate(Mixture([_Again(list(range(100)), 0.01), fast], as_ready=True)):
        if k == 5:
            break
    deadline = time.monotonic() + 2
    while _mix_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _mix_threads() == []


def test_a_sources_exception_is_raised_as_it_is() -> None:
    def broken() -> Iterator[int]:
        yield 1
        raise KeyError("shard 7 is missing")

    class Once:
        def __iter__(self) -> Iterator[int]:
            return broken()

    for as_ready in (False, True):
        with pytest.raises(KeyError, match="shard 7"):
            list(Mixture([Once(), range(100)], stop="all", as_ready=as_ready))


def test_pipelines_fan_in_to_one_stage() -> None:
    def pipeline(start: int) -> Any:
        return (
            PipelineBuilder()
            .add_source(range(start, start + 30))
            .pipe(lambda x: x + 0.5, concurrency=2)
            .add_sink()
            .build()
        )

    joined = (
        PipelineBuilder()
        .add_source(Mixture([pipeline(0), pipeline(100)], as_ready=True, stop="all"))
        .pipe(lambda x: -x)
        .add_sink()
        .build()
    )
    assert sorted(joined) == sorted(-(x + 0.5) for x in [*range(30), *range(100, 130)])


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ([], {}, "at least one source"),
        ([[1], [2]], {"weights": [1.0]}, "one per source"),
        ([[1], [2]], {"weights": [1.0, 0.0]}, "positive"),
        ([[1], [2]], {"weights": [1.0, 2.0], "as_ready": True}, "as_ready"),
        ([[1]], {"stop": "never"}, "stop must be"),
        ([[1]], {"buffer_size": 0}, "buffer_size"),
    ],
)
def test_bad_arguments_say_what_to_give(
    args: list[Any], kwargs: dict[str, Any], match: str
) -> None:
    with pytest.raises(ConfigurationError, match=match):
        Mixture(args, **kwargs)


def test_a_source_whose_iter_raises_is_raised_not_waited_for() -> None:
    class Unlisted:
        def __iter__(self) -> Iterator[int]:
            raise OSError("cannot list bucket")

    with pytest.raises(OSError, match="cannot list bucket"):
        list(Mixture([range(3), Unlisted()], as_ready=True, stop="all"))
    with pytest.raises(TypeError, match="timing"):
        len(Mixture([range(3), range(5)], as_ready=True))
    assert len(Mixture([range(3), range(5)], as_ready=True, stop="all")) == 8


def _fails_at_50(x: int) -> int:
    if x == 50:
        raise ValueError("item 50 is bad")
    return x


@pytest.mark.parametrize("stop", ["all", "first"])
def test_a_mixture_that_ends_stops_the_pipelines_still_running_in_it(stop: str) -> None:
    # One source pipeline fails (or, with stop="first", runs out) while the other still runs:
    # the other is stopped as the mixture ends, not when a garbage collection gets to it.
    threads, segments = _helpers.live_threads(), own_segments()
    short = 50 if stop == "first" else 100
    failing = PipelineBuilder().add_source(range(short)).pipe(_fails_at_50, concurrency=2).build()
    other = PipelineBuilder().add_source(range(1000, 10**6)).pipe(_helpers.identity).build()
    outer = PipelineBuilder().add_source(Mixture([failing, other], stop=stop)).build()
    gc.disable()  # no collection may stop the other pipeline in the mixture's place
    try:
        if stop == "all":
            with pytest.raises(PipelineFailure):
                for _ in outer:
                    pass
        else:
            assert len(list(outer)) == 2 * short  # in turn, until the first runs out
        assert _helpers.wait_until(lambda: not _helpers.live_threads() - threads, within=2.0)
    finally:
        gc.enable()
    del outer, failing, other
    _helpers.assert_nothing_left(threads, segments)
