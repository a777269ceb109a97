"""Worker processes for datasets whose ``__getitem__`` holds the GIL.

Each worker is a :class:`~feedline.SubprocessIterable` whose child holds the dataset (sent
once, when the worker starts) and, per epoch, fetches its share of the batches with a thread
pool, like the main process does without workers. Batch ``b`` goes to worker ``b % W``, as in
PyTorch, so the parent restores the order by taking from the workers in turn. The epoch's
share travels on a queue of its own just before the epoch starts, as one message.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import os
import pickle
import random
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.connection import wait as wait_for
from typing import Any

import numpy as np

from feedline.errors import ConfigurationError
from feedline.pipeline import PipelineBuilder, SubprocessIterable
from feedline.pipeline._subprocess import _CLOSE_GRACE, _DEFAULT_SHM_MIN, _POLL, _Abandoned

from ._fetch import BatchFetcher, Task, collate_in_worker
from ._state import is_stateful

__all__ = ["WorkerSet"]


class _WorkerIterable:
    """Lives in the child: one pass per epoch over the tasks the parent sent for it."""

    def __init__(
        self,
        dataset: Any,
        tasks: Any,
        worker_id: int,
        num_workers: int,
        concurrency: int,
        in_flight: int,
        worker_init_fn: Callable[[int], None] | None,
        collate_fn: Callable[[Any], Any],
        auto_collation: bool,
    ) -> None:
        self._collate_fn = collate_fn
        self._auto = auto_collation
        self._dataset = dataset
        self._tasks = tasks
        self._worker_id = worker_id
        self._num_workers = num_workers
        self._concurrency = concurrency
        self._in_flight = in_flight
        self._worker_init_fn = worker_init_fn  # called once, after the first seeding

    def __iter__(self) -> Iterator[tuple[int, list[Any], Any]]:
        base_seed, tasks, dataset_state = self._tasks.get()
        _seed_like_pytorch(base_seed, self._worker_id, self._num_workers, self._dataset)
        init, self._worker_init_fn = self._worker_init_fn, None
        if init is not None:
            init(self._worker_id)
        stateful = is_stateful(self._dataset)
        if stateful and dataset_state is not None:
            self._dataset.load_state_dict(dataset_state)
        origin = f"DataLoader worker {self._worker_id} (pid {os.getpid()})"
        fetcher = BatchFetcher(
            self._dataset,
            self._concurrency,
            snapshot=self._dataset.state_dict if stateful else None,
            origin=origin,
            seed=base_seed,
        )
        pipeline = (
            PipelineBuilder()
            .add_source(tasks)
            .pipe(
                fetcher.fetch,
                # One call at a time: batches strictly one after another, as in PyTorch's
                # workers, so that draws from the global random generators match.
                concurrency=1 if self._concurrency == 1 else self._in_flight,
                output_order="input",
                name="fetch",
            )
            .pipe(collate_in_worker(self._collate_fn, self._auto, origin), name="collate_fn")
            .add_sink(self._in_flight)
            .build(num_threads=2)
        )
        try:
            with pipeline.auto_stop():
                yield from pipeline
        finally:
            fetcher.close()


def _seed_like_pytorch(base_seed: int, worker_id: int, num_workers: int, dataset: Any) -> None:
    """Seed ``random``, NumPy and torch, and set ``get_worker_info()``, as PyTorch's workers do.

    Every epoch (PyTorch seeds once per worker process; these processes may serve several
    epochs, and a resumed epoch must draw the same numbers). ``worker_init_fn`` runs after
    the first seeding, as in PyTorch, and sees :func:`torch.utils.data.get_worker_info`.
    """
    seed = base_seed + worker_id
    random.seed(seed)
    try:
        import torch
        from torch.utils.data._utils import worker
    except ImportError:  # pragma: no cover - the loader needs torch
        np.random.seed(seed % 2**32)
        return
    torch.manual_seed(seed)
    generate = getattr(worker, "_generate_state", None)  # PyTorch's NumPy seed for a worker
    np.random.seed(generate(base_seed, worker_id) if generate else seed % 2**32)
    if hasattr(worker, "_worker_info") and hasattr(worker, "WorkerInfo"):
        worker._worker_info = worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
        )


_PRELOAD = ("feedline.loader._workers", "torch")
"""What every worker imports: preloaded in the fork server, so that each worker is forked with
them already imported (measured on a 2-core VM: a DataLoader with 2 workers had its first
batch after 2.0-2.7 s, each worker importing torch anew; with the preload, after 0.26 s, from
the second loader of the process on; the first one pays the server's own imports)."""


def _preload_forkserver() -> None:
    """Have the fork server import what the workers need, if it has not started yet.

    Adds to the server's preload list (``"__main__"`` by default, or what the user set with
    ``set_forkserver_preload``) this package's worker module and torch. Not the dataset's
    module: the server survives only an ``ImportError`` in a preload, so a module that exits
    or raises anything else at import would take the server down, and with it every worker
    start, where a worker importing it reports the error plainly. Once the server runs, its
    list no longer matters.
    """
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)
    if server is None or getattr(server, "_forkserver_pid", 0) is not None:
        return  # not CPython's fork server, or it already runs
    current = list(getattr(server, "_preload_modules", ["__main__"]))
    extra = [m for m in _PRELOAD if m not in current]
    if extra:
        forkserver.set_forkserver_preload(current + extra)


