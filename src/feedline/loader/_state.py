"""Where a DataLoader stands in its epochs: what ``state_dict()`` saves and restores.

A :class:`Position` belongs to the loader, not to the epoch's iterator: the iterator updates it
as it hands batches out, and it outlives the iterator, so a checkpoint taken after ``break``,
after an exception in the loop body or after the last batch describes the last batch handed
out (as torchdata's ``StatefulDataLoader`` does), not a fresh epoch.

A stateful dataset's own state is saved with it, and loaded back in torchdata's order
(:func:`start_dataset`, :func:`start_stream`; in worker processes, see ``_workers.py``).

The saved state is plain data (ints, lists, a base64 string for the random state, and whatever
the dataset's and sampler's own ``state_dict()`` return), so it can be written as JSON.
"""

from __future__ import annotations

import base64
import copy
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "STATE_VERSION",
    "Position",
    "check_state",
    "decode_rng",
    "derived_seed",
    "encode_rng",
    "is_stateful",
    "saved_dataset_states",
    "start_dataset",
    "start_stream",
    "state_reporter",
]

STATE_VERSION = 2
_ACCEPTED = (1, 2)  # version 1 held the random state as a tensor, and no dataset or sampler state


def is_stateful(obj: Any) -> bool:
    """Whether ``obj`` follows the Stateful protocol (``state_dict`` and ``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(
        getattr(obj, "load_state_dict", None)
    )


def start_stream(dataset: Any, state: Any, iterates: bool) -> Any:
    """``iter(dataset)`` for its pass, with its saved ``state`` loaded where torchdata does.

    Before ``iter()``, or after it for a dataset that is its own iterator (``iterates``: it
    was when the state was saved), whose ``__iter__`` may start it over. A copy of ``state``
    is loaded: the dataset may keep it, and change it as it goes.

    Args:
        dataset: A stateful iterable dataset (see :func:`is_stateful`).
        state: Its ``state_dict()`` to resume from, or ``None``.
        iterates: Load it after ``iter()``.

    Returns:
        What ``iter(dataset)`` returned.

    """
    if state is not None and not iterates:
        dataset.load_state_dict(copy.deepcopy(state))
    iterator = iter(dataset)
    if state is not None and iterates:
        dataset.load_state_dict(copy.deepcopy(state))
    return iterator


def saved_dataset_states(state: dict[str, Any] | None, *, fresh_workers: bool) -> list[Any] | None:
    """The dataset's states (one per worker, or one) that an epoch resumes from, if any.

    A state saved mid-epoch resumes as it is. One saved at an epoch's end holds the dataset's
    state after its last batch: the next epoch goes on from it where the dataset lives on in
    an uninterrupted loop, in this process or in persistent workers (as torchdata resumes;
    an iterable dataset loads it before its ``iter()``, as the loop would call that on the
    dataset in that state); ``fresh_workers`` start from the dataset as it was sent.
    """
    if state is None or state["dataset_state"] is None:
        return None
    if state["finished"] and fresh_workers:
        return None
    return list(state["dataset_state"])


def state_reporter(position: Position) -> Callable[[int, Any, bool], None]:
    """What records a worker's dataset state as its pass starts, in ``position``.

    Holds the position only (not the epoch's iterator: no reference cycle). Called with the
    worker, its dataset's state, and whether the dataset is its own iterator.
    """

    def report(worker: int, state: Any, iterates: bool) -> None:
        if position.dataset_states is not None:
            position.dataset_states[worker] = state
        position.dataset_iterates = iterates

    return report


def start_dataset(
    dataset: Any, position: Position, saved: list[Any] | None, *, iterate: bool = False
) -> Any:
    """Start the dataset's epoch in this process; return ``iter(dataset)`` if ``iterate``.

    A stateful dataset (``position.dataset_states`` is not ``None``) has its saved state
    loaded (see :func:`start_stream`) when this is called, which is at the point of
    torchdata's order: once the sampler's iterator is made, the base seed drawn and the first
    batch's indices drawn (``dataset.load_state_dict()`` may set the global generators that
    the items draw from). Its state then is the epoch's first.
    """
    states = position.dataset_states
    if states is None:
        return iter(dataset) if iterate else None
    state = saved[0] if saved else None
    iterator = None
    if iterate:
        iterator = start_stream(dataset, state, position.dataset_iterates)
        position.dataset_iterates = iterator is dataset
    elif state is not None:
        dataset.load_state_dict(copy.deepcopy(state))  # a copy: it may keep it
    states[0] = copy.deepcopy(dataset.state_dict())
    return iterator


def encode_rng(state: Any) -> str:
    """A torch random state (a uint8 tensor) as text."""
    return base64.b64encode(state.numpy().tobytes()).decode("ascii")


def decode_rng(torch: Any, value: Any) -> Any:
    """The uint8 tensor back from :func:`encode_rng` (or the tensor a version 1 state held)."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if not isinstance(value, str):
        raise ValueError(f"rng_state must be a base64 string, got {type(value).__name__}")
    raw = bytearray(base64.b64decode(value.encode("ascii"), validate=True))
    return torch.frombuffer(raw, dtype=torch.uint8).clone()


