"""Worker processes for datasets whose ``__getitem__`` holds the GIL, and iterable datasets.

Each worker is a :class:`~feedline.SubprocessIterable` whose child holds the dataset (sent
once, when the worker starts) and, per epoch, fetches its share of the batches with a thread
pool, like the main process does without workers. Batch ``b`` goes to worker ``b % W``, as in
PyTorch, so the parent restores the order by taking from the workers in turn (with
``in_order=False``, to a worker with room, taken as they come). The parent deals the
batches as the workers need them (:mod:`._deal`), on a queue of each worker's own.

An iterable dataset is iterated by every worker, each seeing its own
``torch.utils.data.get_worker_info()`` to take its share of the stream (PyTorch's protocol).
Each worker batches and collates what its iterator gives; the parent takes the workers'
batches in turn, leaving out a worker once its iterator is exhausted, which is the order
PyTorch's DataLoader gives.
"""

from __future__ import annotations

import functools
import itertools
import logging
import multiprocessing as mp
import os
import pickle
import random
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from feedline._proc.forking import fork_hazards
from feedline._proc.queues import close_queue, write_first
from feedline._proc.settings import CHILD_CLOSE_GRACE, SHM_MIN_BYTES
from feedline._watchdog import STALL_AFTER, StallWatch
from feedline.errors import ConfigurationError
from feedline.pipeline import PipelineBuilder, SubprocessIterable

from ._collate import shm_collate_for
from ._concurrency import FetchConcurrency
from ._deal import Dealer, TaskStream, read_start
from ._fetch import BatchFetcher, Collated, Task, collate_in_worker, failed_in_worker
from ._gather import Reporter, StateReport, Turns, WorkerEpoch
from ._seeds import RngWatch, next_only
from ._state import is_stateful, start_stream

__all__ = ["WorkerSet"]

_log = logging.getLogger("feedline.loader")


