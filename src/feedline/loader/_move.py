"""``num_workers="auto"``: fetching on threads, or in worker processes where that pays.

Threads in the training process are the default: they start at once and need no pickling, and
they win wherever ``dataset[i]`` waits or releases the GIL. They lose where it holds the GIL:
the training thread then waits for the GIL each time it gives it up (every small op of a step
launches through it), or the batches come late because threads cannot run Python code at
once. Neither shows in the loader's own throughput; both show in the training loop's.

So the epoch measures windows of batches (:class:`Window`, on the consumer's thread, from the
times it already reads) and a pure function decides (:func:`decide`, its rows in
``tests/loader/test_move_decisions.py``):

* on threads, a window where the training thread slept (off the cores, not queued for one)
  for a share of its time between batches, and longer a batch than taking a batch from a
  worker would cost it, while the ``dataset[i]`` calls kept cores busy, or
  where the consumer waited for most batches while the calls kept at most about one core
  busy with cores idle, is a reason to try worker processes: half as many again as the cores
  the calls kept busy in the first case (two at least), as many as the cores in the second;
* two windows in a row must ask for a trial (one just after a start-up may be slow), unless
  the training thread slept :data:`PLAIN` times the bounds in the first;
* the trial moves fetching to the workers at a batch boundary (the epoch's position and
  ledger go on across it), and after a longer window there (:data:`TRIAL_BATCHES`) it is
  kept if the consumer's batches per second rose by :data:`KEEP_GAIN` over the windows that
  asked, taken together; one that falls short is measured for one more window and judged on
  both; else fetching goes back where it was, and no other trial is made for
  :data:`~feedline._retry.RETRY_AFTER` seconds, twice as long after each later trial that
  goes back (the tuner's schedule for ``executor="auto"`` too);
* in workers, a consumer that still waits for most batches while the machine has idle cores
  gets a trial with twice the workers (at most the cores), judged the same way;
* a dataset that cannot move (an ``IterableDataset``, a stateful one, one that does not pickle
  where the workers cannot fork) stays on threads, and the reason is kept.

A loader with ``num_workers=0`` runs the same measurements and, where a trial would be made,
logs once a hint naming ``num_workers="auto"``.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from feedline._cores import machine_idle
from feedline._retry import retry_delay

__all__ = ["KEEP_GAIN", "Decision", "Sample", "Placement", "Window", "decide"]

MIN_BATCHES = 8
"""Batches a window needs before it is judged."""
MIN_SECONDS = 0.25
"""Seconds a window needs before it is judged."""
SKIP_BATCHES = 2
"""Batches left out at the start of an epoch or after a move: start-up, not the steady state."""
TRIAL_SKIP = 3
"""Batches left out at the start of a trial: the new workers' first batches come late."""
TRIAL_BATCHES = 16
"""Batches a trial's window needs before it is judged: twice a window's, since the gain it
must show (a few per cent) is about the spread of one window's rate."""
TRIAL_SECONDS = 0.5
"""Seconds a trial's window needs before it is judged."""
SLEPT = 0.03
"""The training thread sleeping this share of its time between batches, beside fetching that
keeps cores busy, suggests it waits for the GIL the fetch threads hold (measured beside JPEG
decoding on threads: 4-7 % under a step of small tensor ops, under 1 % under a model step)."""
SLEPT_SECONDS = 1.5e-3
"""...and for at least this long per batch: about what taking a batch from a worker process
costs the training thread instead (2 ms for 16 decoded pictures), which the move must save.
Measured with steps of about 25 ms: 0.7-1.1 ms beside ``numpy.load`` under a model step,
where worker processes gained nothing; 2.0-4.1 ms beside ``load_npz`` under a step of small
tensor ops, where they gained 13 %."""
PLAIN = 3.0
"""A window whose training thread sleeps this many times :data:`SLEPT` and
:data:`SLEPT_SECONDS` moves at once, without a second window to ask too (measured beside
``numpy.load`` under a step of small tensor ops: 19-26 %, 7-10 ms a batch)."""
LOADER_BUSY = 0.05
"""Cores the fetching must keep busy for the training thread's sleep to be put down to it."""
WAITED = 0.5
"""The consumer waiting for this share of its batches: the fetching is the slow side."""
GIL_CORES = 1.25
"""Fetching that keeps at most this many cores busy while the consumer waits and cores are
idle is bound by the GIL: more threads cannot add to it, more processes can."""
IDLE_CORES = 0.5
"""Idle cores of the machine the fetching must leave, for the loader-bound case."""
KEEP_GAIN = 1.02
"""A trial in worker processes is kept if the consumer's batches per second rise this much
over the windows that asked for it."""
GROW_IDLE = 0.5
"""Idle cores of the machine that let a trial with more worker processes be made."""
LEAST_WORKERS = 2
"""Worker processes a move from threads starts at least (fewer only on fewer cores): two cover
each other's pauses, where one falls behind the training loop now and then (measured beside
JPEG decoding under a step of small tensor ops: 2 workers 1.06x PyTorch's best, 1 worker
0.99x)."""


