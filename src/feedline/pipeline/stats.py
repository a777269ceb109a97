"""Per-stage statistics of a running pipeline, and which stage is the bottleneck.

:meth:`Pipeline.stats() <feedline.Pipeline.stats>` returns a :class:`PipelineStats` snapshot.
How to read a stage's numbers:

* ``busy`` near 1: the stage's concurrency slots are always occupied; it limits throughput. Give
  it more ``concurrency`` (if its op releases the GIL or waits on I/O) or make its op cheaper.
* ``starved`` near 1: the stage waits for input most of the time; look upstream.
* ``blocked`` near 1: the stage's output queue is full most of the time; look downstream. If the
  last stage is blocked, the consumer (the training loop) is the slowest part, which is the goal.
"""

from __future__ import annotations

import array
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from feedline._ledger import LedgerStats

from ._queue_stats import ChannelStats, window_share
from ._settings import DURATION_RING

__all__ = ["PipelineStats", "StageStats"]


class SlotTime:
    """A stage's concurrency over time, in slot-seconds: what its busy share is a share of.

    A tuned stage's concurrency changes while it runs, so its slots are summed per period.
    Not locked: the stage's counters hold their lock around it.
    """

    __slots__ = ("_before", "_since", "concurrency")

    def __init__(self, concurrency: int, now: float) -> None:
        self.concurrency = concurrency
        self._before = 0.0  # slot-seconds before ``_since``
        self._since = now

    def set(self, concurrency: int, now: float) -> None:
        """The concurrency is ``concurrency`` from ``now`` on."""
        self._before += self.concurrency * (now - self._since)
        self._since, self.concurrency = now, concurrency

    def at(self, now: float) -> float:
        """Slot-seconds from the start until ``now``."""
        return self._before + self.concurrency * (now - self._since)


