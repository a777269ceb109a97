"""The locality-aware loader: each rank's batches of the regular sequence, mostly from its cache.

Per step, every rank computes its part of the plan (:func:`plan_for`), gets the raw bytes of
what it keeps and sends (from its cache, else from storage, caching what it holds) and of
what it reads for itself, swaps samples with the other ranks (:class:`Exchange`, on a group
of its own), then transforms and collates its local batch. The reads are a feedline
pipeline several steps ahead of the training loop; the exchanges run on a thread of their
own (:class:`_Exchanger`), one step at a time, in order, on every rank, overlapping the
reads of later steps; a small pool transforms.

The first epoch is planned like the others: a sample's holder reads it from storage then
(and keeps it), so every sample is read once, by the rank that will hold it. With replicas,
the holder that reads a sample also sends it to its other holder in that epoch.
"""

from __future__ import annotations

import collections
import datetime
import logging
import os
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any, Generic, TypeVar

import numpy as np

from feedline._extras import require_torch
from feedline._grace import CtrlCHeld, claim_ctrl_c, close_relayed
from feedline._ledger import LedgerStats, ledger_check
from feedline._watchdog import STALL_AFTER, TICK, StallWatch, check_after
from feedline.errors import ConfigurationError, add_note
from feedline.pipeline import Pipeline, PipelineBuilder
from feedline.source import ObjectCache

from ._exchange import Exchange, ExchangeError, ExchangeTimeout, Received
from ._failures import FirstFailure
from ._ledgers import EpochLedger, Handout, handout, resumed, settle
from ._placement import holders, mix64, second_copies
from ._plan import RankPlan, plan_for, with_fills
from ._sequence import GlobalSequence

__all__ = ["DistributedLoader", "LoaderStats"]

_log = logging.getLogger("feedline.distributed")

T = TypeVar("T")

_ABANDON_SECONDS = 1.0
"""How long a loop left by an exception waits for its exchange thread to leave."""

_TAGS = 1 << 28
"""Exchange tags wrap here (gloo tags are ints; two per step)."""

_TIMEOUT = 1800.0
"""The default wait for a peer: torch.distributed's own default for its groups."""


@dataclass
class LoaderStats:
    """What one rank's loader has done so far.

    Attributes:
        storage_reads: Samples read from storage (``samples[i]``).
        storage_bytes: Their bytes.
        cache_hits: Samples found in this rank's cache.
        sent_samples: Samples sent to other ranks; ``sent_bytes``, their bytes.
        received_samples: Samples received; ``received_bytes``, their bytes.
        failures: Samples that could not be read and were left out (within the budget).
        copies_kept: Second copies received from other ranks and kept (with ``replicas``;
            they are counted in ``received_samples`` too).
        steps: Steps exchanged; ``beta_sum``, the sum of their exchanged shares of the
            global batch (the paper's beta): ``beta_sum / steps`` is the mean beta.
        ledger: This rank's epoch ledger, for the epoch under way or the last one: its share
            of the epoch's samples (``planned``), those handed out (``delivered``), failed
            within the budget, handed out twice (0 unless something is wrong), and, once
            the epoch ended, its share never handed out (0); ``None`` with
            ``FEEDLINE_LEDGER=0`` or before the first iteration. See the package README.
        ledger_checked: Epochs whose end checked, across the ranks, that every sample of
            their global batches was handed out (or failed) exactly once, by one rank.

    """

    storage_reads: int = 0
    storage_bytes: int = 0
    cache_hits: int = 0
    sent_samples: int = 0
    sent_bytes: int = 0
    received_samples: int = 0
    received_bytes: int = 0
    failures: int = 0
    copies_kept: int = 0
    steps: int = 0
    beta_sum: float = 0.0
    ledger: LedgerStats | None = None
    ledger_checked: int = 0

    @property
    def beta(self) -> float:
        """The mean exchanged share of the global batch over the steps so far."""
        return self.beta_sum / self.steps if self.steps else 0.0


@dataclass
class _Step:
    # One step on its way through the stages.
    epoch: int
    step: int
    plan: RankPlan
    beta: float
    members: np.ndarray  # the step's samples, all ranks together (then its fills)
    size: int = 0  # the step's own samples, at the start of members
    kept: list[Any] = field(default_factory=list)
    read: list[Any] = field(default_factory=list)
    sends: list[tuple[int, np.ndarray, list[Any]]] = field(default_factory=list)
    copies: list[tuple[int, np.ndarray, list[Any]]] = field(default_factory=list)
    received: Received = field(default_factory=dict)
    error: BaseException | None = None