@dataclass(frozen=True)
class Sample:
    """One window of batches as the consumer took them.

    Attributes:
        workers: The worker processes fetching in it (0: threads).
        batches: Batches the consumer took.
        seconds: Wall time from the window's start to its last batch.
        waited: Share of the batches the consumer waited for.
        slept: Share of the consumer's time between batches its thread was off the cores and
            not queued for one (``None``: not measured: the consumer always waited, or the
            batches came from workers).
        loader_cores: Cores the calls of ``dataset[i]`` kept busy (on threads; 0 in worker
            processes, where the rule does not use it).
        cores: Cores this process may use.
        idle: Cores the whole machine left idle (``None``: unknown).
        between: The consumer's mean time between two batches, over those whose time
            ``slept`` is a share of (``None``: none).

    """

    workers: int
    batches: int
    seconds: float
    waited: float
    slept: float | None
    loader_cores: float
    cores: int
    idle: float | None = None
    between: float | None = None

    @property
    def rate(self) -> float:
        """Batches per second."""
        return self.batches / self.seconds if self.seconds > 0 else 0.0

    @property
    def slept_seconds(self) -> float:
        """Seconds the training thread slept per batch it measured (0: none measured)."""
        if self.slept is None or self.between is None:
            return 0.0
        return self.slept * self.between


@dataclass(frozen=True)
class Decision:
    """What to do after a window, and why.

    ``action``: ``"wait"`` (too short to judge), ``"stay"``, ``"ask"`` (a trial would be
    made if the next window asks too; in a trial: it is judged on the next window and this
    one), ``"move"`` (to ``workers`` processes, a trial judged against ``baseline`` batches
    per second), ``"keep"`` (a trial paid) or ``"back"`` (where it was before the trial).
    """

    action: str
    why: str = ""
    workers: int = 0
    baseline: float = 0.0


@dataclass
class Placement:
    """Where one loader fetches, across its epochs, and what its trials found.

    Attributes:
        auto: ``num_workers="auto"``: moves are made (else only the hint is logged).
        workers: The worker processes fetching now (0: threads).
        trial_rate: The batches per second before a trial, which it is judged against
            (``None``: no trial under way).
        previous: The worker processes before the trial (0: threads), where it goes back.
        retry_at: ``time.monotonic()`` before which no trial is made.
        backs: The trials that went back.
        asked: The last window, if it said ``"ask"`` (kept across epochs: an epoch may be
            shorter than two windows).
        stays: Why the dataset cannot move (``None``: it can).
        log: The decisions taken, oldest first, for ``stats().tuning``.
        hinted: The hint was logged (a loader with ``num_workers=0``).

    """

    auto: bool
    workers: int = 0
    trial_rate: float | None = None
    previous: int = 0
    retry_at: float = 0.0
    backs: int = 0
    asked: Sample | None = None
    stays: str | None = None
    log: list[str] = field(default_factory=list)
    hinted: bool = False

    def note(self, text: str) -> None:
        """Keep ``text`` in the log (the last 20)."""
        self.log.append(text)
        del self.log[:-20]

    def went_back(self, now: float) -> None:
        """A trial went back at ``now`` (``time.monotonic()``): the next one waits longer."""
        self.retry_at = now + retry_delay(self.backs)
        self.backs += 1
        self.trial_rate = None


