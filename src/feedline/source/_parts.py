"""``RemoteStore(part_size="auto")``: how large the range requests of one object should be.

One connection often carries far less than the store can send (a few tens of MB/s on S3),
so a large object comes sooner as several range requests at once. Each request pays the
store's latency ``L`` (until the reply's headers) and then carries its bytes at the
connection's rate ``B``: a part of ``P`` bytes spends ``P / B`` of its ``L + P / B`` moving
bytes. With enough connections, all parts come at once, in ``L + P / B``: the smaller the
parts, the sooner the object, down to ``L``, but the more requests (each billed, each a
round of work for client and server). :class:`PartSizer` measures ``L`` and ``B`` on every
request (headers, then body) and picks ``P = L * B / 4``: the largest part whose bytes take
a quarter of the wait, so that a read comes within 1.25 ``L``, at least 80 % as fast as any
part size could make it. Within :data:`MIN_PART` and :data:`MAX_PART`; the first part of
a read is :data:`MIN_PART` until measured, and times the connection for the rest.
"""

from __future__ import annotations

import threading

__all__ = ["MAX_PART", "MIN_PART", "PartSizer"]

MIN_PART = 1 << 20
"""The smallest part (1 MiB): a request's own cost (a round trip, a request billed) must
stay small beside its bytes."""

MAX_PART = 64 << 20
"""The largest part (64 MiB)."""

TIMED_BODY = 256 << 10
"""Bodies from this size are timed for the connection's rate: a smaller one's time is mostly
the client's own overhead."""


class PartSizer:
    """Measures the store's latency and one connection's rate; says how large a part should be.

    Thread-safe: reads on several event loops (and threads) report to it.
    """

    BYTES_SHARE = 0.25
    """``P = L B / 4``: a part's bytes take a quarter of its wait."""

    WEIGHT = 0.2
    """How much each new request moves the running means (exponential smoothing)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.latency: float | None = None
        """Seconds until a reply's headers, smoothed (``None`` until a request returned)."""
        self.rate: float | None = None
        """Bytes per second one connection carried a body, smoothed (``None`` until timed)."""

    def observe(self, latency: float, nbytes: int, body_seconds: float) -> None:
        """Count one request: seconds to its headers, its body's bytes and their seconds."""
        with self._lock:
            self.latency = _smooth(self.latency, max(0.0, latency), self.WEIGHT)
            if nbytes >= TIMED_BODY and body_seconds > 0:
                self.rate = _smooth(self.rate, nbytes / body_seconds, self.WEIGHT)

    def size(self) -> int:
        """Bytes per part now."""
        with self._lock:
            latency, rate = self.latency, self.rate
        if latency is None or rate is None:
            return MIN_PART
        wanted = int(self.BYTES_SHARE * latency * rate)
        return max(MIN_PART, min(MAX_PART, wanted))


def _smooth(mean: float | None, value: float, weight: float) -> float:
    return value if mean is None else (1 - weight) * mean + weight * value