def _identity(items: Any) -> Any:
    return items


def _not_picklable(dataset: Any, init: Any, error: BaseException) -> ConfigurationError:
    """Say which part of the dataset (or worker_init_fn) cannot be sent to a worker."""
    culprit = "the dataset"
    try:
        pickle.dumps(init)
    except Exception:
        culprit = "worker_init_fn"
    else:
        for name, value in getattr(dataset, "__dict__", {}).items():
            try:
                pickle.dumps(value)
            except Exception:
                culprit = f"the dataset's attribute {name!r} ({type(value).__name__})"
                break
    return ConfigurationError(
        f"{culprit} cannot be sent to the worker processes: {error}. Worker processes start "
        "with forkserver or spawn, which pickle it: define functions at module level (not "
        "lambdas or local functions), or use num_workers=0, whose threads need no pickling"
    )


_SETTLE_SECONDS = 1.0
"""How long persistent workers left mid-epoch get to finish their batch before they are ended
(and started anew by the next epoch)."""


class _Epoch:
    """One epoch over the workers: iterable, and interruptible as a pipeline's source."""

    def __init__(self, workers: WorkerSet, total: int) -> None:
        self._workers = workers
        self._total = total

    def __iter__(self) -> Iterator[tuple[int, list[Any], Any]]:
        return self._workers._run(self._total, None)

    def iter_until(self, stopping: Callable[[], bool]) -> Iterator[tuple[int, list[Any], Any]]:
        """Iterate, ending early once ``stopping()`` is true (see ``SubprocessIterable``)."""
        return self._workers._run(self._total, stopping)


def _drain(q: Any) -> None:
    import queue

    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