class StageCounters:
    """Mutable counters one stage updates while it runs (internal)."""

    __slots__ = (
        "_durations",
        "_n_durations",
        "_slots",
        "_times",
        "failures",
        "in_flight",
        "items_in",
        "kind",
        "lock",
        "max_in_flight",
        "name",
        "t0",
        "where",
    )

    def __init__(self, name: str, kind: str, concurrency: int) -> None:
        self.name = name
        self.kind = kind
        self.lock = threading.Lock()
        self.items_in = 0
        self.failures = 0
        self.in_flight = 0
        self.max_in_flight = 0
        # An array, not a list: it keeps no float objects, so on free-threaded Python a thread
        # that overwrites one another thread made does not hand it back to that thread to free.
        self._durations = array.array("d", bytes(8 * DURATION_RING))
        self._n_durations = 0
        self._times = array.array("d", (0.0, -1.0))  # busy_time, ewma: no float objects
        self.t0 = time.perf_counter()
        self._slots = SlotTime(concurrency, self.t0)
        # StageStats.runs_in: a text, or a function that tells it (a stage that may move).
        self.where: str | Callable[[], str] = "threads"

    @property
    def busy_time(self) -> float:
        """Seconds of calls recorded so far."""
        return self._times[0]

    @busy_time.setter
    def busy_time(self, seconds: float) -> None:
        self._times[0] = seconds

    @property
    def ewma(self) -> float:
        """Smoothed seconds per call; negative until enough calls were seen."""
        return self._times[1]

    @ewma.setter
    def ewma(self, seconds: float) -> None:
        self._times[1] = seconds

    @property
    def concurrency(self) -> int:
        """The most calls the stage runs at once, now."""
        return self._slots.concurrency

    def set_concurrency(self, concurrency: int) -> None:
        """Record a new concurrency (the tuner's), keeping slot-time for the busy share."""
        with self.lock:
            self._slots.set(concurrency, time.perf_counter())

    @property
    def calls(self) -> int:
        """Calls recorded so far."""
        return self._n_durations

    def slots(self, now: float) -> float:
        """Slot-seconds since the stage started: its concurrency over time. ``lock`` held."""
        return self._slots.at(now)

    def task_started(self) -> float:
        """Count one call entering the op; returns its start time. Call with ``lock`` held."""
        self.in_flight += 1
        if self.in_flight > self.max_in_flight:
            self.max_in_flight = self.in_flight
        return time.perf_counter()

    def task_ended(self, t_start: float) -> float:
        """Count one call leaving the op and return its duration. Call with ``lock`` held."""
        dt = time.perf_counter() - t_start
        self.in_flight -= 1
        self._record(dt)
        return dt

    def begin(self, items: int) -> float:
        """:meth:`task_started` under :attr:`lock`, with ``items`` new items in."""
        with self.lock:
            self.items_in += items
            self.in_flight += 1
            if self.in_flight > self.max_in_flight:
                self.max_in_flight = self.in_flight
            return time.perf_counter()

    def end(self, t_start: float, items: int = 0, calls: int = 1) -> None:
        """:meth:`task_ended` under :attr:`lock`, with ``items`` new items in (a source's).

        ``calls``: that many calls made as one (a chunk sent to a worker process), each
        recorded as an equal share of the time. The clock is read under the lock: a wait for
        it (and, under the GIL, for the GIL after it) is the call's, as the tuner reads busy
        slots (a stage that holds the GIL then shows its slots busy and may move).
        """
        with self.lock:
            self.in_flight -= 1
            dt = (time.perf_counter() - t_start) / max(calls, 1)
            for _ in range(max(calls, 1)):
                self._record(dt)
            self.items_in += items

    def ended(self, durations: list[float], items: int = 0) -> None:
        """A task that made calls of ``durations`` in turn ended; ``items`` new items in."""
        with self.lock:
            self.in_flight -= 1
            for dt in durations:
                self._record(dt)
            self.items_in += items

    def lap(self, t_start: float) -> float:
        """Record a call that began at ``t_start`` and ended now; returns now.

        For calls made one after another by one task, counted in flight once for the whole
        run (``task_started`` before the first, ``in_flight -= 1`` after the last): each call
        starts when the one before it ended. Call with ``lock`` held.
        """
        now = time.perf_counter()
        self._record(now - t_start)
        return now

    def _record(self, dt: float) -> None:
        times = self._times
        times[0] += dt
        self._durations[self._n_durations % DURATION_RING] = dt
        self._n_durations += 1
        if self._n_durations > 8:
            ewma = times[1]
            times[1] = ewma + 0.125 * (dt - ewma) if ewma >= 0 else dt

    def snapshot(self, in_q: ChannelStats | None, out_q: ChannelStats) -> StageStats:
        """Build the public snapshot of this stage."""
        with self.lock:
            n = min(self._n_durations, DURATION_RING)
            durations = np.array(self._durations[:n], dtype=np.float64)
            now = time.perf_counter()
            life = max(now - self.t0, 1e-9)
            busy = self.busy_time / max(self.slots(now), 1e-9)
            if n:
                mean = float(durations.mean())
                p50, p90, p99 = (float(v) for v in np.percentile(durations, [50, 90, 99]))
            else:
                mean = p50 = p90 = p99 = 0.0
            return StageStats(
                name=self.name,
                kind=self.kind,
                concurrency=self.concurrency,
                slot_seconds=self.slots(now),
                items_in=self.items_in,
                items_out=out_q.puts,
                failures=self.failures,
                in_flight=self.in_flight,
                max_in_flight=self.max_in_flight,
                task_mean=mean,
                task_p50=p50,
                task_p90=p90,
                task_p99=p99,
                busy=min(busy, 1.0),
                starved=in_q.empty_fraction if in_q is not None else 0.0,
                blocked=out_q.full_fraction,
                queue=out_q,
                life=life,
                runs_in=self.where() if callable(self.where) else self.where,
            )