def decide(
    sample: Sample, trial_rate: float | None, may_try: bool, asked: Sample | None = None
) -> Decision:
    """The placement rule, a pure function of one window (see the module docstring).

    A trial is made when two windows in a row ask for it: the first says ``"ask"``, the
    second ``"move"``, with their rate together as the trial's ``baseline`` (one window's rate
    spreads by about as much as the gain a trial must show). A first window whose training
    thread slept :data:`PLAIN` times both bounds moves at once, against its own rate (the
    gain such a sleep leaves room for is well over a window's spread). A trial's window that
    falls short of :data:`KEEP_GAIN` says ``"ask"`` too: the next window judges the trial on
    both together.

    Args:
        sample: The window.
        trial_rate: In a trial: the batches per second before it, which it is judged
            against (``None``: no trial under way).
        may_try: A trial may be made now (the dataset can move, none failed recently).
        asked: The window before, if it said ``"ask"``.

    """
    if sample.batches < MIN_BATCHES or sample.seconds < MIN_SECONDS:
        return Decision("wait")
    if sample.workers and trial_rate is not None:
        return _judged(sample, trial_rate, asked)
    wanted = _wanted(sample, may_try)
    if wanted.action != "move":
        return wanted
    if asked is None and not _plain(sample):
        return Decision("ask", wanted.why, wanted.workers)
    rate = sample.rate if asked is None else _together(asked, sample).rate
    return Decision("move", wanted.why, wanted.workers, rate)


def _together(first: Sample, then: Sample) -> Sample:
    # Two windows in a row as one (their batches over their seconds).
    return replace(then, batches=first.batches + then.batches, seconds=first.seconds + then.seconds)


def _plain(sample: Sample) -> bool:
    # The training thread sleeps so much that one window shows it (only measured beside
    # threads: a window in workers has no ``slept``).
    return (
        sample.slept is not None
        and sample.slept >= PLAIN * SLEPT
        and sample.slept_seconds >= PLAIN * SLEPT_SECONDS
    )


def _judged(sample: Sample, trial_rate: float, asked: Sample | None) -> Decision:
    # A trial in workers: kept if its rate rose by KEEP_GAIN; one that falls short at its
    # first window is measured once more and judged on both (one window's spread is about
    # the gain it must show: a single slow window must not send it back).
    whole = sample if asked is None else _together(asked, sample)
    gain = whole.rate / trial_rate if trial_rate > 0 else math.inf
    where = f"{whole.rate:.1f} batches/s in {sample.workers} worker process(es)"
    if asked is not None:
        where += " over two windows"
    if gain >= KEEP_GAIN:
        return Decision("keep", f"{where}, {trial_rate:.1f} before ({gain:.2f}x)", sample.workers)
    why = f"{where}, {trial_rate:.1f} before ({gain:.2f}x, under {KEEP_GAIN}x)"
    if asked is None:
        return Decision("ask", f"{why}: measured once more", sample.workers)
    return Decision("back", why)


def _wanted(sample: Sample, may_try: bool) -> Decision:
    # What one window on threads, or in workers kept, asks for alone.
    if sample.workers:
        return _more_workers(sample, may_try)
    busy = sample.loader_cores
    if busy < LOADER_BUSY:
        return Decision("stay", f"fetching keeps {busy:.2f} cores busy")
    why = ""
    if sample.slept is not None and sample.slept >= SLEPT and sample.slept_seconds >= SLEPT_SECONDS:
        why = (
            f"the training thread slept {sample.slept:.0%} of its time between batches "
            f"({1e3 * sample.slept_seconds:.1f} ms a batch) while fetching kept {busy:.2f} "
            "cores busy"
        )
        workers = math.ceil(1.5 * busy)
    elif (
        sample.waited >= WAITED
        and busy <= GIL_CORES
        and (sample.idle is None or sample.idle >= IDLE_CORES)
        and sample.cores > 1
    ):
        why = (
            f"the consumer waited for {sample.waited:.0%} of its batches while fetching kept "
            f"{busy:.2f} cores busy"
            + ("" if sample.idle is None else f" and {sample.idle:.1f} were idle")
        )
        workers = sample.cores
    if not why:
        return Decision("stay", "fetching on threads does not hold the training thread back")
    if not may_try:
        return Decision("stay", why)
    return Decision("move", why, max(1, min(sample.cores, max(LEAST_WORKERS, workers))))