class WorkerSet:
    """``num_workers`` worker processes, started on the first epoch.

    Args:
        dataset: The map-style dataset, pickled once per worker.
        num_workers: How many processes.
        concurrency: Threads fetching items in each worker.
        prefetch: Batches each worker may have ready or in flight.
        worker_init_fn: Called with the worker id in each worker, once, before its first
            epoch and after the seeding (as in PyTorch).
        mp_context: Start method (``"spawn"`` or ``"forkserver"``), or ``None``: ``"fork"``
            when the process runs no other thread as an epoch starts (what PyTorch does,
            without its risk), else ``"forkserver"``.
        timeout: Seconds to wait for a batch (None: no limit).
        persistent: The workers serve several epochs: an epoch left early lets each finish
            its current batch and keeps it, instead of ending it at once.
        in_order: ``False`` yields each worker's batches as they come, so a slow batch holds
            up only its own worker.
        collate_fn, auto_collation: The loader's; batches are collated in the workers, as in
            PyTorch, so one batch rather than its items crosses to the parent.

    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_workers: int,
        concurrency: int,
        prefetch: int,
        worker_init_fn: Callable[[int], None] | None,
        mp_context: str | None,
        timeout: float | None,
        persistent: bool = False,
        in_order: bool = True,
        collate_fn: Callable[[Any], Any] | None = None,
        auto_collation: bool = True,
    ) -> None:
        self._persistent = persistent
        self._in_order = in_order
        self._dataset = dataset
        self._init = worker_init_fn
        self._auto = mp_context is None
        method = mp_context or "forkserver"
        ctx = mp.get_context(method)
        if mp_context == "forkserver":
            _preload_forkserver()
        self._queues = [ctx.Queue() for _ in range(num_workers)]
        self._workers: list[SubprocessIterable[tuple[int, list[Any], Any]]] = [
            # Built directly: the task queue pickles only while the process starts, so the
            # up-front pickling check of iterate_in_subprocess would refuse it.
            SubprocessIterable(
                functools.partial(
                    _WorkerIterable,
                    dataset,
                    q,
                    wid,
                    num_workers,
                    concurrency,
                    prefetch,
                    worker_init_fn,
                    collate_fn or _identity,
                    auto_collation,
                ),
                buffer_size=prefetch,
                timeout=timeout,
                mp_context=method,
                shm_min_bytes=_DEFAULT_SHM_MIN,
                name=f"DataLoader worker {wid}",
                reraise=True,  # the dataset's and worker_init_fn's own exceptions, as PyTorch
            )
            for wid, q in enumerate(self._queues)
        ]

    def epoch(
        self, tasks: list[Task], base_seed: int, dataset_states: list[Any] | None = None
    ) -> _Epoch:
        """Fetch ``tasks`` (batches, in order) across the workers; iterate them in order.

        Each batch comes as ``(number, items, (worker, dataset state) or None)``. Every worker
        is asked for its share before the first batch is awaited, so that they all start (and
        fetch) at once. As a pipeline's source, the epoch ends as soon as the pipeline stops.
        """
        self._start_all()  # first: putting the shares starts the queues' feeder threads
        count = len(self._workers)
        shares = [tasks[w::count] for w in range(count)]
        states = dataset_states or [None] * count
        for q, share, state in zip(self._queues, shares, states, strict=True):
            _drain(q)  # a share left by an epoch abandoned before that worker began it
            q.put((base_seed, share, state))
        return _Epoch(self, len(tasks))

    def _start_all(self) -> None:
        # Here, in the thread that asks for the epoch (the training thread, before the
        # epoch's pipeline starts any thread): with no other thread running, a fork is as
        # safe as PyTorch's and starts a worker in milliseconds; otherwise the fork server.
        method = None
        if self._auto:
            alone = threading.active_count() == 1 and "fork" in mp.get_all_start_methods()
            method = "fork" if alone else "forkserver"
            if not alone:
                _preload_forkserver()
        for w in self._workers:
            try:
                w.start(method)
            except (pickle.PicklingError, AttributeError, TypeError) as error:
                if "pickle" not in str(error):
                    raise
                raise _not_picklable(self._dataset, self._init, error) from error

    def _run(
        self, total: int, stopping: Callable[[], bool] | None
    ) -> Iterator[tuple[int, list[Any], Any]]:
        count = len(self._workers)
        iterators: list[Iterator[tuple[int, list[Any], Any]]] = []
        done = False
        try:
            for w in self._workers:
                iterators.append(w.iter_until(stopping, settle=False))
            try:
                if self._in_order:
                    for i in range(total):
                        number, items, snapshot = next(iterators[i % count])
                        yield number, items, None if snapshot is None else (i % count, snapshot[1])
                else:
                    yield from self._as_they_come(iterators, total, stopping)
            except _Abandoned:
                return  # the pipeline stopped meanwhile: settled below
            for it in iterators:  # let each child end its pass
                for _ in it:
                    pass
            done = True
        finally:
            if not done and not self._persistent:
                self.close()  # at once: nobody waits for a busy worker's current batch
            elif not done:
                # Persistent workers finish the batch they are on, within a common deadline.
                deadline = time.monotonic() + _SETTLE_SECONDS
                for w in self._workers:
                    w.request_stop()
                for w in self._workers:
                    w.settle(deadline)
            for it in iterators:
                it.close()  # type: ignore[attr-defined]

    def _as_they_come(
        self,
        iterators: list[Iterator[tuple[int, list[Any], Any]]],
        total: int,
        stopping: Callable[[], bool] | None,
    ) -> Iterator[tuple[int, list[Any], Any]]:
        # in_order=False: take each worker's next batch as soon as it is there, so that a
        # slow batch holds up only the worker fetching it (as in PyTorch).
        count = len(self._workers)
        left = {w: len(range(w, total, count)) for w in range(count) if w < total}
        for w in left:
            self._workers[w].wait_ready(stopping)
        while left:
            handles = {h: w for w in left for h in self._workers[w].wait_handles()}
            ready = wait_for(list(handles), timeout=_POLL)
            if stopping is not None and stopping():
                raise _Abandoned
            for w in {handles[h] for h in ready}:
                number, items, snapshot = next(iterators[w])  # raises if the worker died
                yield number, items, None if snapshot is None else (w, snapshot[1])
                left[w] -= 1
                if left[w] == 0:
                    del left[w]

    def close(self) -> None:
        """Stop every worker process, all at once (about a second at most). Idempotent."""
        for w in self._workers:
            w.ask_to_leave()
        deadline = time.monotonic() + _CLOSE_GRACE
        for w in self._workers:
            w.close(grace=max(0.0, deadline - time.monotonic()))
        for q in self._queues:
            q.cancel_join_thread()  # a share no worker read must not hold this process
            q.close()
