"""Continuous pipelines: one run across epochs, each loop still one epoch."""

from __future__ import annotations

import collections
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


def test_an_empty_source_ends_and_groups_may_span_epochs() -> None:
    empty = PipelineBuilder().add_source([]).add_sink().build(continuous=True)
    assert list(empty) == []
    grouped = PipelineBuilder().add_source(range(10)).aggregate(4).add_sink().build(continuous=True)
    groups: list[Any] = []
    for _ in range(4):
        groups += list(grouped)
    grouped.stop()
    assert {len(g) for g in groups} == {4}  # no partial group at the epochs' ends
    counts = collections.Counter(x for g in groups for x in g)
    assert all(counts[x] >= 3 for x in range(10))  # 4 epochs, less a group at the edges
    with pytest.raises(ConfigurationError, match="resumable"):
        PipelineBuilder().add_source([1]).add_sink().build(continuous=True, resumable=True)
