"""Sending raw samples between ranks over a dedicated ``torch.distributed`` group.

Each step, a rank sends every destination of its plan one header and one payload, and
receives the same from every source (both sides know from the plan how many samples travel,
so the header's size is known in advance). The header holds the step's tag and, per sample,
its index, length and CRC-32; the payload is the samples' bytes end to end. A payload that does
not match its header raises :class:`ExchangeError`, naming the source rank and the sample.

Messages are tagged by iteration and step, so that a message of one step never matches
another's. A peer that never answers is reported after ``timeout`` seconds (one that died, at
once: its connection closes), never waited on for good. A peer's closed connection does not
say whether that peer failed or stopped after another's failure: the error names the first
failure of the run, recorded in the store (:mod:`._failures`).
"""

from __future__ import annotations

import re
import time
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from feedline.errors import FeedlineError

from ._failures import FirstFailure, blame

__all__ = ["Exchange", "ExchangeError", "ExchangeTimeout", "Received"]

_MISSING = -1
"""The length sent for a sample its sender could not read (counted as a failure there)."""


Received = dict[int, list[tuple[int, bytes | None]]]
"""Per source rank, the ``(index, bytes)`` it sent (``None``: it could not read the sample)."""


class ExchangeError(FeedlineError, ValueError):
    """What another rank sent does not match its header (a sample's length or CRC, the step)."""


class ExchangeTimeout(FeedlineError, RuntimeError):
    """Another rank sent nothing within the timeout, or its connection broke.

    That rank died, hangs, or stopped iterating, or it stopped after another rank failed: the
    message names the rank that failed first, where the ranks' store can tell.
    """


