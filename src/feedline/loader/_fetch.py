"""Fetching the items of a batch concurrently, and what happens when an item fails.

A batch's indices are fetched at once: one ``dataset[i]`` call per index on a thread pool, all
awaited together on the pipeline's event loop. A failing call does not fail the batch: it is
returned as a :class:`FailedItem`, and :class:`FailureTally` (in the consumer's process) logs it,
counts it against the loader's budget and drops it, so the batch comes out one item smaller.
Past the budget, :class:`FailureTally` raises :class:`~feedline.PipelineFailure`, naming the
sample's index and the last error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import math
import os
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple

from feedline._failures import FailureBudget, LogThrottle
from feedline.errors import PipelineFailure, add_note, rebuilds

from ._ahead import FetchAhead
from ._calls import CallsSample, CallsState, decide_calls
from ._pool import LimitedPool, thread_times
from ._seeds import RngWatch, asked, done_fetching, fetching

__all__ = [
    "BatchFetcher",
    "Collated",
    "FailedItem",
    "FailureTally",
    "failed_in_worker",
    "Task",
    "collate_in_worker",
]

_log = logging.getLogger("feedline.loader")

Task = tuple[int, list[Any]]
"""(batch number in the epoch, the indices of its items)."""


@dataclass(frozen=True)
class FailedItem:
    """An item whose ``dataset[index]`` raised; picklable, whatever the exception was."""

    index: Any
    error_type: str
    message: str
    traceback: str
    error: BaseException | None = None  # kept in-process; dropped when it cannot be pickled
    origin: str = ""  # the worker process it failed in ("" for this process)

    def __reduce__(self) -> tuple[Any, ...]:
        error = self.error if self.error is not None and rebuilds(self.error) else None
        fields = (self.index, self.error_type, self.message, self.traceback, error, self.origin)
        return (FailedItem, fields)


class Collated(NamedTuple):
    """A batch collated in a worker process, with what the parent needs to account for it.

    A named tuple, so that the batch's arrays and tensors cross to the parent through shared
    memory (see :mod:`feedline._proc.shm`) rather than torch's pickling, which hands each
    tensor's file descriptor over in a round trip with the worker: a worker busy with its next
    batches answered it 15 ms or more late.

    Attributes:
        batch: ``collate_fn``'s result (``None`` also when every item failed, or it raised).
        failed: The items whose ``dataset[i]`` raised, left out of the batch.
        size: How many items the batch had before the failed ones were left out.
        error: ``collate_fn``'s exception, if it raised (``None`` when it cannot be pickled:
            see ``message``).
        message: That exception as text, with the worker's traceback.
        drew: The dataset drew from the global random generators while the worker fetched
            several items at once (their draws then differ from run to run).

    """

    batch: Any
    failed: list[FailedItem]
    size: int
    error: BaseException | None = None
    message: str = ""
    drew: bool = False


def batch_getter(dataset: Any) -> Callable[[list[Any]], Any] | None:
    """``dataset.__getitems__`` where it is the dataset's own (or a ``Subset``'s of one).

    PyTorch's ``Subset`` and ``StackDataset`` define one that only loops over ``[i]`` when
    the datasets they wrap have none: taking it would fetch a batch's items one after
    another instead of at once.
    """
    method = getattr(type(dataset), "__getitems__", None)
    if method is None:
        return None
    if getattr(method, "__module__", "").startswith("torch.utils.data"):
        inner = getattr(dataset, "dataset", None)  # a Subset's
        if inner is None or batch_getter(inner) is None:
            return None
    getter: Callable[[list[Any]], Any] = dataset.__getitems__
    return getter


def collate_in_worker(
    collate_fn: Callable[[Any], Any], auto: bool, origin: str
) -> Callable[[tuple[int, list[Any], Any]], tuple[int, Collated, Any]]:
    """The worker's collate stage: leave failed items out and collate the rest.

    As PyTorch's workers collate: one batch, not its items, then crosses to the parent.
    """

    def collate(fetched: tuple[int, list[Any], Any]) -> tuple[int, Collated, Any]:
        number, items, state = fetched
        good = [x for x in items if not isinstance(x, FailedItem)]
        failed = [x for x in items if isinstance(x, FailedItem)]
        if failed and not good:  # every item failed (an empty batch is collated, as PyTorch)
            return number, Collated(None, failed, len(items)), state
        try:
            batch = collate_fn(good if auto else good[0])
        except Exception as error:
            raised = failed_in_worker(error, f"collate_fn on batch {number} in {origin}")
            return number, raised._replace(failed=failed, size=len(items)), state
        return number, Collated(batch, failed, len(items)), state

    return collate


def failed_in_worker(error: Exception, where: str) -> Collated:
    """A batch that raises ``error`` in the parent (``where``: what raised it, for a note).

    Call it in the ``except`` block, for the traceback. The exception itself crosses if it
    pickles; its text and traceback always do.
    """
    import pickle

    text = traceback.format_exc()
    try:
        pickle.dumps(error)
    except Exception:
        kept: BaseException | None = None
    else:
        kept = error
    add_note(error, f"feedline.DataLoader: raised by {where}")
    return Collated(None, [], 0, kept, text)


class BatchFetcher:
    """Fetches a batch's items on its own thread pool, at most ``concurrency`` calls at a time.

    A batch's items go to the pool as jobs; the job that finishes last wakes the event loop,
    once per batch rather than once per item. Items that take long (I/O) go one per job, for
    the most concurrency; items that take microseconds go in chunks of about
    :attr:`JOB_SECONDS`, so that the cost of a job (a queue hand-off, a thread wake-up) does
    not dwarf them.

    The calls at once are decided by :func:`~._calls.decide_calls`:
    the fetcher measures windows (how busy this process kept the cores, how long the calls'
    threads queued for one, which of them run now, whether its consumer computes) every
    :attr:`ADJUST_SECONDS`, and every :attr:`SLOW_START_SECONDS` while the first batch is
    fetched (the slow start), and sets the limit decided. The first batch runs alone, until
    it is fetched (or, with ``wait_for_delivery``, until :meth:`first_delivered` says the
    consumer holds it), so that it comes as soon as it can.

    Args:
        dataset: Anything with ``__getitem__``.
        concurrency: Threads of the pool: the most calls of ``dataset[i]`` in flight at once.
        wait_for_delivery: Hold the other batches until :meth:`first_delivered` is called.
        snapshot: Called once a batch's items are in (the dataset's ``state_dict``); its
            result travels with the batch as ``(0, state)``.
        origin: Where the calls run, for error messages (``"DataLoader worker 1 (pid 42)"``).
        cores: The cores this fetcher counts on (default: the machine's); one of several
            worker processes counts its share of them.
        finish: Applied to each batch, ``(number, items, dataset state)``, by the thread that
            fetched its last item (a worker's collation): no hand-over to another thread
            between the batch's last item and its collation.
        least: The fewest calls at once it ever admits (``Auto.low``).
        start: The calls at once it begins with (``Auto.start``; default: the cores + 1,
            or the cores in a worker process).
        seed: The epoch's base seed: each call gets its item's seed from it (see
            :func:`~feedline.loader.get_item_info`).

    """

    JOB_SECONDS = 0.002
    ADJUST_SECONDS = 0.05
    SLOW_START_SECONDS = 0.004
    SAMPLE_EVERY = 8
    """While the consumer is fed, one job in this many measures whether the calls compute or
    wait (:func:`~feedline.loader._pool.thread_times`: two reads of a ``/proc`` file, each
    an open, a read and a close). Every one of those system calls lets the fetch thread take
    the GIL back from the training thread, which then sleeps until it is handed back (about
    0.1 ms on a small VM): measured on every job, a loop launching many small ops ran 10.1
    steps/s beside 16 JPEG decodes per step, 11.2 measured on one job in 8."""
    DELIVERY_GRACE_SECONDS = 0.05
    """With ``wait_for_delivery``: how long the other batches wait for :meth:`first_delivered`
    once the first batch is fetched. Collation and hand-over take a few ms; a consumer that
    comes later (still setting up its model) finds the next batches under way, as it would
    without the wait."""

    def __init__(
        self,
        dataset: Any,
        concurrency: int,
        *,
        wait_for_delivery: bool = False,
        snapshot: Callable[[], Any] | None = None,
        origin: str = "",
        seed: int | None = None,
        cores: int | None = None,
        finish: Callable[[tuple[int, list[Any], Any]], Any] | None = None,
        least: int = 1,
        start: int | None = None,
        batched: bool = False,
    ) -> None:
        self._finish = finish
        # As PyTorch's fetcher: a dataset with __getitems__ of its own gets a batch's indices
        # in one call (each batch one job, several batches at once), where batches are asked.
        self._many = batch_getter(dataset) if batched else None
        self._start = start  # calls at once to begin with (Auto.start; None: by the cores)
        self._dataset = dataset
        self._origin = origin
        self._seed = seed
        # In a worker process (nothing else draws there): draws from the global generators
        # while the first batch is fetched on several threads are not reproducible; warn
        # once. In the training process, the consumer watches instead (see EpochIterator).
        self._watch = RngWatch() if concurrency > 1 and origin else None
        self._snapshot = snapshot
        self._wait_for_delivery = wait_for_delivery
        self._concurrency = concurrency
        self._pool = LimitedPool(concurrency, "feedline-fetch")
        self._cores = cores or os.cpu_count() or 1
        self._calls = CallsState(self._cores, least, concurrency)
        self._item_seconds: float | None = None  # running mean; None: assume slow
        self._adjusting = threading.Lock()
        self._window_start = 0.0  # the measuring window: its start, and this process's CPU
        self._window_cpu = 0.0  # time and the calls' run-queue time at that start
        self._window_queued: float | None = None
        self._new_window(time.perf_counter())
        self._first: asyncio.Event | None = None
        self._held_back = 0  # batches waiting for the first one to be delivered
        self.ahead: FetchAhead | None = None
        """The fetch stage's source, when it draws batches as this fetcher has room for them
        (see :meth:`draw_ahead`)."""
        self.loop: asyncio.AbstractEventLoop | None = None
        self._first_number: int | None = None
        self._running = False  # a call of dataset[i] has begun (see _begin_window)
        self._first_fetched = False  # the first batch's items are all in
        self._waited_share: float | None = None  # of the calls' time off the cores, when fed
        self._jobs_run = 0
        self._cpu_lock = threading.Lock()
        self.calls_cpu = 0.0
        """CPU seconds the calls of ``dataset[i]`` have taken so far, on all threads."""
        self.inline = concurrency > 1 and self._cores == 1
        """Whether :meth:`fetch_now` fetches on the calling thread, as a PyTorch worker does.

        For a worker whose share of the cores is one: CPU-bound items gain nothing from more
        threads, and a pool (or a pipeline) would only add hand-overs, wake-ups and their
        CPU beside the other workers (measured on 2 cores, 4 workers decoding JPEGs: the
        first batch 9 ms later on the pool). It ends for good at the first items that wait
        (their time is neither on a core nor queued for one): the pool then runs several."""

    def draw_ahead(
        self, tasks: Iterator[Task], batch_items: int, ready_most: int, held_most: int
    ) -> FetchAhead:
        """The fetch stage's source: ``tasks``, each drawn once this fetcher has room for it.

        See :class:`~._ahead.FetchAhead`; the consumer says when it takes a batch, or waits
        for one, through :meth:`consumer_took` and :meth:`consumer_waits`.
        """
        self.ahead = FetchAhead(tasks, lambda: self._pool.limit, batch_items, ready_most, held_most)
        return self.ahead

    def _get(self, index: Any) -> Any:
        try:
            return self._dataset[index]
        except Exception as error:
            return self._failed(index, error, traceback.format_exc())

    def _failed(self, index: Any, error: Exception, text: str) -> FailedItem:
        return FailedItem(index, type(error).__name__, str(error), text, error, self._origin)

    def _get_many(self, indices: list[Any], items: list[Any], start: int, stop: int) -> None:
        # dataset.__getitems__ for the batch's items from ``start`` to ``stop``: where it
        # raises, each of them fails with its exception (as PyTorch, whose batch raises it);
        # where it does not return one item per index (a batch in columns, say), they are
        # fetched one by one instead.
        assert self._many is not None
        asked = indices[start:stop]
        try:
            got = self._many(asked)
        except Exception as error:
            text = traceback.format_exc()
            items[start:stop] = [self._failed(i, error, text) for i in asked]
            return
        if isinstance(got, list | tuple) and len(got) == len(asked):
            items[start:stop] = got
            return
        for k in range(start, stop):
            items[k] = self._get(indices[k])

    def _split(self, count: int) -> int:
        """How many jobs a batch of ``count`` items becomes."""
        if self._many is not None:
            return 1
        most = min(count, self._concurrency)
        mean = self._item_seconds
        if mean is None:
            return most
        wanted = math.ceil(count * mean / self.JOB_SECONDS)
        return max(1, min(most, max(wanted, self._cores)))

    def _measured(self, per_item: float) -> None:
        mean = self._item_seconds
        self._item_seconds = per_item if mean is None else 0.8 * mean + 0.2 * per_item
        self._adjust(self.ADJUST_SECONDS)

    def _adjust(self, window: float, starting: bool = False) -> None:
        # Close the window if it is ``window`` seconds old, and set the calls at once the
        # tuner's rules decide from it.
        now = time.perf_counter()
        if now - self._window_start < window or not self._adjusting.acquire(False):
            return
        try:
            pool, share = self._pool, self._waited_share
            if self._calls.holds(share):
                # The threads' /proc files are not read (each read hands the GIL to and fro,
                # see SAMPLE_EVERY); the next window starts without their queueing.
                sample = CallsSample(pool.limit, busy=0.0, off_cores=share)
                self._window_start, self._window_cpu = now, time.process_time()
                self._window_queued = None
            else:
                sample = self._sample(now, starting)
            limit, _ = decide_calls(self._calls, sample)
            self._set_limit(limit)
        finally:
            self._adjusting.release()

    def _sample(self, now: float, starting: bool) -> CallsSample:
        # The window from its start to ``now``, and a new one from here.
        pool, limit = self._pool, self._pool.limit
        cpu, queued = time.process_time(), pool.queued_seconds()
        wall = now - self._window_start
        sampled = min(limit, pool.sampled_threads)  # threads read that ran calls
        share = None
        if queued is not None and self._window_queued is not None and sampled and wall > 0:
            share = (queued - self._window_queued) / (wall * sampled)
        busy = (cpu - self._window_cpu) / wall / self._cores if wall > 0 else 0.0
        self._window_start, self._window_cpu, self._window_queued = now, cpu, queued
        sample = CallsSample(
            limit, busy, share, pool.waiting, starting=starting, off_cores=self._waited_share
        )
        if sample.may_grow():  # which calls run now: read only when it could matter
            running = min(pool.running, pool.sampled_threads)
            sample = dataclasses.replace(sample, on_cores=pool.running_on_cores(), running=running)
        return sample

    def _some_call_waits(self) -> bool:
        # A call running now is off the cores (waiting on I/O, a sleep, a lock): more calls at
        # once could use the time. Calls all on a core or queued for one would only queue
        # more, however idle this process looks beside other processes.
        on_cores = self._pool.running_on_cores()
        return on_cores is None or on_cores < min(self._pool.running, self._pool.sampled_threads)

    def _new_window(self, now: float) -> None:
        # Start measuring how busy the cores are, and how long the calls queue, from now.
        self._window_start, self._window_cpu = now, time.process_time()
        self._window_queued = self._pool.queued_seconds()

    def _begin_window(self, now: float) -> None:
        # The first call began: measure how busy the cores are from here, not from when the
        # fetch was asked for. Threads take a few ms to start, and a window that counted that
        # wait read idle cores and doubled the calls at once for CPU-bound items (measured on
        # 2 cores: from 3 to 6 JPEG decodes at once, on a window that read the cores 80% busy
        # while 3 threads decoded).
        with self._adjusting:
            if not self._running:
                self._new_window(now)
                self._running = True

    def _slow_start(self, loop: asyncio.AbstractEventLoop) -> None:
        """While the first batch is fetched, double the calls at once if the cores are idle.

        Every few ms: I/O-bound items reach full concurrency within about 20 ms, while
        CPU-bound ones stay a few at a time and do not thrash the caches of the cores.
        """
        first = self._first
        if first is None or first.is_set() or self._first_fetched:
            return
        if self._running:
            self._adjust(self.SLOW_START_SECONDS, starting=True)
        loop.call_later(self.SLOW_START_SECONDS, self._slow_start, loop)

    async def fetch(self, task: Task) -> Any:
        """Return ``(batch number, items, dataset state)``.

        An item is a :class:`FailedItem` where its call raised; the dataset state is ``None``
        without ``snapshot``.
        """
        number, indices = task
        if self._first is None and self._first_fetched:  # fetch_now fetched the first batch
            self._first, self.loop = asyncio.Event(), asyncio.get_running_loop()
            self._first.set()
        elif self._first is None:
            self._first, self._first_number = asyncio.Event(), number
            self.loop = asyncio.get_running_loop()
            self._set_limit(self._calls.first(self._start, spare=1))
            self._new_window(time.perf_counter())
            self.loop.call_later(self.SLOW_START_SECONDS, self._slow_start, self.loop)
        elif number != self._first_number and not self._first.is_set():
            self._held_back += 1
            try:
                await self._first.wait()
            finally:
                self._held_back -= 1
        elif self._held_back:
            # Batches held back for the first one are woken, not yet started: start after
            # them (batches start in order; one drawn later would otherwise go first).
            await asyncio.sleep(0)
        fetched = False
        watch = self._watch if number == self._first_number else None
        try:
            if watch is not None:
                watch.start()
            done = await self._fetch(number, indices)
            fetched = True
            if watch is not None:
                watch.check()
            return done
        finally:
            if number == self._first_number:
                self._first_fetched = True
                if fetched and self._wait_for_delivery:
                    asyncio.get_running_loop().call_later(
                        self.DELIVERY_GRACE_SECONDS, self._first.set
                    )
                else:
                    self._first.set()

    def consumer_took(self, waited: bool, computing: float | None) -> None:
        """Say how the consumer took its last batch (see :meth:`CallsState.took`). Thread-safe.

        A consumer that computes and finds its batches ready needs a core of its own: calls
        that compute are then held to the other cores (measured on 2 cores: a training step
        of 80 ms took 90 ms beside 3 JPEG decodes at once). One whose thread sleeps (a
        blocking wait on a GPU, on I/O) leaves its core to them; a batch it waits for lifts
        the hold at once.

        Args:
            waited: It waited for the batch (it was not ready).
            computing: The share of its time since the batch before that its thread spent
                on a core (``None``: unknown).

        """
        if self.ahead is not None:
            self.ahead.took()
        fed, limit = self._calls.fed, self._pool.limit
        self._calls, to = self._calls.took(waited, computing, limit)
        if self._calls.fed != fed:
            self._jobs_run = 0  # the next job measures (see SAMPLE_EVERY)
            if not self._calls.fed:
                self._waited_share = None  # measured again when it is fed again
        self._set_limit(to)

    def _set_limit(self, limit: int) -> None:
        # The calls at once: what the batches drawn ahead follow (see _ahead.py).
        if limit != self._pool.limit:
            self._pool.set_limit(limit)
            if self.ahead is not None:
                self.ahead.poke()

    def consumer_waits(self) -> None:
        """Say the consumer waits for a batch now: more may be drawn ahead. Thread-safe."""
        if self.ahead is not None:
            self.ahead.waits()

    def first_delivered(self) -> None:
        """Let the other batches start: the consumer holds the first one. Thread-safe."""
        first, loop = self._first, self.loop
        if first is not None and loop is not None and not first.is_set():
            with contextlib.suppress(RuntimeError):  # the loop closed: the epoch was stopped
                loop.call_soon_threadsafe(first.set)

    async def _fetch(self, number: int, indices: list[Any]) -> Any:
        if not indices:
            return self._complete(number, [])
        loop = asyncio.get_running_loop()
        finished: asyncio.Future[None] = loop.create_future()

        def wake() -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed: the epoch was stopped
                loop.call_soon_threadsafe(_resolve, finished)

        done = self._submit(number, indices, wake)
        await finished
        return done[0]

    def fetch_now(self, task: Task) -> Any:
        """:meth:`fetch`, from a thread that runs no event loop; returns once it is done.

        At a concurrency of one, the items are fetched on the calling thread itself (as in a
        PyTorch worker: no hand-over between threads). So are they while :attr:`inline`
        holds; otherwise they go to the pool, the calling thread waking up to grow the calls
        at once while the cores are idle (slow start). Used by a worker process for its
        batches until :attr:`inline` ends, and for all of them at concurrency one.
        """
        number, indices = task
        first = not self._first_fetched
        watch = self._watch if first else None
        if first:
            self._set_limit(self._calls.first(self._start, spare=0))
            self._new_window(time.perf_counter())
        try:
            if watch is not None:
                watch.start()
            if not indices:
                return self._complete(number, [])
            items: list[Any] = [None] * len(indices)
            if self._concurrency == 1:
                self._run_items(indices, items, 0, len(indices))
                return self._complete(number, items)
            start = self._inline(indices, items) if self.inline else 0
            if start == len(indices):
                return self._complete(number, items)  # one thread: its draws are in order
            self.inline = False
            finished = threading.Event()
            done = self._submit(number, indices, finished.set, items, start)
            while not finished.wait(self.SLOW_START_SECONDS):
                if self._running and self._some_call_waits():
                    self._adjust(self.SLOW_START_SECONDS, starting=True)
            if watch is not None:
                watch.check()
            return done[0]
        finally:
            self._first_fetched = True

    INLINE_WAIT_SHARE = 0.3
    """:meth:`fetch_now` keeps a worker's items on its own thread while they spend less than
    this share of their time off the cores (on I/O, a sleep, a lock)."""

    def _inline(self, indices: list[Any], items: list[Any]) -> int:
        """Fetch items on this thread while they keep it on a core; return how many.

        The first batch is judged after each item, so that items that wait go to the pool
        early; the later ones once per batch (a check costs about 15 µs), what waited
        sending the next batches to the pool.
        """
        start = time.perf_counter()
        before = thread_times()
        if before is None:
            return 0  # cannot tell waiting from computing: the pool decides
        step = 1 if not self._first_fetched and self._many is None else len(indices)
        k = 0
        while k < len(indices):
            self._run_items(indices, items, k, k + step)
            k += step
            after = thread_times()
            if after is None:
                break
            wall = time.perf_counter() - start
            waited = wall - (after[0] - before[0]) - (after[1] - before[1])
            # From the second item on: the first one may wait on the GIL while the worker's
            # other threads start.
            if k > 1 and waited > self.INLINE_WAIT_SHARE * wall and waited > 0.001:
                self.inline = False
                break
        return k

    def _complete(self, number: int, items: list[Any]) -> Any:
        # The batch, with the dataset's state right after its last item (taken in the thread
        # that fetched it, before that thread takes up another batch's items), finished there.
        snapshot, finish = self._snapshot, self._finish
        batch = (number, items, None if snapshot is None else (0, snapshot()))
        return batch if finish is None else finish(batch)

    def _submit(
        self,
        number: int,
        indices: list[Any],
        wake: Callable[[], None],
        items: list[Any] | None = None,
        start: int = 0,
    ) -> list[Any]:
        # Fetch the batch's items from ``start`` on the pool (``items`` holds those before);
        # the job that finishes last completes the batch into the returned slot and calls
        # ``wake``.
        count = len(indices) - start
        slots: list[Any] = [None] * len(indices) if items is None else items
        jobs = self._split(count)
        left = [jobs]
        done: list[Any] = [None]
        lock = threading.Lock()

        ahead = self.ahead

        def run(lo: int, hi: int) -> None:
            self._run_items(indices, slots, lo, hi)
            if ahead is not None:
                ahead.fetched(hi - lo)
            with lock:
                left[0] -= 1
                last = left[0] == 0
            if last:
                done[0] = self._complete(number, slots)
                wake()

        bounds = [start + count * j // jobs for j in range(jobs + 1)]
        for j in range(jobs):
            self._pool.submit(functools.partial(run, bounds[j], bounds[j + 1]))
        return done

    def _run_items(self, indices: list[Any], items: list[Any], start: int, stop: int) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        if not self._running:
            self._begin_window(wall)
        before = thread_times() if self._calls.fed and self._sample_due() else None
        # The item being fetched, for get_item_info(): one attribute per item, set for the
        # first batch and then only if the dataset asked for it (items of a microsecond
        # lost 15% of their rate to it); the seed is derived only when asked for.
        get = self._get
        current = fetching(self._seed)
        try:
            first = start
            if self._many is not None:
                self._get_many(indices, items, start, stop)
                first = stop
            elif self._seed is None or (self._first_fetched and not asked()):
                # Untracked: a call to get_item_info returns None and turns tracking on,
                # for the next item on.
                while first < stop:
                    items[first] = get(indices[first])
                    first += 1
                    if self._seed is not None and asked():
                        break
            for k in range(first, stop):
                current.index = index = indices[k]
                items[k] = get(index)
        finally:
            done_fetching()
        spent = time.perf_counter() - wall
        used = time.thread_time() - cpu
        with self._cpu_lock:  # a job is 2 ms or more: the lock costs nothing beside it
            self.calls_cpu += used
        after = thread_times() if before is not None else None
        if before is not None and after is not None and spent > 0:
            off = max(0.0, spent - (after[0] - before[0]) - (after[1] - before[1])) / spent
            mean = self._waited_share
            self._waited_share = off if mean is None else 0.8 * mean + 0.2 * off
        self._measured(spent / (stop - start))

    def _sample_due(self) -> bool:
        # Whether this job, run while the consumer is fed, measures its threads' times. The
        # pool's threads count without a lock: two at once may both measure, none skips one.
        n = self._jobs_run + 1
        self._jobs_run = n
        return n % self.SAMPLE_EVERY == 1

    def close(self) -> None:
        """Stop the threads; calls not started yet are dropped."""
        self._pool.close()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():  # cancelled when the pipeline stopped meanwhile
        future.set_result(None)


class FailureTally:
    """Drops failed items from batches, logs them (rate-limited) and enforces the budget."""

    def __init__(self, max_failures: int | float | None) -> None:
        self._budget = FailureBudget(max_failures)
        self.strict = max_failures == 0
        """No budget: an item's own exception is raised as it is (PyTorch's behaviour)."""
        self.failures = 0
        self.items = 0
        self._throttle = LogThrottle()

    def flush(self) -> None:
        """Log, in one line, the failures the rate limit held back since its last message."""
        held, last = self._throttle.take_held()
        if held:
            _log.warning(
                "%d more failed item(s) skipped, not logged one by one; the last: %s "
                "[%d failure(s) in all]",
                held,
                last,
                self.failures,
            )

    def keep(self, items: list[Any]) -> list[Any]:
        """The items that did not fail; raises once failures exceed the budget."""
        self.account([x for x in items if isinstance(x, FailedItem)], len(items))
        return [x for x in items if not isinstance(x, FailedItem)]

    def account(self, failed: list[FailedItem], count: int) -> None:
        """Count ``count`` items of which ``failed`` failed; raises past the budget."""
        self.items += count
        for item in failed:
            self._record(item)

    def _record(self, failed: FailedItem) -> None:
        self.failures += 1
        error = failed.error or RuntimeError(f"{failed.error_type}: {failed.message}")
        if self.strict:
            # No budget: the dataset's own exception, as PyTorch raises it, with where it came
            # from in a note.
            where = f"feedline.DataLoader: raised by dataset[{failed.index!r}]"
            add_note(error, where + (f" in {failed.origin}" if failed.origin else ""))
            if failed.origin:
                add_note(error, "Original traceback:\n" + failed.traceback)
            raise error
        more = self._throttle.admit(
            f"dataset[{failed.index!r}]: {failed.error_type}: {failed.message}"
        )
        if more is not None:
            _log.warning(
                "dataset[%r] failed and was skipped: %s: %s [%d failure(s) so far]%s%s",
                failed.index,
                failed.error_type,
                failed.message,
                self.failures,
                more,
                "\n" + failed.traceback if self.failures == 1 else "",
            )
        if self._budget.exceeded(self.failures, self.items):
            self.flush()
            failure = PipelineFailure(
                "dataset.__getitem__",
                self.failures,
                self.items,
                repr(failed.index),
                error,
                self._budget.description,
                hint="raise the budget with DataLoader(max_failures=...)",
            )
            raise failure from error
