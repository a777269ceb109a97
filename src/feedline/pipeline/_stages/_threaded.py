"""Stages that run in a thread pool as *drain jobs*.

A job is one task submitted to the stage's executor. It takes items from the stage's input
channel and processes them one after another until the input is empty or the output is full,
then returns; it never blocks waiting. A stage runs at most ``concurrency`` jobs at once and
starts new ones when items arrive (``on_data``) or its output drains (``on_space``).

Why jobs rather than one executor task per item: handing an item from one thread to another
costs a wake-up (tens of microseconds on a virtual machine), and a task per item pays two per
stage. A job that drains a queue pays them once per burst, while a slow op still gets
``concurrency`` jobs running side by side.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from .._queue import EMPTY, Channel
from .._resume import PassControl
from ._common import FailureBudget, RunContext, StageBase

__all__ = [
    "AggregateWork",
    "DisaggregateWork",
    "ValueWork",
    "FunctionWork",
    "GeneratorWork",
    "ThreadedSource",
    "ThreadedStage",
    "Work",
]

_SKIP: Any = object()  # a failed item's place in an ordered stage


class _HandOff:
    # A chunk's hand-off failed: each of its items fails with that error.
    def __init__(self, error: Exception) -> None:
        self.error = error

    def failed(self, stage: str) -> Exception:
        return self.error


class Work:
    """What a threaded stage does with one input item."""

    iterates = False  # True: __call__ returns an iterator of outputs; user code runs in next()
    takes = 1  # items a job takes at once: more than one calls many() (a stage in processes)

    def __call__(self, item: Any) -> Any:
        raise NotImplementedError

    def many(self, items: list[Any]) -> list[Any]:
        """The result of each item (for ``takes`` > 1).

        For an item whose call raised: an object whose ``failed(stage)`` is the exception.
        """
        raise NotImplementedError

    def finish(self) -> Iterator[Any] | None:
        """Outputs to emit once the input is exhausted (aggregate's last group)."""
        return None


class FunctionWork(Work):
    """Call a sync function: one input, one output."""

    def __init__(self, op: Callable[[Any], Any]) -> None:
        self.op = op

    def __call__(self, item: Any) -> Any:
        return self.op(item)


class ValueWork(Work):
    """Call a sync function on the value of a ``Tagged`` item, which keeps its source.

    What ``_resume.TaggedOp`` does, without a call of its own per item.
    """

    def __init__(self, op: Callable[[Any], Any]) -> None:
        self.op = op

    def __call__(self, item: Any) -> Any:
        item.value = self.op(item.value)
        return item


class GeneratorWork(Work):
    """Call a generator function: one input, any number of outputs."""

    iterates = True

    def __init__(self, op: Callable[[Any], Iterator[Any]]) -> None:
        self.op = op

    def __call__(self, item: Any) -> Iterator[Any]:
        return iter(self.op(item))


class AggregateWork(Work):
    """Group consecutive items into lists of ``size`` (runs with concurrency 1).

    With ``epochs`` (a continuous run's ``_epochs.Checkpoint``), each epoch has its own
    group, and an epoch's last, partial group is closed as soon as every item of that epoch
    has arrived, so no group mixes two epochs.
    """

    iterates = True

    def __init__(
        self,
        size: int,
        drop_last: bool,
        collect: Callable[[list[Any]], Any] | None = None,
        epochs: Any = None,
    ) -> None:
        self.size = size
        self.drop_last = drop_last
        self._collect = collect  # what to emit of a group (default: the list itself)
        self._group: list[Any] = []
        self._epochs = epochs
        self._groups: dict[int, list[Any]] = {}  # with epochs: the open group of each

    def __call__(self, item: Any) -> Iterator[Any]:
        if self._epochs is not None:
            return self._by_epoch(item)
        self._group.append(item)
        if len(self._group) < self.size:
            return iter(())
        return self._emit()

    def _by_epoch(self, item: Any) -> Iterator[Any]:
        epochs, groups = self._epochs, self._groups
        epoch = epochs.epoch_of(item.tag)
        epochs.arrived(item.tag)
        group = groups.setdefault(epoch, [])
        group.append(item)
        out = []
        if len(group) == self.size:
            out.append(self._made(groups.pop(epoch)))
        for ended in [e for e in sorted(groups) if epochs.complete(e)]:
            out += self._last(groups.pop(ended))
        return iter(out)

    def _last(self, group: list[Any]) -> list[Any]:
        # An epoch's last, partial group: emitted, or dropped (then the points after this
        # stage stop waiting for its items).
        if not self.drop_last:
            return [self._made(group)]
        for item in group:
            self._epochs.dropped(item.tag)
        return []

    def finish(self) -> Iterator[Any] | None:
        if self._epochs is not None:
            groups = [self._groups.pop(e) for e in sorted(self._groups)]
            return iter([out for g in groups for out in self._last(g)])
        if self._group and not self.drop_last:
            return self._emit()
        self._group = []
        return None

    def _emit(self) -> Iterator[Any]:
        group, self._group = self._group, []
        return iter((self._made(group),))

    def _made(self, group: list[Any]) -> Any:
        return group if self._collect is None else self._collect(group)


class DisaggregateWork(Work):
    """Pass on the elements of each incoming iterable (as ``split`` finds them, if given)."""

    iterates = True

    def __init__(self, split: Callable[[Any], Iterable[Any]] | None = None) -> None:
        self._split = split

    def __call__(self, item: Iterable[Any]) -> Iterator[Any]:
        return iter(item if self._split is None else self._split(item))


class _PoolStage(StageBase):
    """What the threaded stage and source share: restarting when the output drains.

    Their jobs count calls under the stage's lock (``counters.begin`` and ``end``).
    """

    def _kick(self, ended: int = 0) -> None:
        raise NotImplementedError

    def on_space(self) -> None:
        """Output drained: resume."""
        self._kick()


class ThreadedStage(_PoolStage):
    """A stage whose work runs as drain jobs in a thread pool (see the module docstring).

    The stage's lock (``counters.lock``) guards the job count, the parked iterators and the
    end of input; ``_emit_lock`` serialises the hand-over to the output channel (and the
    results an ordered stage holds); ``_take_lock`` an ordered stage's taking and numbering
    of items. The hand-over cannot share the stage's lock: a job holds ``_emit_lock`` while
    the channels call the stages next to it (``on_data``, ``on_space``), which take their
    own stage locks. Taking and handing on could share one lock, but an ordered stage's
    jobs then wait for each other (measured: 60% more CPU per item, 8 no-op jobs).
    """

    _input: Channel

    def __init__(
        self,
        run: RunContext,
        name: str,
        kind: str,
        work: Work,
        concurrency: int,
        executor: Any,
        ordered: bool,
        input: Channel,
        output: Channel,
        budget: FailureBudget,
    ) -> None:
        super().__init__(run, name, kind, concurrency, budget, input, output, ordered)
        self._work = work
        self._executor = executor
        self._emit_lock = threading.Lock()
        self._take_lock = threading.Lock()
        self._active = 0  # jobs submitted and not yet returned
        self._ready: deque[Any] = deque()  # completion order: results waiting for room
        # iterators (generator ops, aggregate) paused because the output was full
        self._parked: deque[tuple[Iterator[Any], Any]] = deque()
        self._finish_claimed = False
        self._closed = False

    def set_concurrency(self, concurrency: int) -> None:
        """Run at most ``concurrency`` jobs from now on (the tuner's call, any thread).

        More: jobs start for the waiting work. Fewer: the jobs beyond it end after their
        current item.
        """
        self._set_concurrency(concurrency)  # the kick's lock orders it before the kick
        self._kick()

    def _surplus(self) -> bool:
        # Whether this job is one too many (the tuner lowered the concurrency): it ends, and
        # its ``finally`` takes it off the count. Unlocked, as a lock would not make it exact
        # either (jobs that leave count as active until they have left): if more jobs leave
        # than the surplus, their ``finally`` kicks start jobs for the work that waits.
        return self._active > self._concurrency

    # -- endpoint callbacks (any thread) --------------------------------------------------------

    def on_data(self) -> None:
        """Input arrived or closed: start jobs if there is room for them."""
        if self._active >= self._concurrency:
            # Every slot has a job, which will take the item. (Read without the lock: a job
            # that ends lowers the count under the lock and then kicks, seeing this item.)
            return
        self._kick()

    def _has_unsent(self) -> bool:
        # Unlocked (the hand-over's state, under _emit_lock, which a caller holding the stage
        # lock must not take): a job that hands on or parks kicks after it, under the lock.
        order = self._order
        if order is not None:
            return order.next_emit in order.pending
        return bool(self._ready)

    def _kick(self, ended: int = 0) -> None:
        # Start the jobs there is work for; ``ended``: jobs that returned (or never started),
        # taken off the count first.
        run = self.run
        close = False
        with self.counters.lock:
            self._active -= ended
            if self._closed or run.stopping:
                return
            if self._has_unsent() and not self._output.request_space():
                return  # nothing can move until the output drains; on_space will call again
            # One look: an input found open but closed meanwhile calls on_data, which kicks.
            waiting, closed = self._input.state()
            exhausted = closed and not waiting
            order = self._order
            if order is not None:
                waiting = max(0, min(waiting, order.ahead - (order.next_seq - order.next_emit)))
            waiting += len(self._parked) + (1 if self._has_unsent() else 0)
            if exhausted and not self._finish_claimed:
                waiting += 1
            idle = self._active - self.counters.in_flight
            n = min(self._concurrency - self._active, waiting - idle)
            if n > 0:
                self._active += n
            elif (
                self._active == 0
                and self._finish_claimed
                and exhausted
                and not self._parked
                and not self._ready
                and not (order is not None and order.pending)
            ):
                self._closed = close = True
        if close:
            self._output.close()
            return
        refused = 0
        for _ in range(n):
            if not run.submit(self._executor, self._job):
                refused += 1
        if refused:  # the run is stopping: this only takes them off the count
            self._kick(ended=refused)

    # -- the job (executor thread) ---------------------------------------------------------------

    def _job(self) -> None:
        run = self.run
        life = run.life
        try:
            while not life.stopping:
                if self._surplus() and not self._has_unsent():
                    return
                # Each slot may hold one finished result while the output is full, so a
                # momentarily slow consumer does not stop (and later restart) every job.
                if not self._flush() and self._backlog_full():
                    return
                parked = None
                # unlocked: a job that parks an iterator kicks as it ends (under the lock),
                # and the job that kick starts sees it here.
                if self._parked:
                    with self.counters.lock:
                        if self._parked:
                            parked = self._parked.popleft()
                if parked is not None:
                    if not self._drive(*parked):
                        return
                    continue
                seq = -1
                order = self._order
                takes = self._work.takes
                if takes > 1:  # a stage in processes: a chunk a hand-off
                    batch = self._take_many(takes)
                    if batch is None:
                        return  # the reorder window is full; the next emit restarts us
                    if batch:
                        if not self._process_many(batch):
                            return
                        continue
                    item = EMPTY
                elif order is not None:
                    # The window check, the take and the numbering are one step: checked apart,
                    # two jobs could both pass the check and overfill the window, or number
                    # items 9 and 10 the other way round. (The check reads ``next_emit``
                    # unlocked: a stale value only ends this job early, and the emit that
                    # moves it kicks.)
                    with self._take_lock:
                        if order.full():
                            return  # the reorder window is full; the next emit restarts us
                        item = self._input.try_get()
                        if item is not EMPTY:
                            seq = order.number()
                else:
                    item = self._input.try_get()
                if item is EMPTY:
                    if self._input.exhausted and self._claim_finish():
                        tail = self._work.finish()
                        if tail is not None and not self._drive(tail, "<end of input>"):
                            return
                        continue
                    return
                if not self._process(item, seq):
                    return
        except BaseException as error:  # a bug in the engine: never lose it silently
            run.fail(error)
        finally:
            self._kick(ended=1)  # and catch wake-ups that came while this job was ending

    def _claim_finish(self) -> bool:
        # Whether this job is the one to run the work's end (its last group, parked if the
        # output is full); until it has, the stage does not close its output.
        with self.counters.lock:
            claimed, self._finish_claimed = not self._finish_claimed, True
        return claimed

    def _process(self, item: Any, seq: int) -> bool:
        """Run the op on item number ``seq``; False if the job must stop (output full)."""
        c = self.counters
        t0 = c.begin(1)
        try:
            result = self._work(item)
        except Exception as error:
            c.end(t0)
            self.record_failure(item, error)
            return self._emit(seq, _SKIP) if self._order is not None else True
        c.end(t0)
        if self._work.iterates:
            return self._drive(result, item)
        return self._emit(seq, result)

    def _take_many(self, most: int) -> list[tuple[int, Any]] | None:
        # Up to ``most`` items waiting, numbered where the stage keeps input order (None: its
        # window is full). Never waits for more.
        order = self._order
        if order is None:
            return [(-1, item) for item in self._input.try_get_many(most)]
        taken: list[tuple[int, Any]] = []
        with self._take_lock:
            while len(taken) < most and not order.full():
                item = self._input.try_get()
                if item is EMPTY:
                    break
                taken.append((order.number(), item))
            return taken if taken or not order.full() else None

    def _process_many(self, batch: list[tuple[int, Any]]) -> bool:
        """Run the op on a chunk at once (``Work.many``); False if the job must stop."""
        c = self.counters
        t0 = c.begin(len(batch))
        try:
            outs = self._work.many([item for _, item in batch])
        except Exception as error:  # the hand-off failed (a worker died): every item with it
            outs = [_HandOff(error)] * len(batch)
        c.end_many(t0, len(batch))
        going = True
        for (seq, item), out in zip(batch, outs, strict=True):
            failed = getattr(out, "failed", None)
            if failed is not None:
                self.record_failure(item, failed(self.name))
                if self._order is None:
                    continue
                out = _SKIP
            going = self._emit(seq, out) and going  # each is handed on or held
        return going

    def _drive(self, outputs: Iterator[Any], item: Any) -> bool:
        """Pull outputs from an iterator (running user code) and hand them on."""
        c = self.counters
        life = self.run.life
        while not life.stopping:
            t0 = c.begin(0)
            try:
                value = next(outputs)
            except StopIteration:
                return True
            except Exception as error:
                self.record_failure(item, error)
                return True
            finally:
                c.end(t0)
            if not self._emit(-1, value):
                with self.counters.lock:
                    self._parked.append((outputs, item))
                return False
        return False

    # -- hand-over ---------------------------------------------------------------------------------

    def _emit(self, seq: int, value: Any) -> bool:
        """Hand a result on (or hold it) and what waits before it; False if the output is full.

        ``value`` ``EMPTY``: only hand on what waits (:meth:`_flush`).
        """
        order = self._order
        with self._emit_lock:
            if order is None:
                ready = self._ready
                if value is EMPTY:
                    return self._flush_ready()
                if not ready and self._output.try_put(value):
                    return True
                ready.append(value)
                return self._flush_ready() or len(ready) < self._concurrency
            if value is not EMPTY:
                order.pending[seq] = value
            start = order.next_emit
            while (head := order.head()) is not EMPTY:
                if head is not _SKIP and not self._output.try_put(head):
                    break
                order.advance()
            advanced = order.next_emit != start
            sent = order.head() is EMPTY
        if advanced:
            self._kick()  # the reorder window moved: more jobs may start
        return sent

    def _backlog_full(self) -> bool:
        if self._order is not None:
            return True  # the reorder window already bounds what an ordered stage holds
        return len(self._ready) >= self._concurrency

    def _flush(self) -> bool:
        """Send what is waiting; False if the output is still full."""
        if self._order is None and not self._ready:
            return True  # unlocked: what a stale read misses, the next emit hands on first
        return self._emit(-1, EMPTY)

    def _flush_ready(self) -> bool:
        ready = self._ready
        while ready:
            if not self._output.try_put(ready[0]):
                return False
            ready.popleft()
        return True


class ThreadedSource(_PoolStage):
    """Iterates a sync iterable in a thread pool, one job at a time, and feeds the first channel.

    The job makes one value and puts it, until the output is full (its ``on_space`` starts the
    next job) or the source ends. A continuous run's source (a :class:`PassControl`) is read
    only so far ahead of the consumer: it says whether it may be read now, and wakes the stage
    when it may. After the last value of a pass the job ends and a new one queues behind the
    stages' jobs: the next pass may take long to begin (its ``set_epoch``, its first read),
    and with a pool of one thread the stages after must finish the pass meanwhile.
    """

    def __init__(
        self,
        run: RunContext,
        name: str,
        source: Iterable[Any],
        executor: Any,
        output: Channel,
        budget: FailureBudget,
    ) -> None:
        super().__init__(run, name, "source", 1, budget, None, output)
        self._source = source
        self._executor = executor
        self._iterator: Iterator[Any] | None = None
        self._held: Any = EMPTY  # a value made but not yet put
        self._active = False
        self._done = False  # ended, and the output closed
        passes = getattr(source, "passes", None)
        if not isinstance(passes, PassControl):
            passes = None
        self._boundary: Callable[[], bool] | None = passes.boundary if passes else None
        self._ready: Callable[[], bool] | None = passes.ready if passes else None
        if passes is not None:
            passes.wake_with(self._kick)

    def on_data(self) -> None:
        """Unused: a source has no input."""

    def start(self) -> None:
        """Begin iterating."""
        self._kick()

    def _kick(self, ended: int = 0) -> None:
        # Start the job unless one runs; ``ended``: the job returned.
        ready = self._ready
        with self.counters.lock:
            if ended:
                self._active = False
            if self._active or self._done or self.run.stopping:
                return
            if ready is not None and self._held is EMPTY and not ready():
                return  # woken again when it may be read
            output = self._output
            if len(output) >= output.capacity and not output.request_space():
                return
            self._active = True
        if not self.run.submit(self._executor, self._job):
            self._kick(ended=1)  # the run is stopping: this only clears the flag

    def _job(self) -> None:
        run = self.run
        life = run.life
        output = self._output
        c = self.counters
        try:
            if self._iterator is None:
                self._iterator = iter(self._source)
            iterator = self._iterator
            while not life.stopping:
                if self._held is not EMPTY:
                    if not output.try_put(self._held):
                        return  # full: on_space starts the next job
                    self._held = EMPTY
                    if self._boundary is not None and self._boundary():
                        return  # a pass ended: see the class's docstring
                if self._ready is not None and not self._ready():
                    return  # too far ahead of the consumer: woken when it catches up
                t0 = c.begin(0)
                try:
                    self._held = next(iterator)
                except StopIteration:
                    self._done = True
                    output.close()
                    return
                finally:
                    c.end(t0, self._held is not EMPTY)
        except BaseException as error:  # an error in the source ends the run and propagates
            self._done = True
            run.fail(error)
        finally:
            self._kick(ended=1)  # and catch wake-ups that came while this job was ending

    def close(self) -> None:
        """Close the source iterator (a generator's ``finally`` runs). Call once no job runs."""
        iterator, self._iterator = self._iterator, None
        close = getattr(iterator, "close", None)
        if close is not None:
            with contextlib.suppress(Exception):  # best effort: the run is over
                close()