class Exchange:
    """Point-to-point transfers of raw samples for one rank.

    Args:
        group: The process group the samples travel in (gloo: bytes in CPU memory).
        rank: This rank.
        timeout: Seconds to wait for a peer before :class:`ExchangeTimeout`.
        first_failure: Where the first failure among the ranks is recorded and read;
            ``None``: nowhere (a broken connection's error then says that which rank failed
            first is not known).

    """

    def __init__(
        self, group: Any, rank: int, timeout: float, first_failure: FirstFailure | None = None
    ) -> None:
        self._group = group
        self.rank = rank
        self.timeout = timeout
        self.first_failure = first_failure or FirstFailure(None, "")
        self.sent_samples = 0
        self.sent_bytes = 0
        self.received_samples = 0
        self.received_bytes = 0

    def swap(
        self,
        tag: int,
        where: str,
        sends: Sequence[tuple[int, np.ndarray, list[Any]]],
        receives: Sequence[tuple[int, int]],
    ) -> Received:
        """Send ``sends`` and receive ``receives``.

        Args:
            tag: This step's tag, the same on every rank (under 2**29).
            where: The step, for messages (``"epoch 1, step 7"``).
            sends: ``(destination, indices, samples)``: a sample is bytes-like, or ``None``
                where it could not be read.
            receives: ``(source, count)``: how many samples each source sends.

        """
        import torch
        import torch.distributed as dist

        sending: list[tuple[Any, str, int]] = []
        outgoing = []  # kept alive until the sends complete
        for dst, indices, samples in sends:
            header, payload = _pack(tag, indices, samples)
            outgoing += [header, payload]
            what = f"the send of {len(indices)} sample(s) to rank {dst}"
            work = self._post(dist.isend, header, dst, 2 * tag, what, where)
            sending.append((work, what, dst))
            if payload.numel():
                work = self._post(dist.isend, payload, dst, 2 * tag + 1, what, where)
                sending.append((work, what, dst))
            self.sent_samples += len(indices)
            self.sent_bytes += int(payload.numel())
        headers = {}
        heading: list[tuple[Any, str, int]] = []
        for src, count in receives:
            headers[src] = torch.empty(2 + 3 * count, dtype=torch.int64)
            what = f"the header of {count} sample(s) from rank {src}"
            work = self._post(dist.irecv, headers[src], src, 2 * tag, what, where)
            heading.append((work, what, src))
        deadline = time.monotonic() + self.timeout  # for the whole step
        self._wait(heading, where, deadline)  # the payloads' sizes are in the headers
        payloads = {}
        receiving = []
        for src, count in receives:
            lengths = headers[src][2 + count : 2 + 2 * count].numpy()
            payloads[src] = torch.empty(int(lengths[lengths > 0].sum()), dtype=torch.uint8)
            if payloads[src].numel():
                what = f"{count} sample(s) from rank {src}"
                work = self._post(dist.irecv, payloads[src], src, 2 * tag + 1, what, where)
                receiving.append((work, what, src))
        self._wait(receiving + sending, where, deadline)
        received: Received = {}
        for src, count in receives:
            received[src] = _unpack(headers[src].numpy(), payloads[src].numpy(), tag, src, where)
            self.received_samples += count
            self.received_bytes += int(payloads[src].numel())
        return received

    def total(self, counts: np.ndarray, what: str, where: str) -> np.ndarray:
        """The sum of ``counts`` over the ranks (every rank calls it with the same shape).

        One ``all_reduce`` on the exchange group, waited for as a step's transfers are: a
        rank that died is reported at once, one that stopped iterating after ``timeout``
        seconds, naming the first failure recorded.

        Args:
            counts: Integers, ``uint8`` or ``int32``.
            what: The collective, for messages (``"the epoch's ledger check"``).
            where: When, for messages (``"end of epoch 3"``).

        """
        import torch
        import torch.distributed as dist

        tensor = torch.from_numpy(np.ascontiguousarray(counts))
        try:
            work = dist.all_reduce(tensor, group=self._group, async_op=True)
        except RuntimeError as error:
            raise self._failed(what, where, error, None, timed_out=False) from error
        # It runs on the training loop's thread: poll in sleeps, which Ctrl-C interrupts (a
        # wait inside gloo would hold it until the collective ends), then wait for its end.
        deadline = time.monotonic() + self.timeout
        pause = 0.0005
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 0.02)
        self._wait([(work, what, None)], where, deadline)
        return tensor.numpy()

    def _post(
        self, post: Callable[..., Any], tensor: Any, peer: int, tag: int, what: str, where: str
    ) -> Any:
        # Start a send or a receive. On a connection that a dead peer closed, gloo refuses
        # at once, before any wait: that is the same failure as a wait that breaks.
        try:
            return post(tensor, peer, group=self._group, tag=tag)
        except RuntimeError as error:
            raise self._failed(what, where, error, peer, timed_out=False) from error

    def _wait(
        self, pending: Sequence[tuple[Any, str, int | None]], where: str, deadline: float
    ) -> None:
        # gloo's waits cannot be resumed once they time out (the pair is closed), so each
        # wait is given what is left of the step's timeout.
        import datetime

        for work, what, peer in pending:
            left = max(0.001, deadline - time.monotonic())
            try:
                work.wait(datetime.timedelta(seconds=left))
            except RuntimeError as error:
                timed_out = "Timed out" in str(error) or time.monotonic() >= deadline
                raise self._failed(what, where, error, peer, timed_out) from error

    def _failed(
        self, what: str, where: str, error: RuntimeError, peer: int | None, timed_out: bool
    ) -> ExchangeTimeout:
        # Recorded before this rank stops, so that a rank that then finds this one gone
        # names the failure this one reacted to. ``peer`` is None for a collective: gloo
        # does not say which rank it lost.
        if peer is None:
            return self._collective_failed(what, where, error, timed_out)
        if timed_out:
            first = self.first_failure.record(
                self.rank, f"rank {self.rank} waited {self.timeout:g} s for rank {peer} ({where})"
            )
            cause = (
                f"it sent nothing within {self.timeout:g} s: that rank hangs or stopped "
                "iterating. Every rank must iterate the loader alike (the same epochs, and the "
                "same steps before a break); raise timeout= if storage reads are this slow"
            )
            if first is not None and first.rank != self.rank:
                cause += f". Rank {first.rank} failed first: {first.account}"
        else:
            first = self.first_failure.record(
                peer,
                f"rank {peer}'s connection closed ({where}, seen by rank {self.rank}): it died, "
                "or stopped on an error of its own",
            )
            cause = f"{_first_line(error)}. {blame(peer, first)}"
        return ExchangeTimeout(f"rank {self.rank}: {what} failed ({where}): {cause}")

    def _collective_failed(
        self, what: str, where: str, error: RuntimeError, timed_out: bool
    ) -> ExchangeTimeout:
        if timed_out:
            first = self.first_failure.record(
                self.rank, f"rank {self.rank} waited {self.timeout:g} s in {what} ({where})"
            )
            cause = (
                f"a rank did not join it within {self.timeout:g} s: it hangs or stopped "
                "iterating before the epoch's end"
            )
            if first is not None and first.rank != self.rank:
                cause += f". Rank {first.rank} failed first: {first.account}"
            return ExchangeTimeout(f"rank {self.rank}: {what} failed ({where}): {cause}")
        # gloo does not say which peer it lost, so nothing is recorded: the store names the
        # first failure if a rank recorded one.
        first = self.first_failure.read()
        if first is None:
            told = "A rank has gone: it died, or stopped on an error of its own; its log says why"
        else:
            told = f"Rank {first.rank} failed first: {first.account}; its own log says why"
        return ExchangeTimeout(
            f"rank {self.rank}: {what} failed ({where}): {_first_line(error)}. {told}"
        )


