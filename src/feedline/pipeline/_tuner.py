"""The tuner: measures each window of a run, and applies what :func:`._decide.decide` decides.

It runs as a task on the run's event loop and looks every ``Tuning.interval`` seconds. A look
that closes a window turns the stages' counters into a :class:`._decide.Sample`, asks
:func:`._decide.decide` (a pure function: the rules are there, and in its tests' table), and
sets the concurrency it decides, sizing the queues around each stage for it. What it decided
is in ``stats().tuning`` and logged at DEBUG.

With a memory budget, items are measured as they are put in queues (one in
:data:`SIZE_EVERY`), and the queues and calls in flight must hold at most the budget: a raise
is cut to fit, and if items grew, the grown queues go back to their first size and tuned
stages are halved. A stage the user gave a number is never changed; its queue and calls still
count.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from feedline._cores import machine_idle as _machine_idle

from ._decide import Decision, Memory, Sample, StageSample, State, decide
from ._growth import approx_nbytes
from ._queue import Channel
from ._settings import FIRST_WINDOW, MAX_WINDOW, MIN_ITEMS, MIN_WINDOW, SIZE_EVERY
from ._tuning import Tuning

__all__ = ["ItemSizes", "Knob", "Tuner"]

_log = logging.getLogger("feedline.pipeline")


class ItemSizes:
    """Bytes per item put in one channel: one item in :data:`SIZE_EVERY` is measured.

    Quick to rise (an item that grew counts at once), slow to fall.
    """

    __slots__ = ("_n", "nbytes", "unknown")

    def __init__(self) -> None:
        self._n = 0
        self.nbytes = 0.0
        self.unknown: str | None = None  # the type of an item it could not measure

    def put(self, item: Any) -> None:
        """An item was put in the channel (any thread; unlocked: a lost count is harmless)."""
        n = self._n
        self._n = n + 1
        if n % SIZE_EVERY:
            return
        try:
            size = approx_nbytes(item)
        except Exception:  # a user's object may fail in ways approx_nbytes cannot foresee
            size = None
        if size is None:
            value = getattr(item, "value", item)  # a Tagged item: what the user's op made
            self.unknown = type(value).__name__
        else:
            old = self.nbytes
            self.nbytes = float(size) if size > old else old + 0.25 * (size - old)


@dataclass
class Knob:
    """One tuned stage, and its bounds.

    Attributes:
        stage: The stage (its counters, ``set_concurrency()``).
        index: Where it sits: ``Run.stages[index]``, its output ``Run.channels[index]``.
        low: The least concurrency it may have.
        high: The most.
        placement: Where its calls run, for a stage of ``executor="auto"`` (else ``None``).

    """

    stage: Any
    index: int
    low: int
    high: int
    placement: Any = None

    @property
    def name(self) -> str:
        """The stage's name."""
        return str(self.stage.name)

    @property
    def concurrency(self) -> int:
        """The stage's concurrency now."""
        return int(self.stage.counters.concurrency)


@dataclass
class _Mark:
    """The counters at one moment; a window is the difference of two."""

    t: float
    out: int  # items out of the last tuned stage
    cpu: float  # the process's CPU seconds
    idle: float | None  # the machine's idle CPU seconds (None: not known)
    busy: list[float]  # per knob: seconds its calls ran
    calls: list[int]  # per knob: calls ended
    slots: list[float]  # per knob: slot-seconds (concurrency x time)
    full: list[float]  # per knob: seconds its output was full; the sink's last
    used: list[float]  # per knob: CPU seconds of its calls on threads (stages that may move)


