"""Stage executors sent to a child process as recipes, and made again there.

A live executor cannot cross to another process: a ``ThreadPoolExecutor`` holds locks and its
threads, a ``ProcessPoolExecutor`` its workers and their pipes. When
:func:`~feedline.run_pipeline_in_subprocess` sends a builder to its child, the executor of each
stage that has one of those two kinds travels as an :class:`ExecutorRecipe`: its kind and what
it was made with (the number of workers, the initializer and its arguments, a thread pool's
thread names, a process pool's start method and tasks per worker). The child makes an
equivalent executor from each recipe before it builds the pipeline, owns it, and shuts it down
when it leaves; the executor given in this process is never used by that pipeline. A process
pool made there also ends its workers with the child
(:func:`feedline._proc.lifetime.die_with_parent`).

An executor of any other kind goes as it is if it pickles (a process region's placeholder
does); otherwise the builder is refused before any process starts, with a
:class:`~feedline.ConfigurationError` that names the stage and the executor.
"""

from __future__ import annotations

import multiprocessing as mp
import pickle
from collections.abc import Callable
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from feedline._proc.lifetime import die_with_parent
from feedline.errors import ConfigurationError

from ._builder import PipelineBuilder

__all__ = ["ExecutorRecipe", "made_again", "recipe_of", "with_recipes"]

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
    # A process pool's worker in the child: it ends with the child (which the parent may
    # terminate), then runs the initializer the pool was given.
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


def with_recipes(builder: PipelineBuilder[T]) -> PipelineBuilder[T]:
    """A copy of ``builder`` to send to a child: its stages' executors as recipes."""
    return builder._with_executors(recipe_of)


def made_again(builder: PipelineBuilder[T]) -> tuple[PipelineBuilder[T], list[Executor]]:
    """In the child: ``builder`` with its recipes made into executors, and those executors.

    The caller owns the executors and shuts them down.
    """
    made: list[Executor] = []

    def make(stage: str, executor: Executor) -> Executor:
        if not isinstance(executor, ExecutorRecipe):
            return executor
        made.append(executor.make())
        return made[-1]

    try:
        return builder._with_executors(make), made
    except BaseException:
        for executor in made:
            executor.shutdown(wait=False, cancel_futures=True)
        raise
