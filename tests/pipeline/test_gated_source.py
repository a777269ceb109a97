"""A source read only while it says ready (``GatedSource``), woken when it may go on."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest

from feedline import ConfigurationError, PipelineBuilder
from feedline.pipeline import GatedSource


class _Allowance(GatedSource):
    """``range(n)``, each item drawn only once the test allowed it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.allowed = 0
        self.drawn = 0
        self.lock = threading.Lock()
        self.wake: Callable[[], None] | None = None

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            with self.lock:
                self.drawn += 1
            yield i

    def ready(self) -> bool:
        with self.lock:
            return self.drawn < self.allowed

    def wake_with(self, wake: Callable[[], None]) -> None:
        self.wake = wake

    def allow(self, more: int) -> None:
        with self.lock:
            self.allowed += more
        assert self.wake is not None
        self.wake()


def test_a_gated_source_is_read_only_while_ready() -> None:
    source = _Allowance(10)
    pipeline = PipelineBuilder[int]().add_source(source).pipe(lambda x: 2 * x).add_sink(4).build()
    with pipeline.auto_stop():
        source.allow(3)
        got = [pipeline.get_item(timeout=5) for _ in range(3)]
        with pytest.raises(TimeoutError):
            pipeline.get_item(timeout=0.2)
        assert source.drawn == 3
        source.allow(7)
        got += [pipeline.get_item(timeout=5) for _ in range(7)]
        with pytest.raises(TimeoutError):
            pipeline.get_item(timeout=0.2)  # its end is found by a draw, too
        source.allow(1)
        with pytest.raises(EOFError):
            pipeline.get_item(timeout=5)
    assert got == [2 * i for i in range(10)]


def test_a_pipeline_whose_gated_source_waits_stops_at_once() -> None:
    # The source stage ends its job while the source is not ready, rather than block in it:
    # nothing holds the stop up.
    source = _Allowance(10)
    pipeline = PipelineBuilder[int]().add_source(source).pipe(lambda x: x).add_sink(4).build()
    threads = set(threading.enumerate())
    pipeline.start()
    source.allow(1)
    assert pipeline.get_item(timeout=5) == 0
    t0 = time.monotonic()
    pipeline.stop()
    assert time.monotonic() - t0 < 2
    assert source.drawn == 1
    assert set(threading.enumerate()) <= threads  # the pipeline's threads are gone


def test_a_continuous_run_refuses_a_gated_source() -> None:
    # Its passes read ahead of the source's gate on the run's own terms: refused, not ignored.
    builder = PipelineBuilder().add_source(_Allowance(4)).pipe(str).add_sink()
    with pytest.raises(ConfigurationError, match="GatedSource"):
        builder.build(continuous=True)