@dataclass(frozen=True)
class StageStats:
    """A snapshot of one stage.

    Attributes:
        name: The stage's name.
        kind: ``"source"``, ``"pipe"``, ``"aggregate"`` or ``"disaggregate"``.
        concurrency: The most calls of the op the stage runs at once (now: a tuned stage's
            changes, see ``PipelineBuilder.pipe(concurrency="auto")``).
        items_in: Items the stage has started working on (calls of ``next`` for a source).
        items_out: Items the stage has handed to the next queue.
        failures: Items the op raised on (skipped, counted against the failure budget).
        in_flight: Calls running now.
        max_in_flight: The most calls that ever ran at once (never above ``concurrency``).
        task_mean: Mean seconds per call, over the last 2048 calls.
        task_p50: Median seconds per call.
        task_p90: 90th percentile of seconds per call.
        task_p99: 99th percentile of seconds per call.
        busy: Share of the stage's slot-time (its concurrency over time) spent inside the op
            (0 to 1). Near 1: this stage limits throughput.
        starved: Share of time the stage's input queue was empty: waiting on upstream.
        blocked: Share of time the stage's output queue was full: waiting on downstream.
        queue: Statistics of the queue after this stage.
        life: Seconds the shares above are over: since the stage started, or, for a
            snapshot from :meth:`PipelineStats.since`, between the two snapshots.
        slot_seconds: The stage's concurrency integrated over ``life`` (what ``busy`` is a
            share of).
        runs_in: Where its calls run: ``"threads"``, ``"event loop"``, ``"processes (N)"``
            (a process region, or a stage of ``executor="auto"`` moved there), ``"process
            pool"``, ``"threads (its own executor)"``; a stage of ``executor="auto"`` that
            cannot move says why, as ``"threads (stays: ...)"``.

    """

    name: str
    kind: str
    concurrency: int
    items_in: int
    items_out: int
    failures: int
    in_flight: int
    max_in_flight: int
    task_mean: float
    task_p50: float
    task_p90: float
    task_p99: float
    busy: float
    starved: float
    blocked: float
    queue: ChannelStats
    life: float
    slot_seconds: float = 0.0
    runs_in: str = "threads"

    def since(self, earlier: StageStats) -> StageStats:
        """The counts and shares between ``earlier`` (a snapshot) and this one.

        Task times stay those of the last 2048 calls; ``in_flight`` and ``max_in_flight``
        stay this snapshot's.
        """
        life, then = self.life, earlier.life
        # Busy is a share of slot-time, which a tuned stage's changes of concurrency make
        # unlike wall time: weighed by the slot-seconds of each snapshot.
        slots, slots_then = self.slot_seconds, earlier.slot_seconds
        return replace(
            self,
            items_in=self.items_in - earlier.items_in,
            items_out=self.items_out - earlier.items_out,
            failures=self.failures - earlier.failures,
            busy=window_share(self.busy, slots, earlier.busy, slots_then),
            slot_seconds=slots - slots_then,
            starved=window_share(self.starved, life, earlier.starved, then),
            blocked=window_share(self.blocked, life, earlier.blocked, then),
            queue=self.queue.since(earlier.queue),
            life=life - then,
        )


