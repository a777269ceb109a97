"""Process regions: a run of stages that runs in worker processes, item by item.

A stage that holds the GIL (Python-heavy parsing, ``numpy.load``, a tokenizer without a
native batch call) gains nothing from threads. :meth:`PipelineBuilder.pipe_in_processes
<feedline.PipelineBuilder.pipe_in_processes>` moves a run of such stages into a pool of
worker processes: each worker runs the whole run on an item, so only the run's input and
its output cross the process boundary; nothing is pickled between the run's stages. The
output's NumPy arrays (and CPU tensors) come back through shared memory, as from a
subprocess pipeline, and are mapped again by a light stage in this process.

The pool belongs to the pipeline: its processes start with the first item (from the fork
server, since the pipeline's threads make a plain fork unsafe), serve the epochs that run
to their end, end with their parent if it is killed, and are shut down when an epoch is
stopped part-way or fails (the next item starts new ones) and when the pipeline is dropped;
segments a worker made and nobody mapped are removed then.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from typing import Any, TypeVar

from ._lifetime import die_with_parent
from ._shm import SegmentNames, pack, remove_prefixed, set_segment_names

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


class RegionPool(Executor):
    """The worker processes of one region: a process pool the pipeline owns.

    The processes start with the first item and serve the epochs that follow; :meth:`close`
    ends them (the pipeline does when an epoch is stopped part-way or fails, and when it is
    dropped), and the next item starts new ones.

    Args:
        processes: How many worker processes.
        mp_context: Start method (default: the fork server).

    """

    def __init__(self, processes: int, mp_context: str | None = None) -> None:
        self.processes = processes
        self._context = mp.get_context(mp_context or "forkserver")
        self._lock = threading.Lock()
        self._pool: ProcessPoolExecutor | None = None
        self._prefix = ""

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Run ``fn(*args, **kwargs)`` in a worker (starting the workers if they are not)."""
        with self._lock:
            if self._pool is None:
                self._prefix = SegmentNames.new_prefix()
                self._pool = ProcessPoolExecutor(
                    self.processes,
                    mp_context=self._context,
                    initializer=_start_worker,
                    initargs=(self._prefix,),
                )
            pool = self._pool
        return pool.submit(fn, *args, **kwargs)

    def close(self) -> None:
        """End the workers at once (items under way are dropped) and free their segments."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
            remove_prefixed(self._prefix)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As :meth:`close` (the pipeline owns the pool; this is for ``Executor``'s API)."""
        self.close()
