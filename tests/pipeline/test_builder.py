from __future__ import annotations

import functools
import threading
from collections.abc import AsyncIterator
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any

import pytest

from feedline import ConfigurationError, PipelineBuilder

from . import _helpers


def ident(x: Any) -> Any:
    return x


async def aident(x: Any) -> Any:
    return x


def gen(x: Any) -> Any:
    yield x


def test_rejects_missing_source() -> None:
    with pytest.raises(ConfigurationError, match="add_source"):
        PipelineBuilder().build()
    with pytest.raises(ConfigurationError, match="before add_source"):
        PipelineBuilder().pipe(ident)


def test_rejects_second_source_and_stage_after_sink() -> None:
    b = PipelineBuilder().add_source([1])
    with pytest.raises(ConfigurationError, match="twice"):
        b.add_source([2])
    b.add_sink(2)
    with pytest.raises(ConfigurationError, match="after add_sink"):
        b.pipe(ident)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_rejects_bad_concurrency(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="concurrency must be an int >= 1"):
        PipelineBuilder().add_source([1]).pipe(ident, concurrency=bad)


def test_rejects_non_iterable_source_and_non_callable_op() -> None:
    with pytest.raises(ConfigurationError, match="Iterable or an AsyncIterable"):
        PipelineBuilder().add_source(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match="needs a callable"):
        PipelineBuilder().add_source([1]).pipe(42)  # type: ignore[arg-type]


def test_rejects_bad_output_order_and_duplicate_names() -> None:
    with pytest.raises(ConfigurationError, match="output_order"):
        PipelineBuilder().add_source([1]).pipe(ident, output_order="random")
    with pytest.raises(ConfigurationError, match="unique name"):
        PipelineBuilder().add_source([1]).pipe(ident, name="a").pipe(ident, name="a")


def test_default_names_are_unique() -> None:
    p = PipelineBuilder().add_source([1]).pipe(ident).pipe(ident).build()
    assert "ident -> ident#2" in repr(p)


def test_executor_with_async_op_is_rejected() -> None:
    with ThreadPoolExecutor(1) as ex, pytest.raises(ConfigurationError, match="event loop"):
        PipelineBuilder().add_source([1]).pipe(aident, executor=ex)


def test_generator_in_process_pool_is_rejected() -> None:
    with ProcessPoolExecutor(1) as ex, pytest.raises(ConfigurationError, match="generator"):
        PipelineBuilder().add_source([1]).pipe(gen, executor=ex)


def test_an_op_a_process_pool_cannot_receive_is_rejected_at_once() -> None:
    # Once, every item failed at run time, and the error advised raising the budget.
    held = threading.Lock()
    with ProcessPoolExecutor(1) as ex:
        with pytest.raises(ConfigurationError, match="module level"):
            PipelineBuilder().add_source([1]).pipe(lambda x: x, executor=ex)
        with pytest.raises(ConfigurationError, match="cannot be sent"):
            PipelineBuilder().add_source([1]).pipe(functools.partial(max, held), executor=ex)
        # A module-level function goes, and a lambda is fine on threads.
        PipelineBuilder().add_source([1]).pipe(abs, executor=ex)
        with ThreadPoolExecutor(1) as threads:
            PipelineBuilder().add_source([1]).pipe(lambda x: x, executor=threads)


def test_ordered_generator_needs_concurrency_one() -> None:
    with pytest.raises(ConfigurationError, match="concurrency=1"):
        PipelineBuilder().add_source([1]).pipe(gen, concurrency=2, output_order="input")
    PipelineBuilder().add_source([1]).pipe(gen, concurrency=1, output_order="input").build()


def test_concurrency_above_pool_is_rejected_at_build() -> None:
    b = PipelineBuilder().add_source([1]).pipe(ident, concurrency=8)
    with pytest.raises(ConfigurationError, match="num_threads=4"):
        b.build(num_threads=4)


@pytest.mark.parametrize("bad", [-1, 1.5, 0.0, "x", True])
def test_rejects_bad_max_failures(bad: Any) -> None:
    with pytest.raises(ConfigurationError, match="max_failures"):
        PipelineBuilder().add_source([1]).build(max_failures=bad)


def test_rejects_bad_stats_interval() -> None:
    with pytest.raises(ConfigurationError, match="report_stats_interval"):
        PipelineBuilder().add_source([1]).build(report_stats_interval=0)


def test_build_starts_no_thread() -> None:
    before = set(threading.enumerate())
    p = PipelineBuilder().add_source(range(3)).pipe(ident).build()
    assert set(threading.enumerate()) - before == set()
    assert list(p) == [0, 1, 2]


def test_the_queue_after_a_stage_defaults_by_the_kind_of_its_op() -> None:
    # Coroutine and async-generator ops get a longer queue; a sync op gets the short one,
    # also in an executor of its own. (The last stage's size is the sink's, whatever it says.)
    async def coroutine(x: int) -> int:
        return x

    async def agen(x: int) -> AsyncIterator[int]:
        yield x

    with ThreadPoolExecutor(1) as own:
        p = (
            PipelineBuilder()
            .add_source(range(3))
            .pipe(_helpers.identity)
            .pipe(coroutine)
            .pipe(agen)
            .pipe(coroutine, concurrency=16)
            .pipe(_helpers.identity, concurrency=5)
            .pipe(coroutine, buffer_size=1)
            .pipe(_helpers.identity, executor=own)
            .build()
        )
        assert [s.buffer_size for s in p._config.stages] == [2, 8, 8, 16, 5, 1, 2]
        with p.auto_stop():
            assert sorted(p) == [0, 1, 2]


def test_len_follows_the_source_through_one_to_one_stages_and_groups() -> None:
    def build(source: Any, drop_last: bool = False) -> Any:
        return (
            PipelineBuilder()
            .add_source(source)
            .pipe(str)
            .aggregate(4, drop_last=drop_last)
            .add_sink()
            .build()
        )

    for size, drop_last in ((10, False), (10, True), (8, False), (0, False)):
        pipeline = build(range(size), drop_last)
        assert len(pipeline) == len(list(pipeline))
    with pytest.raises(TypeError, match="no len"):
        len(build(iter(range(3))))
    flat = PipelineBuilder().add_source([[1, 2]]).disaggregate().add_sink().build()
    with pytest.raises(TypeError, match="any number"):
        len(flat)
