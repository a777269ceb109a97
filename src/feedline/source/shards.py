"""Samples streamed from tar shards (the WebDataset layout), shuffled, split, resumable.

:class:`TarShards` reads whole shards from a :class:`~feedline.RemoteStore` or a directory,
a few ahead of the one being read (each read waits on the store's latency on a thread of its
own), walks each with :func:`~feedline.io.tar.tar_samples` (no copy of the shard), and yields
the samples. Each epoch, the shards are shuffled from the seed and the epoch, split between
the ranks of a distributed job (``shards[rank::world]``) and then between the DataLoader
worker processes of a rank (by ``torch.utils.data.get_worker_info()``), and the samples are
shuffled in a buffer. Everything in that order is a function of the seed and the epoch, so a
resumed epoch passes over the samples already handed out and goes on with the next one.

Each iteration keeps an epoch ledger (:class:`~feedline._ledger.Ledger`) of the samples it
handed out, numbered by their place in this rank's (and worker's) stream: it is saved with the
position, checked against it when a state is loaded, and checked at the iteration's end.
"""

from __future__ import annotations

import collections
import logging
import random
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from feedline._grace import CtrlCHeld, claim_ctrl_c, release_ctrl_c
from feedline._ledger import Ledger, LedgerStats, ledger_check
from feedline._watchdog import STALL_AFTER, TICK, StallWatch, check_after
from feedline.errors import ConfigurationError, add_note
from feedline.io.tar import tar_samples

from ._hedge import Runners
from .stored import StoredSamples

__all__ = ["TarShards"]

_log = logging.getLogger("feedline.source")

try:  # a torch IterableDataset where torch is installed, so that DataLoaders treat it as one
    from torch.utils.data import IterableDataset as _Base
except ImportError:  # pragma: no cover - torch is optional
    _Base = object  # type: ignore[assignment,misc]


