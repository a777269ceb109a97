"""The first failure among a loader's ranks, kept in torch.distributed's store.

When a rank fails, its peers find its connections closed and fail in turn, and their peers
find *them* gone: gloo's error reads the same for a rank that died and for one that only
stopped because another died. So the first rank to learn of a failure, its own or a peer's,
records it in the store the ranks share (``compare_set``: the first record stays) before it
stops, and a rank that later finds a peer gone names that first failure, not the peer.

The record is the rank that failed and an account of it, one line. The store is the default
group's: under ``torchrun``, the agent's, which outlives every rank; where a rank hosts it
(``init_method="tcp://..."``, or ``env://`` on rank 0) and has gone, nothing can be read, and
the message says that which rank failed first is not known.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

__all__ = ["Failure", "FirstFailure"]

_log = logging.getLogger("feedline.distributed")


@dataclass(frozen=True)
class Failure:
    """A failure of one rank: which, and what happened (a sentence without a full stop)."""

    rank: int
    account: str


class FirstFailure:
    """The first failure recorded under ``key`` in ``store`` (shared by every rank).

    Args:
        store: A ``torch.distributed.Store`` every rank reaches; ``None``: none (nothing is
            recorded, and the first failure is never known).
        key: The record's key, the same on every rank of one loader and unique to it.

    """

    def __init__(self, store: Any, key: str) -> None:
        self._store = store
        self._key = key

    @classmethod
    def of_default_group(cls, key: str) -> FirstFailure:
        """The record in the default group's store (none if there is no default group)."""
        try:
            # Private, but what torch.distributed's own checkpointing and elastic code reach
            # the default store with; a torch without it only loses the first failure's name.
            from torch.distributed.distributed_c10d import _get_default_store

            store = _get_default_store()
        except Exception:
            store = None
        return cls(store, key)

    def record(self, rank: int, account: str) -> Failure | None:
        """Record that ``rank`` failed, unless a failure is recorded already.

        Returns:
            The first failure recorded (this one, or an earlier one), or ``None`` when the
            store cannot be reached (its host has gone) or there is none.

        """
        if self._store is None:
            return None
        line = " ".join(account.split())
        try:
            value = self._store.compare_set(self._key, "", f"{rank}\n{line}")
            return _parse(value)
        except Exception as error:
            _log.debug("the first failure could not be recorded or read: %s", error)
            return None

    def read(self) -> Failure | None:
        """The first failure recorded, without recording one (``None``: none, or no store)."""
        if self._store is None:
            return None
        try:
            if not self._store.check([self._key]):
                return None
            return _parse(self._store.get(self._key))
        except Exception as error:
            _log.debug("the first failure could not be read: %s", error)
            return None


def _parse(value: Any) -> Failure:
    text = bytes(value).decode("utf-8", "replace")
    first, _, told = text.partition("\n")
    return Failure(int(first), told)


def blame(peer: int, first: Failure | None) -> str:
    """What a rank says of ``peer``, whose connection closed, given the first failure."""
    if first is None:
        return (
            f"Rank {peer} has gone: it failed, or it stopped after another rank failed; "
            "which rank failed first is not known here (torch.distributed's store cannot be "
            "reached), the first to fail says why in its own log"
        )
    if first.rank == peer:
        return f"Rank {peer} failed first: {first.account}; its own log says why"
    return (
        f"Rank {peer} stopped after rank {first.rank} failed first: {first.account}; "
        f"rank {first.rank}'s own log says why"
    )