class _Exchanger:
    """One iteration's exchanges, on a thread of their own, in step order.

    It takes each step's bytes from the read pipeline, swaps samples with the other ranks,
    and hands the step to a pool that transforms and collates it; the training loop takes
    the results in order. At most ``ahead`` steps wait for the loop, so when every rank
    leaves its loop after the same step (a ``break`` at the same place, as data-parallel
    training does), every rank has exchanged, or may exchange, the same steps: leaving, a
    rank completes exactly those (:meth:`stop` with ``drain``) and no peer waits for it.
    """

    def __init__(self, loader: DistributedLoader[Any], reads: Pipeline[_Step], ahead: int) -> None:
        self._loader = loader
        self._reads = reads
        self._ahead = ahead
        self.taken = 0  # steps the training loop took
        self._done = 0  # steps exchanged
        self._limit: int | None = None  # exchange steps below this, then stop (a drain)
        self._cond = threading.Condition()
        self._ready: collections.deque[Future[tuple[int, Any, Handout | None]] | None] = (
            collections.deque()
        )
        self._abandon = False
        self._pool = ThreadPoolExecutor(
            loader.transform_concurrency, thread_name_prefix="feedline-transform"
        )
        self._thread = threading.Thread(target=self._main, name="feedline-exchange", daemon=True)
        name = f"feedline DistributedLoader (rank {loader.rank})"
        reads.watch.name, reads.watch.after = f"{name}'s reads", loader._stall_after
        self.watch = StallWatch(
            name,
            loader._stall_after,
            describe=lambda: [
                f"steps taken by the loop: {self.taken}, exchanged with the peers: "
                f"{self._done}, ready for the loop: {len(self._ready)}"
                + (
                    ""
                    if self._limit is None
                    else f"; leaving the loop: exchanging up to step {self._limit} with the "
                    "peers first (every rank must leave its loop after the same step)"
                )
            ],
            progress=lambda: self._done,
        )

    def start(self) -> None:
        """Start the read pipeline and the exchanges."""
        self._reads.start()
        self._thread.start()

    def next(self) -> Future[tuple[int, Any, Handout | None]] | None:
        """The next step's result (``None``: the epoch is over)."""
        began = time.monotonic()
        with self._cond:
            while not self._ready:
                if not self._cond.wait(TICK):
                    self.watch.tick(began)
            ready = self._ready.popleft()
            self._cond.notify_all()
            return ready

    def _main(self) -> None:
        loader = self._loader
        try:
            while True:
                with self._cond:
                    # Room for the result, unless draining (nobody takes the results then).
                    while self._limit is None and not self._abandon:
                        if len(self._ready) < self._ahead:
                            break
                        self._cond.wait()
                    if self._stopping():
                        return
                try:
                    item = self._reads.get_item()
                except EOFError:
                    break
                # Even after a failed read (sent as missing): the peers wait for this step.
                loader._swap(item)
                loader._exchanged(item.beta)
                with self._cond:
                    self._done += 1
                    if self._limit is None:
                        self._ready.append(self._pool.submit(loader._finish, item))
                        self._cond.notify_all()
        except BaseException as error:
            if self._limit is not None:  # draining: nobody will take the error
                _log.warning("exchanges after the loop was left failed: %s", error)
            failed: Future[tuple[int, Any, Handout | None]] = Future()
            failed.set_exception(error)
            with self._cond:
                self._ready.append(failed)
                self._cond.notify_all()
            return
        with self._cond:
            self._ready.append(None)
            self._cond.notify_all()

    def _stopping(self) -> bool:
        # Under the lock: abandoned, or the drain is complete.
        return self._abandon or (self._limit is not None and self._done >= self._limit)

    def stop(self, drain: bool) -> None:
        """Stop; with ``drain``, after the steps the other ranks may exchange with this one."""
        with self._cond:
            if drain:
                self._limit = self.taken + self._ahead
            else:
                self._abandon = True
            self._ready.clear()
            self._cond.notify_all()
        # Draining waits for the last exchanges (their peers make them too): reported as a
        # stall if a peer keeps it waiting (one that left its loop at another step). Else
        # the thread leaves at once, unless a peer keeps it in an exchange (until timeout).
        if drain:
            began = time.monotonic()
            while self._thread.is_alive():
                self._thread.join(TICK)
                self.watch.tick(began)
        else:
            self._thread.join(_ABANDON_SECONDS)
        self._reads.stop()
        self._pool.shutdown(wait=True, cancel_futures=True)