@dataclass
class Position:
    """How far the current (or last) epoch went.

    Attributes:
        rng_at_start: The generator's state when the epoch began (a uint8 tensor).
        yielded: Batches numbered below this were handed out.
        ahead: Batches above ``yielded`` handed out already (``in_order=False``).
        finished: The epoch ran to its end: a checkpoint now resumes at the next epoch.
        sampler_state: The sampler's own state after the last batch below ``yielded`` was
            drawn, when the sampler is stateful.
        dataset_states: The dataset's own state, per worker (one slot without workers), when
            the dataset is stateful: as the epoch started (after a resumed state was loaded,
            and, for an iterable dataset, ``iter()`` called), then after each batch handed
            out, and at the end after the last one (for an iterable dataset, after its
            iterator ended), as torchdata's ``StatefulDataLoader`` keeps it.
        dataset_iterates: The iterable dataset is its own iterator (``__iter__`` returns it):
            its state is loaded after ``iter()``, not before (torchdata's order).
        seed_chain: With persistent workers, ``(first base seed, epochs since)``: epochs
            after the first derive their base seed from it instead of drawing one (PyTorch
            draws it once per persistent iterator), so that they shuffle as PyTorch's do.
        worker_batches: An iterable dataset with workers: per worker, its batches handed
            out; ``worker_turn``, the worker whose batch comes next.
        ledger: The epoch's :class:`~._ledgers.LoaderLedger` (``None``: not checked).

    """

    rng_at_start: Any
    yielded: int = 0
    ahead: set[int] = field(default_factory=set)
    finished: bool = False
    sampler_state: Any = None
    dataset_states: list[Any] | None = None
    dataset_iterates: bool = False
    seed_chain: tuple[int, int] | None = None
    worker_batches: list[int] | None = None
    worker_turn: int = 0
    ledger: Any = None

    def to_state(self, own_generator: bool, rng_now: Any) -> dict[str, Any]:
        """The ``state_dict()`` of a loader at this position.

        Args:
            own_generator: The loader has a ``generator=`` of its own.
            rng_now: The generator's state now: where the next epoch starts when this one
                finished.

        """
        chain = self.seed_chain
        dataset = self.dataset_states
        if self.finished:
            # The next epoch starts from the sampler's own beginning; the dataset's state is
            # the one after the last batch, which the next epoch continues from where the
            # dataset lives on (see DataLoader.load_state_dict).
            rng, yielded, ahead = rng_now, 0, []
            sampler, streams, turn = None, None, 0
            if chain is not None:
                chain = (chain[0], chain[1] + 1)
        else:
            rng, yielded, ahead = self.rng_at_start, self.yielded, sorted(self.ahead)
            sampler = self.sampler_state
            streams, turn = self.worker_batches, self.worker_turn
        return {
            "version": STATE_VERSION,
            "rng_state": encode_rng(rng),
            "own_generator": own_generator,
            # Batches 0..batches_yielded-1 were handed out, and (with in_order=False) these
            # later ones too.
            "batches_yielded": yielded,
            "yielded_ahead": ahead,
            "finished": self.finished,
            "sampler_state": sampler,
            # A copy: the iterator replaces the list's entries as batches are handed out.
            "dataset_state": None if dataset is None else list(dataset),
            "dataset_iterates": self.dataset_iterates,
            "persistent_seed": None if chain is None else list(chain),
            "worker_batches": None if streams is None else list(streams),
            "worker_turn": turn,
            "ledger": None if self.finished or self.ledger is None else self.ledger.state_dict(),
        }


def check_state(state: Any, own_generator: bool) -> dict[str, Any]:
    """Validate a state from ``state_dict()``; return a copy in the current version's form."""
    if not isinstance(state, dict) or state.get("version") not in _ACCEPTED:
        raise ValueError(
            "not a feedline DataLoader state (expected a dict from DataLoader.state_dict() "
            f"with version {STATE_VERSION})"
        )
    if state["own_generator"] != own_generator:
        raise ValueError(
            "the state was saved by a loader "
            + ("with" if state["own_generator"] else "without")
            + " a generator=; resume with the same kind of loader"
        )
    # A copy: the sampler's and dataset's load_state_dict() may keep what they are given,
    # and the epoch must not change the caller's checkpoint as it goes.
    out = copy.deepcopy(dict(state))
    out.setdefault("finished", False)
    out.setdefault("sampler_state", None)
    out.setdefault("dataset_state", None)
    out.setdefault("dataset_iterates", False)
    out.setdefault("persistent_seed", None)
    out.setdefault("worker_batches", None)
    out.setdefault("worker_turn", 0)
    out.setdefault("ledger", None)
    return out


def derived_seed(first: int, epochs_since: int) -> int:
    """The base seed of a persistent loader's epoch after its first, as ``random_()`` gives."""
    digest = hashlib.blake2b(f"{first}:{epochs_since}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
