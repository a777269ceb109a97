"""Task hooks: user code called around every task of a pipeline's stages, for tracing.

See "Task hooks" in the README: :func:`hooked` wraps each op of this process when the
pipeline is built (a pipeline without hooks pays nothing); hooks run on the thread that runs
the task (a pool thread, or the event loop), so they must be thread-safe and quick.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from ._defs import OpKind

__all__ = ["TaskHook", "hooked"]


class TaskHook:
    """Called around the tasks of a pipeline's stages; override what you need.

    Every method receives the stage's name. ``item`` is the value the op is called with.
    """

    def stage_start(self, stage: str) -> None:
        """An epoch's run starts (before the stage's first task)."""

    def stage_end(self, stage: str) -> None:
        """An epoch's run ended or was stopped (after the stage's last task)."""

    def task_start(self, stage: str, item: Any) -> None:
        """A call of the stage's op is about to run on ``item``."""

    def task_end(
        self, stage: str, item: Any, result: Any, error: BaseException | None, seconds: float
    ) -> None:
        """The call on ``item`` returned ``result`` or raised ``error``, after ``seconds``.

        For a generator op, ``result`` is the number of items it yielded.
        """


def hooked(
    op: Callable[..., Any], kind: OpKind, stage: str, hooks: Sequence[TaskHook]
) -> Callable[..., Any]:
    """``op`` wrapped so that ``hooks`` are called around each of its calls."""
    hooks = tuple(hooks)

    @contextmanager
    def task(item: Any) -> Iterator[list[Any]]:
        # One call: the hooks before it, and after it with its result (out[0]) or error.
        for hook in hooks:
            hook.task_start(stage, item)
        out: list[Any] = [None]
        start = time.perf_counter()
        error: BaseException | None = None
        try:
            yield out
        except BaseException as failure:
            error = failure
            raise
        finally:
            seconds = time.perf_counter() - start
            for hook in hooks:
                hook.task_end(stage, item, out[0], error, seconds)

    if kind is OpKind.COROUTINE:

        async def coroutine(item: Any) -> Any:
            with task(item) as out:
                out[0] = await op(item)
            return out[0]

        return coroutine
    if kind is OpKind.GENERATOR:

        def generator(item: Any) -> Iterator[Any]:
            with task(item) as out:
                out[0] = 0  # a generator's result: how many items it yielded
                for result in op(item):
                    out[0] += 1
                    yield result

        return generator
    if kind is OpKind.ASYNC_GENERATOR:

        async def async_generator(item: Any) -> AsyncIterator[Any]:
            with task(item) as out:
                out[0] = 0
                async for result in op(item):
                    out[0] += 1
                    yield result

        return async_generator

    def function(item: Any) -> Any:
        with task(item) as out:
            out[0] = op(item)
        return out[0]

    return function