def _first_line(error: BaseException) -> str:
    # gloo's messages run on over several lines (and an emoji), after the place in its
    # source: the first sentence says what broke. (The next guesses that the peer crashed,
    # which is what this module's own message answers.)
    text = str(error).strip()
    if not text:
        return type(error).__name__
    line = re.sub(r"^\[[^\]]*\]\s*", "", text.splitlines()[0])
    return line.split(". ", 1)[0].rstrip(".") or type(error).__name__


def _pack(tag: int, indices: np.ndarray, samples: list[Any]) -> tuple[Any, Any]:
    # The header [tag, count, indices..., lengths..., crcs...] and the joined payload.
    import torch

    count = len(indices)
    header = np.zeros(2 + 3 * count, dtype=np.int64)
    header[0], header[1] = tag, count
    header[2 : 2 + count] = indices
    parts = []
    for k, sample in enumerate(samples):
        if sample is None:
            header[2 + count + k] = _MISSING
            continue
        view = memoryview(sample).cast("B")
        header[2 + count + k] = len(view)
        header[2 + 2 * count + k] = zlib.crc32(view)
        parts.append(view)
    joined = bytearray(b"".join(parts))
    payload = torch.frombuffer(joined, dtype=torch.uint8) if joined else torch.empty(0)
    return torch.from_numpy(header), payload.to(torch.uint8)


def _unpack(
    header: np.ndarray, payload: np.ndarray, tag: int, src: int, where: str
) -> list[tuple[int, bytes | None]]:
    count = int(header[1]) if header.size >= 2 else -1
    if header.size < 2 or header[0] != tag or header.size != 2 + 3 * count:
        got = int(header[0]) if header.size else None
        raise ExchangeError(
            f"rank {src} sent a header for another step (tag {got}, expected {tag}; "
            f"{where}): the ranks iterate differently"
        )
    indices = header[2 : 2 + count]
    lengths = header[2 + count : 2 + 2 * count]
    crcs = header[2 + 2 * count :]
    data = payload.tobytes()
    samples: list[tuple[int, bytes | None]] = []
    offset = 0
    for index, length, crc in zip(indices.tolist(), lengths.tolist(), crcs.tolist(), strict=True):
        if length == _MISSING:
            samples.append((index, None))
            continue
        blob = data[offset : offset + length]
        offset += length
        if len(blob) != length or zlib.crc32(blob) != crc:
            raise ExchangeError(
                f"sample {index} from rank {src} is damaged ({where}): {len(blob)} bytes with "
                f"CRC-32 {zlib.crc32(blob):08x}, the sender's header says {length} bytes with "
                f"{crc:08x}"
            )
        samples.append((index, blob))
    if offset != len(data):
        raise ExchangeError(f"rank {src} sent {len(data)} bytes for samples of {offset} ({where})")
    return samples
