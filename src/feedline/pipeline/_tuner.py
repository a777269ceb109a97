"""The tuner: sets tuned stages' concurrency while a run goes, from what the engine measures.

It runs as a task on the run's event loop and looks every ``Tuning.interval`` seconds. Each
look that closes a window (long enough for the slowest tuned op to finish a few calls, and
for some items to come out) does one of these:

* **Judge a trial.** The last raise is kept if the output rate (items out of the last tuned
  stage: a batch made after it would count many items as one) grew by at least :data:`GAIN`
  and by a :data:`SHARE` of the raise (a doubling must bring a quarter more; for a stage
  whose calls mostly wait, :data:`WAITING`, the gain alone), and so did
  the stage's capacity (its concurrency over its mean call time in the window: an op that
  holds the GIL or computes on busy cores only takes longer per call as calls are added).
  Otherwise the failed value becomes the stage's *ceiling*, and the stage is tried at half
  the concurrency it had (not below the cores the process kept busy, :data:`LOWER_CORES`;
  not at all if the raise left its calls about as long, :data:`CONTENTION`, and half of
  them could not end the calls it ended before): kept if the output rate stays at
  :data:`KEEP_LOWER` of what it was and the stage's capacity still covers the calls it
  ended (an op that holds the GIL or computes may run as fast with less contention), and
  put back otherwise, that value becoming its *floor* (not tried again). A raise kept
  against the run's first window, decided and judged on busy cores (:data:`RECHECK_CPU`),
  is tried back at once: the start-up held that window's rate down. A ceiling holds until
  the stage's mean call time, at the concurrency it was kept at, changes by :data:`CHANGED`
  (a slower server, larger items: what did not pay may pay now), or :data:`CEILING_TTL`
  passes; a floor too. A raise kept where the calls take that much longer or shorter, before
  the raise as after it, drops them as well (the window after a put-back, whose calls
  include the trial's last ones, does not judge conditions; the raise that follows it
  does). Calls that became F times longer make the next raise, within
  :data:`JUMP_WINDOWS`, go to F times the concurrency the stage had at once (Little's law:
  the same rate needs F times as many calls in flight).
* **Raise the bottleneck.** Unless the consumer is the slower side (the sink is full most of
  the window) or the process already uses its CPU budget (:data:`BUSY_CPU` of it), the
  tuned stage whose slots were busiest (at least :data:`BUSY` of the time, not held up by a
  full output) is doubled within its bound and the memory budget; below a ceiling, it goes
  halfway to it (while that is a quarter more at least). Doubling reaches the dozens of
  calls a slow read wants in a few looks; a raise that does not pay is undone at the next.
  A stage that feeds a tuned stage which waits for items goes at once to the calls in
  flight that stage's capacity needs (Little's law: its concurrency / its call time x this
  stage's call time, with :data:`FEED_MARGIN`), if that is more than a doubling, and at
  most :data:`FEED_MOST` times at once.
* **Fewer for a slower consumer.** While the sink is full, the busiest tuned stage is
  tried at half (kept if the output stays as fast, as above): threads that compute take the
  GIL and the cores from the consumer, and calls that wait hold memory it does not need.
* **Trim.** A stage that used few of its slots for :data:`TRIM_AFTER` windows in a row
  (starved, or held up downstream) is lowered to what it used plus room, so that it holds
  no threads, memory or CPU it does not need.

With a memory budget, items are measured as they are put in queues (one in
:data:`SIZE_EVERY`), and the queues and calls in flight must hold at most the budget: a
raise is cut to fit, and if items grew, the grown queues go back to their first size and
tuned stages are halved. A stage the user gave a number is never changed; its queue and
calls still count.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

from ._growth import approx_nbytes
from ._queue import Channel
from ._tuning import Tuning

__all__ = [
    "BUSY",
    "BUSY_CPU",
    "CEILING_TTL",
    "CHANGED",
    "CONTENTION",
    "GAIN",
    "LOWER_CORES",
    "RECHECK_CPU",
    "SHARE",
    "SIZE_EVERY",
    "TRIM_AFTER",
    "WAITING",
    "ItemSizes",
    "Knob",
    "Tuner",
]

_log = logging.getLogger("feedline.pipeline")

GAIN = 1.05
"""A raise is kept if the output rate grew by this factor at least..."""

KEEP_LOWER = 0.97
"""A trial of fewer calls (at half, after a raise that did not pay) is kept if the output
rate stays at this share of what it was at least, and the stage's capacity at this share of
the calls it ended before."""

SHARE = 0.25
"""... and by this share of the raise at least (a doubling: by a quarter), so that a window's
noise does not keep a raise that does not pay (measured on two shared cores: +-8 %)."""

BUSY = 0.6
"""A tuned stage is raised only if its slots were busy at least this share of the window."""

TRIM_AFTER = 3
"""Windows in a row a stage must use few of its slots before it is lowered."""

CHANGED = 2.0
"""A stage's mean call time, at the concurrency it was kept at, that grew or shrank by this
factor means conditions changed: its ceiling and floor no longer hold."""

CEILING_TTL = 30.0
"""Seconds a raise that did not pay keeps the stage below it."""

JUMP_WINDOWS = 3
"""Windows for which a stage whose calls became longer may jump to the concurrency that
keeps its rate (Little's law) at its next raise; later, conditions may have changed again."""

FEED_MARGIN = 1.25
"""A stage that feeds a waiting tuned stage is raised at once to this many times the calls in
flight that stage's capacity needs (see ``Tuner._to_feed``)."""

FEED_MOST = 8
"""The most times its concurrency a raise to feed the next stage goes at once."""

BUSY_CPU = 0.95
"""The process uses its CPU budget from this share of it on: no stage is raised (more calls
would only queue for the cores). Not lower: beside a server process on the same 2 cores,
read + decode kept 1.8 of them busy, and raising its decode from 2 calls to 4 still paid
(the process's threads took a larger share of the cores)."""

RECHECK_CPU = 0.8
"""A raise kept against the run's first window is tried back where it was if the process
kept this share of its CPU budget busy at least in that window and in the one that judged it
(see ``Tuner._recheck``)."""

LOWER_CORES = 0.9
"""After a raise that did not pay, the stage is tried at half, but not at fewer calls than
this share of the cores the process kept busy in the window (they would idle: a stage that
computes at one call per core is kept there)."""

CONTENTION = 0.5
"""A raise of R times that did not pay and made the stage's calls longer by more than
R ** CONTENTION times (a doubling: 1.41 times) found contention (the GIL, busy cores, a
server at its limit): fewer calls may be as fast, and are tried. Calls about as long as
before wait on something that fewer would not shorten: fewer are tried only if they could
still end the calls wanted."""

WAITING = 4.0
"""A stage whose calls in flight were, on average, this many times the cores the process
kept busy at least waits more than it computes (at most a quarter of its calls' time on a
core): a raise of it need only bring :data:`GAIN`, not a :data:`SHARE` of the raise. Calls
that wait cost little more than memory, which the trim takes back if they go unused; a
read whose doubling from 32 to 64 brought 6 % was put back and held at 40, 6 % below the
oracle's 64."""

JUDGED_RAISE = 4.0
"""A raise of more than this many times must bring what a raise of this many times must."""

SIZE_EVERY = 8
"""With a memory budget, one item in this many put in each queue is measured."""

_MIN_WINDOW = 0.25  # seconds: shorter windows are mostly noise
_FIRST_WINDOW = 0.1  # seconds: the run's first window, which only decides a raise
_MAX_WINDOW = 2.0
_MIN_ITEMS = 8  # items out in a window, unless it reached _MAX_WINDOW


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


class Knob:
    """One tuned stage: its bounds, where it stands, and what did not pay."""

    __slots__ = (
        "ceiling",
        "ceiling_at",
        "ceiling_task",
        "floor",
        "floor_at",
        "high",
        "index",
        "jump",
        "jump_until",
        "low",
        "settle_window",
        "stage",
        "trim",
    )

    def __init__(self, stage: Any, index: int, low: int, high: int) -> None:
        self.stage = stage  # has counters, set_concurrency()
        self.index = index  # in Run.stages (0: the source); its output is Run.channels[index]
        self.low, self.high = low, high
        self.ceiling: int | None = None  # a concurrency that did not pay
        self.ceiling_at = 0.0
        # The smoothed task time when the ceiling was found, at the concurrency the stage
        # has now: the conditions the ceiling holds for. (At another concurrency the task
        # time of an op that holds the GIL or computes differs for that reason alone.)
        self.ceiling_task = 0.0
        self.floor: int | None = None  # a lower concurrency that was slower
        self.floor_at = 0.0
        # The concurrency its next raise may go to at once, its calls having become longer
        # (0: none), and the last window that holds (see JUMP_WINDOWS).
        self.jump = 0
        self.jump_until = -1
        self.trim = 0  # windows in a row with few slots used
        # The window after a trial was put back: its calls include the trial's last ones,
        # longer or shorter than calls at this concurrency (see Tuner._expire).
        self.settle_window = -1

    @property
    def name(self) -> str:
        """The stage's name."""
        return str(self.stage.name)

    @property
    def concurrency(self) -> int:
        """The stage's concurrency now."""
        return int(self.stage.counters.concurrency)

    def jump_to(self, concurrency: int, window: int) -> None:
        """Let a raise within :data:`JUMP_WINDOWS` of ``window`` go to ``concurrency``."""
        self.jump, self.jump_until = concurrency, window + JUMP_WINDOWS

    def take_jump(self, window: int) -> int:
        """The concurrency a raise in ``window`` may jump to (0: none); it is used once."""
        jump = self.jump if window <= self.jump_until else 0
        self.jump = 0
        return jump


@dataclass
class _Mark:
    t: float
    out: int
    cpu: float
    busy: list[float]  # per knob: busy seconds
    calls: list[int]  # per knob: calls ended
    slots: list[float]  # per knob: slot-seconds
    full: list[float]  # per knob: its output's full seconds; the sink's last


@dataclass
class _Trial:
    knob: Knob
    before: int
    after: int
    rate: float  # the output rate before the raise
    capacity: float  # concurrency / mean call time before the raise: calls it could end per s
    task: float  # the stage's mean call time in the window before the raise
    # Decided on the run's first window (its rate held down by the start-up): the cores the
    # process kept busy in it, as a share of its budget; None otherwise.
    cold_cpu: float | None = None
    recheck: bool = False  # back below such a raise (see Tuner._recheck)
    # The stage's calls ended per second in the window before the trial (a trial of fewer
    # calls is kept only if it can still end as many: see Tuner._judge); for the trial at
    # half after a raise that did not pay, in the window before that raise. 0: not known.
    demand: float = 0.0
    waits: bool = False  # its calls waited more than they computed (see WAITING)


class Tuner:
    """Tunes the ``knobs`` of one run (see the module docstring).

    Args:
        knobs: The tuned stages.
        channels: The run's channels (``channels[i]`` after ``Run.stages[i]``; the last is
            the sink).
        tuning: Budgets and interval.

    """

    def __init__(
        self,
        knobs: list[Knob],
        channels: list[Channel],
        tuning: Tuning,
        stages: list[Any] | None = None,
    ) -> None:
        self.knobs = knobs
        tuned = {k.index for k in knobs}
        # Stages of fixed concurrency (not the source): their calls count in the budget too.
        self._fixed = [(i, st) for i, st in enumerate(stages or []) if i and i not in tuned]
        self._stages = stages or []
        self._channels = channels
        self._sink = channels[-1]
        # The rate a trial is judged by: items out of the last tuned stage (a batch made
        # after it would count 32 items as one, and make windows long).
        self._out = channels[max((k.index for k in knobs), default=len(channels) - 1)]
        self._tuning = tuning
        self._cores = tuning.cores()
        self.decisions: deque[str] = deque(maxlen=8)
        self._trial: _Trial | None = None
        self._first = True  # the run's first window (see look)
        self._windows = 0  # windows decided on
        self._sizes: list[ItemSizes] = []
        self._warned: set[str] = set()
        if tuning.memory_budget is not None:
            for channel in channels:
                channel.sizes = sizes = ItemSizes()
                self._sizes.append(sizes)
        self._mark = self._take_mark()
        self._t0 = self._mark.t
        self.cpu_s = 0.0  # CPU time the tuner's looks took (thread time)
        self.looks = 0

    def settled(self) -> dict[str, int]:
        """Each tuned stage's concurrency, by name, leaving out a trial under way."""
        found = {k.name: k.concurrency for k in self.knobs}
        trial = self._trial
        if trial is not None:
            found[trial.knob.name] = trial.before
        return found

    # -- the loop --------------------------------------------------------------------------------

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
        """One look: measure items if there is a budget, then decide if a window closed."""
        self.looks += 1
        budget = self._tuning.memory_budget
        if budget is not None:
            self._keep_within(budget)
        now = time.perf_counter()
        mark = self._mark
        dt = now - mark.t
        slowest = max((max(k.stage.counters.ewma, 0.0) for k in self.knobs), default=0.0)
        # The first window may be shorter: a raise decided on it compares no rates, and a
        # cold start at a few calls in flight is where waiting costs most.
        first = self._first and self._trial is None
        window = min(_MAX_WINDOW, max(_FIRST_WINDOW if first else _MIN_WINDOW, 3 * slowest))
        if dt < window:
            return
        current = self._take_mark(now)
        if current.out - mark.out < _MIN_ITEMS and dt < _MAX_WINDOW:
            return
        # A window shorter than _MIN_WINDOW only decides a raise (or nothing).
        self._decide(mark, current, raise_only=dt < _MIN_WINDOW, first=first)
        self._first = False

    # -- decisions -------------------------------------------------------------------------------

    def _decide(
        self, mark: _Mark, now: _Mark, raise_only: bool = False, first: bool = False
    ) -> None:
        dt = now.t - mark.t
        rate = (now.out - mark.out) / dt
        self._windows += 1
        trial, self._trial = self._trial, None
        if trial is not None and self._judge(trial, rate, mark, now):
            self._mark = self._take_mark()
            return
        self._mark = now
        sink_full = (now.full[-1] - mark.full[-1]) / dt
        if raise_only and sink_full > 0.5:
            return
        if sink_full > 0.5:
            # The consumer is the slower side: nothing to raise. Threads that do not wait
            # take the GIL and the cores from it, so the busiest tuned stage is tried at
            # half: kept if the output stays as fast (see _judge).
            self._trim(mark, now, dt)
            if rate > 0:  # not a consumer that paused (an evaluation, a checkpoint)
                self._try_fewer(mark, now, rate)
            return
        if _cores_busy(mark, now) >= BUSY_CPU * self._cores:
            return  # the cores are busy: more calls in flight would only queue for them
        best: tuple[float, Knob] | None = None
        for i, knob in enumerate(self.knobs):
            self._expire(knob, now.t, self._task(knob, mark, now), self._windows)
            busy = _busy(i, mark, now)
            blocked = (now.full[i] - mark.full[i]) / dt
            if (
                busy >= BUSY
                and blocked < 0.5
                and _raisable(knob)
                and (best is None or busy > best[0])
            ):
                best = busy, knob
        if best is None:
            if not raise_only:
                self._trim(mark, now, dt)
            return
        knob = best[1]
        c = knob.concurrency
        if knob.ceiling is None:
            fed = self._to_feed(knob, mark, now)
            target = min(knob.high, max(2 * c, knob.take_jump(self._windows), fed))
        else:
            target = min(knob.high, (c + knob.ceiling) // 2)  # halfway to what did not pay
        budget = self._tuning.memory_budget
        if budget is not None:
            each = self._in_flight_bytes(knob)
            if each > 0:
                room = budget - self._held_bytes()
                target = min(target, c + max(0, int(room // each)))
        if target <= c:
            return
        task = self._task(knob, mark, now)  # at the concurrency the window had
        self._set(knob, target)
        capacity = c / task if task > 0 else 0.0
        cold = _cores_busy(mark, now) / self._cores if first else None
        i = self.knobs.index(knob)
        demand = _calls_rate(i, mark, now)
        in_flight = (now.busy[i] - mark.busy[i]) / dt
        waits = in_flight >= WAITING * max(_cores_busy(mark, now), 0.5)
        self._trial = _Trial(
            knob, c, target, rate, capacity, task, cold_cpu=cold, demand=demand, waits=waits
        )
        # The window of the trial starts once the new calls are under way.
        self._mark = self._take_mark()
        _log.debug("tuner: trying %s at %d (was %d, %.0f items/s)", knob.name, target, c, rate)

    def _judge(self, trial: _Trial, rate: float, mark: _Mark, now: _Mark) -> bool:
        # Keep or undo the trial whose window just closed (at output ``rate``); returns
        # whether the tuner changed a stage again (a new window starts).
        knob = trial.knob
        task = self._task(knob, mark, now)  # the stage's mean call time in the window
        capacity = trial.after / task if task > 0 else 0.0
        if trial.after < trial.before:  # a lower concurrency: kept if as fast
            # ... and if the stage can still end the calls it ended before: the output of a
            # window right after a cut is still fed by the items queued behind the stage
            # (measured: reads of 30 ms cut from 36 to 18 in flight, "as fast" on that
            # window, 600 calls/s at most against the 800 wanted).
            as_fast = (
                trial.rate > 0
                and rate >= trial.rate * KEEP_LOWER
                and (task <= 0 or capacity >= trial.demand * KEEP_LOWER)  # task 0: none ended
            )
            if as_fast or self._output_ended():
                # At the concurrency kept; not compared with the ceiling's conditions: calls
                # of an op that holds the GIL are half as long at half the calls.
                knob.ceiling_task = task
                if trial.recheck:  # the raise did not pay after all
                    knob.ceiling, knob.ceiling_at = trial.before, time.perf_counter()
                self._note(
                    f"{knob.name}: {trial.before} -> {trial.after} kept, as fast "
                    f"({trial.rate:,.0f} -> {rate:,.0f} items/s)"
                )
                return False
            self._set(knob, trial.before)
            knob.floor, knob.floor_at = trial.after, time.perf_counter()
            knob.settle_window = self._windows + 1
            self._note(f"{knob.name}: back to {trial.before}, {trial.after} was slower")
            return True
        # Kept if the output grew, and the stage's own capacity with it: an op that holds
        # the GIL, computes on busy cores or waits for a server at its limit takes longer per
        # call as calls are added, which the capacity shows with less noise.
        # A large raise (a jump to feed the next stage, or after calls grew longer) is judged
        # as a raise of JUDGED_RAISE times: the gain it must show is bounded.
        share = 0.0 if trial.waits else SHARE
        need = max(GAIN, 1 + (min(trial.after / trial.before, JUDGED_RAISE) - 1) * share)
        if (rate >= trial.rate * need and capacity >= trial.capacity * need) or (
            self._output_ended()
        ):
            self._kept_at(knob, task, trial, self._windows)
            self._note(
                f"{knob.name}: {trial.before} -> {trial.after} kept "
                f"({trial.rate:,.0f} -> {rate:,.0f} items/s)"
            )
            return self._recheck(trial, rate, mark, now)
        other = self._limiting(mark, now, knob)
        if other is not None and capacity >= trial.capacity * need:
            # The stage can do more, and another tuned stage now limits the output (two
            # stages at the same rate: neither raise alone pays). Kept; that one goes next.
            self._kept_at(knob, task, trial, self._windows)
            self._note(
                f"{knob.name}: {trial.before} -> {trial.after} kept, {other.name} limits now "
                f"({trial.rate:,.0f} -> {rate:,.0f} items/s)"
            )
            return False
        knob.ceiling, knob.ceiling_at = trial.after, time.perf_counter()
        # The conditions it holds for: the task time before the raise (a raise that does not
        # pay often makes calls wait longer, and undoing it makes them short again: that is
        # no change of conditions).
        knob.ceiling_task = trial.task
        self._note(
            f"{knob.name}: {trial.after} did not pay ({trial.rate:,.0f} -> {rate:,.0f} items/s)"
        )
        # Half, but not fewer calls than the cores the process kept busy: they would idle
        # (a decode at one call per core was tried at half, every time, and ran half as
        # fast). The process's CPU may be another stage's, or the consumer's: that only
        # keeps this stage higher than it needs.
        busy_cores = _cores_busy(mark, now)
        lower = max(knob.low, trial.before // 2, math.ceil(LOWER_CORES * busy_cores))
        if (
            lower < trial.before
            and (knob.floor is None or lower > knob.floor)
            and not self._fewer_cannot_keep_up(trial, task, lower)
        ):
            # Try fewer: an op that holds the GIL or computes on busy cores may run as fast
            # with less contention, and holds less memory.
            self._set(knob, lower)
            self._trial = _Trial(
                knob, trial.before, lower, trial.rate, 0.0, trial.task, demand=trial.demand
            )
        else:
            self._set(knob, trial.before)
            knob.settle_window = self._windows + 1
        return True

    @staticmethod
    def _kept_at(knob: Knob, task: float, trial: _Trial, window: int) -> None:
        # A raise was kept, the stage's calls taking ``task`` at its concurrency now: the
        # conditions its ceiling and floor hold for from here on. Ones found where calls
        # took over twice or under half as long, before the raise as after it, go
        # (measured: reads whose store slowed from 10 to 100 ms went halfway to a ceiling
        # found at 10 ms, in the window after a put-back, which does not judge conditions;
        # kept, that raise made the ceiling look current, and it held the reads at a tenth
        # of the rate for 30 s). Before the raise too: calls that the raise itself made
        # longer (the GIL, busy cores, a server at its limit) are no change of conditions.
        old = knob.ceiling_task
        # (No call ended before the raise, calls of seconds: the time after it alone.)
        before = trial.task if trial.task > 0 else task
        if _changed(old, task) and _changed(old, before) and (task > old) == (before > old):
            knob.ceiling = knob.floor = None
            if trial.task > old:
                # As in _expire: F times longer calls need F times as many in flight for the
                # rate the stage had, at the concurrency it had (doubling from 24 reads took
                # 2 to 4 s to get back).
                knob.jump_to(round(trial.before * trial.task / old), window)
        knob.ceiling_task = task

    @staticmethod
    def _fewer_cannot_keep_up(trial: _Trial, task: float, lower: int) -> bool:
        # After a raise that did not pay: whether ``lower`` calls at once could not end the
        # calls the stage ended before it. Only where the raise left the calls about as long
        # (calls that wait on a server or a sleep, not on each other): fewer would not make
        # them shorter, so ``lower`` of them end ``lower / task`` a second. Calls that grew
        # with the raise (contention: the GIL, busy cores, a server at its limit) may shrink
        # with fewer: those are tried. (Measured: reads of 30 ms whose raise from 32 to 64
        # did not pay were tried at 16, a window at two thirds of the rate.) Not after a raise
        # decided on the run's first window: its calls were slow with the start-up, no
        # measure of how long they are.
        if trial.demand <= 0 or trial.task <= 0 or task <= 0 or trial.cold_cpu is not None:
            return False
        if task / trial.task > (trial.after / trial.before) ** CONTENTION:
            return False
        return lower / trial.task < trial.demand * KEEP_LOWER

    def _to_feed(self, knob: Knob, mark: _Mark, now: _Mark) -> int:
        # The calls in flight ``knob`` needs to feed the next tuned stage at that stage's
        # capacity (Little's law: its calls per second x this stage's seconds per call), if
        # that stage waits for items; else 0. A read that waits 30 ms feeding a decode of
        # 2.5 ms on 2 threads needs 24 in flight: one raise, not five doublings.
        i = self.knobs.index(knob)
        if i + 1 >= len(self.knobs):
            return 0
        after = self.knobs[i + 1]
        busy = _busy(i + 1, mark, now, without_slots=1.0)
        task, fed_task = self._task(knob, mark, now), self._task(after, mark, now)
        if busy >= BUSY or task <= 0 or fed_task <= 0:
            return 0
        wanted = math.ceil(FEED_MARGIN * after.concurrency / fed_task * task)
        # At most FEED_MOST times at once: a next stage of microseconds (a len(), a cheap
        # check) would ask for hundreds, which a store at its bandwidth cannot serve sooner.
        return min(wanted, FEED_MOST * knob.concurrency)

    def _limiting(self, mark: _Mark, now: _Mark, besides: Knob) -> Knob | None:
        # Another tuned stage whose slots were busy in the window and that may go higher (a
        # stage held below a raise that did not pay may not: keeping a raise for it to follow
        # only made the raised stage go up and be trimmed back, again and again).
        for i, knob in enumerate(self.knobs):
            if knob is besides or not _raisable(knob):
                continue
            busy = _busy(i, mark, now)
            blocked = (now.full[i] - mark.full[i]) / (now.t - mark.t)
            if busy >= BUSY and blocked < 0.5:
                return knob
        return None

    def _try_fewer(self, mark: _Mark, now: _Mark, rate: float) -> None:
        best: tuple[float, Knob] | None = None
        for i, knob in enumerate(self.knobs):
            self._expire(knob, now.t, self._task(knob, mark, now), self._windows)
            c = knob.concurrency
            lower = max(knob.low, c // 2)
            if lower >= c or (knob.floor is not None and lower <= knob.floor):
                continue
            busy = _busy(i, mark, now)
            if best is None or busy > best[0]:
                best = busy, knob
        if best is None:
            return
        knob = best[1]
        c = knob.concurrency
        lower = max(knob.low, c // 2)
        task = self._task(knob, mark, now)
        if knob.ceiling is None:
            knob.ceiling_task = task  # the conditions a floor found now holds for
        self._set(knob, lower)
        demand = _calls_rate(self.knobs.index(knob), mark, now)
        self._trial = _Trial(knob, c, lower, rate, 0.0, task, demand=demand)
        self._mark = self._take_mark()

    def _recheck(self, trial: _Trial, rate: float, mark: _Mark, now: _Mark) -> bool:
        # A raise kept against the run's first window compared a rate that the start-up
        # held down (threads starting, cold caches, first calls slow). Where the cores were
        # already mostly busy in that window, and still are, the gain may be that alone: a
        # JPEG decode went from one call per core to two and stayed there, 15% slower. The
        # stage is tried back at once, unless that would leave busy cores without a call:
        # kept if as fast (the raise becomes its ceiling), else put back with the lower value
        # as its floor (see _judge). Returns whether it was tried.
        knob, cores = trial.knob, self._cores
        busy = _cores_busy(mark, now)
        if (
            trial.cold_cpu is None
            or trial.cold_cpu < RECHECK_CPU
            or busy < RECHECK_CPU * cores
            or trial.before < LOWER_CORES * busy
            or knob.concurrency != trial.after
            or self._output_ended()
        ):
            return False
        self._set(knob, trial.before)
        task = self._task(knob, mark, now)
        # A trial of fewer calls: from the raised value back to where it was.
        self._trial = _Trial(
            knob,
            before=trial.after,
            after=trial.before,
            rate=rate,
            capacity=0.0,
            task=task,
            recheck=True,
            demand=_calls_rate(self.knobs.index(knob), mark, now),
        )
        self._note(
            f"{knob.name}: trying {trial.before} again, the raise was judged against the start-up"
        )
        return True

    def _trim(self, mark: _Mark, now: _Mark, dt: float) -> None:
        for i, knob in enumerate(self.knobs):
            used = (now.busy[i] - mark.busy[i]) / dt  # calls in flight on average
            c = knob.concurrency
            keep = max(knob.low, math.ceil(1.5 * used) + 1)
            if c > keep and c > 2 * used + 2:
                knob.trim += 1
                if knob.trim >= TRIM_AFTER:
                    knob.trim = 0
                    knob.floor = None  # found at a concurrency the stage no longer needs
                    # What it had and left unused is a ceiling too: a raise back there would
                    # only be trimmed again (measured: a read trimmed from 128 to 72, then
                    # tried at 144, 108 and 90, none paying).
                    if knob.ceiling is None or knob.ceiling > c:
                        knob.ceiling, knob.ceiling_at = c, time.perf_counter()
                        knob.ceiling_task = self._task(knob, mark, now)
                    self._set(knob, keep)
                    self._note(f"{knob.name}: {c} -> {keep}, it used {used:.1f} slots")
            else:
                knob.trim = 0

    @staticmethod
    def _expire(knob: Knob, now: float, task: float, window: int) -> None:
        # A ceiling holds while conditions hold (the op's mean time in the window, ``task``,
        # within twice or half of what it was at the concurrency kept) and for CEILING_TTL
        # at most; a floor likewise.
        # Not on the window right after a trial was put back: it ends the trial's last calls
        # (measured: 1 MB reads of a 200 MB/s server, tried at 32 in flight and put back at
        # 4, ended calls twice as long as at 4 in that window; read as changed conditions,
        # the ceiling went and 32 was tried again, every second).
        old = knob.ceiling_task
        changed = window != knob.settle_window and _changed(old, task)
        if changed:
            knob.floor = None
            # Calls that take F times longer need F times as many in flight for the same
            # rate (Little's law): the next raise goes there at once.
            knob.jump_to(round(knob.concurrency * task / old) if task > old else 0, window)
            knob.ceiling_task = task
        if changed or now - knob.ceiling_at > CEILING_TTL:
            knob.ceiling = None
        if changed or now - knob.floor_at > CEILING_TTL:
            knob.floor = None  # found in a window as noisy as any: tried again later

    def _output_ended(self) -> bool:
        return self._sink.closed

    def _note(self, decision: str) -> None:
        t = time.perf_counter() - self._t0
        self.decisions.append(f"{t:.1f}s {decision}")
        _log.debug("tuner: %s", decision)

    # -- memory ----------------------------------------------------------------------------------

    def _bytes(self, index: int) -> float:
        # Bytes per item in channel ``index`` (0 without a budget).
        return self._sizes[index].nbytes if self._sizes else 0.0

    def _in_flight_bytes(self, knob: Knob) -> float:
        # What one call of a stage holds: its result, or the item it works on.
        i = knob.index
        return max(self._bytes(i), self._bytes(i - 1))

    def _held_bytes(self) -> float:
        # Queues at their capacity, and one item per call in flight, tuned or not (a call's
        # result waiting for room is counted with it).
        total = sum(c.capacity * self._bytes(i) for i, c in enumerate(self._channels))
        total += sum(k.concurrency * self._in_flight_bytes(k) for k in self.knobs)
        for i, stage in self._fixed:
            each = max(self._bytes(i), self._bytes(i - 1))
            total += stage.counters.concurrency * each
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
        for knob in sorted(self.knobs, key=self._in_flight_bytes, reverse=True):
            while self._held_bytes() > budget and knob.concurrency > knob.low:
                c = knob.concurrency
                self._set(knob, max(knob.low, c // 2), alone=True)
                self._note(f"{knob.name}: {c} -> {knob.concurrency} for the memory budget")

    def _set(self, knob: Knob, concurrency: int, alone: bool = False) -> None:
        # Change the stage's concurrency, and size its default-sized queues as the build does
        # for a stage of that concurrency: the one before it holds enough to feed each slot,
        # the one after it enough for each slot's result (a stage that keeps input order
        # holds finished calls back while its output is full: a queue of 2 after 48 reads in
        # flight starves the next stage). Within the byte limits of the queue (Growth) and
        # the memory budget. A queue that grew on its own (after a cheap stage) keeps its size.
        knob.stage.set_concurrency(concurrency)
        for index in (knob.index - 1, knob.index):
            channel = self._channels[index]
            growth = channel.growth
            if channel is self._sink or growth is None:
                continue
            # For the larger of the stages at its two ends, tuned or not (as the build sizes
            # it): a decode of 2 calls put back after a trial must not shrink the queue its
            # 64 reads fill (measured: read blocked 15 % of the time on a queue of 8, the
            # output 4 % below the same fixed settings). For the memory budget (``alone``),
            # by this stage alone: halving it must free the bytes its queues hold.
            other = 0 if alone else self._neighbour(index, knob)
            size = min(max(concurrency, other), growth.grow_to)
            budget = self._tuning.memory_budget
            each = self._bytes(index)
            if budget is not None and each > 0:
                size = min(size, max(growth.first, int(budget // (4 * each))))
            old = growth.start
            growth.rebase(size)
            if channel.capacity == old or channel.capacity < growth.start:
                channel.resize(growth.start)

    def _neighbour(self, channel: int, knob: Knob) -> int:
        # The concurrency of the other stage at channel ``channel``'s ends than ``knob``'s
        # (0 for the source or where the run's stages are not known).
        other = channel if channel != knob.index else channel + 1
        if other == 0 or other >= len(self._stages):
            return 0
        return int(self._stages[other].counters.concurrency)

    # -- measuring -------------------------------------------------------------------------------

    def _take_mark(self, now: float | None = None) -> _Mark:
        t = time.perf_counter() if now is None else now
        busy, calls, slots, full = [], [], [], []
        for knob in self.knobs:
            c = knob.stage.counters
            with c.lock:
                busy.append(c.busy_time)
                calls.append(c.calls)
                slots.append(c.slots(t))
            full.append(self._channels[knob.index].full_seconds())
        full.append(self._sink.full_seconds())
        return _Mark(t, self._out.puts, time.process_time(), busy, calls, slots, full)

    def _task(self, knob: Knob, mark: _Mark, now: _Mark) -> float:
        # The stage's mean seconds per call over the window (0 if it finished none).
        i = self.knobs.index(knob)
        calls = now.calls[i] - mark.calls[i]
        busy = now.busy[i] - mark.busy[i]
        return busy / calls if calls > 0 and busy > 0 else 0.0


def _calls_rate(i: int, mark: _Mark, now: _Mark) -> float:
    """Calls of knob ``i`` ended per second between two marks."""
    dt = now.t - mark.t
    return (now.calls[i] - mark.calls[i]) / dt if dt > 0 else 0.0


def _changed(old: float, task: float) -> bool:
    """Whether a stage's mean call time went from ``old`` to ``task`` by :data:`CHANGED`."""
    return old > 0 and task > 0 and (task > CHANGED * old or task < old / CHANGED)


def _cores_busy(mark: _Mark, now: _Mark) -> float:
    """The cores the process kept busy between two marks, on average."""
    return (now.cpu - mark.cpu) / (now.t - mark.t)


def _raisable(knob: Knob) -> bool:
    """Whether the tuner would raise a stage.

    Below its bound; and, below a raise that did not pay, halfway to it is a step worth a
    window (a quarter more at least).
    """
    c = knob.concurrency
    if knob.ceiling is None:
        return c < knob.high
    return min(knob.high, (c + knob.ceiling) // 2) >= c + max(1, c // 4)


def _busy(i: int, mark: _Mark, now: _Mark, without_slots: float = 0.0) -> float:
    """Share of knob ``i``'s slot-time spent in its op between two marks."""
    slots = now.slots[i] - mark.slots[i]
    return (now.busy[i] - mark.busy[i]) / slots if slots > 0 else without_slots
