"""The fetcher's rules for its calls at once: a pure function from a short window to a limit.

The pipeline's tuner (``feedline.pipeline._decide``) tunes stages on windows of a quarter
second or more, judged by what the output did. The fetcher's pool of ``dataset[i]`` calls,
several per batch, needs an answer within milliseconds (a 20 ms GET should reach full
concurrency within about 20 ms of the first batch), from what the calls do to the cores rather
than from a rate. :class:`~._fetch.BatchFetcher` measures windows of a few ms
(:class:`CallsSample`) and asks :func:`decide_calls`; no clock, no threads: the rows of
``tests/loader/test_calls.py`` give samples by hand. In each window, in this order:

==========================  ===============================================================
the consumer computes       its thread found its batches ready :data:`FED_BATCHES` times in a
                            row while on a core: calls that compute (off the cores under
                            :data:`QUEUED_SHARE` of their time) keep to the other cores
                            (cores - 1), so that the training step keeps its own.
cores full                  this process kept :data:`SATURATED` of the cores busy, or the
                            calls' threads queued for a core :data:`QUEUED_SHARE` of the
                            time (also when other processes fill the cores, which makes this
                            one look idle): 20 % fewer, not below cores + 1.
calls wait                  cores under :data:`IDLE` busy while calls wait to start, and not
                            more running calls than cores on a core or queued for one: a
                            quarter more; twice as many in the slow start (the first batch)
                            or while the cores are under half busy (calls that wait on I/O).
==========================  ===============================================================

A consumer no longer fed (it waited for a batch, or sleeps between batches) gives calls that
compute every core back at once: at least cores + 1.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

__all__ = ["CallsSample", "CallsState", "decide_calls"]

SATURATED = 0.92
"""Share of the cores this process kept busy from which more calls at once would only queue."""

IDLE = 0.85
"""Share of the cores busy under which calls waiting to start may have more at once."""

MOSTLY_IDLE = 0.5
"""Under this share of the cores busy, the calls at once double (calls that wait on I/O)."""

QUEUED_SHARE = 0.25
"""Calls whose threads spent more than this share of a window runnable but waiting for a core
find the cores full: more of them at once would only queue. Measured on 2 cores: three
CPU-bound calls alone queue about a third of the time, and about 60 % with two other processes
spinning; calls waiting on I/O hardly at all. Also the share of their time off the cores
under which calls count as computing, beside a consumer that computes."""

FEWER = 0.8
"""Cores full: the calls at once are cut to this share (not below cores + 1)."""

FED_BATCHES = 3
"""Batches in a row the consumer found ready, computing between them, before it counts as fed
(it needs a core of its own)."""

COMPUTING = 0.5
"""A consumer whose thread was on a core (or queued for one) this share of its time between two
batches computes; under it, it sleeps (a blocking wait on a GPU, on I/O) and leaves its core."""


@dataclass(frozen=True)
class CallsSample:
    """What a pool's owner measured over one short window.

    Attributes:
        limit: The calls allowed at once in the window.
        busy: The cores this process kept busy, as a share of the cores counted on.
        queued: The share of the window the calls' threads (those read) spent runnable but
            waiting for a core (``None``: not read).
        waiting: Calls submitted and not started.
        on_cores: Running calls on a core or queued for one now, of those read (``None``: not
            read; only needed when the calls may grow, see :meth:`may_grow`).
        running: Running calls, of those read.
        starting: The slow start (the first batch): calls that wait double.
        off_cores: With a fed consumer, the share of the calls' time off the cores (on I/O,
            a sleep, a lock; ``None``: not measured yet).

    """

    limit: int
    busy: float
    queued: float | None = None
    waiting: int = 0
    on_cores: int | None = None
    running: int = 0
    starting: bool = False
    off_cores: float | None = None

    def may_grow(self) -> bool:
        """Whether more calls could be admitted, before the calls' threads are read."""
        return self.busy < IDLE and self.waiting > 0


@dataclass(frozen=True)
class CallsState:
    """A pool's bounds, and what :func:`decide_calls` remembers of its consumer.

    Attributes:
        cores: The cores the pool counts on (a worker process: its share).
        low: The fewest calls at once (``Auto.low``).
        high: The most (the pool's threads).
        ready: Batches in a row the consumer found ready while it computed.

    """

    cores: int
    low: int = 1
    high: int = 128
    ready: int = 0

    @property
    def fed(self) -> bool:
        """The consumer computes and finds its batches ready: it needs a core of its own."""
        return self.ready >= FED_BATCHES

    def holds(self, off_cores: float | None) -> bool:
        """Whether the calls keep to the cores the consumer leaves.

        They do while it is fed, and they compute: off the cores (``off_cores``, measured)
        under :data:`QUEUED_SHARE` of their time.
        """
        return self.fed and off_cores is not None and off_cores < QUEUED_SHARE

    def first(self, start: int | None, spare: int) -> int:
        """The calls at once to begin with: ``start`` (``Auto.start``), else cores + ``spare``.

        The DataLoader's pipeline starts with a spare call (cores + 1); a worker process with
        none, since each extra CPU-bound call only queues beside the other workers' (measured:
        the first batch of 2 workers 10 ms later). Calls that wait leave the cores idle, and
        the slow start admits more.
        """
        return max(self.low, start or self.cores + spare)

    def took(self, waited: bool, computing: float | None, limit: int) -> tuple[CallsState, int]:
        """How the consumer took its last batch; the new state and calls at once.

        Args:
            waited: It waited for the batch (it was not ready).
            computing: The share of its time since the batch before that its thread spent on
                a core or queued for one (``None``: unknown).
            limit: The calls allowed at once now.

        Returns:
            The new state, and the calls at once: a consumer no longer fed gets every core
            back at once (cores + 1 at least).

        """
        computes = computing is not None and computing > COMPUTING
        after = replace(self, ready=self.ready + 1 if computes and not waited else 0)
        if self.fed and not after.fed:
            limit = max(limit, self.low, self.cores + 1)
        return after, limit


def decide_calls(state: CallsState, s: CallsSample) -> tuple[int, str]:
    """The calls at once after one window (see the module's table), and why (``""``: as is)."""
    limit, cores = s.limit, state.cores
    if state.holds(s.off_cores):
        return max(state.low, cores - 1), "the consumer computes: calls keep to the other cores"
    if s.busy > SATURATED or (s.queued is not None and s.queued > QUEUED_SHARE):
        return min(state.high, max(state.low, cores + 1, int(limit * FEWER))), "cores full"
    if s.may_grow() and not (s.on_cores is not None and s.on_cores > max(cores, s.running // 2)):
        # (Most running calls on a core or queued for one, more of them than cores: other
        # processes make this one look idle, and a window of a few ms can miss the calls'
        # queueing; measured: 21 threads for 96 CPU-bound calls on 2 cores beside 2 spinning
        # processes. Calls that wait on I/O are hardly ever caught on a core.)
        more = 2 * limit if s.starting or s.busy < MOSTLY_IDLE else limit + max(1, limit // 4)
        return min(state.high, more), "calls wait, cores idle"
    return limit, ""
