"""Process regions: a run of stages that runs in worker processes, item by item.

A stage that holds the GIL (Python-heavy parsing, ``numpy.load``, a tokenizer without a
native batch call) gains nothing from threads. :meth:`PipelineBuilder.pipe_in_processes
<feedline.PipelineBuilder.pipe_in_processes>` moves a run of such stages into a pool of
worker processes: each worker runs the whole run on an item, so only the run's input and
its output cross the process boundary; nothing is pickled between the run's stages. The
output's NumPy arrays (and CPU tensors) come back through shared memory, as from a
subprocess pipeline, and are mapped again in this process by the pool's thread that receives
the result.

The pool belongs to the pipeline: its processes start with the first item (from the fork
server, since the pipeline's threads make a plain fork unsafe), serve the epochs that run
to their end, end with their parent if it is killed, and are shut down when an epoch is
stopped part-way or fails (the next item starts new ones) and when the pipeline is dropped;
segments a worker made and nobody mapped are removed then. The processes are a
:class:`~feedline._proc.pipe_pool.PipePool`: a pipe each way per worker, no helper threads.
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

    The processes start with the first item and serve the epochs that follow; :meth:`close`
    ends them (the pipeline does when an epoch is stopped part-way or fails, and when it is
    dropped), and the next item starts new ones: a :class:`PipePool` whose workers name their
    shared memory with a new prefix at each start.

    Args:
        processes: How many worker processes.
        mp_context: Start method (default: the fork server).
        name: The region's stage name, for errors.

    """

    def __init__(self, processes: int, mp_context: str | None = None, name: str = "region") -> None:
        self.processes = processes
        self.name = name
        # Each start of the workers names their segments with a new prefix, and each end
        # removes what is left under it.
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

        A stage's op applied to an item that carries its source item (``TaggedOp`` on a
        ``Tagged``) sends only the item's value: its source item stays in this process.
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

    def close(self) -> None:
        """End the workers at once (items under way are dropped) and free their segments.

        Safe to call again, also after an interruption part-way (it finishes the job).
        """
        self._pool.close()

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As :meth:`close` (the pipeline owns the pool; this is for ``Executor``'s API)."""
        self.close()