class TarShards(_Base):  # type: ignore[type-arg]
    """The samples of tar shards: dicts of ``{"__key__", "__url__", field: data}``.

    A field's data is a ``memoryview`` of its shard (no copy), or ``bytes`` where the sample
    is kept or sent on: in the shuffle buffer, and in a DataLoader's worker processes (a
    view does not pickle).

    Iterating it in a ``DataLoader`` with worker processes splits each rank's shards between
    the workers. Call :meth:`set_epoch` before each epoch's ``iter()``; with persistent
    workers it does not reach their copies, so every epoch would repeat the first one's
    order (as with PyTorch).

    Resuming: :meth:`state_dict` is the epoch, the samples of it the current (or last)
    iteration handed out, and that iteration's ledger. After :meth:`load_state_dict`, the
    next ``iter()`` goes on from there: it reads the shards again up to that point and hands
    out nothing twice. Otherwise each ``iter()`` is a new pass over the epoch from its first
    sample, as a list's is (a DataLoader starts each epoch so); to go on after a ``break``
    or an error, load the state first: ``shards.load_state_dict(shards.state_dict())``.
    A sample counts as handed out once the iterator returned it, also if the loop that took
    it raised. The position never goes back within an iteration: while a resumed one passes
    over what was handed out, the state still says all of it was (an error while it reads
    those shards leaves the state as it was loaded). :meth:`set_epoch` to another epoch, or
    :meth:`load_state_dict`, during an iteration detaches it: the state describes the new
    epoch (or the loaded state) from then on, not that iteration.

    Shards that cannot be read (the store's retries spent) or are damaged raise, naming the
    shard; with ``max_failures=``, up to that many are skipped in each pass instead, each
    logged once as a WARNING on the ``feedline.source`` logger. A shard damaged part-way
    gives the samples before the damage (but the last, whose fields might go on past it).
    The state records the shards skipped so far and where each ended, so that a resumed pass
    skips them again, as they were skipped, and hands out nothing twice even if the store
    now answers.

    The ledger records each sample handed out by its place in the stream; a state whose
    position does not match it (resuming from it would repeat or lose samples) is refused
    with :class:`~feedline.LedgerError`, and so is an iteration that ran to its end without
    handing out each sample once. :meth:`ledger_stats` shows it. In a DataLoader's worker
    processes, each worker's copy keeps its own, saved with the loader's state.

    Args:
        store: A :class:`~feedline.RemoteStore` (shards are read whole with ``read_sync``,
            with its retries and checks) or a directory.
        keys: The shards' keys (or paths under the directory), in order.
        shuffle: Samples in the shuffle buffer (0: the shards' own order, and the shards in
            the given order). Shuffled samples are copied out of their shard, so that the
            buffer holds samples, not whole shards.
        seed: The shuffles' seed; each epoch (:meth:`set_epoch`) shuffles anew.
        rank, world_size: This rank's share of the shards: ``shards[rank::world_size]``.
            Default: from ``torch.distributed`` when it is initialised, else all of them.
        read_ahead: Shards read ahead of the one being walked.
        max_failures: Shards each pass may skip (unreadable or damaged), or ``None`` for
            any number; past it (and with the default, 0, at the first) the shard's error
            is raised, as it is when every shard of a pass fails without a sample. In a
            DataLoader's worker processes, each worker's pass has this budget.
        report_stall_after: Seconds a shard's read may keep the iteration waiting before it
            is reported, once, as a WARNING on the ``feedline.watchdog`` logger (the shard,
            the store's requests in flight, where busy threads stand); ``None``: never.

    """

    def __init__(
        self,
        store: Any,
        keys: Sequence[str],
        *,
        shuffle: int = 0,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        read_ahead: int = 2,
        max_failures: int | None = 0,
        report_stall_after: float | None = STALL_AFTER,
    ) -> None:
        self.shards = StoredSamples(store, keys)
        self.report_stall_after = check_after(report_stall_after)
        for name, value, least in (("shuffle", shuffle, 0), ("read_ahead", read_ahead, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigurationError(f"{name} must be an int >= {least}, got {value!r}")
        if max_failures is not None and (
            isinstance(max_failures, bool) or not isinstance(max_failures, int) or max_failures < 0
        ):
            raise ConfigurationError(
                f"max_failures must be an int >= 0 (shards a pass may skip) or None (any "
                f"number), got {max_failures!r}"
            )
        self.shuffle, self.seed, self.read_ahead = shuffle, seed, read_ahead
        self.max_failures = max_failures
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.epoch = 0
        self._pass = _Pass()  # the current (or last) iteration of self.epoch, or a loaded state

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for ``epoch`` from the next iteration on (from its first sample)."""
        if epoch != self.epoch:
            self.epoch, self._pass = epoch, _Pass()

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the samples of it handed out (in this process), the ledger, skips.

        The skips (``"skipped"``, where there are any) are the shards skipped, each with the
        samples it gave before its error. Plain data (it pickles and goes into JSON); the
        ledger is about a hundred bytes, as samples are handed out in the order it numbers
        them.
        """
        here = self._pass
        ledger = None if here.ledger is None else here.ledger.state_dict()
        state = {"epoch": self.epoch, "yielded": here.yielded, "ledger": ledger}
        if here.skipped:
            state["skipped"] = dict(here.skipped)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from ``state`` (from :meth:`state_dict`) at the next iteration.

        A state saved without a ledger (an older feedline) loads unchecked, and the
        iteration that goes on from it keeps none.

        Raises:
            ValueError: ``state`` is not a state :meth:`state_dict` returned.
            LedgerError: The state's position does not match the samples its ledger says
                were handed out: resuming from it would repeat or lose them.

        """
        epoch, yielded = _count(state, "epoch"), _count(state, "yielded")
        skipped = state.get("skipped", {})
        if not isinstance(skipped, dict) or not all(
            isinstance(k, str) and isinstance(n, int) and not isinstance(n, bool) and n >= 0
            for k, n in skipped.items()
        ):
            raise ValueError(
                f"not a TarShards state: 'skipped' must map shard keys to ints >= 0, got "
                f"{skipped!r} (pass the dict that TarShards.state_dict() returned)"
            )
        saved = state.get("ledger")
        ledger = None
        if saved is not None and ledger_check():
            ledger = Ledger(self._ledger_name(epoch))
            ledger.load_state_dict(saved)
            ledger.check_resume(yielded)
        self.epoch, self._pass = epoch, _Pass(yielded, ledger, resume=True, skipped=skipped)

    def ledger_stats(self) -> LedgerStats | None:
        """The current (or last) iteration's ledger: samples handed out, repeated, missing.

        ``planned`` (the samples of this process's stream) and ``missing`` are known once
        the iteration ran to its end. ``None`` where there is none: no iteration (nor
        loaded state) yet, one resumed from a state saved without a ledger, or
        ``FEEDLINE_LEDGER=0``. In a DataLoader with worker processes, the workers' copies
        keep theirs (in the loader's ``state_dict()["dataset_state"]``), not this one.
        """
        ledger = self._pass.ledger
        return None if ledger is None else ledger.stats()

    def my_shards(self) -> list[str]:
        """The shards this rank (and worker process) reads this epoch, in order."""
        keys = list(self.shards.keys)
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}:shards").shuffle(keys)
        keys = keys[self.rank :: self.world_size]
        worker = _worker()
        return keys if worker is None else keys[worker[0] :: worker[1]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        # A new pass, unless a loaded state waits: it takes the position from here (not at
        # the first next()), so that what comes later (set_epoch, load_state_dict) detaches
        # it rather than changing the epoch it walks.
        loaded = self._pass
        if loaded.resume:
            skip, ledger = loaded.yielded, loaded.ledger
            if ledger is None and skip == 0:
                ledger = self._new_ledger()
        else:
            skip, ledger = 0, self._new_ledger()
        here = self._pass = _Pass(skip, ledger, skipped=loaded.skipped if loaded.resume else {})
        return self._hand_out(here, skip, self.my_shards(), self.epoch)

    def _hand_out(
        self, here: _Pass, skip: int, keys: list[str], epoch: int
    ) -> Iterator[dict[str, Any]]:
        # The stream's samples, numbered by their place in it (the ledger's slots), past the
        # first ``skip`` (handed out before a resume). ``here.yielded`` is the position, a
        # count of its own, which the ledger checks.
        ledger = here.ledger
        total = 0
        here.replaying = skip > 0
        relayed = claim_ctrl_c()  # on the main thread: a Ctrl-C as a sample is counted waits
        try:
            for slot, sample in enumerate(self._shuffled(self._samples(keys, here), epoch)):
                total = slot + 1
                here.replaying = total < skip  # while the next sample is one handed out before
                if slot < skip:
                    here.yielded = _position_while_skipping(skip, total)
                    continue
                with CtrlCHeld():  # counted whole, and handed out before a Ctrl-C comes
                    here.yielded += 1
                    if ledger is not None:
                        ledger.deliver(slot)
                yield sample
            if ledger is not None:  # ran to its end (not after a break or an error)
                ledger.plan(total)
                ledger.check_resume(here.yielded)
                ledger.check_end()
        finally:
            if relayed:
                release_ctrl_c()

    def _new_ledger(self) -> Ledger | None:
        return Ledger(self._ledger_name(self.epoch)) if ledger_check() else None

    def _ledger_name(self, epoch: int) -> str:
        where = []
        if self.world_size > 1:
            where.append(f"rank {self.rank} of {self.world_size}")
        worker = _worker()
        if worker is not None:
            where.append(f"DataLoader worker {worker[0]} of {worker[1]}")
        return f"TarShards epoch {epoch}" + (f" ({', '.join(where)})" if where else "")

    def _samples(self, keys: list[str], here: _Pass) -> Iterator[dict[str, Any]]:
        # Each shard's samples in order, the next shards read meanwhile. A shard the pass
        # skipped before its state was saved gives the samples it gave then, and no more.
        place = {key: k for k, key in enumerate(self.shards.keys)}
        cuts = dict(here.skipped)
        upcoming = iter(keys)
        pending: collections.deque[tuple[str, Future[Any] | None]] = collections.deque()
        # Daemon threads: a loop left (break, an error, Ctrl-C) waits for no read under way.
        pool = Runners(max(self.read_ahead, 1), name="feedline-shard")

        def read_next() -> bool:
            key = next(upcoming, None)
            if key is None:
                return False
            unread = cuts.get(key) == 0  # skipped before any sample: not read again
            pending.append((key, None if unread else pool.submit(self.shards.read, place[key])))
            return True

        try:
            # The first shard alone: the shards after it would share its bandwidth and
            # delay the first samples; they are read while its samples go on.
            read_next()
            while pending:
                key, future = pending.popleft()
                walked, cut = 0, cuts.get(key)
                try:
                    data = None if future is None else self._await(key, future)
                    while len(pending) < self.read_ahead and read_next():
                        pass
                    if data is not None:
                        for sample in tar_samples(data, shard=key):
                            if walked == cut:
                                break
                            walked += 1
                            yield sample
                except Exception as error:
                    self._skip(here, key, walked, cut, error, len(keys))
                    while len(pending) < self.read_ahead and read_next():
                        pass
                if not pending:  # read_ahead=0: the next shard once this one is walked
                    read_next()
        finally:
            for _, future in pending:
                if future is not None:
                    future.cancel()  # not begun: never read; the others end on their own
            pool.close()

    def _skip(
        self, here: _Pass, key: str, walked: int, cut: int | None, error: Exception, shards: int
    ) -> None:
        # Skip the shard whose read or walk raised ``error`` after ``walked`` samples, or
        # raise it: past the budget, where skipping would change the samples handed out
        # before a resume (a shard that failed while the pass re-reads them), or where every
        # one of the pass's ``shards`` failed (a refused credential is no empty epoch).
        if walked == cut:  # skipped there before the state was saved: met where expected
            return
        if cut is not None or here.replaying:
            add_note(
                error,
                f"TarShards: shard {key!r} failed while a resumed pass re-read the samples "
                "handed out before its state was saved; skipping it now would repeat or lose "
                "samples, so the state stays as loaded: load it again to retry",
            )
            raise error
        skipped = len(here.skipped) + 1
        if skipped == shards and walked == 0 and not any(here.skipped.values()):
            add_note(error, f"TarShards: every shard of this pass ({shards}) failed")
            raise error
        if self.max_failures is not None and skipped > self.max_failures:
            if self.max_failures:
                add_note(
                    error,
                    f"TarShards: {skipped} shards failed in this pass, over "
                    f"max_failures={self.max_failures}",
                )
            raise error
        here.skipped[key] = walked
        budget = "" if self.max_failures is None else f" of max_failures={self.max_failures}"
        _log.warning(
            "TarShards epoch %d: skipped shard %r after %d sample(s) (%d skipped%s): %s: %s",
            self.epoch,
            key,
            walked,
            skipped,
            budget,
            type(error).__name__,
            error,
        )

    def _await(self, key: str, future: Future[Any]) -> Any:
        # A shard's bytes; a read that takes report_stall_after seconds is reported once
        # (with the store's requests in flight), and waited for.
        if self.report_stall_after is None:
            return future.result()
        began = time.monotonic()
        watch = StallWatch(f"{self!r}", self.report_stall_after, lambda: [f"reading shard {key!r}"])
        while True:
            try:
                return future.result(timeout=TICK)
            except FutureTimeout:
                watch.tick(began)

    def _shuffled(self, samples: Iterator[dict[str, Any]], epoch: int) -> Iterator[dict[str, Any]]:
        # A buffer of ``shuffle`` samples: each new one takes the place of a random one,
        # which is handed out (as WebDataset's shuffle), then the rest in a random order.
        worker = _worker()
        if not self.shuffle:
            if worker is not None:  # the samples cross to the parent process: they must pickle
                yield from map(_owned, samples)
            else:
                yield from samples
            return
        number = 0 if worker is None else worker[0]
        rng = random.Random(f"{self.seed}:{epoch}:{self.rank}:{number}")
        buffer: list[dict[str, Any]] = []
        for sample in samples:
            owned = _owned(sample)
            if len(buffer) < self.shuffle:
                buffer.append(owned)
                continue
            k = rng.randrange(len(buffer))
            buffer[k], owned = owned, buffer[k]
            yield owned
        rng.shuffle(buffer)
        yield from buffer

    def __repr__(self) -> str:
        return (
            f"TarShards({len(self.shards)} shards, shuffle={self.shuffle}, "
            f"rank {self.rank} of {self.world_size})"
        )


class _Pass:
    """One iteration over an epoch, or a loaded state that the next one goes on from.

    ``yielded``: the samples handed out (those before its resume included); ``ledger``:
    ``None`` where not checked; ``resume``: a loaded state, not taken by an iteration yet;
    ``skipped``: the shards skipped, each with the samples it gave first; ``replaying``: the
    next sample is one handed out before the resume.
    """

    __slots__ = ("ledger", "replaying", "resume", "skipped", "yielded")

    def __init__(
        self,
        yielded: int = 0,
        ledger: Ledger | None = None,
        resume: bool = False,
        skipped: dict[str, int] | None = None,
    ) -> None:
        self.yielded, self.ledger, self.resume = yielded, ledger, resume
        self.skipped = dict(skipped or {})
        self.replaying = False


def _position_while_skipping(handed_out: int, passed: int) -> int:
    """The position while a resumed iteration passes over the samples handed out before it.

    All ``handed_out`` of them, whether it has passed over them yet (``passed``) or not.

    (It was ``passed``, counted up from 0: a read error while passing over them left a state
    that said fewer had been handed out, and a resume from it repeated the rest. The tests
    put that back to see the ledger refuse it.)
    """
    return handed_out


def _count(state: Any, name: str) -> int:
    # A non-negative int of a saved state, or a ValueError that says what to pass.
    value = state.get(name) if isinstance(state, dict) else None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(
            f"not a TarShards state: {name!r} must be an int >= 0, got {value!r} (pass the "
            "dict that TarShards.state_dict() returned)"
        )
    return value


def _owned(sample: dict[str, Any]) -> dict[str, Any]:
    # The sample with its fields copied out of the shard.
    return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in sample.items()}


def _rank_and_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    if rank is None and world_size is None:
        try:
            import torch.distributed as dist
        except ImportError:  # pragma: no cover - torch is optional
            return 0, 1
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank(), dist.get_world_size()
        return 0, 1
    if (rank is None) != (world_size is None):
        raise ConfigurationError(
            f"give rank and world_size together (got rank={rank}, world_size={world_size}), "
            "or neither to take them from torch.distributed"
        )
    rank, world_size = rank or 0, world_size or 1
    if not 0 <= rank < world_size:
        raise ConfigurationError(f"rank must be in [0, world_size={world_size}), got {rank}")
    return rank, world_size


def _worker() -> tuple[int, int] | None:
    # This DataLoader worker process and how many there are (None outside workers).
    try:
        from torch.utils.data import get_worker_info
    except ImportError:  # pragma: no cover - torch is optional
        return None
    info = get_worker_info()
    return None if info is None else (info.id, info.num_workers)