class DistributedLoader(Generic[T]):
    """Each rank's local batches of the regular distributed sequence, mostly from its cache.

    Every global batch is exactly the one ``DistributedSampler`` and a ``DataLoader`` per
    rank would give (so are the gradients), but after the first epoch each rank trains on the
    samples of the batch it already holds, and the ranks exchange only the rest.

    Args:
        samples: A map-style dataset of raw samples: ``len(samples)`` and ``samples[i]``
            returning bytes (an object's body, a file's contents); see
            :class:`StoredSamples` for objects in a :class:`~feedline.RemoteStore` or files.
        batch_size: Samples per rank and step (the local batch).
        transform: Turns a sample's bytes into what the batch holds (decoding,
            augmentation), on the rank that trains on it; ``None``: the bytes as they are.
        collate_fn: Makes the batch from the transformed samples; default: PyTorch's
            ``default_collate`` (a list without torch).
        shuffle, seed, drop_last: As ``DistributedSampler``'s (and ``drop_last`` as the
            rank's ``DataLoader``'s too).
        rank, world_size: This rank and the number of ranks; default: from
            ``torch.distributed``, which must then be initialised (a world of one without).
        cache: Where this rank keeps the samples it holds: memory first, then the disk
            tier of a :class:`~feedline.source.ObjectCache` given a ``directory`` (kept
            across restarts). Default: 2 GiB in memory.
        cached_share: The share of its samples each rank keeps (the paper's alpha), when the
            cache cannot hold its whole share of the dataset (about ``len(samples) /
            world_size`` samples): a deterministic subset every rank computes alike; the rest
            is read from storage when a step needs it.
        replicas: Copies of each cached sample over the ranks' caches, from 1 to 2 (1.5: a
            hash-chosen half of them has a second holder): spare cache, about ``(replicas -
            1) * len(samples) / world_size`` samples per rank beyond a rank's share. Either
            holder may train on such a sample, and each step's assignment keeps as many
            samples as possible where they are held (an exact maximum flow), so far fewer
            travel between ranks. The second copies are sent by the holder that reads a
            sample, in the first epoch the loader iterates.
        prefetch: Steps prepared ahead of the training loop (values under 2 count as 2).
        read_concurrency: Reads (from storage or the cache) in flight at once.
        transform_concurrency: Threads that transform and collate steps, each step on one
            thread, at most ``prefetch`` steps at once (default: the cores, up to that). A
            transform that releases the GIL (feedline's decoders) uses that many cores.
        timeout: Seconds a rank waits for another's samples of a step before it raises (a
            rank that hangs or stopped iterating; one that died is reported at once). A rank
            that pauses its loop (a checkpoint, an evaluation on one rank) holds up the
            others' exchanges of the steps after the ones they took: the default, 30
            minutes, is torch.distributed's own.
        max_failures: Samples whose read may fail before the loader raises (an int, or a
            fraction of the samples); failed ones are left out of their batch. With 0, the
            first failure raises the read's own exception.
        report_stall_after: Seconds the training loop may wait for a step with nothing
            moving before the stall is logged, once, as a WARNING on ``feedline.watchdog``
            (the steps taken, exchanged and ready, where each busy thread stands: a read, an
            exchange with a peer); ``None``: never. ``timeout`` still raises.
        group: The process group the samples travel in; default: a new gloo group of all
            ranks, made here (every rank must construct its loader at the same point, as
            for any group), so that exchanges never interleave with the training's own
            collectives.

    """

    def __init__(
        self,
        samples: Any,
        *,
        batch_size: int,
        transform: Callable[[bytes], Any] | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        rank: int | None = None,
        world_size: int | None = None,
        cache: ObjectCache | None = None,
        cached_share: float = 1.0,
        replicas: float = 1.0,
        prefetch: int = 2,
        read_concurrency: int = 16,
        transform_concurrency: int | None = None,
        timeout: float = _TIMEOUT,
        max_failures: int | float | None = 0,
        group: Any = None,
        report_stall_after: float | None = STALL_AFTER,
    ) -> None:
        require_torch("feedline.distributed.DistributedLoader (it runs on torch.distributed)")
        if not hasattr(samples, "__len__") or not hasattr(samples, "__getitem__"):
            raise ConfigurationError(
                f"samples must be a map-style dataset of raw samples (len() and [i]), got "
                f"{type(samples).__name__}; wrap objects in a store with StoredSamples"
            )
        if not 0.0 <= cached_share <= 1.0:
            raise ConfigurationError(f"cached_share must be in [0, 1], got {cached_share!r}")
        if isinstance(replicas, bool) or not 1.0 <= replicas <= 2.0:
            raise ConfigurationError(
                f"replicas must be between 1 (one copy of each sample) and 2 (two), got "
                f"{replicas!r}"
            )
        for name, value, least in (
            ("prefetch", prefetch, 1),
            ("read_concurrency", read_concurrency, 1),
            (
                "transform_concurrency",
                1 if transform_concurrency is None else transform_concurrency,
                1,
            ),
            ("batch_size", batch_size, 1),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigurationError(f"{name} must be an int >= {least}, got {value!r}")
        if timeout <= 0:
            raise ConfigurationError(f"timeout must be > 0 seconds, got {timeout!r}")
        self.rank, self.world_size, exchange_group = _world(rank, world_size, group, timeout)
        # The group it made (ended by close(), or by the finalizer: a loader dropped without
        # close() kept its group's threads and sockets for good).
        self._own_groups = [exchange_group] if group is None and exchange_group is not None else []
        self.samples = samples
        self.batch_size = batch_size
        self._transform = transform
        self._collate = collate_fn or _default_collate()
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.cache = cache if cache is not None else ObjectCache(memory_bytes=2 << 30)
        self.cached_share = cached_share
        self.replicas = float(replicas)
        self.prefetch = max(2, prefetch)
        self._stall_after = check_after(report_stall_after)
        self.read_concurrency = read_concurrency
        self.transform_concurrency = transform_concurrency or min(
            self.prefetch, os.cpu_count() or 1
        )
        self._budget_limit = max_failures
        self._exchange = Exchange(exchange_group, self.rank, timeout)
        self._sequence = GlobalSequence(
            len(samples), self.world_size, batch_size, seed, shuffle, drop_last
        )
        self._holder, self._second = _holders(
            len(samples), self.world_size, seed, cached_share, self.replicas - 1.0
        )
        self._fill_epoch: int | None = None  # the epoch whose reads also fill the replicas
        self._ledgered = ledger_check()  # one setting for every rank: checked in _agree
        self._ledger: EpochLedger | None = None  # the epoch's under way (or the last one's)
        self._pending: EpochLedger | None = None  # a loaded state's, for the next iteration
        self._ledger_checked = 0
        if self.world_size > 1:
            token = self._agree(exchange_group)
            self._exchange.first_failure = FirstFailure.of_default_group(
                f"feedline/distributed/{token}/first-failure"
            )
        self._stats = LoaderStats()
        self._unreadable: set[int] = set()  # samples whose read failed within the budget
        self._flights: dict[int, Future[Any]] = {}  # samples being read, by index
        self._lock = threading.Lock()
        self._epoch = 0
        self._step = 0  # steps of self._epoch handed out
        self._skip = 0  # samples of the epoch's order consumed before an elastic restart
        self._resuming = False  # a state was loaded: the next iteration continues it
        self._pool = ThreadPoolExecutor(read_concurrency, thread_name_prefix="feedline-read")
        self._finalizer = weakref.finalize(self, _release, self._pool, self._own_groups)

    def _agree(self, group: Any) -> str:
        # Ranks that plan with different settings would exchange the wrong samples, or wait
        # for each other: compare them once, here. Returns rank 0's token, this loader's
        # name on every rank (its key in the store).
        import uuid

        import torch.distributed as dist

        mine = {
            "len(samples)": len(self.samples),
            "batch_size": self.batch_size,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "cached_share": self.cached_share,
            "replicas": self.replicas,
            "prefetch": self.prefetch,
            "ledger (FEEDLINE_LEDGER)": self._ledgered,  # the epoch's end is a collective
        }
        everyone: list[Any] = [None] * self.world_size
        dist.all_gather_object(everyone, {**mine, "token": uuid.uuid4().hex}, group=group)
        token = str(everyone[0].pop("token"))
        for other, theirs in enumerate(everyone):
            theirs.pop("token", None)
            differ = {k: (v, theirs.get(k)) for k, v in mine.items() if theirs.get(k) != v}
            if differ:
                shown = ", ".join(f"{k} {a!r} here, {b!r} there" for k, (a, b) in differ.items())
                raise ConfigurationError(
                    f"rank {self.rank}'s DistributedLoader differs from rank {other}'s: {shown}. "
                    "Every rank must build it over the same dataset with the same settings"
                )
        return token

    # -- the sequence --------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Use ``epoch``'s order from the next iteration on (``DistributedSampler.set_epoch``).

        The next iteration starts ``epoch`` from its first step, as a ``DataLoader`` over
        ``DistributedSampler`` does, also after a ``break`` in it; only a state loaded with
        :meth:`load_state_dict` in ``epoch`` goes on where it was. Without it, an iteration
        after a finished epoch takes the next epoch, and one after a ``break`` starts the
        same epoch again.
        """
        if epoch != self._epoch or self._step >= self._epoch_sequence().steps:
            self._epoch, self._step, self._skip = epoch, 0, 0
            self._resuming = False

    def _epoch_sequence(self) -> GlobalSequence:
        if not self._skip:
            return self._sequence
        return GlobalSequence(
            len(self.samples),
            self.world_size,
            self.batch_size,
            self.seed,
            self.shuffle,
            self.drop_last,
            skip=self._skip,
        )

    def __len__(self) -> int:
        """Steps in an epoch: the same on every rank."""
        return self._epoch_sequence().steps

    # -- iterating -----------------------------------------------------------------------------

    def __iter__(self) -> Iterator[T]:
        self._epoch, self._step, self._skip = _iteration_start(
            self._epoch, self._step, self._skip, self._epoch_sequence().steps, self._resuming
        )
        resuming, self._resuming = self._resuming, False
        sequence = self._epoch_sequence()
        epoch, first = self._epoch, self._step
        ledger = self._ledger_for(sequence, first, resuming)
        grid = sequence.grid(epoch)
        if self._fill_epoch is None:
            self._fill_epoch = epoch
        filling = epoch == self._fill_epoch
        copies = self._second is not None and filling
        fills = _to_fill(sequence, epoch) if filling else None
        spread_over = sequence.steps - first  # the fills, over this iteration's steps

        def steps() -> Iterator[_Step]:
            for k in range(first, sequence.steps):
                rows = sequence.step(epoch, k, grid)
                plan = plan_for(
                    rows,
                    self._holder,
                    self.rank,
                    self._second,
                    copies=copies,
                    positions=ledger is not None,
                )
                beta = plan.exchanged / rows.size if rows.size else 0.0
                members = rows.ravel()
                if fills is not None and fills.size:
                    extra = fills[k - first :: spread_over]
                    plan = with_fills(plan, extra, self._holder, self.rank, self._second)
                    members = np.concatenate([members, extra])
                yield _Step(epoch, k, plan, beta, members, rows.size)

        reads: Pipeline[_Step] = (
            PipelineBuilder[_Step]()
            .add_source(steps())
            .pipe(self._gather, concurrency=self.prefetch, output_order="input", name="read")
            .add_sink(self.prefetch)
            .build(max_failures=0)
        )
        return self._run(_Exchanger(self, reads, self.prefetch), ledger)

    def _ledger_for(
        self, sequence: GlobalSequence, first: int, resuming: bool
    ) -> EpochLedger | None:
        # The iteration's ledger: a loaded state's, when the iteration resumes it; else a new
        # pass over the epoch, from its start. Either way it must agree with where the
        # iteration starts (a new pass that does not start at step 0 would lose steps).
        pending, self._pending = self._pending, None
        if not self._ledgered:
            return None
        ledger = pending
        if (
            not resuming
            or ledger is None
            or ledger.epoch != self._epoch
            or ledger.sequence != sequence
        ):
            ledger = EpochLedger(self._epoch, sequence, self.rank)
        ledger.started = first
        self._ledger = ledger
        ledger.check_position(first, "the saved position" if resuming else "a new iteration")
        return ledger

    def _run(self, exchanger: _Exchanger, ledger: EpochLedger | None) -> Iterator[T]:
        exchanger.start()
        relayed = claim_ctrl_c()  # a Ctrl-C while a batch is counted comes after it
        leaving_early = True
        try:
            while True:
                done = exchanger.next()
                if done is None:
                    leaving_early = False
                    if ledger is not None:
                        self._settle(ledger)
                    return
                number, batch, out = done.result()
                with CtrlCHeld():  # the ledger's record and the step, whole
                    if ledger is not None and out is not None:
                        ledger.take(number, out)
                    self._step = number + 1
                    exchanger.taken += 1
                yield batch
        except GeneratorExit:
            raise  # a break, or the loop's own exception dropping the iterator: drain
        except BaseException as error:
            leaving_early = False  # the loader's error (the others fail too): no drain
            self._record_failure(error)
            raise
        finally:
            close_relayed(lambda: exchanger.stop(drain=leaving_early), relayed)

    def _settle(self, ledger: EpochLedger) -> None:
        # The epoch's end, on every rank at the same step: the ledgers of all ranks together.
        exchange = self._exchange if self.world_size > 1 else None
        if settle(ledger, exchange, self.world_size):
            with self._lock:
                self._ledger_checked += 1

    def _record_failure(self, error: BaseException) -> None:
        # This rank's own failure (a read, a damaged sample, Ctrl-C), before its connections
        # close: the peers that find it gone name it. A failure of the exchange is recorded
        # already (the first record stays), or deliberately not (a collective's closed
        # connection does not say which rank has gone): it is another rank's, not this one's.
        if self.world_size > 1 and not isinstance(error, ExchangeTimeout):
            lines = str(error).strip().splitlines()
            text = lines[0] if lines else ""
            self._exchange.first_failure.record(
                self.rank,
                f"rank {self.rank} raised {type(error).__name__}"
                + (f": {text}" if text else "")
                + f" (epoch {self._epoch}, step {self._step})",
            )

    def _gather(self, item: _Step) -> _Step:
        # The bytes of what this rank keeps and sends (its cache, else storage) and of what it
        # reads for itself. A sample that cannot be read is None (its sends still go, so
        # that no peer waits); the error, if over the budget, is raised after the exchange.
        plan = item.plan
        wanted = [plan.keep, plan.read, *(s for _, s in plan.sends), *(s for _, s in plan.copies)]
        wanted.append(plan.fills)  # into the cache only (_get keeps what it holds)
        flat = np.concatenate(wanted).tolist()
        held = [True] * len(flat)
        held[len(plan.keep) : len(plan.keep) + len(plan.read)] = [False] * len(plan.read)
        unique = dict(zip(flat, held, strict=True))  # a padded step may repeat a sample
        try:
            found = dict(
                zip(
                    unique, self._pool.map(self._get_or_error, unique, unique.values()), strict=True
                )
            )
        except BaseException as error:  # the pool was shut down (the loader closed)
            item.error = error
            found = {index: (None, None) for index in unique}
        got = []
        for index in flat:
            data, failure = found[index]
            got.append(data)
            if failure is not None and item.error is None:
                item.error = failure
        cursor = len(plan.keep) + len(plan.read)
        item.kept = got[: len(plan.keep)]
        item.read = got[len(plan.keep) : cursor]
        for dst, indices in plan.sends:
            item.sends.append((dst, indices, got[cursor : cursor + len(indices)]))
            cursor += len(indices)
        for dst, indices in plan.copies:
            item.copies.append((dst, indices, got[cursor : cursor + len(indices)]))
            cursor += len(indices)
        return item

    def _swap(self, item: _Step) -> None:
        # One message per peer: the samples it trains on, then the copies it keeps.
        plan = item.plan
        if not plan.copies and not plan.copies_in:
            item.received = self._exchange.swap(
                _tag(item.epoch, item.step), _where(item), item.sends, plan.receives
            )
            _check_members(item, item.received)
            return
        outgoing: dict[int, tuple[list[np.ndarray], list[Any]]] = {}
        for dst, indices, got in [*item.sends, *item.copies]:
            parts = outgoing.setdefault(dst, ([], []))
            parts[0].append(indices)
            parts[1].extend(got)
        sends = [(dst, np.concatenate(i), d) for dst, (i, d) in sorted(outgoing.items())]
        trained = dict(plan.receives)
        incoming = collections.Counter(trained)
        incoming.update(dict(plan.copies_in))
        received = self._exchange.swap(
            _tag(item.epoch, item.step), _where(item), sends, sorted(incoming.items())
        )
        _check_members(item, received)
        kept = 0
        for src, samples in received.items():
            count = trained.get(src, 0)
            for index, data in samples[count:]:
                if data is not None:
                    self.cache.put(str(index), data)
                    kept += 1
            if count:
                item.received[src] = samples[:count]
        with self._lock:
            self._stats.copies_kept += kept

    def _get_or_error(self, index: int, held: bool) -> tuple[bytes | None, BaseException | None]:
        # Steps are gathered several at once, and padding repeats samples across them: a
        # sample being read is waited for, not read again.
        with self._lock:
            flight = self._flights.get(index)
            mine = flight is None
            if flight is None:
                flight = self._flights[index] = Future()
        if not mine:
            return flight.result()  # type: ignore[no-any-return]
        try:
            result: tuple[bytes | None, BaseException | None] = (self._get(index, held), None)
        except BaseException as error:
            result = (None, error)
        with self._lock:
            del self._flights[index]
        flight.set_result(result)
        return result

    def _exchanged(self, beta: float) -> None:
        exchange = self._exchange
        with self._lock:
            self._stats.steps += 1
            self._stats.beta_sum += beta
            self._stats.sent_samples = exchange.sent_samples
            self._stats.sent_bytes = exchange.sent_bytes
            self._stats.received_samples = exchange.received_samples
            self._stats.received_bytes = exchange.received_bytes

    def _get(self, index: int, held: bool) -> bytes | None:
        if index in self._unreadable:
            return None  # failed before and counted then: left out again, not read again
        key = str(index)
        if held:
            data = self.cache.get(key)
            if data is not None:
                with self._lock:
                    self._stats.cache_hits += 1
                return data
        try:
            raw = self.samples[index]
            data = bytes(raw) if not isinstance(raw, bytes) else raw
        except Exception as error:
            self._failed(index, error)
            return None
        with self._lock:
            self._stats.storage_reads += 1
            self._stats.storage_bytes += len(data)
        if held:
            self.cache.put(key, data)
        return data

    def _failed(self, index: int, error: Exception) -> None:
        from feedline._failures import FailureBudget

        with self._lock:
            self._stats.failures += 1
            stats = self._stats
            failures, seen = stats.failures, stats.storage_reads + stats.cache_hits + 1
        budget = FailureBudget(self._budget_limit)
        if self._budget_limit == 0 or budget.exceeded(failures, seen):
            add_note(
                error,
                f"feedline.distributed: reading sample {index} on rank {self.rank} "
                f"({failures} failure(s), budget {budget.description})",
            )
            raise error
        self._unreadable.add(index)
        _log.warning("sample %d could not be read and is left out: %s", index, error)

    def _finish(self, item: _Step) -> tuple[int, Any, Handout | None]:
        # The local batch: kept, read, then received (by source rank), transformed, collated;
        # with the ledger, where its samples stand in the step.
        if item.error is not None:
            raise item.error
        raw = list(item.kept) + list(item.read)
        for src in sorted(item.received):
            raw += [data for _, data in item.received[src]]
        present = [data for data in raw if data is not None]
        plan = item.plan
        indices = [plan.keep, plan.read]
        for src in sorted(item.received):
            indices.append(np.array([i for i, _ in item.received[src]], dtype=np.int64))
        order = np.concatenate(indices)  # each raw sample's index
        out = None
        if self._ledgered:
            mask = None if len(present) == len(raw) else np.array([d is not None for d in raw])
            members = item.members[: item.size]
            out = handout(members, plan.positions, order, mask)
        transform = self._transform
        if transform is None:
            return item.step, self._collate(present), out
        values = []
        named = (int(i) for i, data in zip(order, raw, strict=True) if data is not None)
        for index, data in zip(named, present, strict=True):
            try:
                values.append(transform(data))
            except Exception as error:
                add_note(
                    error,
                    f"raised by the transform of sample {index} on rank {self.rank} "
                    f"(epoch {self._epoch}, step {item.step})",
                )
                raise
        return item.step, self._collate(values), out

    # -- state ---------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the loader is: the epoch and the steps of it handed out (JSON-friendly).

        Taken after a ``break`` (or an exception in the loop), it describes the last batch
        handed out: a resumed run continues with the next one. Mid-epoch it holds this
        rank's epoch ledger too (``"ledger"``), which :meth:`load_state_dict` checks the
        position against; the rest is the same on every rank.
        """
        sequence = self._epoch_sequence()
        epoch, step, skip = self._epoch, self._step, self._skip
        if step >= sequence.steps:  # finished: the next epoch, from its start
            epoch, step, skip = epoch + 1, 0, 0
            sequence = self._sequence
        trained = min(step * self.batch_size, sequence.per_rank) * self.world_size
        consumed = min(len(self.samples), skip + trained)  # padding repeats, not new
        ledger = self._pending if self._resuming else self._ledger
        if ledger is not None and (ledger.epoch, ledger.sequence) != (epoch, sequence):
            ledger = None  # another epoch's (or a finished one's)
        return {
            "epoch": epoch,
            "step": step,
            "consumed": consumed,
            "world_size": self.world_size,
            "batch_size": self.batch_size,
            "size": len(self.samples),
            "seed": self.seed,
            "skip": skip,
            "ledger": None if ledger is None else ledger.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (from :meth:`state_dict`, of any rank).

        With the same world size and batch size, exactly where it was; with others, the same
        epoch's order from the first sample not yet trained on (nothing lost or repeated).

        Raises:
            ConfigurationError: The state is of another dataset or seed.
            LedgerError: The state's position is not where its epoch's ledger says the
                epoch stood: resuming from it would repeat or lose samples.

        """
        if state.get("size") != len(self.samples) or state.get("seed") != self.seed:
            raise ConfigurationError(
                f"this state is of another dataset or seed (size {state.get('size')}, seed "
                f"{state.get('seed')}; this loader: {len(self.samples)}, {self.seed})"
            )
        same = state["world_size"] == self.world_size and state["batch_size"] == self.batch_size
        skip = int(state.get("skip", 0)) if same else int(state["consumed"])
        pending = None
        if self._ledgered:
            now = replace(self._sequence, skip=skip)
            pending = resumed(state, now, self.rank)  # LedgerError before anything changes
        self._epoch = int(state["epoch"])
        self._skip, self._step = skip, int(state["step"]) if same else 0
        self._pending = pending
        self._resuming = True

    # -- the rest ------------------------------------------------------------------------------

    def stats(self) -> LoaderStats:
        """A copy of what this rank's loader has done so far, with its epoch ledger's counts."""
        with self._lock:
            copy = LoaderStats(**self._stats.__dict__)
            copy.ledger_checked = self._ledger_checked
        # unlocked: the ledger's one writer is the training loop's thread, which calls this
        # too; from another thread the counts may be a batch behind.
        ledger = self._ledger
        if ledger is not None:
            copy.ledger = ledger.stats()
        return copy

    def close(self) -> None:
        """Stop the read threads and wait for them, and end the group it made. Idempotent."""
        self._finalizer.detach()
        self._pool.shutdown(wait=True)
        _release(self._pool, self._own_groups)

    def __enter__(self) -> DistributedLoader[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _iteration_start(
    epoch: int, step: int, skip: int, steps: int, resuming: bool
) -> tuple[int, int, int]:
    # Where a new iteration starts, as (epoch, step, skip), from where the last one left
    # (``step`` of an epoch of ``steps``). A finished epoch: the next one. A state just
    # loaded: where it was. Else, a break or an exception in the loop: the epoch again
    # from its start, as a DataLoader over DistributedSampler starts it (``state_dict()``
    # still says where the break was, for a checkpoint).
    if step >= steps:
        return epoch + 1, 0, 0
    if resuming:
        return epoch, step, skip
    return epoch, 0, 0


def _to_fill(sequence: GlobalSequence, epoch: int) -> np.ndarray:
    # The samples the first epoch leaves out (drop_last), read into their holders' caches in
    # it too: shuffled, the later epochs train on most of them, and would read them then.
    # In order, the same ones are left out of every epoch: none.
    if not sequence.shuffle:
        return np.empty(0, dtype=np.int64)
    return sequence.left_out(epoch)


def _tag(epoch: int, step: int) -> int:
    # The same on every rank for the same step; a break drains the exchanges under way, so
    # a step's tag may be used again when it is iterated again.
    return (epoch * 1_000_003 + step) % _TAGS


def _check_members(item: _Step, received: Received) -> None:
    # A header with a sample of another step (intact bytes, a wrong plan) would train on it.
    for src, samples in received.items():
        indices = np.fromiter((i for i, _ in samples), dtype=np.int64, count=len(samples))
        strangers = indices[~np.isin(indices, item.members)]
        if strangers.size:
            raise ExchangeError(
                f"rank {src} sent sample {int(strangers[0])}, which is not in {_where(item)}: "
                "the ranks plan differently (another dataset, seed or version on that rank)"
            )


def _where(item: _Step) -> str:
    return f"epoch {item.epoch}, step {item.step}"


def _holders(
    size: int, world: int, seed: int, share: float, spare: float
) -> tuple[np.ndarray, np.ndarray | None]:
    # Each sample's holder, or -1 where the holder does not keep it (outside cached_share),
    # and, with spare cache, each sample's second holder (None without).
    replicated = spare > 0 and world > 1
    placed = holders(size, world, seed, 2 if replicated else 1)
    first = placed[0]
    if share < 1.0:
        draw = mix64(np.arange(size, dtype=np.uint64), seed ^ 0xCAC4E) >> np.uint64(11)
        kept = draw.astype(np.float64) / float(1 << 53) < share
        placed[0] = first = np.where(kept, first, -1).astype(first.dtype)
    return first, second_copies(placed, seed, spare) if replicated else None


def _release(pool: ThreadPoolExecutor, groups: list[Any]) -> None:
    """Stop the read threads (without waiting) and end the groups in ``groups``."""
    pool.shutdown(wait=False)
    while groups:
        group = groups.pop()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group(group)


def _world(
    rank: int | None, world_size: int | None, group: Any, timeout: float
) -> tuple[int, int, Any]:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency of this package's users
        dist = None  # type: ignore[assignment]
    ready = dist is not None and dist.is_available() and dist.is_initialized()
    if not ready:
        if rank not in (None, 0):
            raise ConfigurationError(
                f"rank={rank} needs torch.distributed: call "
                "torch.distributed.init_process_group() first (torchrun sets its variables)"
            )
        if (world_size or 1) != 1:
            raise ConfigurationError(
                f"world_size={world_size} needs torch.distributed: call "
                "torch.distributed.init_process_group() first (torchrun sets its variables)"
            )
        return rank or 0, 1, None
    actual_rank, actual_world = dist.get_rank(), dist.get_world_size()
    if (rank is not None and rank != actual_rank) or (
        world_size is not None and world_size != actual_world
    ):
        raise ConfigurationError(
            f"rank={rank}, world_size={world_size} differ from torch.distributed's "
            f"({actual_rank} of {actual_world}); leave them out to use its values"
        )
    if group is None and actual_world > 1:
        # With the loader's timeout: its making waits for every rank, and a collective a
        # failed rank left in its thread would otherwise hold the process at exit (gloo
        # joins it) for torch's default of 30 minutes.
        try:
            group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        except dist.DistStoreError as error:  # (it names no rank)
            raise ExchangeTimeout(
                f"rank {actual_rank}: not every rank of {actual_world} made its "
                f"DistributedLoader within timeout={timeout:g} s ({error}); each rank must "
                "make it at the same point (one may have died, or be elsewhere)"
            ) from error
    return actual_rank, actual_world, group


def _default_collate() -> Callable[[list[Any]], Any]:
    try:
        from torch.utils.data import default_collate
    except ImportError:  # pragma: no cover - without torch: the list as it is
        return list
    return default_collate
