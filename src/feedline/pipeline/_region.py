"""Process regions (``pipe_in_processes``): a run of functions applied in worker processes.

See "Process regions" in the README: each worker applies the whole run to an item, packing
the result's large arrays into shared memory that the pool's receiving thread maps again;
the pool belongs to the pipeline, which ends it when an epoch stops part-way or fails.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, TypeVar

from feedline._proc.lifetime import die_with_parent
from feedline._proc.pipe_pool import PipePool
from feedline._proc.shm import SegmentNames, pack, remove_prefixed, set_segment_names, unpack

from ._resume import Tagged, TaggedOp

__all__ = ["RegionPool", "RunOfStages"]

_SHM_MIN = 64 * 1024  # arrays from this size cross through shared memory

T = TypeVar("T")


class RunOfStages:
    """The ops of a region, applied one after another to an item in a worker process."""

    def __init__(self, ops: Sequence[Callable[[Any], Any]], name: str) -> None:
        self.ops = list(ops)
        self.__name__ = name

    def __call__(self, item: Any) -> Any:
        for op in self.ops:
            item = op(item)
        return pack(item, _SHM_MIN, _names)


_names: SegmentNames | None = None  # the worker's segment names (set by _start_worker)


def _start_worker(prefix: str) -> None:
    global _names
    die_with_parent()
    _names = SegmentNames(f"{prefix}{os.getpid()}_")  # the pool's prefix, then this worker's
    set_segment_names(_names)


def _retag(item: Tagged, outer: Future[Any], inner: Future[Any]) -> None:
    # The worker's result becomes the item's value (an error leaves the item as it was).
    error = inner.exception()
    if error is not None:
        outer.set_exception(error)
    else:
        item.value = inner.result()
        outer.set_result(item)


class RegionPool(Executor):
    """The worker processes of one region: a process pool the pipeline owns.

    The processes start with the first item; :meth:`close` ends them, and the next item
    starts new ones (after ``close(hold=True)``, once :meth:`reopen` is called), which name
    their shared memory with a new prefix.

    Args:
        processes: How many worker processes.
        mp_context: Start method (default: the fork server).
        name: The region's stage name, for errors.

    """

    def __init__(self, processes: int, mp_context: str | None = None, name: str = "region") -> None:
        self.processes = processes
        self.name = name
        self._pool = PipePool(
            processes,
            mp.get_context(mp_context or "forkserver"),
            f"process region {name!r}",
            initializer=_start_worker,
            initargs=lambda: (SegmentNames.new_prefix(),),
            on_result=unpack,
            on_end=lambda initargs: remove_prefixed(initargs[0]),
        )

    @property
    def broken(self) -> bool:
        """Whether a worker died as it started: every item fails until :meth:`close`."""
        return self._pool.broken

    @property
    def idle(self) -> bool:
        """Whether no call is under way in the workers."""
        return self._pool.idle

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` in a worker (starting the workers if they are not).

        A ``TaggedOp`` on a ``Tagged`` item sends only the value: its source item stays here.
        """
        if isinstance(fn, TaggedOp) and len(args) == 1 and not kwargs:
            (item,) = args
            if isinstance(item, Tagged):
                inner = self._pool.submit(fn.op, item.value)
                outer: Future[Any] = Future()
                outer.set_running_or_notify_cancel()
                inner.add_done_callback(functools.partial(_retag, item, outer))
                return outer
        return self._pool.submit(fn, *args, **kwargs)

    def close(self, hold: bool = False) -> None:
        """End the workers at once (items under way are dropped) and free their segments.

        Safe to call again, also after an interruption part-way (it finishes the job). With
        ``hold``, items fail as cancelled instead of starting workers until :meth:`reopen`.
        """
        self._pool.close(hold)

    def reopen(self) -> None:
        """Let the next item start workers again after ``close(hold=True)``."""
        self._pool.reopen()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As :meth:`close` (the pipeline owns the pool; this is for ``Executor``'s API)."""
        self.close()