class Tuner:
    """Tunes the ``knobs`` of one run (see the module docstring).

    Args:
        knobs: The tuned stages.
        channels: The run's channels (``channels[i]`` after ``Run.stages[i]``; the last is
            the sink).
        tuning: Budgets and interval.
        stages: The run's stages, for the queues between a tuned stage and another and for
            the memory budget (stages of fixed concurrency count in it too).

    """

    def __init__(
        self,
        knobs: list[Knob],
        channels: list[Channel],
        tuning: Tuning,
        stages: list[Any],
    ) -> None:
        self.knobs = knobs
        self._stages = stages
        self._channels = channels
        self._sink = channels[-1]
        # The rate a trial is judged by: items out of the last tuned stage (a batch made
        # after it would count 32 items as one, and make windows long).
        self._out = channels[max((k.index for k in knobs), default=len(channels) - 1)]
        self._tuning = tuning
        self._cores = tuning.cores()
        self.decisions: deque[str] = deque(maxlen=8)
        self._sizes: list[ItemSizes] = []
        self._warned: set[str] = set()
        if tuning.memory_budget is not None:
            for channel in channels:
                channel.sizes = sizes = ItemSizes()
                self._sizes.append(sizes)
        self._mark = self._take_mark()
        self._t0 = self._mark.t
        # A stage whose moves went back in an earlier epoch waits on where it left off (the
        # placement outlives the epoch; the rest of what the tuner learned starts afresh).
        self.state = State(
            tuple(
                Memory()
                if k.placement is None
                else Memory(no_move_until=k.placement.retry_at - self._t0, backs=k.placement.backs)
                for k in knobs
            )
        )
        self.cpu_s = 0.0  # CPU time the tuner's looks took (thread time)

    def settled(self) -> dict[str, int]:
        """Each tuned stage's concurrency, by name, leaving out a trial under way."""
        found = {k.name: k.concurrency for k in self.knobs}
        trial = self.state.trial
        if trial is not None and not trial.move:  # a move stands until judged
            found[self.knobs[trial.stage].name] = trial.before
        return found

    async def run(self) -> None:
        """Look every ``interval`` seconds until cancelled."""
        interval = self._tuning.interval
        while True:
            await asyncio.sleep(interval)
            t = time.thread_time()
            try:
                self.look()
            except Exception:  # a tuner bug must not fail the pipeline: it stops tuning
                _log.exception("the pipeline's tuner failed and stops; concurrency stays")
                return
            finally:
                self.cpu_s += time.thread_time() - t

    def look(self) -> None:
        """One look: keep within the memory budget, then measure and decide if a window closed."""
        budget = self._tuning.memory_budget
        if budget is not None:
            self._keep_within(budget)
        moving = False
        for knob in self.knobs:
            placement = knob.placement
            if placement is not None:
                probing = placement.moving
                moving = placement.poll() or moving
                if probing and placement.processes:  # moved: queues that hold its chunks
                    c = knob.concurrency
                    self._set(knob, c, items=c * placement.takes)
                placement.tidy()
        if moving:  # a move's window starts once its workers answer
            self._mark = self._take_mark()
            return
        now, mark = time.perf_counter(), self._mark
        first = self.state.window == 0
        slowest = max((max(k.stage.counters.ewma, 0.0) for k in self.knobs), default=0.0)
        window = FIRST_WINDOW if first else min(MAX_WINDOW, max(MIN_WINDOW, 3 * slowest))
        if now - mark.t < window:
            return
        current = self._take_mark(now)
        if not first and current.out - mark.out < MIN_ITEMS and now - mark.t < MAX_WINDOW:
            return
        self.state, decisions = decide(self.state, self.measure(mark, current, first))
        self.apply(decisions)
        # The next window starts once the new calls are under way.
        self._mark = self._take_mark() if decisions else current

    def measure(self, mark: _Mark, now: _Mark, first: bool = False) -> Sample:
        """What the window between two marks measured."""
        dt = now.t - mark.t
        stages = []
        for i, knob in enumerate(self.knobs):
            calls = now.calls[i] - mark.calls[i]
            busy = now.busy[i] - mark.busy[i]
            slots = now.slots[i] - mark.slots[i]
            placement = knob.placement
            processes = placement.processes if placement is not None else 0
            fixed = knob.concurrency if processes else 0  # not tuned in processes
            stages.append(
                StageSample(
                    knob.name,
                    knob.concurrency,
                    busy=busy / slots if slots > 0 else 0.0,
                    task=busy / calls if calls > 0 and busy > 0 else 0.0,
                    blocked=(now.full[i] - mark.full[i]) / dt,
                    low=fixed or knob.low,
                    high=fixed or knob.high,
                    room=self._room(knob),
                    cpu=(now.used[i] - mark.used[i]) / dt,
                    movable=placement is not None and placement.stays is None and not processes,
                    processes=processes,
                )
            )
        return Sample(
            tuple(stages),
            rate=(now.out - mark.out) / dt,
            cores=(now.cpu - mark.cpu) / dt,
            idle=None if now.idle is None or mark.idle is None else (now.idle - mark.idle) / dt,
            cpu_budget=self._cores,
            t=now.t - self._t0,
            sink_full=(now.full[-1] - mark.full[-1]) / dt,
            first=first,
            ended=self._sink.closed,
        )

    def apply(self, decisions: list[Decision]) -> None:
        """Set the concurrency each decision gives, and record it."""
        for d in decisions:
            knob = self.knobs[d.stage]
            why = d.why
            if d.action == "move":
                knob.placement.move(d.processes)
            elif d.action == "back":
                knob.placement.back()
                memory = self.state.memory[d.stage]  # the next epoch's tuner waits on
                knob.placement.backs = memory.backs
                knob.placement.retry_at = self._t0 + memory.no_move_until
                if knob.placement.stays is not None:
                    why = f"{why} (it stays: {knob.placement.stays})"
            if d.to != knob.concurrency:
                self._set(knob, d.to)
            self._note(f"{knob.name}: {why}")

    def _note(self, decision: str) -> None:
        t = time.perf_counter() - self._t0
        self.decisions.append(f"{t:.1f}s {decision}")
        _log.debug("tuner: %s", decision)

    def _set(
        self, knob: Knob, concurrency: int, alone: bool = False, items: int | None = None
    ) -> None:
        # Change the stage's concurrency, and size its default-sized queues as the build does
        # for a stage of that concurrency: the one before it holds enough to feed each slot,
        # the one after it enough for each slot's result (a stage that keeps input order
        # holds finished calls back while its output is full). A queue between two stages is
        # sized for the larger (a decode of 2 put back after a trial must not shrink the queue
        # its 64 reads fill), but by this stage ``alone`` for the memory budget (halving it
        # must free what its queues hold). Within the queue's byte limits (a channel resized
        # up measures its next item) and the budget; a queue that grew on its own (after a
        # cheap stage) keeps its size. A stage that takes chunks (in processes) has them
        # sized for ``items`` instead.
        knob.stage.set_concurrency(concurrency)
        for index in (knob.index - 1, knob.index):
            channel = self._channels[index]
            growth = channel.growth
            if channel is self._sink or growth is None:
                continue
            other = 0 if alone else self._neighbour(index, knob)
            size = growth.within_bytes(max(items or concurrency, other))
            budget, each = self._tuning.memory_budget, self._bytes(index)
            if budget is not None and each > 0:
                size = min(size, max(growth.first, int(budget // (4 * each))))
            old = growth.start
            growth.rebase(size)
            if channel.capacity == old or channel.capacity < growth.start:
                channel.resize(growth.start)

    def _neighbour(self, channel: int, knob: Knob) -> int:
        # The concurrency of the stage at channel ``channel``'s other end than ``knob`` (0 for
        # the source and the sink).
        other = channel if channel != knob.index else channel + 1
        if other == 0 or other >= len(self._stages):
            return 0
        return int(self._stages[other].counters.concurrency)

    def _take_mark(self, now: float | None = None) -> _Mark:
        t = time.perf_counter() if now is None else now
        busy, calls, slots, full, used = [], [], [], [], []
        for knob in self.knobs:
            c = knob.stage.counters
            with c.lock:
                busy.append(c.busy_time)
                calls.append(c.calls)
                slots.append(c.slots(t))
            full.append(self._channels[knob.index].full_seconds())
            used.append(knob.placement.cpu_seconds() if knob.placement is not None else 0.0)
        full.append(self._sink.full_seconds())
        cpu = time.process_time()
        return _Mark(t, self._out.puts, cpu, _machine_idle(), busy, calls, slots, full, used)

    # -- memory ----------------------------------------------------------------------------------

    def _bytes(self, index: int) -> float:
        # Bytes per item in channel ``index`` (0 without a budget).
        return self._sizes[index].nbytes if self._sizes else 0.0

    def _each(self, index: int) -> float:
        # What one call of the stage at ``index`` holds: its result, or the item it works on.
        return max(self._bytes(index), self._bytes(index - 1))

    def _room(self, knob: Knob) -> int | None:
        # Calls more the memory budget holds for ``knob`` (None: no budget, or no measure).
        budget, each = self._tuning.memory_budget, self._each(knob.index)
        if budget is None or each <= 0:
            return None
        return max(0, int((budget - self._held_bytes()) // each))

    def _held_bytes(self) -> float:
        # Queues at their capacity, and one item per call in flight of every stage, tuned or
        # not (a call's result waiting for room is counted with it).
        total = sum(c.capacity * self._bytes(i) for i, c in enumerate(self._channels))
        for i, stage in enumerate(self._stages[1:], start=1):
            total += stage.counters.concurrency * self._each(i)
        return total

    def _keep_within(self, budget: int) -> None:
        for channel, sizes in zip(self._channels, self._sizes, strict=True):
            if sizes.unknown is not None and channel.name not in self._warned:
                self._warned.add(channel.name)
                _log.warning(
                    "memory_budget: the items in queue %r (%s) cannot be measured, so the "
                    "budget does not count them; return NumPy arrays, tensors, bytes, or lists, "
                    "dicts or dataclasses of them (anything with nbytes)",
                    channel.name,
                    sizes.unknown,
                )
        if self._held_bytes() <= budget:
            return
        for channel in self._channels:  # grown queues back to their first size
            growth = channel.growth
            if growth is not None and channel.capacity > growth.first:
                growth.rebase(growth.first)
                channel.resize(growth.first)
        for knob in sorted(self.knobs, key=lambda k: self._each(k.index), reverse=True):
            while self._held_bytes() > budget and knob.concurrency > knob.low:
                c = knob.concurrency
                self._set(knob, max(knob.low, c // 2), alone=True)
                self._note(f"{knob.name}: {c} -> {knob.concurrency} for the memory budget")
