"""Continuous pipelines: one run across epochs, each loop still one epoch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from feedline import ConfigurationError, PipelineBuilder

pytestmark = pytest.mark.timeout(60)


class Epochs:
    """Ten items per epoch, numbered by it; remembers the epochs it was told."""

    def __init__(self, fail: int | None = None) -> None:
        self.epoch, self.told, self.fail = 0, [], fail

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.told.append(epoch)

    def __iter__(self) -> Iterator[int]:
        return iter(range(100 * self.epoch, 100 * self.epoch + 10))


class Stamps:
    """An op that records when it ran on each item, and on which thread."""

    def __init__(self, fail: int | None = None) -> None:
        self.lock = threading.Lock()
        self.started: dict[int, float] = {}
        self.threads: set[int] = set()
        self.fail = fail

    def __call__(self, x: int) -> int:
        with self.lock:
            self.started[x] = time.monotonic()
            self.threads.add(threading.get_ident())
        time.sleep(0.002 * (x % 3))
        if x == self.fail:
            raise ValueError(f"item {x}")
        return x


def _feedline_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("feedline")]


def test_each_loop_is_one_epoch_and_the_threads_go_on() -> None:
    source, op = Epochs(), Stamps()
    pipeline = (
        PipelineBuilder()
        .add_source(source)
        .pipe(op, concurrency=4)
        .add_sink()
        .build(continuous=True)
    )
    threads = None
    for epoch in range(3):
        assert pipeline.epoch == epoch
        assert sorted(pipeline) == list(range(100 * epoch, 100 * epoch + 10))
        if threads is None:
            threads = set(_feedline_threads())
        assert set(_feedline_threads()) == threads  # nothing stopped or started
    assert source.told[:3] == [0, 1, 2]
    pipeline.stop()
    assert _feedline_threads() == []


def test_the_next_epoch_is_under_way_before_this_one_is_taken() -> None:
    source, op = Epochs(), Stamps()
    pipeline = (
        PipelineBuilder()
        .add_source(source)
        .pipe(op, concurrency=2)
        .add_sink()
        .build(continuous=True)
    )
    taken_last = 0.0
    for _ in pipeline:
        time.sleep(0.01)  # a slow training step
        taken_last = time.monotonic()
    assert min(op.started[x] for x in range(100, 110) if x in op.started) < taken_last
    assert sorted(pipeline) == list(range(100, 110))
    pipeline.stop()


def test_a_break_ends_the_run_and_the_next_loop_runs_the_next_epoch() -> None:
    source = Epochs()
    pipeline = PipelineBuilder().add_source(source).pipe(Stamps()).add_sink().build(continuous=True)
    for k, _ in enumerate(pipeline):
        if k == 2:
            break
    assert _feedline_threads() == []
    assert sorted(pipeline) == list(range(100, 110))
    pipeline.stop()


def test_a_skipped_failure_does_not_hold_up_the_epoch() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(Epochs())
        .pipe(Stamps(fail=104))
        .add_sink()
        .build(continuous=True, max_failures=1)
    )
    assert sorted(pipeline) == list(range(10))
    assert sorted(pipeline) == [x for x in range(100, 110) if x != 104]
    pipeline.stop()


def test_an_empty_source_ends_and_resumable_is_refused() -> None:
    empty = PipelineBuilder().add_source([]).add_sink().build(continuous=True)
    assert list(empty) == []
    with pytest.raises(ConfigurationError, match="resumable"):
        PipelineBuilder().add_source([1]).add_sink().build(continuous=True, resumable=True)
    with pytest.raises(ConfigurationError, match="for loop"):
        empty.get_item()  # its items would never count for a loop's epoch


@pytest.mark.parametrize("drop_last", [False, True])
def test_groups_end_with_their_epoch(drop_last: bool) -> None:
    # Completion order and uneven op times mix the items; every group still holds one
    # epoch's items only, and each epoch ends with its own partial group, as a DataLoader's.
    pipeline = (
        PipelineBuilder()
        .add_source(Epochs())
        .pipe(Stamps(), concurrency=4)
        .aggregate(4, drop_last=drop_last)
        .add_sink()
        .build(continuous=True)
    )
    for epoch in range(4):
        groups = list(pipeline)
        assert [len(g) for g in groups] == ([4, 4] if drop_last else [4, 4, 2])
        assert all(100 * epoch <= x < 100 * epoch + 10 for g in groups for x in g)
        if not drop_last:
            assert sorted(x for g in groups for x in g) == list(
                range(100 * epoch, 100 * epoch + 10)
            )
    pipeline.stop()
    assert _feedline_threads() == []


def _some(x: int) -> Iterator[int]:
    # None, one or two outputs per input.
    for k in range(x % 3):
        time.sleep(0.001 * (x % 2))
        yield 10 * x + k


async def _some_async(x: int) -> Any:
    for k in range(x % 3):
        yield 10 * x + k


def _lists(x: int) -> list[int]:
    return [10 * x + k for k in range(x % 3)]


@pytest.mark.parametrize("kind", ["generator", "async generator", "disaggregate"])
def test_one_to_many_stages_end_each_epoch_with_its_own_items(kind: str) -> None:
    # Items that make no output, or several, or whose outputs come late, neither hold an
    # epoch up nor leak into the next one; the batches are those of a pipeline that is built
    # anew for each epoch, keeping input order.
    def build(continuous: bool, ordered: bool, source: Epochs) -> Any:
        order = "input" if ordered else "completion"
        calls = 1 if ordered else 3  # one at a time keeps a generator's outputs in order
        builder = PipelineBuilder().add_source(source)
        if kind == "generator":
            builder = builder.pipe(_some, concurrency=calls, output_order=order)
        elif kind == "async generator":
            builder = builder.pipe(_some_async, concurrency=calls, output_order=order)
        else:
            builder = builder.pipe(_lists, concurrency=3, output_order=order).disaggregate()
        return builder.aggregate(3).add_sink().build(continuous=continuous)

    reference = Epochs()
    continuous, ordered = build(True, True, Epochs()), build(False, True, reference)
    for epoch in range(3):
        reference.set_epoch(epoch)  # a pipeline of one epoch, built anew
        assert list(continuous) == list(ordered)
    continuous.stop()
    mixed = build(True, False, Epochs())
    for epoch in range(3):
        groups = list(mixed)
        want = sorted(
            10 * x + k for x in range(100 * epoch, 100 * epoch + 10) for k in range(x % 3)
        )
        assert sorted(y for g in groups for y in g) == want
        sizes = sorted(len(g) for g in groups)  # one partial group at most
        assert 1 <= sizes[0] <= 3
        assert sizes[1:] == [3] * (len(groups) - 1)
    mixed.stop()


def _fails_after_one(x: int) -> Iterator[int]:
    yield x
    if x % 5 == 0:
        raise ValueError(f"item {x}")
    yield -x


def test_a_generator_that_fails_part_way_keeps_what_it_gave() -> None:
    pipeline = (
        PipelineBuilder()
        .add_source(Epochs())
        .pipe(_fails_after_one, concurrency=2)
        .aggregate(4)
        .add_sink()
        .build(continuous=True, max_failures=0.5)
    )
    for epoch in range(3):
        got = sorted(y for g in pipeline for y in g)
        items = range(100 * epoch, 100 * epoch + 10)
        assert got == sorted([*items, *(-x for x in items if x % 5)])
    pipeline.stop()


class _SlowNextPass(Epochs):
    """Four items per epoch; beginning epoch 1 takes a while (a shard list, a first read)."""

    def set_epoch(self, epoch: int) -> None:
        super().set_epoch(epoch)
        if epoch == 1:
            time.sleep(1.0)

    def __iter__(self) -> Iterator[int]:
        return iter(range(100 * self.epoch, 100 * self.epoch + 4))


def _slowly(x: int) -> int:
    time.sleep(0.002)  # a stage that refills its input from the source before each call
    return x


def _only_first_two(x: int) -> Iterator[int]:
    if x % 100 < 2:
        yield x


@pytest.mark.parametrize(
    "kind",
    [
        "filter",
        "dropped groups",
        "partial group",
        # Items filtered out after the aggregate took its last one complete the epoch at its
        # checkpoint from the filter's thread: that wakes the aggregate to close the group.
        "filter then group",
        "slow op",
    ],
)
def test_an_epoch_ends_when_its_last_item_ends_not_when_the_next_begins(kind: str) -> None:
    # Epoch 0's loop must not wait for epoch 1 to begin: not when its last items make no
    # output, nor when its last group is partial or dropped (drop_last).
    builder: Any = PipelineBuilder().add_source(_SlowNextPass())
    want: list[Any] = {
        "filter": [0, 1],
        "dropped groups": [],
        "partial group": [[0, 1, 2], [3]],
        "filter then group": [[0, 1]],
        "slow op": [0, 1, 2, 3],
    }[kind]
    if kind.startswith("filter"):
        builder = builder.pipe(_only_first_two)
    elif kind == "slow op":
        builder = builder.pipe(_slowly)
    if kind == "dropped groups":
        builder = builder.aggregate(5, drop_last=True)
    elif kind.endswith("group"):
        builder = builder.aggregate(3)
    pipeline = builder.add_sink().build(continuous=True)
    try:
        start = time.monotonic()
        assert list(pipeline) == want
        assert time.monotonic() - start < 0.5
        assert [x for x in pipeline] == [_shift(v, 100) for v in want]
    finally:
        pipeline.stop()  # also when it fails: no thread left for the tests after


def _shift(value: Any, by: int) -> Any:
    return [x + by for x in value] if isinstance(value, list) else value + by


def test_an_item_that_comes_late_is_yielded_in_its_epoch() -> None:
    # Completion order: an item of epoch 1 finishes after items of epoch 2 have come (it
    # was held behind them, and never yielded).
    def op(x: int) -> int:
        if x == 0:
            time.sleep(0.5)
        if x == 100:
            time.sleep(0.2)
        return x

    pipeline = (
        PipelineBuilder()
        .add_source(Epochs())
        .pipe(op, concurrency=8)
        .add_sink()
        .build(continuous=True)
    )
    for epoch in range(3):
        assert sorted(pipeline) == list(range(100 * epoch, 100 * epoch + 10))
    pipeline.stop()


class Counted:
    """Twenty items per epoch, numbered by it; counts the items read, all epochs together."""

    def __init__(self) -> None:
        self.epoch = 0
        self.read = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        for x in range(100 * self.epoch, 100 * self.epoch + 20):
            self.read += 1
            yield x


def test_a_slow_item_holds_up_the_reads_of_later_epochs_without_spinning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import feedline.pipeline._pipeline as pipeline_module

    monkeypatch.setattr(pipeline_module, "CONTINUOUS_AHEAD", 30)
    release = threading.Event()

    def op(x: int) -> int:
        if x == 3:  # epoch 0's item 3 holds its loop up until released
            release.wait(10)
        return x

    source = Counted()
    pipeline = (
        PipelineBuilder()
        .add_source(source)
        .pipe(op, concurrency=4, output_order="completion")
        .add_sink(4)
        .build(continuous=True)
    )
    epochs: list[list[int]] = []
    loop = threading.Thread(target=lambda: epochs.extend(sorted(pipeline) for _ in range(4)))
    loop.start()
    time.sleep(0.5)  # the run goes as far as it may meanwhile
    cpu = time.process_time()
    time.sleep(1.0)
    spent = time.process_time() - cpu
    # Epoch 0 ends at item 20; 30 items may be read past it (and one read ahead).
    assert 20 + 30 <= source.read <= 20 + 30 + 1
    assert spent < 0.3, f"{spent:.2f} s of CPU in 1 s while the reads wait: a busy loop"
    release.set()
    loop.join(20)
    assert not loop.is_alive()
    pipeline.stop()
    assert epochs == [list(range(100 * e, 100 * e + 20)) for e in range(4)]


def test_stopping_between_loops_starts_the_next_epoch_afresh_without_repeats() -> None:
    # Each loop in a run of its own (auto_stop per epoch): items of the next epoch that the
    # stopped run had made early are made again by the new run, not yielded twice.
    def op(x: int) -> int:
        if x % 100 == 9:
            time.sleep(0.2)  # the epoch's last item comes late: the next epoch's come first
        return x

    pipeline = (
        PipelineBuilder()
        .add_source(Epochs())
        .pipe(op, concurrency=4, output_order="completion")
        .add_sink()
        .build(continuous=True)
    )
    for epoch in range(3):
        with pipeline.auto_stop():
            assert sorted(pipeline) == list(range(100 * epoch, 100 * epoch + 10))


def test_a_users_source_with_methods_named_like_the_runs_own_is_iterated_as_any() -> None:
    class Odd:
        ready = True  # not callable
        passes = "mine"

        def boundary(self) -> bool:
            return True

        def wake_with(self, wake: Any) -> None:
            raise AssertionError("the engine took this source for its own")

        def __iter__(self) -> Iterator[int]:
            return iter(range(50))

    for continuous in (False, True):
        pipeline = PipelineBuilder().add_source(Odd()).add_sink().build(continuous=continuous)
        assert sorted(pipeline) == list(range(50))
        pipeline.stop()