class _WorkerIterable:
    """Lives in the child: one pass per epoch over the tasks the parent sent for it."""

    def __init__(
        self,
        dataset: Any,
        tasks: Any,
        worker_id: int,
        num_workers: int,
        concurrency: FetchConcurrency,
        in_flight: int,
        worker_init_fn: Callable[[int], None] | None,
        collate_fn: Callable[[Any], Any],
        auto_collation: bool,
        stream: tuple[int, bool] | None = None,
    ) -> None:
        self._collate_fn = collate_fn
        self._auto = auto_collation
        self._stream = stream  # an iterable dataset's (batch size, drop_last)
        self._dataset = dataset
        self._tasks = tasks
        self._worker_id = worker_id
        self._num_workers = num_workers
        self._concurrency = concurrency
        self._in_flight = in_flight
        self._worker_init_fn = worker_init_fn  # called once, after the first seeding

    def __iter__(self) -> Iterator[tuple[int, Any, Any]]:
        seeded = self._tasks.seed  # known at the start: seeded (and initialised) while the
        self._tasks.seed = None  # parent starts the other workers and draws the batches
        if seeded is not None:
            self._seed(seeded)
        start = read_start(self._tasks.get)
        _, epoch, base_seed, first, dataset_state, last, taken, iterates, between, own = start
        if own != seeded:  # (the generators' seed: the epoch's, or its part's after a move)
            self._seed(own)
        tasks = TaskStream(self._tasks.queue, epoch, first, last)
        stateful = is_stateful(self._dataset)
        origin = f"DataLoader worker {self._worker_id} (pid {os.getpid()})"
        if self._stream is not None:
            # Resumed: a dataset with a state goes on from it; else the batches handed out
            # are drawn again, not collated.
            replay = taken if dataset_state is None or not stateful else 0
            state = dataset_state if stateful else None
            yield from self._batches_of_stream(taken, replay, stateful, origin, state, iterates)
            return
        if stateful:
            if dataset_state is not None:
                self._dataset.load_state_dict(dataset_state)
                if between:
                    # Saved after the last epoch's end: a persistent worker goes on with its
                    # dataset's state, and its generators are seeded for the new epoch.
                    _seed_like_pytorch(own, self._worker_id, self._num_workers, self._dataset)
            # The parent keeps it from the start (see WorkerEpoch.read_reports).
            yield -1, StateReport(self._dataset.state_dict(), False, ended=False), None
        fetcher = BatchFetcher(
            self._dataset,
            self._concurrency.threads,
            least=self._concurrency.least,
            start=self._concurrency.start,
            snapshot=self._dataset.state_dict if stateful else None,
            origin=origin,
            seed=base_seed,
            # Its share of the cores: N workers fetching CPU-bound items with cores + 1 calls
            # each would queue N times as many calls as there are cores.
            cores=max(1, (os.cpu_count() or 1) // self._num_workers),
            finish=collate_in_worker(shm_collate_for(self._collate_fn), self._auto, origin),
            batched=self._auto,
        )
        try:
            # Batches one after another on this thread, as a PyTorch worker fetches them (a
            # pipeline and its threads cost 15-30 ms on 2 cores, measured, and take the cores
            # from the other workers): the first one always, then while the fetcher keeps
            # their items on this thread; at a concurrency of one, every batch, so that global
            # draws match PyTorch's.
            several = self._concurrency.threads > 1
            for task in tasks.take(1 if several and not fetcher.inline else None):
                yield fetcher.fetch_now(task)
                if several and not fetcher.inline:
                    break  # its items wait: several at once from here
            if several and not tasks.complete:
                yield from self._pipeline(fetcher, tasks)
        finally:
            fetcher.close()

    def _batches_of_stream(
        self, first: int, replay: int, stateful: bool, origin: str, state: Any, iterates: bool
    ) -> Iterator[tuple[int, Any, Any]]:
        # An iterable dataset: this worker's batches of its own iterator, numbered from
        # ``first`` and collated here, as PyTorch's workers make them; the first ``replay``
        # batches drawn (handed out before a resume) are dropped, not collated. A stateful
        # dataset's state is loaded (``state``), and reported, as the pass starts, with each
        # batch, and once its iterator ended.
        assert self._stream is not None
        size, drop_last = self._stream
        finish = collate_in_worker(shm_collate_for(self._collate_fn), self._auto, origin)
        number = first - replay
        try:
            if stateful:
                iterator = start_stream(self._dataset, state, iterates)
                iterates = iterator is self._dataset
                yield number, StateReport(self._dataset.state_dict(), iterates, False), None
            else:
                iterator = iter(self._dataset)
            items = next_only(iterator)
            while True:
                chunk = list(itertools.islice(items, size))
                if not chunk or (drop_last and len(chunk) < size):
                    break
                if number >= first:
                    snapshot = (0, self._dataset.state_dict()) if stateful else None
                    yield finish((number, chunk, snapshot))
                number += 1
        except Exception as error:
            # Raised in the parent in this worker's turn; its stream ends there, the other
            # workers' go on (as in PyTorch, whose worker's iterator is done after it raised).
            yield max(number, first), failed_in_worker(error, f"the dataset in {origin}"), None
            return
        if stateful:
            yield number, StateReport(self._dataset.state_dict(), iterates, ended=True), None

    def _pipeline(self, fetcher: BatchFetcher, tasks: TaskStream) -> Iterator[Any]:
        # The batches after the first: fetched by a pipeline, several in flight. Nothing
        # else in this process draws from the global generators meanwhile: a draw is the
        # dataset's (or collate_fn's), made on several threads at once, which the parent
        # warns of (the first batches are watched: the generators' states cost a few µs).
        pipeline = (
            PipelineBuilder[Task]()
            .add_source(tasks)
            .pipe(fetcher.fetch, concurrency=self._in_flight, output_order="input", name="fetch")
            .add_sink(self._in_flight)
            .build(num_threads=2)
        )
        watch = RngWatch()
        watch.start()
        watched = _WATCHED_BATCHES
        with pipeline.auto_stop():
            for number, collated, state in pipeline:
                if watched and isinstance(collated, Collated):
                    watched -= 1
                    if watch.drew():
                        collated, watched = collated._replace(drew=True), 0
                yield number, collated, state

    def _seed(self, base_seed: int) -> None:
        _seed_like_pytorch(base_seed, self._worker_id, self._num_workers, self._dataset)
        init, self._worker_init_fn = self._worker_init_fn, None
        if init is not None:
            init(self._worker_id)


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
    # One intra-op thread per worker, as PyTorch's workers: torch's own pool in every worker
    # oversubscribes the cores (a collate of 5 MB took 45-265 ms instead of 5 with 2 workers on
    # 2 cores, its threads spinning against each other).
    torch.set_num_threads(1)
    torch.manual_seed(seed)
    generate = getattr(worker, "_generate_state", None)  # PyTorch's NumPy seed for a worker
    np.random.seed(generate(base_seed, worker_id) if generate else seed % 2**32)
    if hasattr(worker, "_worker_info") and hasattr(worker, "WorkerInfo"):
        worker._worker_info = worker.WorkerInfo(
            id=worker_id, num_workers=num_workers, seed=seed, dataset=dataset
        )


_PRELOAD = ("feedline.loader._workers", "torch", "numpy.random")
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


class _Shares:
    """A worker's queue of hands (see :mod:`._deal`).

    Each start of a worker gets a new queue, so that nothing meant for a worker that was
    ended reaches the next one.
    """

    def __init__(self) -> None:
        self.queue: Any = None
        self.seed: int | None = None  # the base seed of the epoch it starts for

    def renew(self, ctx: Any) -> None:
        """A new queue, for a worker about to start; the old one is closed."""
        self.close()
        self.queue = ctx.Queue()

    def close(self) -> None:
        """Close the queue: nothing on it is waited for."""
        if self.queue is not None:
            close_queue(self.queue)
            self.queue = None

    def get(self) -> Any:
        """In the worker: the next message."""
        return self.queue.get()


def _identity(items: Any) -> Any:
    return items


def _not_picklable(
    dataset: Any, parts: dict[str, Any], error: BaseException, why: str
) -> ConfigurationError:
    """Say which part of the dataset (or which other argument) cannot be sent to a worker."""
    culprit = "the dataset"
    for name, value in parts.items():
        try:
            pickle.dumps(value)
        except Exception:
            culprit = name
            break
    else:
        for name, value in getattr(dataset, "__dict__", {}).items():
            try:
                pickle.dumps(value)
            except Exception:
                culprit = f"the dataset's attribute {name!r} ({type(value).__name__})"
                break
    return ConfigurationError(
        f"{culprit} cannot be sent to the worker processes: {error}. Worker processes start "
        f"with {why}, which pickles it: define functions at module level (not lambdas or "
        "local functions), or use num_workers=0, whose threads need no pickling"
    )


_WATCHED_BATCHES = 16
"""Batches of a worker's pipeline after which it stops checking for global random draws."""


class WorkerSet:
    """``num_workers`` worker processes, started on the first epoch.

    Args:
        dataset: The map-style dataset, pickled once per worker.
        num_workers: How many processes.
        concurrency: The calls of ``dataset[i]`` at once in each worker: threads, and with
            ``"auto"`` the fewest and first (``Auto.low``, ``Auto.start``).
        prefetch: Batches each worker may have ready or in flight.
        worker_init_fn: Called with the worker id in each worker, once, before its first
            epoch and after the seeding (as in PyTorch).
        mp_context: Start method (``"spawn"`` or ``"forkserver"``), or ``None``: ``"fork"``
            where no thread of the process makes it unsafe as an epoch starts (what PyTorch
            does, without its risk: see :mod:`feedline._proc.forking`), else
            ``"forkserver"``.
        timeout: Seconds to wait for a batch (None: no limit).
        persistent: The workers serve several epochs: an epoch left early lets each finish
            its current batch and keeps it, instead of ending it at once.
        in_order: ``False`` yields each worker's batches as they come, so a slow batch holds
            up only its own worker, and deals the next batch to a worker with room.
        collate_fn, auto_collation: The loader's; batches are collated in the workers, as in
            PyTorch, so one batch rather than its items crosses to the parent.
        stream: For an iterable dataset, ``(batch size, drop_last)``: each worker batches
            its own iterator (:meth:`stream_epoch`).
        report_stall_after: Seconds the consumer may wait on the workers with nothing coming
            before the stall is reported (see :mod:`feedline._watchdog`).

    """

    def __init__(
        self,
        dataset: Any,
        *,
        num_workers: int,
        concurrency: FetchConcurrency,
        prefetch: int,
        worker_init_fn: Callable[[int], None] | None,
        mp_context: str | None,
        timeout: float | None,
        persistent: bool = False,
        in_order: bool = True,
        collate_fn: Callable[[Any], Any] | None = None,
        auto_collation: bool = True,
        stream: tuple[int, bool] | None = None,
        report_stall_after: float | None = STALL_AFTER,
    ) -> None:
        # Imported here, before any worker forks, so that each worker does not import it anew
        # while seeding itself (15 ms per worker before its first item, measured on 2 cores).
        import numpy.random  # noqa: F401

        self._unrun: WorkerEpoch | None = None  # the last epoch asked for
        self._epochs = 0  # epochs asked for: tags the messages to the workers
        self._prefetch = prefetch
        self.persistent = persistent  # read by the epochs (see WorkerEpoch)
        self.in_order = in_order
        self._dataset = dataset
        self._init = worker_init_fn
        self._collate = collate_fn
        self._auto = mp_context is None
        self._told = False  # why the workers do not fork was logged
        method = mp_context or "forkserver"
        self._ctx = mp.get_context(method)
        if mp_context == "forkserver":
            _preload_forkserver()
        self._shares = [_Shares() for _ in range(num_workers)]
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
                    stream,
                ),
                buffer_size=prefetch,
                timeout=timeout,
                mp_context=method,
                shm_min_bytes=SHM_MIN_BYTES,
                name=f"DataLoader worker {wid}",
                reraise=True,  # the dataset's and worker_init_fn's own exceptions, as PyTorch
            )
            for wid, q in enumerate(self._shares)
        ]
        # One watch for the consumer's waits on any worker: the report names them all.
        children = self._workers
        self.watch = StallWatch(
            "feedline.DataLoader",
            report_stall_after,
            describe=lambda: [child.describe() for child in children],
        )
        for child in children:
            child.watch = self.watch

    @property
    def processes(self) -> list[SubprocessIterable[tuple[int, Any, Any]]]:
        """The workers, by id."""
        return self._workers

    def send(self, worker: int, message: tuple[Any, ...]) -> None:
        """Put ``message`` (a hand, see :mod:`._deal`) on ``worker``'s queue."""
        queue = self._shares[worker].queue
        if queue is not None:
            queue.put(message)

    def begun(self, epoch: WorkerEpoch) -> None:
        """``epoch`` is being iterated: it need not be remembered as one never run."""
        if self._unrun is epoch:
            self._unrun = None

    def start(self, base_seed: int | None = None, count: int | None = None) -> None:
        """Start the workers that do not run (the first ``count`` of them), without waiting.

        ``base_seed``, the coming epoch's, lets a started worker seed itself (and run
        ``worker_init_fn``) at once.

        The loader starts the first worker before drawing the epoch's batches: a fork is
        cheaper from a process that has not yet made the sampler's permutation (with an
        ImageNet-sized one, 15-22 ms a worker instead of 8, measured on 2 cores), and it
        starts up while the permutation is drawn. :meth:`epoch` starts the others.
        """
        self._drop_unrun()
        method = self._start_method()
        for worker, shares in list(zip(self._workers, self._shares, strict=True))[:count]:
            self._start_one(worker, shares, method, base_seed)

    def wait_started(self) -> None:
        """Wait until every worker has made its dataset copy; raise what stopped one.

        A dataset that pickles may still fail to be rebuilt in a child (a class defined in a
        notebook's ``__main__``, under the fork server): the move of ``num_workers="auto"``
        learns it here, before it deals the workers any batch.
        """
        for worker in self._workers:
            worker.wait_ready()

    def _drop_unrun(self) -> None:
        # An epoch asked for and never iterated: its batches would come first. Its workers
        # are ended (and started anew).
        if self._unrun is not None and not self._unrun.begun:
            self._unrun = None
            self.close()

    def _start_method(self) -> str | None:
        # Here, in the thread that asks for the epoch (the training thread, before the
        # epoch's pipeline starts any thread): where a fork is as safe as PyTorch's, it
        # starts a worker in milliseconds; otherwise the fork server.
        if not self._auto or all(w.pid is not None for w in self._workers):
            return None
        return "fork" if self._may_fork() else "forkserver"

    def _may_fork(self) -> bool:
        if "fork" not in mp.get_all_start_methods():
            return False
        hazards = fork_hazards()
        if hazards and not self._told:
            self._told = True
            _log.info(
                "DataLoader workers start with the fork server (slower to start than a fork, "
                "and the dataset must pickle): this process runs %s, which a forked worker "
                "would inherit half-alive",
                ", ".join(sorted(set(hazards))),
            )
        return not hazards

    def _start_one(
        self, worker: Any, shares: _Shares, method: str | None, base_seed: int | None
    ) -> None:
        if worker.pid is not None:
            return
        if method == "fork" and not self._may_fork():
            method = "forkserver"  # a thread started since: forking is no longer safe
        if method == "forkserver":
            _preload_forkserver()
        shares.renew(self._ctx)
        shares.seed = base_seed  # inherited or pickled by the start
        try:
            # Begins its first pass as soon as it runs: it waits for the start message.
            worker.start(method, begin=True)
        except (pickle.PicklingError, AttributeError, TypeError) as error:
            if "pickle" not in str(error):
                raise
            why = method or self._ctx.get_start_method()
            hazards = sorted(set(fork_hazards())) if self._auto else []
            if hazards:
                why += f" (not a fork: this process runs {', '.join(hazards)})"
            parts = {"worker_init_fn": self._init, "collate_fn": self._collate}
            raise _not_picklable(self._dataset, parts, error, why) from error
        finally:
            shares.seed = None

    def epoch(
        self,
        tasks: Iterator[Task],
        base_seed: int,
        dataset_states: list[Any] | None = None,
        report: Reporter | None = None,
        *,
        between: bool = False,
        start: int = 0,
        worker_seed: int | None = None,
    ) -> WorkerEpoch:
        """Fetch ``tasks`` (batches, in order, drawn as needed) across the workers.

        The epoch, iterated, yields ``(number, items, (worker, dataset state) or None)`` in
        order. A stateful dataset's worker loads its state from ``dataset_states`` (saved
        ``between`` epochs: then seeds itself for this one again), and tells ``report`` its
        state as its pass starts (see :class:`WorkerEpoch`). ``start``: the number of the
        first batch (batch ``n`` goes to worker ``n % W``, in a resumed epoch too).
        ``worker_seed``: what the workers seed their global generators from, if not
        ``base_seed`` (workers started part-way through an epoch must not draw again what
        the epoch's first workers drew; items' own seeds stay ``base_seed``'s). Every
        worker gets its first batches before the first one is awaited, so that they all
        start (and fetch) at once. As a pipeline's source, the epoch ends as soon as the
        pipeline stops.

        A worker that does not run yet is started here and given its first batches at once,
        before the next one starts: the first batch, the one the consumer waits for, begins
        while the other workers start. Their messages are written without a feeder thread
        (:func:`write_first`), so that the process has no thread when the next worker forks.
        """
        self._drop_unrun()
        self._epochs += 1
        dealer = Dealer(tasks, len(self._workers), self._prefetch, start, in_order=self.in_order)
        hands = dealer.first_hands()
        states = dataset_states or [None] * len(self._workers)
        method = self._start_method()
        later = []
        for worker, shares, hand, state in zip(
            self._workers, self._shares, hands, states, strict=True
        ):
            self._start_one(worker, shares, method, base_seed)
            message = (
                "start",
                self._epochs,
                base_seed,
                hand,
                state,
                dealer.exhausted,
                0,
                False,
                between,
                base_seed if worker_seed is None else worker_seed,
            )
            if not write_first(shares.queue, message):
                later.append((shares, message))  # put once every worker has forked
        return self._begin(later, dealer, report)

    def stream_epoch(
        self,
        base_seed: int,
        dataset_states: list[Any] | None = None,
        taken: list[int] | None = None,
        turn: int = 0,
        start: int = 0,
        iterates: bool = False,
        report: Reporter | None = None,
    ) -> WorkerEpoch:
        """An iterable dataset's epoch: every worker iterates its own copy of the dataset.

        The epoch, iterated, yields ``(number, batch, StreamMark)``: the workers' batches in
        turn (``in_order=False``: as they come), each worker left out once its iterator is
        exhausted. To resume, ``taken`` says how many of its batches each worker had handed
        out (drawn again, not collated; a worker with a dataset state resumes from it
        instead), ``turn`` whose turn is next, ``start`` the number of the next batch.
        ``iterates``: the dataset was its own iterator when its states were saved (they are
        loaded after ``iter()``). ``report``: as for :meth:`epoch`; each worker's state after
        its iterator ended comes as a batch whose items are a :class:`StateReport`.
        """
        self._drop_unrun()
        self._epochs += 1
        count = len(self._workers)
        states = dataset_states or [None] * count
        done = taken or [0] * count
        method = self._start_method()
        later: list[tuple[_Shares, Any]] = []
        for w, (worker, shares) in enumerate(zip(self._workers, self._shares, strict=True)):
            self._start_one(worker, shares, method, base_seed)
            message: tuple[Any, ...] = (
                "start",
                self._epochs,
                base_seed,
                [],
                states[w],
                True,
                done[w],
                iterates,
                False,
                base_seed,
            )
            if not write_first(shares.queue, message):
                later.append((shares, message))
        return self._begin(later, Turns(done, turn, start), report)

    def _begin(
        self, later: list[tuple[_Shares, Any]], dealer: Dealer | Turns, report: Reporter | None
    ) -> WorkerEpoch:
        # The start messages too large to write at once, then every worker's pass.
        for shares, message in later:
            shares.queue.put(message)  # put once every worker has forked
        for worker in self._workers:
            worker.request_epoch()  # a no-op for a worker that has just started
        stateful = report is not None and is_stateful(self._dataset)
        self._unrun = WorkerEpoch(self, dealer, self._epochs, report if stateful else None)
        return self._unrun

    def close(self) -> None:
        """Stop every worker process, all at once (about a second at most). Idempotent."""
        for w in self._workers:
            w.ask_to_leave()
        deadline = time.monotonic() + CHILD_CLOSE_GRACE
        for w in self._workers:
            w.close(grace=max(0.0, deadline - time.monotonic()))
        for shares in self._shares:
            shares.close()
