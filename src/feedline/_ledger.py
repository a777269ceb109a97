"""The epoch ledger: a bit per sample of what an epoch handed out, checked at its end.

Data loaders resume by bookkeeping (batches yielded, a watermark, each worker's count), and
a slip in it repeats or drops samples without a word. A :class:`Ledger` is a second,
independent record, made where the consumer receives each sample (or batch): a set bit per
*slot* delivered, a set bit per slot that failed and was reported (skipped within the
failure budget, or raised to the caller). A slot is whatever numbers the epoch's plan: a
sampler's batch, a source item, a sample of a shard stream.

Checks (each raises :class:`~feedline.errors.LedgerError`, naming the first slot and how many):

- delivered twice: seen as it happens, raised at :meth:`Ledger.check_end` (the epoch's end);
- never delivered nor failed: at the epoch's end, every slot of the plan (``[0, planned)``);
- after a resume: the position a saved state resumes from (:meth:`Ledger.check_resume`) must
  pass over exactly the slots the ledger saw done, or the resumed epoch would repeat or
  drop them.

One writer: the thread that hands samples out (no lock on the way). The bits live in a
``bytearray``: a shuffled epoch of two million samples costs 250 KiB, and a saved state
holds them compressed (a few hundred bytes where they are mostly set).
"""

from __future__ import annotations

import base64
import os
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from feedline.errors import LedgerError

__all__ = ["Ledger", "LedgerStats", "ledger_check"]


_SUSPECTS = (
    "a bug in feedline, or a dataset's or sampler's state_dict()/load_state_dict() that does "
    "not restore its position"
)


@dataclass(frozen=True)
class LedgerStats:
    """What an epoch's ledger holds now.

    Attributes:
        planned: Slots the epoch holds (``None`` while its end is not known: a stream, or a
            sampler not drawn to its end yet).
        delivered: Slots handed out.
        failed: Slots that failed and were reported (skipped within the budget or raised),
            and not delivered since.
        repeated: Deliveries of a slot handed out already (0 unless something is wrong).
        missing: Slots of the plan neither delivered nor failed (known at the end).

    """

    planned: int | None
    delivered: int
    failed: int
    repeated: int
    missing: int | None


