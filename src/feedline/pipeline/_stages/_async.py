"""Stages on the event loop: coroutine and async-generator ops, async sources, process pools.

Each stage runs ``concurrency`` worker coroutines, which other threads wake through a
:class:`LoopSignal` (a burst of wake-ups costs one call into the loop). A cheap coroutine op
free to reorder runs in bursts (``AsyncStage._run_burst``); other ops go item by item.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
from collections import deque
from collections.abc import AsyncIterable
from typing import TYPE_CHECKING, Any

from .._defs import OpKind, PipeConfig
from .._queue import EMPTY, Channel
from .._settings import BURST, BURST_ABORT, EAGER_WORKERS
from ._common import StageBase

if TYPE_CHECKING:
    from .._engine import Run

__all__ = ["AsyncSource", "AsyncStage", "LoopSignal"]

_END: Any = object()
_SKIP: Any = object()


class LoopSignal:
    """Wakes coroutines waiting on the event loop; ``notify`` may be called from any thread.

    Args:
        run: The run whose loop the waiters wait on.
        lock: Guards the wake-ups asked for and not yet delivered: the stage's lock, which
            its signals share (it is never held while another lock is taken).

    """

    def __init__(self, run: Run, lock: threading.Lock) -> None:
        self._run = run
        self._lock = lock
        # Changed only on the loop thread, without the lock; other threads only test it for
        # emptiness (see ``notify``), as a caller on the hot path may before calling it.
        self.waiters: deque[asyncio.Future[None]] = deque()
        self._wakes = 0  # wake-ups requested but not yet delivered
        self._scheduled = False

    def wait(self) -> asyncio.Future[None]:
        """Register a waiter (loop thread only). Await it, or ``discard`` it.

        Then re-check the condition on the channel: its lock orders the registration before
        a later put's test of ``waiters`` (see "Memory ordering" in the README).
        """
        fut: asyncio.Future[None] = self._run.loop.create_future()
        self.waiters.append(fut)
        return fut

    def discard(self, fut: asyncio.Future[None]) -> None:
        """Withdraw a waiter that is no longer needed (loop thread only)."""
        with contextlib.suppress(ValueError):
            self.waiters.remove(fut)

    def notify(self, wake_all: bool = False) -> None:
        """Wake one waiter (or all), now if on the loop thread, else soon."""
        # unlocked: a waiter registers before it re-checks its condition, so an empty deque
        # read here cannot be one that waiter needed.
        if not self.waiters:
            return
        with self._lock:
            if not self.waiters:
                return
            self._wakes = 1 << 30 if wake_all else self._wakes + 1
            if self._scheduled:
                return
            on_loop = self._run.on_loop_thread()
            if not on_loop:
                self._scheduled = True
        if on_loop:
            self._deliver()
            return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the run is over
            self._run.loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            self._scheduled = False
            n, self._wakes = self._wakes, 0
            woken = []
            while n > 0 and self.waiters:
                woken.append(self.waiters.popleft())
                n -= 1
        for fut in woken:
            if not fut.done():
                fut.set_result(None)


class _AsyncProducer(StageBase):
    """Hand-over to the output channel from coroutines."""

    _space: LoopSignal  # wakes the workers waiting for room in the output

    def on_space(self) -> None:
        """Output drained (wake one waiting worker) or closed (wake all).

        One at a time: a woken worker that has put its item wakes the next if room is left
        (see ``_put``); waking all would make those beyond the room wait again.
        """
        self._space.notify(wake_all=self._output.closed)

    async def _put(self, value: Any) -> bool:
        output = self._output
        waited = False
        while not output.try_put(value):
            if output.closed:
                return False
            fut = self._space.wait()
            if output.request_space():
                self._space.discard(fut)
                continue
            await fut
            waited = True
        if waited and self._space.waiters and output.request_space():
            # Pass the wake-up on while the output is at most half full; above that,
            # request_space asked for the next on_space for the workers still waiting.
            self._space.notify()
        return True


class _Burst:
    """One worker's run of calls on taken items (see ``AsyncStage._run_burst``)."""

    __slots__ = ("done", "flush", "results", "waited")

    def __init__(self) -> None:
        self.results: list[Any] = []  # not yet handed on
        self.done = False  # the last call has returned
        self.waited = False  # a call waited since the loop last ran ``_spill``
        self.flush: asyncio.Task[bool] | None = None  # hands on results held when a call waited


