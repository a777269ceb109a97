"""A whole pipeline in a child process: the builder crosses, the child builds and runs it.

:func:`run_pipeline_in_subprocess` is :func:`~feedline.iterate_in_subprocess` (the child
process, its queues and shared memory: :mod:`feedline._proc.subprocess`) whose factory
builds the pipeline in the child, with each stage's executor made again there from its
recipe (:mod:`._recipes`).
"""

from __future__ import annotations

import functools
import multiprocessing as mp
from collections.abc import Iterable, Iterator
from concurrent.futures import Executor
from typing import Any, TypeVar

from feedline._proc.settings import SHM_MIN_BYTES
from feedline._proc.subprocess import SubprocessIterable, iterate_in_subprocess

from ._builder import PipelineBuilder
from ._pipeline import Pipeline
from ._recipes import made_again, with_recipes

__all__ = ["run_pipeline_in_subprocess"]

T = TypeVar("T")


class _ChildPipeline:
    """The pipeline a child built, with the executors it made for its stages (it owns them)."""

    def __init__(self, pipeline: Pipeline[Any], executors: list[Executor]) -> None:
        self._pipeline = pipeline
        self._executors = executors

    def __iter__(self) -> Iterator[Any]:
        return iter(self._pipeline)

    def close(self) -> None:
        """Stop the pipeline and shut its executors down (the child is leaving)."""
        self._pipeline.stop()
        for executor in self._executors:
            executor.shutdown(wait=True, cancel_futures=True)


def _build(builder: PipelineBuilder[Any], options: dict[str, Any]) -> Iterable[Any]:
    # In the child. It may start processes (process pools, process regions), as the main
    # process may: its parent still ends it as a daemon, and those processes end with it.
    mp.current_process().daemon = False
    builder, executors = made_again(builder)
    try:
        return _ChildPipeline(builder.build(**options), executors)
    except BaseException:
        for executor in executors:
            executor.shutdown(wait=False, cancel_futures=True)
        raise


def run_pipeline_in_subprocess(
    builder: PipelineBuilder[T],
    *,
    num_threads: int | None = None,
    max_failures: int | float | None = 0,
    report_stats_interval: float | None = None,
    autotune: bool = False,
    memory_budget: int | None = None,
    cpu_budget: float | None = None,
    buffer_size: int = 3,
    timeout: float | None = None,
    mp_context: str = "spawn",
    shm_min_bytes: int = SHM_MIN_BYTES,
) -> SubprocessIterable[T]:
    """Build and run the pipeline that ``builder`` describes in a child process.

    The builder (its source and ops) is pickled to the child, which builds the pipeline with
    ``num_threads``, ``max_failures``, ``report_stats_interval``, ``autotune``,
    ``memory_budget`` and ``cpu_budget`` (see :meth:`PipelineBuilder.build`; the tuner runs
    in the child, and each epoch starts where the last one's left the concurrency) and runs
    one epoch each time the result is iterated. The
    other arguments are those of :func:`iterate_in_subprocess`. The result is iterable, so it
    can be the source of another pipeline (for example one that moves batches to the GPU).

    A stage's own ``executor=`` does not cross to the child (it holds threads, locks,
    worker processes): a ``ThreadPoolExecutor`` or ``ProcessPoolExecutor`` is made again
    there, of the same kind with the same ``max_workers``, initializer and start method; the
    child owns it and shuts it down when it leaves, and the one given here runs nothing.
    The child may start processes (process pools, ``pipe_in_processes`` regions); they end
    with it.

    Raises:
        ConfigurationError: On invalid arguments; or a stage's executor of another kind that
            does not pickle (or an initializer that does not), naming the stage.

    """
    options: dict[str, Any] = {
        "num_threads": num_threads,
        "max_failures": max_failures,
        "report_stats_interval": report_stats_interval,
        "autotune": autotune,
        "memory_budget": memory_budget,
        "cpu_budget": cpu_budget,
    }
    builder.build(**options)  # validate here, where the error is easy to read
    return iterate_in_subprocess(
        functools.partial(_build, with_recipes(builder), options),
        buffer_size=buffer_size,
        timeout=timeout,
        mp_context=mp_context,
        shm_min_bytes=shm_min_bytes,
    )