def _more_workers(sample: Sample, may_try: bool) -> Decision:
    # In worker processes, kept: more of them while the consumer waits for its batches and
    # the machine has a core idle (a consumer that waits leaves its own core to them too).
    if (
        not may_try
        or sample.waited < WAITED
        or sample.idle is None
        or sample.idle < GROW_IDLE
        or sample.workers >= sample.cores
    ):
        return Decision("stay", f"kept in {sample.workers} worker process(es)")
    workers = min(sample.cores, 2 * sample.workers)
    return Decision(
        "move",
        f"the consumer waited for {sample.waited:.0%} of its batches from {sample.workers} "
        f"worker process(es) while {sample.idle:.1f} cores were idle",
        workers,
    )


class Window:
    """Measures a window of batches on the consumer's thread (see :class:`Sample`).

    Reads the clocks once per batch (the consumer's own times come from the epoch); the
    process's CPU time and the machine's idle time once per window.
    """

    def __init__(
        self, workers: int, cpu: Callable[[], float] | None = None, trial: bool = False
    ) -> None:
        self.workers = workers
        self._cpu_now = cpu or (lambda: 0.0)
        self._skip = TRIAL_SKIP if trial else SKIP_BATCHES
        self._least = (TRIAL_BATCHES, TRIAL_SECONDS) if trial else (MIN_BATCHES, MIN_SECONDS)
        self._start = 0.0
        self._cpu = 0.0  # the fetching's CPU seconds at the start
        self._idle: float | None = None
        self._batches = 0
        self._waited = 0
        self._between = 0.0  # the consumer's time between batches, where measured
        self._measured = 0  # the batches it was measured for
        self._slept = 0.0  # of which its thread slept
        self._last = 0.0  # when it took the last batch

    def _begin(self, now: float) -> None:
        self._start, self._cpu, self._idle = now, self._cpu_now(), machine_idle()
        self._batches = self._waited = 0
        self._between = self._slept = 0.0
        self._measured = 0

    def took(
        self, now: float, waited: bool, between: float | None, computing: float | None
    ) -> None:
        """The consumer took a batch at ``now`` (``perf_counter``).

        ``between``: its time since the batch before, of which ``computing`` (a share) its
        thread was on a core or queued for one.
        """
        if self._skip:
            self._skip -= 1
            if not self._skip:
                self._begin(now)
            return
        self._batches += 1
        self._waited += waited
        if between is not None and computing is not None:
            self._between += between
            self._measured += 1
            self._slept += between * max(0.0, 1.0 - computing)
        self._last = now

    def ready(self) -> bool:
        """Whether the window is long enough to be judged."""
        batches, seconds = self._least
        return not self._skip and self._batches >= batches and self._last - self._start >= seconds

    def sample(self, cores: int) -> Sample:
        """The window so far."""
        seconds = self._last - self._start
        idle_now = machine_idle()
        idle = None
        if idle_now is not None and self._idle is not None and seconds > 0:
            idle = (idle_now - self._idle) / seconds
        return Sample(
            workers=self.workers,
            batches=self._batches,
            seconds=seconds,
            waited=self._waited / self._batches,
            slept=self._slept / self._between if self._between > 0 else None,
            loader_cores=max(0.0, self._cpu_now() - self._cpu) / seconds if seconds > 0 else 0.0,
            cores=cores,
            idle=idle,
            between=self._between / self._measured if self._measured else None,
        )

    def restart(self) -> None:
        """Start a new window at the next batch, judged as an ordinary one."""
        self._skip = 1
        self._least = (MIN_BATCHES, MIN_SECONDS)