class AsyncStage(_AsyncProducer):
    """Runs an async op (or a sync op in a process pool) with ``concurrency`` workers.

    A coroutine op is called on a ``Tagged`` item's value (see ``_resume``); others on the item.
    """

    _input: Channel

    def __init__(
        self,
        run: Run,
        cfg: PipeConfig,
        ordered: bool,
        input: Channel,
        output: Channel,
    ) -> None:
        super().__init__(run, cfg.name, "pipe", cfg.concurrency, input, output, ordered)
        self._space = LoopSignal(run, self.counters.lock)
        self._op = cfg.op
        self._kind = cfg.kind
        self._executor = cfg.executor
        self._workers = 0  # worker coroutines running
        self._starting = 0  # worker coroutines made and not yet running
        self._tasks: set[asyncio.Task[None]] = set()
        self._started = self._ended = False
        self._data = LoopSignal(run, self.counters.lock)
        self._window = LoopSignal(run, self.counters.lock)  # an ordered stage's window moved
        self._taken: deque[Any] = deque()  # taken in a batch, for any worker to start in order
        # Bursts running: until they end, a worker that finds the input exhausted waits
        # rather than ends (a burst whose call waits wakes it to start taken items).
        self._bursts = 0

    def on_data(self) -> None:
        """Input arrived (wake one worker) or closed (wake all)."""
        if self._data.waiters:  # else no worker waits: as notify's own first check
            self._data.notify(wake_all=self._input.closed)

    async def run_stage(self) -> None:
        """Run the workers until the input is exhausted, then close the output."""
        self._started = True
        try:
            # Past EAGER_WORKERS, the others start as items come (see _more_workers).
            self._spawn(min(self._concurrency, EAGER_WORKERS))
            while self._tasks:
                done, _ = await asyncio.wait(set(self._tasks))
                for task in done:
                    task.result()  # a worker's error fails the stage, as it did the gather
        finally:
            self._ended = True
            left = list(self._tasks)
            for task in left:
                task.cancel()
            if left:  # the stage was cancelled, or a worker failed: let the others end
                await asyncio.gather(*left, return_exceptions=True)
        if not self.run.life.stopping:
            self._output.close()

    def _spawn(self, n: int) -> None:
        loop = self.run.loop
        self._starting += n
        for _ in range(n):
            task = loop.create_task(self._worker())
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def set_concurrency(self, concurrency: int) -> None:
        """Run ``concurrency`` workers from now on (the tuner's call, on the loop thread).

        More: new workers start as items come (unless the stage has ended). Fewer: those
        beyond it end before their next item.
        """
        self._set_concurrency(concurrency)
        if self._started and self._workers < concurrency:
            self._more_workers()
        elif self._workers > concurrency and self._data.waiters:
            self._data.notify(wake_all=True)  # idle ones look, and the surplus leaves

    def _more_workers(self) -> None:
        # Work was taken: if no worker is left waiting for more, start one, up to the
        # concurrency. Past EAGER_WORKERS, workers start as items come rather than all at
        # the stage's start: a DataLoader's fetch stage may hold 2,048 batches of one item,
        # and making that many coroutines as each epoch started put 40 ms before its first
        # batch (measured).
        if (
            self._workers < self._concurrency
            and not self._data.waiters
            and not self._starting
            and not self._ended
        ):
            self._spawn(1)

    async def _worker(self) -> None:
        self._starting -= 1
        self._workers += 1
        left = False
        try:
            left = await self._work()
        finally:
            if not left:
                self._workers -= 1

    def _leaves(self) -> bool:
        # Whether this worker is one too many (the tuner lowered the concurrency); if so it
        # is taken off the count now, so that exactly the surplus leaves.
        if self._workers > self._concurrency:
            self._workers -= 1
            return True
        return False

    async def _get(self) -> Any:
        # The next item, from the input or from those taken already (counted in then).
        inp = self._input
        while True:
            if self._taken:
                return self._taken.popleft()
            item = inp.try_get()
            if item is not EMPTY:
                self.counters.items_in += 1
                return item
            held, closed = inp.state()
            if closed and not held and not self._bursts:
                return _END
            fut = self._data.wait()
            held, closed = inp.state()
            if held or self._taken or (closed and not self._bursts):
                self._data.discard(fut)
                continue
            await fut

    async def _work(self) -> bool:
        # Returns True if the worker left as one too many (see _leaves).
        c = self.counters
        run = self.run
        life = run.life
        kind = self._kind
        order = self._order
        bursts = kind is OpKind.COROUTINE and order is None
        while not life.stopping:
            while order is not None and order.full():
                await self._window.wait()
            if self._leaves():
                return True
            taken = self._taken
            if bursts and self.cheap():
                if not taken and (batch := self._input.try_get_many(BURST)):
                    c.items_in += len(batch)
                    taken.extend(batch)
                    self._more_workers()
                if taken:
                    if not await self._run_burst():
                        return False
                    continue
            if taken:
                item = taken.popleft()
            else:
                item = self._input.try_get()  # fast path: no coroutine when an item is waiting
                if item is EMPTY:
                    item = await self._get()  # counts what it takes from the input
                    if item is _END:
                        return False
                else:
                    c.items_in += 1
            self._more_workers()
            seq = -1 if order is None else order.number()
            if kind is OpKind.ASYNC_GENERATOR:
                if not await self._run_async_generator(item):
                    return False
                continue
            t0 = c.task_started()
            try:
                if kind is not OpKind.COROUTINE:
                    result = await run.call_in_executor(self._executor, self._op, item)
                else:
                    item.value = await self._op(item.value)
                    result = item
            except Exception as error:
                c.task_ended(t0)
                self.record_failure(item, error)
                if order is not None and not await self._emit(seq, _SKIP):
                    return False
                continue
            c.task_ended(t0)
            fast = order is None and self._output.try_put(result)  # no coroutine if room
            if not fast and not await self._emit(seq, result):
                return False
            # Let go of what was handed on before waiting: else each worker holds an item
            # beyond what the queues and calls hold (and a memory budget counts).
            item = result = None
        return False

    async def _run_burst(self) -> bool:
        """Start taken items in turn, up to ``BURST`` calls, then hand the results on together.

        A cheap coroutine op free to reorder: one lock round trip each way per burst and one
        clock read per item (measured: the loop's CPU per item through 3 no-op stages fell
        from 28 to 16 us). If a call really waits, the loop runs ``_spill``, which hands on
        the results so far and wakes the other workers for the taken items; a call over
        ``BURST_ABORT`` that does not wait ends the burst.

        Returns:
            ``False`` if the run is over for this worker (output closed, or run stopped).

        """
        c = self.counters
        op = self._op
        run = self.run
        loop = run.loop
        taken = self._taken
        burst = _Burst()
        spill = loop.call_soon(self._spill, burst)  # runs soon after a call begins to wait
        self._bursts += 1
        try:
            t = c.task_started()
            try:
                for _ in range(BURST):
                    if not taken:
                        break
                    item = taken.popleft()
                    try:
                        item.value = await op(item.value)
                        result = item
                    except Exception as error:
                        t = c.lap(t)
                        self.record_failure(item, error)
                        if run.life.stopping:
                            return False
                        continue
                    start, t = t, c.lap(t)
                    burst.results.append(result)
                    if t - start > BURST_ABORT:  # turned slow: the rest goes item by item
                        break
                    if burst.waited:  # ready for the next call that waits
                        burst.waited = False
                        spill = loop.call_soon(self._spill, burst)
            finally:
                c.in_flight -= 1
                burst.done = True
                spill.cancel()
                self._bursts -= 1
                if not self._bursts and self._input.closed:
                    self._data.notify(wake_all=True)  # workers waiting on the burst may end
            # The results from before a call that waited go first, then the rest.
            return await self._put_after(burst.flush, burst.results)
        finally:
            if burst.flush is not None:
                burst.flush.cancel()  # done already, unless this worker was cancelled

    def _spill(self, burst: _Burst) -> None:
        # The loop got control in the middle of a burst: its current call waits.
        if burst.done:
            return
        burst.waited = True
        if self._taken:
            self._data.notify(wake_all=True)
            self._more_workers()
        if burst.results:
            held, burst.results = burst.results, []
            burst.flush = self.run.loop.create_task(self._put_after(burst.flush, held))

    async def _put_after(self, earlier: asyncio.Task[bool] | None, results: list[Any]) -> bool:
        # Hand on ``results`` once the results held before them are.
        return (earlier is None or await earlier) and await self._put_all(results)

    async def _put_all(self, results: list[Any]) -> bool:
        # Hand on ``results`` in order: at once what fits, the rest one by one as room comes.
        if not results:
            return True
        taken = self._output.try_put_many(results)
        for result in itertools.islice(results, taken, None):
            if not await self._put(result):
                return False
        return True

    async def _run_async_generator(self, item: Any) -> bool:
        c = self.counters
        agen = self._op(item)
        try:
            while True:
                t0 = c.task_started()
                try:
                    value = await agen.__anext__()
                except StopAsyncIteration:
                    return True
                except Exception as error:
                    self.record_failure(item, error)
                    return True
                finally:
                    c.task_ended(t0)
                if not await self._put(value):
                    return False
        finally:
            await agen.aclose()

    async def _emit(self, seq: int, value: Any) -> bool:
        order = self._order
        if order is None:
            return await self._put(value)
        order.pending[seq] = value
        if seq != order.next_emit:
            return True
        # Only the worker holding the next sequence number flushes, so order is kept.
        while (head := order.head()) is not EMPTY:
            if head is not _SKIP and not await self._put(head):
                return False
            order.advance()
            self._window.notify(wake_all=True)
        return True


class AsyncSource(_AsyncProducer):
    """Iterates an async iterable on the event loop and feeds the first channel."""

    def __init__(self, run: Run, name: str, source: AsyncIterable[Any], output: Channel) -> None:
        super().__init__(run, name, "source", 1, None, output)
        self._space = LoopSignal(run, self.counters.lock)
        self._source = source

    async def run_stage(self) -> None:
        """Iterate the source to its end (or until the run stops), then close the output."""
        c = self.counters
        iterator = aiter(self._source)
        try:
            while not self.run.life.stopping:
                t0 = c.task_started()
                try:
                    value = await anext(iterator)
                except StopAsyncIteration:
                    self._output.close()
                    return
                finally:
                    c.task_ended(t0)
                c.items_in += 1
                if not await self._put(value):
                    return
        finally:
            aclose = getattr(iterator, "aclose", None)
            if aclose is not None:
                await aclose()
