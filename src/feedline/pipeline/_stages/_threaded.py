"""Stages that run in a thread pool as *drain jobs* (see "How work moves" in the README).

A job takes items from the stage's input and processes them until the input is empty or the
output is full, then returns; it never blocks. A stage runs at most ``concurrency`` jobs and
starts them when items arrive (``on_data``) or its output drains (``on_space``): a hand-over
between threads then costs a wake-up per burst, not per item. Cheap calls go a *take* at a
time (:func:`per_take`): several items per lock of the input and per count of the stage.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from .._epochs import Passes
from .._gated import GatedSource
from .._placement import Failed
from .._queue import EMPTY, Channel
from .._settings import TAKE_MOST, TAKE_SECONDS
from ._common import StageBase, close_quietly

if TYPE_CHECKING:
    from .._engine import Run

__all__ = ["AggregateWork", "ThreadedSource", "ThreadedStage"]

_SKIP: Any = object()  # a failed item's place in an ordered stage
_now = time.perf_counter


def per_take(per_call: float) -> int:
    """Items a job takes at once for calls of ``per_call`` seconds each.

    :data:`TAKE_SECONDS` of them, :data:`TAKE_MOST` at most; one while not yet timed.
    """
    if per_call < 0:
        return 1
    return max(1, min(TAKE_MOST, int(TAKE_SECONDS / max(per_call, 1e-9))))


class AggregateWork:
    """Group consecutive items into ``collect(list of size items)`` (runs with concurrency 1).

    With ``epochs`` (a continuous run's ``_epochs.Checkpoint``), each epoch has its own
    group, and an epoch's last, partial group closes once that epoch is complete there.
    """

    def __init__(
        self, size: int, drop_last: bool, collect: Callable[[list[Any]], Any], epochs: Any = None
    ) -> None:
        self.size = size
        self.drop_last = drop_last
        self._collect = collect
        self._group: list[Any] = []
        self.epochs = epochs  # a continuous run's checkpoint (its stage hooks on it)
        self._groups: dict[int, list[Any]] = {}  # with epochs: the open group of each

    def __call__(self, item: Any) -> Iterator[Any]:
        if self.epochs is not None:
            return self._by_epoch(item)
        self._group.append(item)
        if len(self._group) < self.size:
            return iter(())
        group, self._group = self._group, []
        return iter((self._collect(group),))

    def _by_epoch(self, item: Any) -> Iterator[Any]:
        epochs, groups = self.epochs, self._groups
        epoch = epochs.epoch_of(item.tag)
        epochs.arrived(item.tag)
        group = groups.setdefault(epoch, [])
        group.append(item)
        out = []
        if len(group) == self.size:
            out.append(self._collect(groups.pop(epoch)))
        out += self._ended()
        return iter(out)

    def _ended(self) -> list[Any]:
        # The partial groups of the epochs complete here (their last groups), in order.
        epochs, groups = self.epochs, self._groups
        out = []
        for ended in [e for e in sorted(groups) if epochs.complete(e)]:
            out += self._last(groups.pop(ended))
        return out

    def epochs_ended(self) -> Iterator[Any] | None:
        """The last groups of epochs that ended since an item last came (``None``: none).

        An epoch may end here with no item of it left to come: its last items were filtered
        out before this stage, after the last one that came.
        """
        out = self._ended() if self.epochs is not None else []
        return iter(out) if out else None

    def _last(self, group: list[Any]) -> list[Any]:
        # A partial group: emitted, or dropped (the points after this stage stop waiting).
        if not self.drop_last:
            return [self._collect(group)]
        for item in group if self.epochs is not None else ():
            self.epochs.dropped(item.tag)
        return []

    def finish(self) -> Iterator[Any] | None:
        """The last, partial group(s), once the input is exhausted (``None``: none)."""
        groups = [self._groups.pop(e) for e in sorted(self._groups)]
        if self._group:
            groups.append(self._group)
            self._group = []
        out = [made for group in groups for made in self._last(group)]
        return iter(out) if out else None


class ThreadedStage(StageBase):
    """A stage whose work runs as drain jobs in a thread pool (see the module docstring).

    ``counters.lock`` guards the job count and the end of input; ``_emit_lock`` the results
    held while the output is full (an unordered stage's result goes straight on when none
    is held) and an ordered stage's hand-over; ``_take_lock`` an ordered stage's taking and
    numbering. The hand-over cannot share the stage's lock: the channels call the stages
    next to it (``on_data``, ``on_space``), at times under ``_emit_lock``. Taking
    could share it, but an ordered stage's jobs then wait for each other (measured: 60% more
    CPU per item, 8 no-op jobs).

    Args:
        work: Called on each item: its result, or with ``iterates`` an iterator of results
            (user code runs in ``next``). An :class:`AggregateWork` also ends the input. A
            work with ``many(items)`` (a stage that may run in processes) is given chunks of
            ``work.takes`` items while that is over one.
        executor: Where the jobs run (default: the run's pool).

    """

    _input: Channel

    def __init__(
        self,
        run: Run,
        name: str,
        kind: str,
        work: Callable[[Any], Any],
        input: Channel,
        output: Channel,
        *,
        iterates: bool = True,
        concurrency: int = 1,
        executor: Any = None,
        ordered: bool = False,
    ) -> None:
        super().__init__(run, name, kind, concurrency, input, output, ordered)
        self._work = work
        self._iterates = iterates
        self._aggregate = work if isinstance(work, AggregateWork) else None
        self._finish = self._aggregate.finish if self._aggregate is not None else None
        # A continuous run's epoch ended at this aggregate from another stage's thread: a job
        # closes its partial group (see AggregateWork.epochs_ended).
        self._epoch_ended = False
        if self._aggregate is not None and self._aggregate.epochs is not None:
            self._aggregate.epochs.on_complete = self._on_epoch_ended
        self._chunks: Any = work if hasattr(work, "many") else None
        self._executor = executor or run.pool
        self._emit_lock = threading.Lock()
        self._take_lock = threading.Lock()
        self._active = 0  # jobs submitted and not yet returned
        self._ready: deque[Any] = deque()  # completion order: results waiting for room
        # Iterators paused because the output was full. unlocked: a deque's append and
        # popleft are atomic, and a job that parks one kicks (under the lock) as it ends.
        self._parked: deque[tuple[Iterator[Any], Any]] = deque()
        self._finish_claimed = False
        self._closed = False

    def set_concurrency(self, concurrency: int) -> None:
        """Run at most ``concurrency`` jobs from now on (the tuner's call, any thread).

        More: jobs start for the waiting work. Fewer: the surplus ends after its item.
        """
        self._set_concurrency(concurrency)  # the kick's lock orders it before the kick
        self._kick()

    def _surplus(self) -> bool:
        # unlocked: a lock would not make it exact either (jobs count as active until they
        # have left); if more leave than the surplus, their ``finally`` kicks start others.
        return self._active > self._concurrency

    # -- endpoint callbacks (any thread) --------------------------------------------------------

    def on_data(self) -> None:
        """Input arrived or closed: start jobs if there is room for them."""
        # unlocked: a job that ends lowers the count under the lock, then kicks and sees this.
        if self._active < self._concurrency:
            self._kick()

    def on_space(self) -> None:
        """Output drained: resume."""
        self._kick()

    def _on_epoch_ended(self) -> None:
        # (any thread) An epoch may have ended at this aggregate: a job looks.
        self._epoch_ended = True
        self._kick()

    def _has_unsent(self) -> bool:
        # unlocked (the hand-over's state, under _emit_lock, which a caller holding the stage
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
            if self._closed or run.life.stopping:
                return
            if self._has_unsent() and not self._output.request_space():
                return  # nothing can move until the output drains; on_space will call again
            # One look: an input found open but closed meanwhile calls on_data, which kicks.
            waiting, closed = self._input.state()
            exhausted = closed and not waiting
            order = self._order
            if order is not None:
                waiting = max(0, min(waiting, order.ahead - (order.next_seq - order.next_emit)))
            waiting += len(self._parked) + (1 if self._has_unsent() else 0) + self._epoch_ended
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
                if self._parked:
                    parked = None
                    with contextlib.suppress(IndexError):  # another job took it
                        parked = self._parked.popleft()
                    if parked is not None and not self._drive(*parked):
                        return
                    continue
                if self._epoch_ended and self._aggregate is not None:
                    self._epoch_ended = False
                    tail = self._aggregate.epochs_ended()
                    if tail is not None and not self._drive(tail, "<end of an epoch>"):
                        return
                    continue
                seq = -1
                order = self._order
                chunks = self._chunks
                if chunks is not None and chunks.takes > 1:  # in processes: a chunk a hand-off
                    batch = self._take_many(chunks.takes)
                    if batch is None:
                        return  # the reorder window is full; the next emit restarts us
                    if batch:
                        if not self._process_many(batch):
                            return
                        continue
                    item = EMPTY
                elif order is not None:
                    taken = self._take_many(1)
                    if taken is None:
                        return  # the reorder window is full; the next emit restarts us
                    seq, item = taken[0] if taken else (-1, EMPTY)
                elif not self._iterates and (most := self._takes()) > 1:
                    batch = self._input.try_get_many(most)
                    if batch:
                        if not self._process_batch(batch):
                            return
                        continue
                    item = EMPTY
                else:
                    item = self._input.try_get()
                if item is EMPTY:
                    if self._input.exhausted and self._claim_finish():
                        tail = self._finish() if self._finish is not None else None
                        if tail is not None and not self._drive(tail, "<end of input>"):
                            return
                        continue
                    return
                if not self._process(item, seq):
                    return
        except BaseException as error:  # a bug in the engine: never lose it silently
            run.begin_stop(error)
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
        if self._iterates:
            return self._drive(result, item)
        return self._emit(seq, result)

    def _takes(self) -> int:
        # Items a job of an unordered stage takes at once: TAKE_SECONDS of its calls, no more
        # than its output has room for (their results go on as they are made, and what does
        # not fit waits in the stage), one until its calls were timed.
        most = per_take(self.counters.ewma)
        if most > 1:
            output = self._output
            most = min(most, output.capacity - len(output))
        return most

    def _process_batch(self, batch: list[Any]) -> bool:
        """Run the op on each item taken and hand each result on as it is made.

        As one item at a time would: a later call may wait for the consumer to use an earlier
        result (a pool of buffers it gives back), and a stop ends the take. The calls are
        timed one by one and counted in one go. False if the output is full.
        """
        c, work, life = self.counters, self._work, self.run.life
        going = True
        times: list[float] = []
        c.begin(len(batch))
        try:
            for item in batch:
                if life.stopping:
                    return False
                t0 = _now()
                try:
                    result = work(item)
                except Exception as error:
                    times.append(_now() - t0)
                    self.record_failure(item, error)
                    continue
                times.append(_now() - t0)
                going = self._emit(-1, result) and going  # each is handed on or held
        finally:
            c.ended(times)
        return going

    def _take_many(self, most: int) -> list[tuple[int, Any]] | None:
        # Up to ``most`` items waiting, numbered where the stage keeps input order (None: its
        # window is full). Never waits for more.
        order = self._order
        if order is None:
            return [(-1, item) for item in self._input.try_get_many(most)]
        # The window check, the take and the numbering are one step: apart, two jobs could
        # overfill the window, or number items 9 and 10 the other way round. (unlocked:
        # ``next_emit``; a stale value only ends the job early, and the emit that moves it
        # kicks.)
        taken: list[tuple[int, Any]] = []
        with self._take_lock:
            while len(taken) < most and not order.full():
                item = self._input.try_get()
                if item is EMPTY:
                    break
                taken.append((order.number(), item))
            return taken if taken or not order.full() else None

    def _process_many(self, batch: list[tuple[int, Any]]) -> bool:
        """Run the op on a chunk at once (``work.many``); False if the job must stop."""
        c = self.counters
        t0 = c.begin(len(batch))
        try:
            outs = self._chunks.many([item for _, item in batch])
        except Exception as error:  # the hand-off failed (a worker died): every item with it
            outs = [Failed((error, ""))] * len(batch)
        c.end(t0, calls=len(batch))
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
                self._parked.append((outputs, item))
                return False
        return False

    def close(self) -> None:
        """Close the op's iterators a stop left part-way (their ``finally`` blocks run)."""
        while self._parked:
            close_quietly(self._parked.popleft()[0])

    # -- hand-over ---------------------------------------------------------------------------------

    def _emit(self, seq: int, value: Any) -> bool:
        """Hand a result on (or hold it) and what waits before it; False if the output is full.

        ``value`` ``EMPTY``: only hand on what waits (:meth:`_flush`).
        """
        order = self._order
        # unlocked: with nothing held, a result goes straight on (an unordered stage's results
        # have no order among them); one that another job holds meanwhile goes on at that
        # job's next look (_flush), or the next job's (see _kick).
        straight = order is None and value is not EMPTY  # a result of an unordered stage
        if straight and not self._ready and self._output.try_put(value):
            return True
        with self._emit_lock:
            if order is None:
                if straight:
                    self._ready.append(value)
                    return self._flush_ready() or len(self._ready) < self._concurrency
                return self._flush_ready()
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


class ThreadedSource(StageBase):
    """Iterates a sync iterable on the run's source thread and feeds the first channel.

    One job at a time puts values until the output is full (``on_space`` starts the next) or
    the source ends; a cheap source's job times and counts a few calls at once. A
    :class:`~.._gated.GatedSource` is read a value at a time, and only while it is ready (a
    continuous run's :class:`~.._epochs.Passes`: so far ahead of the consumer), the job
    ending until its wake-up; the job also ends after each pass.
    """

    def __init__(
        self,
        run: Run,
        name: str,
        source: Iterable[Any],
        output: Channel,
        gated: GatedSource | None = None,
    ) -> None:
        super().__init__(run, name, "source", 1, None, output)
        self._source = source
        self._iterator: Iterator[Any] | None = None
        self._held: Any = EMPTY  # a value made but not yet put
        self._active = False
        self._done = False  # ended, and the output closed
        self._passes = source if isinstance(source, Passes) else None
        self._gated = gated  # what says when ``source`` may be read (it may wrap it)
        if self._gated is not None:
            self._gated.wake_with(self._kick)

    def start(self) -> None:
        """Begin iterating."""
        self._kick()

    def on_space(self) -> None:
        """Output drained: resume."""
        self._kick()

    def _kick(self, ended: int = 0) -> None:
        # Start the job unless one runs; ``ended``: the job returned.
        gated = self._gated
        with self.counters.lock:
            if ended:
                self._active = False
            if self._active or self._done or self.run.life.stopping:
                return
            if gated is not None and self._held is EMPTY and not gated.ready():
                return  # woken again when it may be read
            output = self._output
            if len(output) >= output.capacity and not output.request_space():
                return
            self._active = True
        if not self.run.submit(self.run.source_pool, self._job):
            self._kick(ended=1)  # the run is stopping: this only clears the flag

    def _job(self) -> None:
        run = self.run
        life = run.life
        output = self._output
        passes, gated = self._passes, self._gated
        one_at_a_time = passes is not None or gated is not None
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
                elif gated is not None and not gated.ready():
                    return  # e.g. too far ahead of the consumer: woken when it catches up
                elif not self._calls(iterator, output, 1 if one_at_a_time else per_take(c.ewma)):
                    return
                if passes is not None and passes.boundary():
                    return  # a pass ended: see the class's docstring
        except BaseException as error:  # an error in the source ends the run and propagates
            self._done = True
            run.begin_stop(error)
        finally:
            self._kick(ended=1)  # and catch wake-ups that came while this job was ending

    def _calls(self, iterator: Iterator[Any], output: Channel, most: int) -> bool:
        # Up to ``most`` calls of the iterator, counted as one task (one lock of the counters
        # for a cheap source's few calls instead of two a call), each value put as it is made:
        # a value is never held back for a later call, which may wait. False: the job ends
        # (the source ended, or the output is full and the value is held). A gated source
        # (a continuous run's passes) is read a call at a time.
        c = self.counters
        times: list[float] = []  # the calls' own times: the puts are the engine's
        c.begin(0)
        try:
            while len(times) < most:
                t0 = _now()
                try:
                    value = next(iterator)
                finally:
                    times.append(_now() - t0)
                # Counted before it is put (never fewer in than out), with no lock: this job,
                # one at a time, is the only writer of a source's count.
                c.items_in += 1
                if not output.try_put(value):
                    self._held = value
                    return False
        except StopIteration:
            self._done = True
            output.close()
            return False
        finally:
            c.ended(times)
        return True

    def close(self) -> None:
        """Close the source iterator (a generator's ``finally`` runs). Call once no job runs."""
        iterator, self._iterator = self._iterator, None
        close_quietly(iterator)
