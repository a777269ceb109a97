"""A whole pipeline in a child process: the builder crosses, the child builds and runs it.

:func:`run_pipeline_in_subprocess` is :func:`~feedline.iterate_in_subprocess` (the child
process, its queues and shared memory: :mod:`feedline._proc.subprocess`) whose factory builds
the pipeline in the child. A live executor cannot cross (it holds threads, locks, workers):
each stage's ``ThreadPoolExecutor`` or ``ProcessPoolExecutor`` travels as an
:class:`ExecutorRecipe` (its kind and what it was made with), and the child makes one of each
before it builds the pipeline, owns it, and shuts it down when it leaves (a process pool's
workers end with the child). An executor of another kind goes as it is if it pickles (a
process region's placeholder does), or the builder is refused before any process starts.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import pickle
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from feedline._proc.lifetime import die_with_parent
from feedline._proc.settings import SHM_MIN_BYTES
from feedline._proc.subprocess import SubprocessIterable, iterate_in_subprocess
from feedline.errors import ConfigurationError

from ._builder import PipelineBuilder
from ._pipeline import Pipeline

__all__ = ["ExecutorRecipe", "recipe_of", "run_pipeline_in_subprocess"]

T = TypeVar("T")

_FIX = (
    "give the stage a ThreadPoolExecutor or a ProcessPoolExecutor (made again in the child, "
    "with the same max_workers), an executor that pickles, or none (the pipeline's thread "
    "pool); or build and iterate the pipeline in this process with PipelineBuilder.build()"
)


@dataclass(frozen=True)
class ExecutorRecipe(Executor):
    """How to make a stage's executor again in another process (never runs anything itself)."""

    kind: Literal["thread", "process"]
    max_workers: int
    initializer: Callable[..., Any] | None = None
    initargs: tuple[Any, ...] = ()
    thread_name_prefix: str = ""  # a thread pool's
    start_method: str | None = None  # a process pool's
    max_tasks_per_child: int | None = None  # a process pool's (Python 3.11 and later)

    def make(self) -> Executor:
        """A new executor of this kind and size, owned by the caller."""
        if self.kind == "thread":
            return ThreadPoolExecutor(
                self.max_workers,
                thread_name_prefix=self.thread_name_prefix,
                initializer=self.initializer,
                initargs=self.initargs,
            )
        extra: dict[str, Any] = {}
        if self.max_tasks_per_child is not None:
            extra["max_tasks_per_child"] = self.max_tasks_per_child
        return ProcessPoolExecutor(
            self.max_workers,
            mp_context=mp.get_context(self.start_method),
            initializer=_start_worker,
            initargs=(self.initializer, *self.initargs),
            **extra,
        )


def _start_worker(initializer: Callable[..., Any] | None, *initargs: Any) -> None:
    # A process pool's worker in the child ends with the child, then runs its initializer.
    die_with_parent()
    if initializer is not None:
        initializer(*initargs)


def _made_with(stage: str, executor: Executor, names: tuple[str, ...]) -> list[Any]:
    # The constructor arguments an executor keeps (CPython's private attributes). One that
    # cannot be read is refused: an initializer silently dropped would change what runs.
    values = []
    for name in names:
        if not hasattr(executor, name):
            raise ConfigurationError(
                f"stage {stage!r}: cannot tell how its {type(executor).__name__} was made on "
                f"this Python (it has no {name}), so it cannot be made again in the child "
                f"process; {_FIX}"
            )
        values.append(getattr(executor, name))
    return values


def recipe_of(stage: str, executor: Executor) -> Executor:
    """What stands for ``executor`` on the way to a child: a recipe, or the executor itself.

    Raises:
        ConfigurationError: The executor (or its initializer) cannot be sent; the message
            names the stage and the executor's type, and says what to do instead.

    """
    recipe: Executor
    if type(executor) is ThreadPoolExecutor:
        workers, prefix, initializer, initargs = _made_with(
            stage, executor, ("_max_workers", "_thread_name_prefix", "_initializer", "_initargs")
        )
        recipe = ExecutorRecipe("thread", workers, initializer, initargs, thread_name_prefix=prefix)
    elif type(executor) is ProcessPoolExecutor:
        workers, context, initializer, initargs = _made_with(
            stage, executor, ("_max_workers", "_mp_context", "_initializer", "_initargs")
        )
        recipe = ExecutorRecipe(
            "process",
            workers,
            initializer,
            initargs,
            start_method=context.get_start_method(),
            max_tasks_per_child=getattr(executor, "_max_tasks_per_child", None),
        )
    else:
        recipe = executor
    try:
        pickle.dumps(recipe)
    except Exception as error:
        what = (
            f"the initializer of its {type(executor).__name__} (or its initargs)"
            if isinstance(recipe, ExecutorRecipe)
            else f"its executor, a {type(executor).__module__}.{type(executor).__qualname__},"
        )
        raise ConfigurationError(
            f"stage {stage!r}: {what} cannot be sent to the child process that "
            f"run_pipeline_in_subprocess starts ({type(error).__name__}: {error}); {_FIX}"
        ) from error
    return recipe


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
        _shut_down(self._executors, wait=True)


def _shut_down(executors: list[Executor], wait: bool) -> None:
    for executor in executors:
        executor.shutdown(wait=wait, cancel_futures=True)


def _build(builder: PipelineBuilder[Any], options: dict[str, Any]) -> Iterable[Any]:
    # In the child, which may start processes (pools, regions) as the main process may: its
    # parent still ends it as a daemon, and those processes end with it.
    mp.current_process().daemon = False
    made: list[Executor] = []

    def make(stage: str, executor: Executor) -> Executor:
        if isinstance(executor, ExecutorRecipe):
            made.append(executor.make())
            return made[-1]
        return executor

    try:
        return _ChildPipeline(builder._with_executors(make).build(**options), made)
    except BaseException:
        _shut_down(made, wait=False)
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
    one epoch each time the result is iterated. The other arguments are those of
    :func:`iterate_in_subprocess`. The result is iterable, so it can be the source of another
    pipeline (for example one that moves batches to the GPU).

    A stage's own ``ThreadPoolExecutor`` or ``ProcessPoolExecutor`` is made again in the
    child (same kind, ``max_workers``, initializer and start method), which owns it; the one
    given here runs nothing. The child may start processes (process pools, regions); they
    end with it.

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
        functools.partial(_build, builder._with_executors(recipe_of), options),
        buffer_size=buffer_size,
        timeout=timeout,
        mp_context=mp_context,
        shm_min_bytes=shm_min_bytes,
    )
