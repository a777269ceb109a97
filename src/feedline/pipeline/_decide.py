"""The tuner's decisions: a pure function from what a window measured to what to change.

:func:`decide` takes what the tuner learned so far (:class:`State`) and one window's
measurements (:class:`Sample`), and returns the new state and its :class:`Decision` s. No
clock, no threads, no stages: :mod:`._tuner` measures and applies, and the tests give samples
by hand (``tests/pipeline/test_tuner_decisions.py``, a table of cases). It judges an op by
what more calls in flight did to the output, never by what kind of op it is: a stage of
Python code that scales on free-threaded Python is raised there, and not under the GIL.

In each window, in this order:

==========================  ===============================================================
judge the trial             a raise is kept if the output rate and the stage's capacity
                            (calls in flight / call time) both grew by what it must bring
                            (:data:`GAIN`, :data:`SHARE`); else it becomes a *ceiling* and
                            the stage is tried lower (:data:`LOWER_CORES`,
                            :data:`CONTENTION`), kept if as fast (:data:`KEEP_LOWER`), else
                            put back with a *floor*. A raise that did not pay is kept while
                            another stage then limits the output. A raise kept against the
                            run's first window is tried back where its calls compute
                            (:data:`COMPUTES`).
conditions changed          calls at the kept concurrency :data:`CHANGED` times longer or
                            shorter drop ceiling and floor; longer ones let the next raise
                            jump to the calls in flight the rate needs (Little's law,
                            :data:`JUMP_WINDOWS`). Both lapse after :data:`CEILING_TTL`.
slower consumer             the sink was full: nothing is raised, the busiest stage is tried
                            at half (threads that compute take cores from the consumer).
busy cores                  nothing is raised (:data:`BUSY_CPU`; the run's first window:
                            :data:`COLD_CPU`, its rate held down by the start-up).
raise the bottleneck        the busiest stage (:data:`BUSY`, its output not full) doubles,
                            goes halfway to its ceiling, or at once to what the next stage
                            can take (:data:`FEED_MARGIN`, :data:`FEED_MOST`).
trim                        a stage that used few of its slots :data:`TRIM_AFTER` windows in
                            a row is lowered to what it used, plus room.
==========================  ===============================================================

A stage of ``executor="auto"`` on threads whose raise did not pay (or, with nothing to raise,
in a process that keeps about one core busy), while its calls kept about one core busy
(:data:`MOVE_CPU`, :data:`MOVE_GIL`), each waiting part of its time (:data:`MOVE_WAITED`),
and other cores stayed idle (:data:`MOVE_IDLE`), holds the GIL: instead of fewer
calls, it is tried in worker processes (as many as the cores its calls and the idle ones
make, two calls in flight each), kept if the output grew by :data:`MOVE_GAIN`, else moved back
and not tried again for :data:`~feedline._retry.RETRY_AFTER` seconds, twice as long after each
later move that goes back (the DataLoader's schedule). In processes its concurrency is not
tuned.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from feedline._retry import retry_delay

from ._settings import (
    BLOCKED,
    BUSY,
    BUSY_CPU,
    CEILING_TTL,
    CHANGED,
    COLD_CPU,
    COMPUTES,
    CONTENTION,
    FEED_MARGIN,
    FEED_MOST,
    GAIN,
    JUDGED_RAISE,
    JUMP_WINDOWS,
    KEEP_LOWER,
    LOWER_CORES,
    MOVE_CPU,
    MOVE_GAIN,
    MOVE_GIL,
    MOVE_IDLE,
    MOVE_ROOM,
    MOVE_WAITED,
    SHARE,
    TRIM_AFTER,
    WAITING,
)

__all__ = ["Decision", "Memory", "Sample", "StageSample", "State", "Trial", "decide"]


@dataclass(frozen=True)
class StageSample:
    """One tuned stage over a window.

    Attributes:
        name: The stage's name (for the decisions' text).
        concurrency: Its concurrency in the window.
        busy: Share of its slot-time its calls ran: 1.0, every slot busy throughout.
        task: Its mean seconds per call ended in the window (0: none ended).
        blocked: Share of the window its output queue was full.
        low: The least concurrency it may have.
        high: The most.
        room: Calls more the memory budget holds (``None``: no budget).
        cpu: Cores its calls on threads kept busy (measured for stages that may move).
        movable: It may move to worker processes (``executor="auto"``, on threads).
        processes: Worker processes its calls run in (0: threads); its concurrency is not
            tuned there.

    """

    name: str
    concurrency: int
    busy: float = 1.0
    task: float = 0.0
    blocked: float = 0.0
    low: int = 1
    high: int = 32
    room: int | None = None
    cpu: float = 0.0
    movable: bool = False
    processes: int = 0

    @property
    def in_flight(self) -> float:
        """Calls in flight on average."""
        return self.busy * self.concurrency

    @property
    def ended(self) -> float:
        """Calls ended per second (Little's law: in flight / seconds per call)."""
        return self.in_flight / self.task if self.task > 0 else 0.0


@dataclass(frozen=True)
class Sample:
    """What the tuner measured over one window (see :class:`StageSample`).

    Attributes:
        stages: The tuned stages, in pipeline order.
        rate: Items out of the last tuned stage per second.
        cores: Cores the process kept busy, on average.
        cpu_budget: Cores it may keep busy.
        t: Seconds since the run began, at the window's end.
        sink_full: Share of the window the sink was full (the consumer the slower side).
        first: The run's first window (shorter, its calls cold): it only decides a raise.
        ended: The output ended: whatever is under trial is kept.
        idle: Cores the whole machine left idle (``None``: not known): a machine that left
            none is no room for a move to processes (:data:`MOVE_ROOM`).

    """

    stages: tuple[StageSample, ...]
    rate: float
    cores: float
    cpu_budget: float = 2.0
    t: float = 0.0
    sink_full: float = 0.0
    first: bool = False
    ended: bool = False
    idle: float | None = None

    @property
    def saturated(self) -> bool:
        """Whether the whole machine left (almost) no core idle (:data:`MOVE_ROOM`)."""
        return self.idle is not None and self.idle < MOVE_ROOM


@dataclass(frozen=True)
class Memory:
    """What the tuner learned of one stage.

    Attributes:
        ceiling: A concurrency whose raise did not pay (raises go halfway to it at most).
        ceiling_until: ``Sample.t`` from which it no longer holds.
        floor: A lower concurrency that was slower (not tried again).
        floor_until: ``Sample.t`` from which it no longer holds.
        task: The stage's call time at the concurrency kept, when those were found: the
            conditions they hold for.
        jump: The concurrency its next raise may go to at once (0: none)...
        jump_until: ... in windows up to this one.
        idle: Windows in a row it used few of its slots.
        settle: A window that ends a put-back trial's calls: it judges no conditions.
        no_move_until: ``Sample.t`` before which it is not tried in processes (a move that
            did not pay).
        backs: Its moves to processes that went back (each makes the wait for the next
            twice as long: :func:`~feedline._retry.retry_delay`).

    """

    ceiling: int | None = None
    ceiling_until: float = 0.0
    floor: int | None = None
    floor_until: float = 0.0
    task: float = 0.0
    jump: int = 0
    jump_until: int = -1
    idle: int = 0
    settle: int = -1
    no_move_until: float = 0.0
    backs: int = 0


@dataclass(frozen=True)
class Trial:
    """A change under trial, judged by the next window.

    Attributes:
        stage: Its index in ``Sample.stages``.
        before: The concurrency it had.
        after: The concurrency it has under trial.
        rate: The output rate before it.
        capacity: The calls it could end a second before (``before / task``; 0: not known).
        task: Its mean call time before (0: not known, or the run's first window's, cold).
        demand: Its calls ended per second before (0: not known).
        in_flight: Its calls in flight before, on average.
        cores: The cores the process kept busy before (see :data:`WAITING`,
            :data:`COMPUTES`).
        cold: Decided on the run's first window, whose rate the start-up held down, by a
            rate alone (not to feed the next stage).
        move: A move to worker processes (``after`` calls in flight there).

    """

    stage: int
    before: int
    after: int
    rate: float
    capacity: float = 0.0
    task: float = 0.0
    demand: float = 0.0
    in_flight: float = 0.0
    cores: float = 0.0
    cold: bool = False
    move: bool = False


@dataclass(frozen=True)
class State:
    """Everything :func:`decide` remembers between windows."""

    memory: tuple[Memory, ...]
    trial: Trial | None = None
    window: int = 0  # windows decided on

    @staticmethod
    def start(stages: int) -> State:
        """The state before the first window."""
        return State(tuple(Memory() for _ in range(stages)))


@dataclass(frozen=True)
class Decision:
    """What to do with one stage, and why.

    Attributes:
        stage: Its index in ``Sample.stages``.
        action: ``raise`` or ``lower`` (a trial), ``keep`` (a trial kept), ``undo`` (back to
            where it was), ``trim`` (lowered, no trial), ``move`` (to worker processes, a
            trial), ``back`` (from them to threads).
        to: The concurrency it gets (or keeps).
        why: For ``stats().tuning``: ``"4 -> 8 kept (1,000 -> 1,500 items/s)"``.
        processes: For ``move``: how many worker processes.

    """

    stage: int
    action: str
    to: int
    why: str
    processes: int = 0


def decide(state: State, s: Sample) -> tuple[State, list[Decision]]:
    """The decisions for one window (see the module's table), and the state after them."""
    mem = list(state.memory)
    window = state.window + 1
    out: list[Decision] = []
    trial = None
    if state.trial is not None:
        trial = _judge(state.trial, s, mem, window, out)
        if any(d.action != "keep" for d in out):  # changed: a new window starts
            return State(tuple(mem), trial, window), out
    for i, st in enumerate(s.stages):
        mem[i] = _expire(mem[i], st, s.t, window)
    if s.first:  # only a raise, on idle cores: the start-up holds this window's rate down
        if s.sink_full <= BLOCKED and s.cores < COLD_CPU * s.cpu_budget:
            trial = _raise(s, mem, window, out)
    elif s.sink_full > BLOCKED:  # the consumer is the slower side
        trimmed = _trim(s, mem, out)
        if s.rate > 0:  # not a consumer that paused (an evaluation, a checkpoint)
            trial = _fewer(s, mem, out, trimmed)
    else:
        if s.cores < BUSY_CPU * s.cpu_budget:
            trial = _raise(s, mem, window, out) or _gil_bound(s, mem, out)
        if trial is None:
            _trim(s, mem, out)
    return State(tuple(mem), trial, window), out


def _judge(
    trial: Trial, s: Sample, mem: list[Memory], window: int, out: list[Decision]
) -> Trial | None:
    i, before, after = trial.stage, trial.before, trial.after
    st, m = s.stages[i], mem[i]
    capacity = after / st.task if st.task > 0 else 0.0
    rates = f"({trial.rate:,.0f} -> {s.rate:,.0f} items/s)"
    if trial.move:
        if st.processes and (s.rate >= trial.rate * MOVE_GAIN or s.ended):
            out.append(Decision(i, "keep", after, f"processes ({st.processes}) kept {rates}"))
        else:
            wait = retry_delay(m.backs)
            mem[i] = replace(m, no_move_until=s.t + wait, backs=m.backs + 1, settle=window + 1)
            why = "it could not move"
            if st.processes:
                why = f"processes did not pay {rates} (tried again in {wait:.0f} s)"
            out.append(Decision(i, "back", before, f"{why}, back on threads at {before}"))
        return None
    if after < before:  # fewer: kept if as fast, and if the stage can still end its calls
        as_fast = (
            trial.rate > 0
            and s.rate >= trial.rate * KEEP_LOWER
            and (st.task <= 0 or capacity >= trial.demand * KEEP_LOWER)
        )
        if as_fast or s.ended:
            mem[i] = replace(m, task=st.task)
            out.append(Decision(i, "keep", after, f"{before} -> {after} kept, as fast {rates}"))
        else:
            mem[i] = replace(m, floor=after, floor_until=s.t + CEILING_TTL, settle=window + 1)
            out.append(Decision(i, "undo", before, f"back to {before}, {after} was slower"))
        return None
    share = 0.0 if trial.in_flight >= WAITING * max(trial.cores, 0.5) else SHARE
    need = max(GAIN, 1 + (min(after / before, JUDGED_RAISE) - 1) * share)
    grew = capacity >= trial.capacity * need
    if (s.rate >= trial.rate * need and grew) or s.ended:
        mem[i] = _kept(m, st.task, trial, window)
        out.append(Decision(i, "keep", after, f"{before} -> {after} kept {rates}"))
        if trial.cold and trial.cores >= COMPUTES * trial.in_flight and not s.ended:
            # Judged against the start-up: tried back once, so that what stays was judged
            # on warm windows (calls that wait leave the cores idle: their raise stands).
            why = f"trying {before} again, {after} was judged against the start-up"
            out.append(Decision(i, "lower", before, why))
            return Trial(i, after, before, s.rate, task=st.task, demand=st.ended)
        return None
    other = next((j for j in _raisable(s, mem) if j != i), None)
    if other is not None and grew:  # two stages at one rate: neither raise alone pays
        mem[i] = _kept(m, st.task, trial, window)
        name = s.stages[other].name
        out.append(
            Decision(i, "keep", after, f"{before} -> {after} kept, {name} limits now {rates}")
        )
        return None
    m = mem[i] = replace(m, ceiling=after, ceiling_until=s.t + CEILING_TTL, task=trial.task)
    why = f"{after} did not pay {rates}"
    # The calls compute, and more of them gained nothing with cores idle: the GIL.
    moved = _move(s, i, m, why, out, max(trial.rate, s.rate), before)
    if moved is not None:
        return moved
    lower = max(st.low, before // 2, math.ceil(LOWER_CORES * s.cores))
    if (
        lower < before
        and (m.floor is None or lower > m.floor)
        and not _fewer_cannot_keep_up(trial, st.task, lower)
    ):  # an op that contends (the GIL, busy cores) may be as fast with fewer calls
        out.append(Decision(i, "lower", lower, f"{why}, trying {lower}"))
        return Trial(i, before, lower, trial.rate, task=trial.task, demand=trial.demand)
    mem[i] = replace(m, settle=window + 1)
    out.append(Decision(i, "undo", before, f"{why}, back to {before}"))
    return None


def _move(
    s: Sample, i: int, m: Memory, why: str, out: list[Decision], rate: float, before: int
) -> Trial | None:
    # Stage ``i`` tried in worker processes, if it may move and its calls keep about a
    # core busy (what threads of Python code can under the GIL) with cores idle.
    st, idle = s.stages[i], s.cpu_budget - s.cores
    waited = st.cpu <= MOVE_WAITED * st.in_flight
    gil = MOVE_CPU <= st.cpu <= MOVE_GIL and waited
    if not (st.movable and s.t >= m.no_move_until and gil and idle >= MOVE_IDLE):
        return None
    if s.ended or s.saturated:
        return None
    n = min(int(s.cpu_budget), round(st.cpu + idle), st.high // 2)
    if n < 2:
        return None
    why = f"{why}; its calls kept {st.cpu:.1f} cores busy, {idle:.1f} idle"
    out.append(Decision(i, "move", 2 * n, f"{why}: trying {n} processes", n))
    return Trial(i, before, 2 * n, rate, move=True)


def _gil_bound(s: Sample, mem: list[Memory], out: list[Decision]) -> Trial | None:
    # Nothing to raise, and the whole process keeps about one core busy with others idle:
    # the GIL limits it. The stage whose calls hold it most is tried in processes.
    if s.cores > MOVE_GIL:
        return None
    found = [i for i, st in enumerate(s.stages) if st.movable and st.blocked < BLOCKED]
    if not found:
        return None
    i = max(found, key=lambda j: s.stages[j].cpu)
    why = f"the process keeps {s.cores:.1f} cores busy, nothing to raise"
    return _move(s, i, mem[i], why, out, s.rate, s.stages[i].concurrency)


def _fewer_cannot_keep_up(trial: Trial, task: float, lower: int) -> bool:
    # Calls about as long after the raise as before wait on something fewer calls would not
    # shorten: ``lower`` of them end ``lower / task`` a second, too few if below the calls
    # ended before. (Not known after the run's first window: its calls were cold.)
    if trial.demand <= 0 or trial.task <= 0 or task <= 0:
        return False
    if task / trial.task > (trial.after / trial.before) ** CONTENTION:
        return False
    return lower / trial.task < trial.demand * KEEP_LOWER


def _changed(old: float, task: float) -> bool:
    return old > 0 and task > 0 and (task > CHANGED * old or task < old / CHANGED)


def _kept(m: Memory, task: float, trial: Trial, window: int) -> Memory:
    # A raise kept, its calls taking ``task``: the conditions from here on. Where the calls
    # took over twice or under half as long before the raise as after it, both against the
    # conditions the ceiling was found in, those changed (a store that slowed from 10 to
    # 100 ms), not only by the raise (calls a raise itself made longer are contention).
    before = trial.task if trial.task > 0 else task
    old = m.task
    if _changed(old, task) and _changed(old, before) and (task > old) == (before > old):
        m = replace(m, ceiling=None, floor=None)
        if trial.task > old:  # F times longer calls need F times the calls in flight
            m = replace(
                m, jump=round(trial.before * trial.task / old), jump_until=window + JUMP_WINDOWS
            )
    return replace(m, task=task)


def _expire(m: Memory, st: StageSample, t: float, window: int) -> Memory:
    # Not on the window after a put-back: it ends the trial's calls, longer or shorter than
    # calls at the concurrency put back (1 MB reads tried at 32 and put back at 4 ended calls
    # twice as long there; read as a change, 32 was tried again every second).
    if window != m.settle and _changed(m.task, st.task):
        jump = round(st.concurrency * st.task / m.task) if st.task > m.task else 0
        m = replace(
            m, ceiling=None, floor=None, task=st.task, jump=jump, jump_until=window + JUMP_WINDOWS
        )
    if m.ceiling is not None and t >= m.ceiling_until:
        m = replace(m, ceiling=None)
    if m.floor is not None and t >= m.floor_until:
        m = replace(m, floor=None)
    return m


def _raisable(s: Sample, mem: list[Memory]) -> list[int]:
    # The stages that limit the output, busiest first: their slots busy, their output not
    # full, below their bound (below a ceiling, halfway to it is a quarter more at least).
    found = []
    for i, st in enumerate(s.stages):
        c, ceiling = st.concurrency, mem[i].ceiling
        up = (
            c < st.high
            if ceiling is None
            else min(st.high, (c + ceiling) // 2) >= c + max(1, c // 4)
        )
        if st.busy >= BUSY and st.blocked < BLOCKED and up:
            found.append(i)
    return sorted(found, key=lambda i: -s.stages[i].busy)


def _raise(s: Sample, mem: list[Memory], window: int, out: list[Decision]) -> Trial | None:
    found = _raisable(s, mem)
    if not found:
        return None
    i = found[0]
    st, m = s.stages[i], mem[i]
    c = st.concurrency
    feed = 0
    if m.ceiling is None:
        jump = m.jump if window <= m.jump_until else 0
        feed = _to_feed(s, i)
        target = max(2 * c, jump, feed)
        why = "the busiest" if target == 2 * c else "to feed the next" if target == feed else ""
        why = why or "calls longer"
    else:
        target, why = (c + m.ceiling) // 2, f"halfway to {m.ceiling}"
    mem[i] = replace(m, jump=0)
    target = min(st.high, target if st.room is None else min(target, c + st.room))
    if target <= c:
        return None
    why = f"trying {target} (was {c}, {s.rate:,.0f} items/s; {why})"
    out.append(Decision(i, "raise", target, why))
    capacity = c / st.task if st.task > 0 else 0.0
    # The first window's calls were cold: no measure of how long calls are (as conditions).
    task = 0.0 if s.first else st.task
    # A raise to feed the next stage is sized by call times, not judged by a rate alone (and
    # the cores busy are that stage's): it is not tried back.
    cold = s.first and target != feed
    return Trial(i, c, target, s.rate, capacity, task, st.ended, st.in_flight, s.cores, cold)


def _to_feed(s: Sample, i: int) -> int:
    # The calls in flight stage ``i`` needs to feed the next tuned stage at its capacity, if
    # that one waits for items (Little's law: its calls a second x this stage's call time).
    if i + 1 >= len(s.stages):
        return 0
    st, fed = s.stages[i], s.stages[i + 1]
    if fed.busy >= BUSY or st.task <= 0 or fed.task <= 0:
        return 0
    wanted = math.ceil(FEED_MARGIN * fed.concurrency / fed.task * st.task)
    return min(wanted, FEED_MOST * st.concurrency)


def _fewer(s: Sample, mem: list[Memory], out: list[Decision], skip: set[int]) -> Trial | None:
    # The consumer is the slower side: the busiest stage that may go lower is tried at half.
    best = None
    for i, st in enumerate(s.stages):
        lower, floor = max(st.low, st.concurrency // 2), mem[i].floor
        if i in skip or lower >= st.concurrency or (floor is not None and lower <= floor):
            continue
        if best is None or st.busy > s.stages[best].busy:
            best = i
    if best is None:
        return None
    st, m = s.stages[best], mem[best]
    lower = max(st.low, st.concurrency // 2)
    if m.ceiling is None:
        mem[best] = replace(m, task=st.task)  # the conditions a floor found now holds for
    out.append(
        Decision(
            best, "lower", lower, f"trying {lower} (was {st.concurrency}), the consumer is slower"
        )
    )
    return Trial(best, st.concurrency, lower, s.rate, task=st.task, demand=st.ended)


def _trim(s: Sample, mem: list[Memory], out: list[Decision]) -> set[int]:
    # A stage that used few of its slots for TRIM_AFTER windows is lowered to what it used
    # plus room; what it had becomes its ceiling (a raise back would be trimmed again:
    # a read trimmed from 128 to 72 was tried at 144, 108 and 90, none paying).
    trimmed = set()
    for i, st in enumerate(s.stages):
        used, c, m = st.in_flight, st.concurrency, mem[i]
        keep = max(st.low, math.ceil(1.5 * used) + 1)
        if not (c > keep and c > 2 * used + 2):
            mem[i] = replace(m, idle=0)
        elif m.idle + 1 < TRIM_AFTER:
            mem[i] = replace(m, idle=m.idle + 1)
        else:
            m = replace(m, idle=0, floor=None)
            if m.ceiling is None or m.ceiling > c:
                m = replace(m, ceiling=c, ceiling_until=s.t + CEILING_TTL, task=st.task)
            mem[i] = m
            out.append(Decision(i, "trim", keep, f"{c} -> {keep}, it used {used:.1f} slots"))
            trimmed.add(i)
    return trimmed