class Ledger:
    """One epoch's record of the slots delivered and failed.

    Args:
        name: What to call the epoch in messages (``"DataLoader epoch 3"``).
        unit: What a slot is, in messages (``"batch"``, ``"sample"``, ``"source item"``).
        describe: Says more about a slot in a message (its dataset indices, its key); it is
            called only when a message is written.
        suspects: What a message says could be at fault.

    """

    __slots__ = (
        "_delivered",
        "_describe",
        "_failed",
        "_first_repeated",
        "_repeated",
        "_suspects",
        "delivered_count",
        "name",
        "planned",
        "unit",
    )

    def __init__(
        self,
        name: str,
        unit: str = "sample",
        describe: Callable[[int], str] | None = None,
        suspects: str = _SUSPECTS,
    ) -> None:
        self.name = name
        self.unit = unit
        self._describe = describe
        self._suspects = suspects
        self._delivered = bytearray()
        self._failed = bytearray()
        self.delivered_count = 0
        self._repeated = 0
        self._first_repeated: str | None = None
        self.planned: int | None = None

    # Recording, on the thread that hands out --------------------------------------------

    def deliver(self, slot: int) -> None:
        """Record that ``slot`` was handed out."""
        bits = self._delivered
        byte = slot >> 3
        if byte < len(bits):  # the common case, without deliver_many's loop and tuple
            value, bit = bits[byte], 1 << (slot & 7)
            if not value & bit:
                bits[byte] = value | bit
                self.delivered_count += 1
                return
        self.deliver_many((slot,))

    def deliver_many(self, slots: Iterable[int]) -> None:
        """Record that each of ``slots`` was handed out.

        One loop here takes about half the time of a call of :meth:`deliver` per slot.
        """
        bits = self._delivered
        count = 0
        for slot in slots:
            byte, bit = slot >> 3, 1 << (slot & 7)
            if byte >= len(bits):
                bits.extend(bytes(max(byte + 1 - len(bits), len(bits))))
            value = bits[byte]
            if value & bit:
                self._repeat(slot)
                continue
            bits[byte] = value | bit
            count += 1
        self.delivered_count += count

    def deliver_range(self, start: int, stop: int) -> None:
        """Record that the slots ``start`` to ``stop - 1`` were handed out."""
        if stop - start < 24:
            for slot in range(start, stop):
                self.deliver(slot)
            return
        head = -(-start // 8) * 8  # whole bytes from here ...
        tail = stop // 8 * 8  # ... to here
        for slot in range(start, head):
            self.deliver(slot)
        bits = self._delivered
        if tail // 8 > len(bits):
            bits.extend(bytes(max(tail // 8 - len(bits), len(bits))))
        whole = bits[head // 8 : tail // 8]
        if whole.count(0) == len(whole):
            bits[head // 8 : tail // 8] = b"\xff" * len(whole)
            self.delivered_count += tail - head
        else:  # some were handed out already: one at a time, to count and name them
            for slot in range(head, tail):
                self.deliver(slot)
        for slot in range(tail, stop):
            self.deliver(slot)

    def fail(self, slot: int) -> None:
        """Record that ``slot`` failed and was reported (it is not owed any more)."""
        bits = self._failed
        byte = slot >> 3
        if byte >= len(bits):
            bits.extend(bytes(max(byte + 1 - len(bits), len(bits))))
        bits[byte] |= 1 << (slot & 7)

    def plan(self, planned: int) -> None:
        """The epoch holds the slots ``0`` to ``planned - 1`` (known once its plan ends)."""
        self.planned = planned

    def _repeat(self, slot: int) -> None:
        self._repeated += 1
        if self._first_repeated is None:
            self._first_repeated = self._name(slot)

    # Reading ------------------------------------------------------------------------------

    def _has(self, bits: bytearray, slot: int) -> bool:
        byte = slot >> 3
        return byte < len(bits) and bool(bits[byte] >> (slot & 7) & 1)

    def delivered(self, slot: int) -> bool:
        """Whether ``slot`` was handed out."""
        return self._has(self._delivered, slot)

    def done(self, slot: int) -> bool:
        """Whether ``slot`` was handed out, or failed and was reported."""
        return self._has(self._delivered, slot) or self._has(self._failed, slot)

    def done_bits(self) -> bytes:
        """The slots handed out or failed, a bit each, as bytes.

        Slot ``k`` is bit ``k % 8`` of byte ``k // 8``: ``numpy.unpackbits(...,
        bitorder="little")`` reads it.
        """
        size = max(len(self._delivered), len(self._failed))
        return self._done_int().to_bytes(size, "little")

    def _done_int(self) -> int:
        # Delivered or failed, as one int: bit ``k`` is slot ``k``.
        delivered = int.from_bytes(self._delivered, "little")
        return delivered | int.from_bytes(self._failed, "little")

    def _undone(self, stop: int) -> tuple[int, int | None]:
        """How many slots below ``stop`` are not done, and the first of them."""
        if stop <= 0:
            return 0, None
        undone = ~self._done_int() & ((1 << stop) - 1)
        if not undone:
            return 0, None
        return undone.bit_count(), (undone & -undone).bit_length() - 1

    def failed_count(self) -> int:
        """Slots that failed and were not delivered since."""
        failed = int.from_bytes(self._failed, "little")
        return (failed & ~int.from_bytes(self._delivered, "little")).bit_count()

    def stats(self) -> LedgerStats:
        """A snapshot of the counts."""
        missing = None if self.planned is None else self._undone(self.planned)[0]
        return LedgerStats(
            planned=self.planned,
            delivered=self.delivered_count,
            failed=self.failed_count(),
            repeated=self._repeated,
            missing=missing,
        )

    def _name(self, slot: int) -> str:
        extra = ""
        if self._describe is not None:
            try:
                extra = self._describe(slot)
            except Exception:  # a message must not fail for its details
                extra = ""
        return f"{self.unit} {slot}" + (f" ({extra})" if extra else "")

    # Checks -------------------------------------------------------------------------------

    def check_end(self) -> None:
        """At the epoch's end: nothing handed out twice, every planned slot done.

        Raises:
            LedgerError: Naming the first slot repeated or missing, and how many.

        """
        parts = self.end_findings()
        if parts:
            self._fail("; ".join(parts))

    def end_findings(self) -> list[str]:
        """What :meth:`check_end` would raise about, a phrase each (none: the epoch is right)."""
        missing, first = (0, None) if self.planned is None else self._undone(self.planned)
        return self._findings(missing, first, "never handed out (nor reported as failed)")

    def check_resume(
        self, below: int, ahead: Iterable[int] = (), position: str = "the saved position"
    ) -> None:
        """Check that a state resuming past the slots under ``below`` and ``ahead`` is right.

        A resumed epoch skips what its position says was handed out. A slot it skips that
        was never handed out is lost; a slot done that it does not skip comes twice.
        ``position`` names the position in messages.

        Raises:
            LedgerError: Naming the first such slot, and how many.

        """
        extra = set(ahead)
        skipped = (1 << below) - 1
        for slot in extra:
            skipped |= 1 << slot
        done = self._done_int()
        lost = skipped & ~done
        again = done & ~skipped
        if again:
            first = (again & -again).bit_length() - 1
            self._fail(
                f"{position} resumes at {self.unit} {below} but {again.bit_count()} "
                f"{self.unit}(s) it does not pass over were handed out already (first: "
                f"{self._name(first)}): the resumed epoch would repeat them"
            )
        missing = lost.bit_count()
        first_lost = (lost & -lost).bit_length() - 1 if lost else None
        self._raise(missing, first_lost, f"passed over by {position} but never handed out")

    def _raise(self, missing: int, first: int | None, why: str) -> None:
        parts = self._findings(missing, first, why)
        if parts:
            self._fail("; ".join(parts))

    def _findings(self, missing: int, first: int | None, why: str) -> list[str]:
        parts = []
        if self._repeated:
            parts.append(
                f"{self._repeated} {self.unit}(s) handed out twice (first: {self._first_repeated})"
            )
        if missing:
            assert first is not None
            parts.append(f"{missing} {self.unit}(s) {why} (first: {self._name(first)})")
        return parts

    def _fail(self, text: str) -> None:
        raise LedgerError(
            f"{self.name}: {text}. The epoch did not deliver each {self.unit} exactly once: "
            f"{self._suspects}; please report it with this message",
            repeated=self._repeated,
        )

    # State --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The ledger as plain data (its bits compressed and base64-encoded)."""
        return {
            "delivered": _pack(self._delivered, self.delivered_count),
            "failed": _pack(self._failed),
            "count": self.delivered_count,
            "repeated": self._repeated,
            "planned": self.planned,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take the record of a saved epoch (from :meth:`state_dict`)."""
        try:
            self._delivered = _unpack(state["delivered"])
            self._failed = _unpack(state["failed"])
            self.delivered_count = int(state["count"])
            self._repeated = int(state["repeated"])
            planned = state["planned"]
            self.planned = None if planned is None else int(planned)
        except (KeyError, TypeError, ValueError, zlib.error) as error:
            raise ValueError(
                f"a damaged ledger in the saved state ({error!r}): pass the dict that "
                "state_dict() returned, unchanged"
            ) from error


def _pack(bits: bytearray, count: int | None = None) -> str:
    # "<run>*<byte>:<the rest, compressed>": the bits start with a long run of one byte
    # (all set where an epoch went in order; none where nothing failed), kept as its length.
    # ``count``: the bits set, where known. A dataset's state_dict() may save its ledger
    # after every batch, and bytes.lstrip() and rstrip() take 10-17 ns a byte (1.4 ms for
    # a million samples' bits): bits that are the first ``count`` ones, or none, are found
    # by comparing whole buffers instead (memcmp, ~30 us for a million).
    data = bytes(bits)  # one copy: the writer may change ``bits`` meanwhile
    whole, part = divmod(count or 0, 8)
    top = b"\xff" * whole + (bytes(((1 << part) - 1,)) if part else b"")
    if data.startswith(top) and data.endswith(bytes(len(data) - len(top))):
        if whole:
            return _packed(whole, 0xFF, top[whole:])
        return _packed(len(top), top[0] if top else 0, b"")
    data = data.rstrip(b"\0")
    lead = data[:1] or b"\0"
    rest = data.lstrip(lead)
    return _packed(len(data) - len(rest), lead[0], rest)


def _packed(run: int, lead: int, rest: bytes) -> str:
    return f"{run}*{lead:02x}:" + base64.b64encode(zlib.compress(rest)).decode("ascii")


def _unpack(text: str) -> bytearray:
    head, _, rest = text.partition(":")
    run, _, lead = head.partition("*")
    return bytearray(bytes.fromhex(lead) * int(run)) + zlib.decompress(
        base64.b64decode(rest.encode("ascii"), validate=True)
    )


def ledger_check() -> bool:
    """Whether epochs keep a ledger: yes, unless the environment sets ``FEEDLINE_LEDGER=0``.

    Read when each epoch starts, so that a benchmark can compare with and without it.
    """
    return os.environ.get("FEEDLINE_LEDGER", "1") != "0"
