"""Task hooks: called around every task of every stage in this process, and per epoch."""

from __future__ import annotations

import asyncio
import threading
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

from feedline import ConfigurationError, PipelineBuilder, PipelineFailure
from feedline.pipeline import TaskHook


class Recorder(TaskHook):
    """Records every call, from any thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.events: list[tuple[Any, ...]] = []

    def stage_start(self, stage: str) -> None:
        with self.lock:
            self.events.append(("start", stage))

    def stage_end(self, stage: str) -> None:
        with self.lock:
            self.events.append(("end", stage))

    def task_start(self, stage: str, item: Any) -> None:
        with self.lock:
            self.events.append(("task", stage, item))

    def task_end(
        self, stage: str, item: Any, result: Any, error: BaseException | None, seconds: float
    ) -> None:
        assert seconds >= 0
        with self.lock:
            self.events.append(
                ("done", stage, item, result, type(error).__name__ if error else None)
            )

    def count(self, kind: str, stage: str) -> int:
        return sum(1 for e in self.events if e[0] == kind and e[1] == stage)


def double(x: int) -> int:
    return 2 * x


async def add_one(x: int) -> int:
    await asyncio.sleep(0)
    return x + 1


def pairs(x: int) -> Iterator[int]:
    yield x
    yield -x


async def apairs(x: int) -> AsyncIterator[int]:
    yield x


def test_every_kind_of_stage_is_hooked_per_task_and_per_epoch() -> None:
    recorder = Recorder()
    pipeline = (
        PipelineBuilder()
        .add_source(range(10))
        .pipe(double, concurrency=3)
        .pipe(add_one, concurrency=2)
        .pipe(pairs)
        .pipe(apairs)
        .aggregate(4)
        .add_sink()
        .build(hooks=[recorder])
    )
    for _ in range(2):  # two epochs
        assert sum(len(b) for b in pipeline) == 20
    stages = ("double", "add_one", "pairs", "apairs")
    for stage in stages:
        assert recorder.count("start", stage) == 2
        assert recorder.count("end", stage) == 2
    assert recorder.count("task", "double") == recorder.count("done", "double") == 20
    assert recorder.count("task", "apairs") == 40  # one task per input, 20 inputs a run
    done = {(e[2], e[3]) for e in recorder.events if e[0] == "done" and e[1] == "double"}
    assert done == {(x, 2 * x) for x in range(10)}
    generated = Counter(e[3] for e in recorder.events if e[0] == "done" and e[1] == "pairs")
    assert generated == {2: 20}  # each generator task yielded two items
    assert recorder.events[0][0] == "start"  # stage_start before any task
    assert recorder.events[-1][0] == "end"


def fail_on_two(x: int) -> int:
    if x == 2:
        raise ValueError("two")
    return x


def test_failures_are_reported_to_the_hook_and_a_stopped_epoch_ends_the_stages() -> None:
    recorder = Recorder()
    pipeline = (
        PipelineBuilder()
        .add_source(range(5))
        .pipe(fail_on_two)
        .add_sink()
        .build(hooks=[recorder], max_failures=1)
    )
    assert sorted(pipeline) == [0, 1, 3, 4]
    failed = [e for e in recorder.events if e[0] == "done" and e[4] is not None]
    assert failed == [("done", "fail_on_two", 2, None, "ValueError")]
    strict = PipelineBuilder().add_source(range(50)).pipe(double).add_sink().build(hooks=[recorder])
    for k, _ in enumerate(strict):
        if k == 3:
            break
    assert recorder.events[-1] == ("end", "double")
    failing = (
        PipelineBuilder().add_source(range(5)).pipe(fail_on_two).add_sink().build(hooks=[recorder])
    )
    with pytest.raises(PipelineFailure):
        list(failing)
    assert recorder.events[-1] == ("end", "fail_on_two")


def test_a_hook_without_the_methods_is_refused() -> None:
    with pytest.raises(ConfigurationError, match="TaskHook"):
        PipelineBuilder().add_source([1]).pipe(double).add_sink().build(hooks=[object()])  # type: ignore[list-item]