@dataclass(frozen=True)
class PipelineStats:
    """A snapshot of a whole pipeline.

    Attributes:
        elapsed: Seconds since the current (or last) run started (for a snapshot from
            :meth:`since`: between the two snapshots).
        stages: One :class:`StageStats` per stage, source first.
        bottleneck: The name of the stage that limits throughput, or ``"consumer"`` when the
            pipeline produces faster than it is consumed (the goal).
        reason: One sentence saying why ``bottleneck`` was chosen.
        tuning: The tuner's last decisions (``build(autotune=True)``, ``concurrency="auto"``),
            oldest first, each with the seconds into the run it was taken.
        tuner_cpu: CPU seconds the tuner has used in this run (0 without one).
        ledger: What the epoch's ledger holds (resumable pipelines, DataLoaders): items
            planned, delivered, failed, delivered twice and never (see ``_ledger.py``);
            ``None`` where no ledger is kept.

    """

    elapsed: float
    stages: tuple[StageStats, ...]
    bottleneck: str
    reason: str
    tuning: tuple[str, ...] = ()
    tuner_cpu: float = 0.0
    ledger: LedgerStats | None = None

    def since(self, earlier: PipelineStats) -> PipelineStats:
        """What happened between ``earlier`` and this snapshot, and the bottleneck then.

        The whole-run shares of a snapshot hide a bottleneck that moved (a cache that warmed
        up, a consumer that slowed down); the shares over a recent window show it::

            before = pipeline.stats()
            ...                                  # a few seconds of training
            print(pipeline.stats().since(before))

        Raises:
            ValueError: ``earlier`` is not an earlier snapshot of the same run.

        """
        names = [s.name for s in self.stages]
        if [s.name for s in earlier.stages] != names or earlier.elapsed > self.elapsed:
            raise ValueError(
                "since() needs an earlier snapshot of the same pipeline run: take it with "
                "pipeline.stats() before this one, in the same epoch"
            )
        stages = tuple(s.since(e) for s, e in zip(self.stages, earlier.stages, strict=True))
        name, reason = find_bottleneck(stages)
        return PipelineStats(
            elapsed=self.elapsed - earlier.elapsed,
            stages=stages,
            bottleneck=name,
            reason=reason,
            tuning=self.tuning,
            tuner_cpu=self.tuner_cpu - earlier.tuner_cpu,
            ledger=self.ledger,
        )

    def __getitem__(self, name: str) -> StageStats:
        """Return the stage called ``name``."""
        for stage in self.stages:
            if stage.name == name:
                return stage
        raise KeyError(f"no stage named {name!r}; stages: {[s.name for s in self.stages]}")

    @property
    def items_out(self) -> int:
        """Items that reached the consumer's buffer."""
        return self.stages[-1].items_out if self.stages else 0

    def __str__(self) -> str:
        head = (
            f"{'stage':<22}{'conc':>5}{'in':>9}{'out':>9}{'fail':>6}{'p50 ms':>9}"
            f"{'p99 ms':>9}{'busy':>7}{'starved':>9}{'blocked':>9}{'queue':>7}"
        )
        lines = [head, "-" * len(head)]
        for s in self.stages:
            occ = f"{s.queue.mean_occupancy:.0%}"
            lines.append(
                f"{s.name[:21]:<22}{s.concurrency:>5}{s.items_in:>9}{s.items_out:>9}"
                f"{s.failures:>6}{s.task_p50 * 1e3:>9.2f}{s.task_p99 * 1e3:>9.2f}"
                f"{s.busy:>7.0%}{s.starved:>9.0%}{s.blocked:>9.0%}{occ:>7}"
            )
        rate = self.items_out / self.elapsed if self.elapsed > 0 else 0.0
        grouping = [s.kind for s in self.stages if s.kind in ("aggregate", "disaggregate")]
        unit = "batches" if grouping and grouping[-1] == "aggregate" else "items"
        source = self.stages[0].items_out if self.stages else 0
        made = f" from {source} source items" if unit == "batches" else ""
        lines.append(
            f"{self.items_out} {unit}{made} in {self.elapsed:.2f}s ({rate:,.0f} {unit}/s); "
            f"bottleneck: {self.bottleneck} ({self.reason})"
        )
        lines.extend(f"tuner: {decision}" for decision in self.tuning)
        return "\n".join(lines)


def find_bottleneck(stages: tuple[StageStats, ...]) -> tuple[str, str]:
    """Name the stage that limits throughput, with a reason."""
    if not stages:
        return "none", "no stages"
    last = stages[-1]
    if last.blocked > 0.5:
        return (
            "consumer",
            f"the output buffer was full {last.blocked:.0%} of the time: the pipeline is "
            "faster than the loop consuming it",
        )
    worst = max(stages, key=lambda s: s.busy)
    if worst.busy < 0.05:
        return "none", "no stage is busy; the pipeline is idle or just started"
    reason = f"its {worst.concurrency} slot(s) were busy {worst.busy:.0%} of the time"
    if worst.task_mean > 0 and worst.kind == "pipe":
        # A slot finishes 1 / (seconds per call) items a second: one more adds that much if
        # the op waits (I/O) rather than computes on cores that are already busy.
        more = 1 / worst.task_mean
        reason += f"; one more slot would add up to {more:,.0f} items/s if its op waits"
    return worst.name, reason
