"""One epoch of a ``feedline.DataLoader``: the pipeline that fetches, collates and hands out.

:class:`EpochIterator` is what ``iter(loader)`` returns. It draws the epoch's seeds as
PyTorch's iterator does, builds the pipeline (batch sampler -> fetch -> drop failed items ->
collate_fn -> [pin memory] -> consumer; with workers, their batches instead of the fetch),
counts what it hands out into the loader's :class:`~._state.Position` (for
``state_dict()``), and stops its threads when it ends, breaks or is dropped.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from feedline._cores import usable_cores
from feedline._extras import require_torch
from feedline._grace import Closing, CtrlCHeld, claim_ctrl_c, release_ctrl_c
from feedline._ledger import ledger_check
from feedline.errors import ConfigurationError, add_note
from feedline.pipeline import Pipeline, PipelineBuilder, PipelineStats

from ._ahead import FetchAhead
from ._fetch import BatchFetcher, Collated, FailureTally, Task
from ._gather import StateReport, StreamMark
from ._indices import index_iterator
from ._ledgers import LoaderLedger, stream_batch_taken
from ._move import Window, decide
from ._pool import thread_times
from ._rewind import GeneratorRewind, sampler_generators
from ._seeds import RngWatch, next_only
from ._state import (
    Position,
    decode_rng,
    derived_seed,
    is_stateful,
    saved_dataset_states,
    start_dataset,
    state_reporter,
)

if TYPE_CHECKING:
    from ._loader import DataLoader

__all__ = ["EpochIterator"]

T = TypeVar("T")
_log = logging.getLogger("feedline.loader")
_SKIP = object()
_WAITED = 0.001
"""Seconds ``get_item`` may take before the consumer counts as having waited for a batch."""


class _Abort:
    """A batch that raises instead: ``error``, for batch ``number``.

    A dataset's or ``collate_fn``'s own exception is raised for its batch and the epoch goes
    on (as PyTorch's iterator: a loop that catches it gets the next batch); a spent failure
    budget, or an iterable dataset's stream that raised (``number`` None), ends the epoch.
    """

    __slots__ = ("dataset_state", "error", "number")

    def __init__(
        self, error: BaseException, number: int | None = None, dataset_state: Any = None
    ) -> None:
        self.error = error
        self.number = number
        self.dataset_state = dataset_state


def _pin(torch: Any, data: Any) -> Any:
    if isinstance(data, torch.Tensor):
        return data.pin_memory()
    if isinstance(data, dict):
        return type(data)({k: _pin(torch, v) for k, v in data.items()})
    if isinstance(data, tuple) and hasattr(data, "_fields"):
        return type(data)(*(_pin(torch, v) for v in data))
    if isinstance(data, list | tuple):
        return type(data)(_pin(torch, v) for v in data)
    return data


class _Finisher:
    """The collate stage: drops failed items, then collates.

    It holds no reference to the iterator, so dropping the iterator stops its pipeline at once
    (no reference cycle to wait for the garbage collector). Errors come out as :class:`_Abort`
    so that the consumer raises them as they are (PyTorch re-raises ``collate_fn``'s own
    exception), not wrapped by the pipeline.
    """

    def __init__(self, tally: FailureTally, collate_fn: Callable[[Any], Any], auto: bool) -> None:
        self.tally = tally
        self._collate_fn = collate_fn
        self._auto = auto

    def __call__(self, fetched: tuple[int, Any, Any]) -> Any:
        number, items, dataset_state = fetched
        if isinstance(items, _Abort):  # the dataset's iterator raised
            return items
        if isinstance(items, StateReport):  # a worker's stream ended: no batch, a state
            return fetched
        if isinstance(items, Collated):  # collated in a worker process
            return self._collated(number, items, dataset_state)
        try:
            good = self.tally.keep(items)
        except Exception as error:  # the dataset's own error, or the failure budget is spent
            return self._failed(error, number, dataset_state)
        if items and not good:  # every item failed (an empty batch is collated, as PyTorch)
            return number, _SKIP, dataset_state
        try:
            return number, self._collate_fn(good if self._auto else good[0]), dataset_state
        except Exception as error:
            add_note(error, f"feedline.DataLoader: raised by collate_fn on batch {number}")
            return _Abort(error, number, dataset_state)

    def _failed(self, error: Exception, number: int, dataset_state: Any) -> _Abort:
        # Without a budget, the item's own exception: its batch raises, the epoch goes on.
        if self.tally.strict:
            return _Abort(error, number, dataset_state)
        return _Abort(error)

    def _collated(self, number: int, collated: Collated, dataset_state: Any) -> Any:
        try:
            self.tally.account(collated.failed, collated.size)
        except Exception as error:
            return self._failed(error, number, dataset_state)
        if collated.drew:
            RngWatch.warn(stacklevel=5, where="on several threads in each worker process")
        if collated.message:  # collate_fn raised in the worker
            raised = collated.error or RuntimeError(collated.message.strip().splitlines()[-1])
            add_note(raised, "Original traceback:\n" + collated.message)
            return _Abort(raised, number, dataset_state)
        if collated.size and len(collated.failed) == collated.size:  # every item failed
            return number, _SKIP, dataset_state
        return number, collated.batch, dataset_state  # None, too, if collate_fn returned it


def _next_item(
    pipeline: Pipeline[Any] | _Direct,
    fetcher: BatchFetcher | None,
    timeout: float | None,
    asked: float,
) -> Any:
    """The pipeline's next item, asked for at ``asked`` (perf_counter).

    A consumer that has waited :data:`_WAITED` for it says so to the fetcher, which then
    draws batches past ``prefetch_factor`` (see ``_ahead.py``). A function, not a
    method: a traceback through it holds no iterator (its workers end when it is dropped).
    """
    if fetcher is None or fetcher.ahead is None or (timeout is not None and timeout <= _WAITED):
        return pipeline.get_item(timeout=timeout)
    try:
        return pipeline.get_item(timeout=_WAITED)
    except TimeoutError:
        fetcher.consumer_waits()
    if timeout is not None:
        timeout = max(0.0, asked + timeout - time.perf_counter())
    return pipeline.get_item(timeout=timeout)


def _cpu_wanted() -> float:
    """The calling thread's seconds on a core, or runnable and queued for one, so far."""
    times = thread_times()
    return time.thread_time() if times is None else times[0] + times[1]


class EpochIterator(Generic[T]):
    """One epoch of a DataLoader."""

    def __init__(self, loader: DataLoader[T], state: dict[str, Any] | None) -> None:
        torch = require_torch("feedline.DataLoader")
        tl = loader._torch_loader
        generator = tl.generator
        if state is not None:
            rng = decode_rng(torch, state["rng_state"])
            if generator is not None:
                generator.set_state(rng)
            else:
                torch.set_rng_state(rng)
        skip = 0 if state is None else int(state["batches_yielded"])
        position = Position(
            generator.get_state() if generator is not None else torch.get_rng_state(),
            yielded=skip,
            ahead=set() if state is None else set(state["yielded_ahead"]),
        )
        # The loader keeps the position, so that its state_dict() describes this epoch even
        # after this iterator is dropped.
        self.position = loader._position = position
        position.ledger = _ledger(loader, state)
        # A strong reference: ``for batch in DataLoader(...)`` drops the loader at once, and
        # its worker processes must live until the epoch ends.
        self._loader: DataLoader[T] | None = loader
        self._length = tl.__len__  # not the loader: a closed iterator holds none
        self._timeout = tl.timeout or None
        # len(loader) of an iterable dataset, if asked: more batches than that are warned
        # of, as PyTorch's iterator does.
        self._len_called = tl._IterableDataset_len_called if loader._iterable else None
        self._closed = False
        self._in_del = False  # closed by __del__: an exception raised there is lost
        self._superseded = False
        self._lock = threading.Lock()
        # The sampler's own state after each batch drawn, until that batch is handed out.
        self._sampler_states: dict[int, Any] = {}
        # The sampler's error, if it raised: raised once the batches drawn before it are out.
        self._sampler_failed: list[Exception] = []
        # The random generators the sampler draws from (generator=), and their states after
        # each batch drawn: an epoch left part-way puts them back where PyTorch's iterator,
        # which draws no batch ahead, would have left them.
        self._rewinder = GeneratorRewind(sampler_generators(tl))
        dataset_state = saved_dataset_states(
            state, fresh_workers=tl.num_workers > 0 and not tl.persistent_workers
        )
        self._between = dataset_state is not None and bool(state and state["finished"])
        if self._between and tl.num_workers == 0 and is_stateful(tl.dataset):
            # Where the dataset lives on: before the epoch's first draws, as in the loop
            # that saved it (its load_state_dict() may set the generators they draw from).
            assert dataset_state is not None
            tl.dataset.load_state_dict(copy.deepcopy(dataset_state[0]))
            dataset_state = None  # loaded: the epoch starts from the dataset as it is
        if is_stateful(tl.dataset):
            # Loaded where torchdata loads them: in each worker, after its seeding and
            # worker_init_fn; here, once the sampler started (see start_dataset). Then
            # each one's state as the epoch starts, after each batch and at the end.
            slots = max(1, int(tl.num_workers))
            if dataset_state is not None and len(dataset_state) != slots:
                saved = len(dataset_state)
                raise ConfigurationError(
                    f"this state was saved with num_workers={'0 or 1' if saved == 1 else saved}"
                    f" (it holds the dataset's state in each process) and this loader has "
                    f"num_workers={tl.num_workers}: each worker's copy of the dataset resumes "
                    "from its own state; resume with the same num_workers"
                )
            position.dataset_states = (
                list(dataset_state) if dataset_state is not None else [None] * slots
            )
            # Loaded after iter() only mid-epoch: a state saved at the end comes before it.
            position.dataset_iterates = (
                state is not None and bool(state["dataset_iterates"]) and not self._between
            )
        sampler = _stateful_sampler(tl)
        sampler_state = None if state is None else state["sampler_state"]
        if sampler is not None and sampler_state is not None:
            # It resumes itself (nothing to skip), from a copy it may keep and change.
            sampler.load_state_dict(copy.deepcopy(sampler_state))
            position.sampler_state = sampler_state
        # The same draws, in the same order, as PyTorch's iterator: sampler, then base seed.
        sampler_iter = index_iterator(tl._index_sampler)
        chain = _seed_chain(loader, state)
        if chain is not None and chain[1] > 0:
            base_seed = derived_seed(*chain)  # persistent workers: PyTorch draws it once
        else:
            base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
            if tl.persistent_workers and tl.num_workers > 0:
                chain = (base_seed, 0)
        loader._seed_chain = position.seed_chain = chain
        self._base_seed = base_seed
        # num_workers="auto" (or 0, for its hint): windows of batches measured, and the
        # worker processes fetching is moving to (0: back to threads) at the next boundary.
        self._window: Window | None = None
        self._moving: int | None = None
        self._part_taken = 0  # items taken from the part of the epoch fetching now
        self._took_last: tuple[float, bool, float | None, float | None] | None = None
        # The loader's placement as the epoch started (num_workers set meanwhile takes
        # effect at the next epoch).
        self._placement = loader._placement
        self._gate: _Gate | None = None
        self._finish = _Finisher(
            FailureTally(loader.max_failures), tl.collate_fn, bool(tl._auto_collation)
        )
        self._fetcher: BatchFetcher | None = None
        # When the consumer asked for its last batch (None: not yet, or it waited for that
        # one), and its thread's CPU time then.
        self._left: tuple[float | None, float] = (None, 0.0)
        self._tasks: _Releasable | None = None
        self._first_pending: BatchFetcher | None = None
        concurrent = loader._fetch.threads > 1 and tl.num_workers == 0 and not loader._iterable
        self._watch: RngWatch | None = RngWatch() if concurrent else None
        self._pin_pool: ThreadPoolExecutor | None = None
        replay = skip if sampler_state is None else 0
        builder: PipelineBuilder[Any] = PipelineBuilder()
        epoch = None
        if loader._iterable and state is not None:
            _check_stream_workers(state, tl.num_workers)
        if loader._iterable and tl.num_workers > 0:
            # Each worker iterates its copy (its share, by get_worker_info()); after a
            # resume, each draws again the batches it had handed out.
            taken = None if state is None else state["worker_batches"]
            position.worker_batches = list(taken or [0] * tl.num_workers)
            position.worker_turn = 0 if state is None else int(state["worker_turn"])
            epoch = loader._worker_set().stream_epoch(
                base_seed,
                dataset_state,
                list(position.worker_batches),
                position.worker_turn,
                start=skip,
                iterates=position.dataset_iterates,
                report=None if position.dataset_states is None else state_reporter(position),
            )
        elif loader._iterable:
            self._add_iterable_source(builder, tl, replay, dataset_state, loader.in_flight)
        else:
            epoch = self._add_map_source(
                builder, loader, sampler_iter, skip, replay, base_seed, sampler, dataset_state
            )
        self._pipeline: Pipeline[Any] | _Direct = self._serve(builder, loader, epoch)
        self._finalizer = self._finalize()
        self._pipeline.start()
        self._ctrl_c = claim_ctrl_c()  # a Ctrl-C while a batch is counted comes after it

    def _serve(
        self, builder: PipelineBuilder[Any], loader: DataLoader[T], epoch: Any
    ) -> Pipeline[Any] | _Direct:
        # What the consumer takes its batches from: the workers' ``epoch`` straight, or the
        # pipeline ``builder`` holds (with a fetch stage, or the workers' epoch as its
        # source), finished by collation and pinning.
        if epoch is not None and not loader._pin:
            # The workers fetch and collate; this thread takes their batches itself, as
            # PyTorch's iterator does: a pipeline's threads would only hand them over (and
            # take the cores from the workers while they start: 5-10 ms to the first batch).
            return _Direct(epoch, self._finish)
        if epoch is not None:
            # The workers' batches: a short queue of whole batches, which does not grow.
            builder.add_source(epoch, buffer_size=max(2, loader.in_flight))
        # Whole batches on to pinning: a short queue, which does not grow either.
        builder.pipe(self._finish, name="collate_fn", buffer_size=max(2, loader.in_flight))
        if loader._pin:
            self._pin_pool = ThreadPoolExecutor(1, thread_name_prefix="feedline-pin")
            builder.pipe(
                functools.partial(_pin_numbered, require_torch("pin_memory")),
                executor=self._pin_pool,
                name="pin_memory",
            )
        builder.add_sink(loader.in_flight)
        pipeline = builder.build(max_failures=0)
        self._watch_pipeline(pipeline, loader, epoch is not None)
        return pipeline

    def _finalize(self) -> weakref.finalize[Any, Any]:
        # Stops what the epoch runs now when the iterator is dropped.
        return weakref.finalize(
            self,
            EpochIterator._shutdown,
            self._pipeline,
            self._fetcher,
            self._pin_pool,
            self._tasks,
            self._finish.tally,
        )

    def _add_map_source(
        self,
        builder: PipelineBuilder[Any],
        loader: DataLoader[T],
        sampler_iter: Iterator[Any],
        skip: int,
        replay: int,
        base_seed: int,
        sampler: Any,
        dataset_state: list[Any] | None,
    ) -> Any:
        # With workers, returns their epoch (the source of the batches); else adds the
        # source and the fetch stage to ``builder`` and returns None.
        tl = loader._torch_loader
        auto = tl._auto_collation
        # A batch sampler may yield tensors or arrays of indices (``randperm(n).split(b)``):
        # a list of their elements, as PyTorch's fetcher takes them one by one.
        batches = ((b if type(b) is list else list(b)) if auto else [b] for b in sampler_iter)
        # A function, not a method: the pipeline holds its source, and must not hold this
        # iterator (dropping the iterator stops the pipeline).
        tasks = _numbered(
            batches,
            skip,
            replay,
            sampler,
            frozenset(self.position.ahead),
            self._sampler_states,
            self._rewinder,
            self.position.ledger,
            self._sampler_failed,
        )
        workers = loader._fetch_workers()
        if workers > 0:
            loader._worker_set().start(base_seed, count=1)  # before the sampler's first draw
        first = list(itertools.islice(tasks, 1))  # the sampler draws its seed now, here
        self._tasks = _Releasable(itertools.chain(first, tasks))
        gate = self._gate = _Gate(self._tasks)
        placement = loader._placement
        measure = False
        if placement is not None and (placement.auto or not placement.hinted):
            if placement.stays is None:  # (a dataset the workers could not take stays)
                placement.stays = _stays(tl.dataset)
            measure = placement.stays is None
            said = f"fetch: stays on threads: {placement.stays}"
            if placement.auto and placement.stays is not None and said not in placement.log:
                placement.note(said)
        if workers > 0:
            # (a trial the last epoch ended in is judged on an ordinary window: an epoch too
            # short for a trial's would never judge it)
            self._window = self._new_window(workers) if measure else None
            report = None if self.position.dataset_states is None else state_reporter(self.position)
            # A state saved between epochs: persistent workers go on with their datasets'
            # states into an epoch seeded anew (see WorkerSet.epoch).
            return loader._worker_set().epoch(
                gate.view(), base_seed, dataset_state, report, between=self._between, start=skip
            )
        start_dataset(tl.dataset, self.position, dataset_state)
        self._fetch_stage(builder, loader, gate.view(), first=True)
        self._window = self._new_window(workers) if measure else None
        return None

    def _fetch_stage(
        self,
        builder: PipelineBuilder[Any],
        loader: DataLoader[T],
        tasks: Iterator[Task],
        first: bool,
    ) -> None:
        # The source of batches and the stage that fetches their items on threads.
        tl = loader._torch_loader
        self._fetcher = BatchFetcher(
            tl.dataset,
            loader._fetch.threads,
            wait_for_delivery=first,
            snapshot=_snapshot(tl.dataset),
            seed=self._base_seed,
            least=loader._fetch.least,
            start=loader._fetch.start,
            batched=bool(tl._auto_collation),
        )
        if first:
            # Told when the consumer holds the first batch: only then do the other batches
            # start, so that their threads take no CPU from the first batch's collation and
            # hand-over (measured on 2 cores: up to 18 ms between the first batch's collation
            # and the consumer holding it, when the next batches started at collation).
            self._first_pending = self._fetcher
        # fetch_concurrency=1: batches strictly one after another, as PyTorch fetches them, so
        # that draws from the global random generators match. Else batches drawn as the
        # fetcher has room for them (see _ahead.py). Either way a few batches drawn ahead of
        # the fetch stage, not the dozens a queue after a cheap source grows to: a move of
        # fetching (see _move.py) waits for those drawn.
        concurrency = 1
        source: Iterator[Task] | FetchAhead = tasks
        if loader._fetch.threads > 1:
            items = _batch_items(tl)
            concurrency = loader._fetch.batches(loader.in_flight, items)
            source = self._fetcher.draw_ahead(tasks, items, loader.in_flight, concurrency)
        builder.add_source(source, buffer_size=max(2, loader.in_flight))
        builder.pipe(
            self._fetcher.fetch,
            concurrency=concurrency,
            output_order="input" if tl.in_order else "completion",
            name="fetch",
            buffer_size=max(2, loader.in_flight),  # whole batches: keep this queue short
        )

    def _add_iterable_source(
        self,
        builder: PipelineBuilder[Any],
        tl: Any,
        replay: int,
        state: list[Any] | None,
        in_flight: int,
    ) -> None:
        dataset = tl.dataset
        snapshot = _snapshot(dataset)
        if snapshot is not None and state is not None and state[0] is not None:
            replay = 0  # the dataset resumes itself
        size = tl.batch_size if tl._auto_collation else 1
        drop_last = bool(tl.drop_last) and tl._auto_collation
        skip = self.position.yielded
        # iter() here, as PyTorch's iterator calls it when it is made (an error raises from
        # iter(loader)), after the dataset's state was loaded.
        iterator = start_dataset(dataset, self.position, state, iterate=True)

        def batches() -> Iterator[tuple[int, list[Any] | _Abort, Any]]:
            n = skip - replay
            try:
                items = next_only(iterator)
                for n in itertools.count(skip - replay):
                    chunk = list(itertools.islice(items, size))
                    if not chunk or (drop_last and len(chunk) < size):
                        return
                    if n >= skip:
                        yield n, chunk, (0, snapshot()) if snapshot is not None else None
            except Exception as error:
                # Raised in turn, after the batches read before it, and the epoch ends there
                # (PyTorch's iterator: the dataset's iterator is done after it raised).
                yield max(n, skip), _Abort(error), None

        # Fixed: the dataset is read a few batches ahead of collation (4, or what prefetching
        # asks if more), not the 64 batches a default queue after a cheap source grows to.
        builder.add_source(batches(), buffer_size=max(4, in_flight))

    @staticmethod
    def _watch_pipeline(pipeline: Pipeline[Any], loader: DataLoader[T], workers: bool) -> None:
        # The epoch's pipeline reports its stalls as the DataLoader's, with the workers'
        # states where they fetch.
        watch = pipeline.watch
        watch.name, watch.after = "feedline.DataLoader", loader._stall_after
        if workers:
            own, theirs = watch.describe, loader._worker_set().watch.describe
            watch.describe = lambda: [*(own() if own else []), *(theirs() if theirs else [])]

    def __iter__(self) -> EpochIterator[T]:
        return self

    def __len__(self) -> int:
        """Batches in the epoch, as ``len(loader)`` (PyTorch's iterator has it too)."""
        return int(self._length())

    def __next__(self) -> T:
        while True:
            if self._closed:
                if self._superseded:
                    raise RuntimeError(
                        "this DataLoader iterator was stopped because a new iteration over the "
                        "loader started (its worker processes serve one at a time, and an "
                        "iteration after load_state_dict() takes the place of the ones "
                        "before it); finish (or drop) one loop before starting the next"
                    )
                raise StopIteration
            watch, self._watch = self._watch, None
            try:
                took, self._took_last = self._took_last, None
                if took is not None:
                    self._place(*took)
                if watch is not None:
                    watch.start()
                # (The thread's times are for the fetch threads' hold; worker processes
                # have none here: a read of /proc per batch that they would not use.)
                asked = time.perf_counter()
                asked_cpu = _cpu_wanted() if self._fetcher is not None else 0.0
                item = _next_item(self._pipeline, self._fetcher, self._timeout, asked)
                took = self._took(asked, asked_cpu)
                if watch is not None:
                    # While this thread waited, only the fetch threads ran user code: if the
                    # global generators moved, the dataset drew from them concurrently.
                    watch.check(stacklevel=3)
                fetcher, self._first_pending = self._first_pending, None
                if fetcher is not None:
                    fetcher.first_delivered()  # the other batches may start now
                self._part_taken += 1
                if self._moving is not None and self._drained(item):
                    # The threads' last batch: the workers start now and fetch their first
                    # batches while the consumer works on it (at the next call, it would
                    # wait for them: 35-45 ms of the 65-75 a move cost beside JPEG decoding).
                    self._moved()
                    took = None  # the workers' windows measure the workers' batches only
            except EOFError:
                if self._moving is not None and self._moved():
                    continue  # the rest of the epoch, fetched where it moved
                if self._sampler_failed:  # in the place of the batch it could not draw
                    self.close()
                    failure = self._sampler_failed.pop()
                    try:
                        raise failure
                    finally:
                        del failure
                self.position.finished = True
                self._dataset_at_end()
                self.close()
                ledger = self.position.ledger
                if ledger is not None:
                    ledger.check(self.position, end=True)  # LedgerError in StopIteration's place
                raise StopIteration from None
            except TimeoutError:
                self.close()
                raise RuntimeError(
                    f"DataLoader timed out after {self._timeout} seconds waiting for a batch"
                ) from None
            except BaseException:  # KeyboardInterrupt, a worker's error: end the workers now
                self.close(end_workers=True)
                raise
            if isinstance(item, _Abort):
                if item.number is None:  # the failure budget is spent, or the stream raised
                    # The epoch ends here, unfinished: a state taken now resumes after the
                    # last batch handed out (the stream read again and fast-forwarded, or
                    # the dataset's own state loaded), as torchdata's does.
                    self.close()
                else:  # this batch raises; the next call goes on with the next one
                    self._count(item.number, item.dataset_state, "raised")
                error = item.error
                # The traceback keeps this frame: without its references (the iterator, and
                # the error itself, a cycle), an iterator that a loop left with the error is
                # collected, its threads stopped, as usual, even while the error is kept
                # (pytest.raises, a logged exception).
                del self, item
                try:
                    raise error
                finally:
                    del error
            number, batch, dataset_state = item
            if isinstance(batch, StateReport):  # a worker's stream ended: its state after it
                states = self.position.dataset_states
                if states is not None:
                    states[dataset_state[0]] = dataset_state[1]
                continue
            self._count(number, dataset_state, "skipped" if batch is _SKIP else "delivered")
            if self._window is not None:
                self._took_last = took  # judged at the next ask, inside its try
            if batch is _SKIP:
                continue
            if self._len_called is not None and self.position.yielded > self._len_called:
                self._warn_length()
            return batch  # type: ignore[no-any-return]

    def read_dataset_states(self) -> None:
        """Have the position hold each worker's dataset state, for ``state_dict()``.

        A worker that has handed out no batch yet tells its state as its pass starts: taken
        now (waiting for the worker to start), as torchdata's iterator waits for every
        worker's when it is made. (Batches that go through a pipeline, to be pinned, bring
        the workers' states when the pipeline takes them.)
        """
        if isinstance(self._pipeline, _Direct) and not self._closed:
            self._pipeline.read_reports()

    def _dataset_at_end(self) -> None:
        # The epoch ended: the dataset's state after its last batch (an iterable dataset's,
        # after its iterator ended), as torchdata keeps it. Workers send theirs.
        states, loader = self.position.dataset_states, self._loader
        if states is not None and loader is not None and loader._torch_loader.num_workers == 0:
            states[0] = copy.deepcopy(loader._torch_loader.dataset.state_dict())

    def _warn_length(self) -> None:
        loader = self._loader
        dataset = loader.dataset if loader is not None else "the dataset"
        workers = loader._torch_loader.num_workers if loader is not None else 0
        warnings.warn(
            f"Length of IterableDataset {dataset} was reported to be {self._len_called} (when "
            f"accessing len(dataloader)), but {self.position.yielded} samples have been "
            "fetched."
            + (
                " For multiprocessing data-loading, this is what a dataset gives when each "
                "worker yields the whole stream: give each worker its own share (by "
                "torch.utils.data.get_worker_info())"
                if workers
                else ""
            ),
            stacklevel=3,
        )

    def _took(
        self, asked: float, asked_cpu: float
    ) -> tuple[float, bool, float | None, float | None]:
        # Tell the fetcher whether the consumer waited for this batch, and how much of its
        # time since the last one its thread computed, or was ready to but queued for a core
        # (the fetch threads' pushing it off its core must not hide that it computes; see
        # BatchFetcher.consumer_took). Measured from one ask to the next, with one read of
        # the thread's times per batch (each read hands the GIL to the fetch threads, see
        # thread_times): getting a batch that was ready takes microseconds of that time. A
        # wait would count in the next batch's share (and the collation this thread may do
        # while it waits, see Run.pull), so the batch after one is not judged.
        # Returns when it took the batch, whether it waited, its time since the batch
        # before and the share of it computing (None: not measured).
        now = time.perf_counter()
        waited = now - asked > _WAITED
        fetcher = self._fetcher
        if fetcher is None:  # from worker processes: no times read here
            return now, waited, None, None
        left, left_cpu = self._left
        between = computing = None
        if left is not None and asked > left:
            between = asked - left
            computing = (asked_cpu - left_cpu) / between
        fetcher.consumer_took(waited, computing)
        self._left = (None, 0.0) if waited else (asked, asked_cpu)
        return now, waited, between, computing

    def _place(
        self, now: float, waited: bool, between: float | None, computing: float | None
    ) -> None:
        # num_workers="auto": measure the window, and where it is judged, decide whether
        # fetching moves (see _move.py); a loader with num_workers=0 logs the hint instead.
        window, placement, gate = self._window, self._placement, self._gate
        if window is None or placement is None or gate is None or self._moving is not None:
            return
        window.took(now, waited, between, computing)
        if not window.ready():
            return
        sample = window.sample(usable_cores())
        may_try = placement.stays is None and time.monotonic() >= placement.retry_at
        decision = decide(sample, placement.trial_rate, may_try, placement.asked)
        if decision.action == "wait":
            return
        window.restart()
        placement.asked = sample if decision.action == "ask" else None
        if decision.action == "ask" and placement.trial_rate is not None:
            placement.note(f"fetch: the trial: {decision.why}")
        if decision.action in ("stay", "ask"):
            return
        if not placement.auto:
            placement.hinted, self._window = True, None
            _hint(decision.why)
            return
        if decision.action == "move":
            placement.trial_rate, placement.previous = decision.baseline, sample.workers
            self._moving = decision.workers
            placement.note(
                f"fetch: moves to {decision.workers} worker process(es) to try them: {decision.why}"
            )
        elif decision.action == "keep":
            placement.trial_rate = None
            placement.note(f"fetch: stays in {decision.workers} worker process(es): {decision.why}")
        else:  # back
            placement.went_back(time.monotonic())
            self._moving = placement.previous
            where = f"{placement.previous} worker process(es)" if placement.previous else "threads"
            placement.note(f"fetch: moves back to {where}: {decision.why}")
        if self._moving is not None:
            _log.info("feedline.DataLoader: %s", placement.log[-1])
            gate.pause()  # the batches drawn so far are fetched where they are

    def _new_window(self, workers: int, trial: bool = False) -> Window:
        # Measures the next window (a trial's, after a move to try workers); on threads, the
        # fetch calls' own CPU time is the fetching's (not the engine's, nor other threads').
        fetcher = self._fetcher
        return Window(workers, None if fetcher is None else lambda: fetcher.calls_cpu, trial)

    def _drained(self, item: Any) -> bool:
        # On threads, while a move waits: the part fetched there handed over ``item``, its
        # last (the threads have nothing more to fetch and may be joined).
        gate = self._gate
        return (
            self._fetcher is not None
            and gate is not None
            and not (isinstance(item, _Abort) and item.number is None)
            and gate.drained(self._part_taken)
        )

    def _moved(self) -> bool:
        # _move_on, stopping the epoch (its workers ended) if it raises: Ctrl-C during the
        # move leaves no process behind.
        try:
            return self._move_on()
        except BaseException:
            self.close(end_workers=True)
            raise

    def _move_on(self) -> bool:
        # The part of the epoch fetched so far has handed out its last batch: stop what
        # fetched it (its threads joined, so that workers may fork) and go on with the rest
        # of the epoch where ``_moving`` says. False: no batch is left.
        loader, gate, workers = self._loader, self._gate, self._moving
        self._moving = None
        assert loader is not None
        assert gate is not None
        assert workers is not None
        placement = self._placement
        assert placement is not None
        EpochIterator._stop_fetching(self._pipeline, self._fetcher, self._pin_pool)
        self._fetcher = self._pin_pool = None
        self._part_taken = 0
        loader._last_stats = None  # the part of the epoch that comes next has its own
        if not workers:
            loader._end_workers()
        if not gate.more():
            if placement.trial_rate is None:  # back: the next epoch starts there
                placement.workers = workers
            else:  # a trial that found no batch left: not made
                placement.trial_rate = None
                placement.note("fetch: the trial was not made: the epoch had no batch left")
            return False
        placement.workers = workers
        # Workers started part-way through the epoch seed their generators from the part's
        # first batch: the epoch's first workers' draws are not made again.
        seed = derived_seed(self._base_seed, gate.next_number())
        if workers:
            try:
                loader._worker_set().start(seed)
                loader._worker_set().wait_started()
            except Exception as error:  # the dataset cannot be sent to (or rebuilt in) workers
                loader._end_workers()
                placement.workers = workers = 0
                placement.trial_rate = None
                placement.stays = f"the workers could not start: {error}"
                placement.note(f"fetch: stays on threads: {placement.stays}")
                _log.warning("feedline.DataLoader: %s", placement.log[-1])
        builder: PipelineBuilder[Any] = PipelineBuilder()
        epoch = None
        if workers:
            epoch = loader._worker_set().epoch(
                gate.view(), self._base_seed, start=gate.next_number(), worker_seed=seed
            )
        else:
            self._fetch_stage(builder, loader, gate.view(), first=False)
        self._pipeline = self._serve(builder, loader, epoch)
        self._finalizer.detach()
        self._finalizer = self._finalize()
        trial = placement.trial_rate is not None
        self._window = self._new_window(workers, trial) if placement.stays is None else None
        self._left = (None, 0.0)
        self._pipeline.start()
        return True

    def _count(
        self, number: int, dataset_state: tuple[int, Any] | StreamMark | None, outcome: str
    ) -> None:
        # ``outcome``: the batch was "delivered", all its items were "skipped" within the
        # failure budget, or it "raised" in their place. Whole: a Ctrl-C part-way left the
        # ledger saying a batch was handed out that the position did not (a checkpoint that
        # load_state_dict() refused); it comes a moment after, once the batch is out.
        with CtrlCHeld():
            self._record(number, dataset_state, outcome)

    def _record(
        self, number: int, dataset_state: tuple[int, Any] | StreamMark | None, outcome: str
    ) -> None:
        position = self.position
        ledger = position.ledger
        slot: tuple[int, Any] | None
        if isinstance(dataset_state, StreamMark):  # an iterable dataset's worker batch
            worker, batch, state = dataset_state
            if position.worker_batches is not None and stream_batch_taken(outcome):
                position.worker_batches[worker] = batch + 1
                position.worker_turn = (worker + 1) % len(position.worker_batches)
            if ledger is not None and outcome == "delivered":
                ledger.deliver(batch, worker)
            slot = None if state is None else (worker, state)
        else:
            if ledger is not None:
                if outcome == "delivered":
                    ledger.deliver(number)
                else:
                    ledger.fail(number)
            slot = dataset_state
        if slot is not None and position.dataset_states is not None:
            position.dataset_states[slot[0]] = slot[1]
        # Out of order, a batch may come before those numbered below it: keep the watermark
        # and the few handed out above it.
        if number != position.yielded:
            position.ahead.add(number)
            return
        states = self._sampler_states
        while True:
            if number in states:
                position.sampler_state = states.pop(number)
            self._rewinder.handed_out(number)
            position.yielded = number = number + 1
            if number not in position.ahead:
                return
            position.ahead.remove(number)

    def _rewind(self, tl: Any) -> None:
        # The epoch was left part-way, its source stopped: put the sampler's generators
        # back to their state after the batches PyTorch's iterator would have drawn by now
        # (those handed out; with workers, prefetch_factor per worker more), so that the
        # next epoch shuffles as it would have. Draws this one made ahead are undone.
        ahead = tl.prefetch_factor * tl.num_workers if tl.num_workers > 0 else 0
        position = self.position
        self._rewinder.rewind(position.yielded + len(position.ahead) - 1 + ahead)

    def stats(self) -> PipelineStats | None:
        """The epoch's pipeline statistics (``None`` for batches straight from workers)."""
        pipeline = self._pipeline
        if not isinstance(pipeline, Pipeline):
            return None
        try:
            return pipeline.stats()
        except RuntimeError:  # made by a move, not started yet (for a few milliseconds)
            return None

    def supersede(self) -> None:
        """Stop this epoch because a newer one needs the worker processes."""
        self._superseded = True
        self.close()

    def close(self, end_workers: bool = False) -> None:
        """Stop this epoch's threads (and its pass in the worker processes).

        Re-entrant: a call interrupted part-way (a second Ctrl-C) is finished by the next one,
        or by the finalizer. ``end_workers`` ends the worker processes at once, even
        persistent ones, instead of letting them finish the batch they are on.
        """
        with Closing(deliver=not self._in_del):  # a Ctrl-C held back as a batch was counted
            self._close(end_workers)

    def _close(self, end_workers: bool) -> None:
        with self._lock:
            self._closed = True
        loader = self._loader
        if loader is not None and (end_workers or not loader._torch_loader.persistent_workers):
            loader._end_workers()  # first: the pipeline's source may be waiting on one
        EpochIterator._shutdown(
            self._pipeline, self._fetcher, self._pin_pool, self._tasks, self._finish.tally
        )
        self._finalizer.detach()
        if not self.position.finished and loader is not None:
            self._rewind(loader._torch_loader)
        if loader is not None and isinstance(self._pipeline, Pipeline) and not sys.is_finalizing():
            # (Not at interpreter exit, where an iterator still alive is closed by __del__
            # and the statistics' imports fail.)
            loader._last_stats = self.stats()
        self._loader = None  # a closed iterator kept alive keeps no loader
        if loader is not None:
            loader._epoch_ended()
        if getattr(self, "_ctrl_c", False):  # last: a Ctrl-C as the stop waits is the relay's
            self._ctrl_c = False
            release_ctrl_c()

    @staticmethod
    def _shutdown(
        pipeline: Pipeline[Any] | _Direct,
        fetcher: BatchFetcher | None,
        pin: ThreadPoolExecutor | None,
        tasks: _Releasable | None,
        tally: FailureTally,
    ) -> None:
        EpochIterator._stop_fetching(pipeline, fetcher, pin)
        if tasks is not None:
            tasks.release()
        tally.flush()

    @staticmethod
    def _stop_fetching(
        pipeline: Pipeline[Any] | _Direct,
        fetcher: BatchFetcher | None,
        pin: ThreadPoolExecutor | None,
    ) -> None:
        # Stop what fetches and hands out the batches (the epoch, or its part before a move),
        # its threads joined.
        pipeline.stop()
        if fetcher is not None:
            fetcher.close()
        if pin is not None:
            pin.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        if hasattr(self, "_finalizer"):  # __init__ may have raised before it was set
            self._in_del = True
            self.close()


class _Direct:
    """The worker processes' batches, taken by the consumer's thread: no pipeline, no thread.

    Stands in for the epoch's pipeline (``get_item``, ``stop``). Holds no reference to the
    iterator, so dropping the iterator stops it at once.
    """

    def __init__(self, epoch: Any, finish: _Finisher) -> None:
        stopped = self._stopped = [False]
        self._epoch = epoch
        self._batches: Iterator[Any] | None = epoch.iter_until(lambda: stopped[0])
        self._finish = finish
        self._taking = threading.Lock()  # held while a batch is taken from the workers

    def read_reports(self) -> None:
        """Take the workers' reports of their dataset states (see ``WorkerEpoch``).

        Not while another thread takes a batch (a ``state_dict()`` from a checkpointing
        thread): the workers' messages are read by one thread at a time.
        """
        if self._batches is None or not self._taking.acquire(blocking=False):
            return
        try:
            self._epoch.read_reports()
        finally:
            self._taking.release()

    def start(self) -> None:
        """Nothing to start: the workers began when the epoch was asked for."""

    def get_item(self, *, timeout: float | None = None) -> Any:
        """The next batch, finished; ``EOFError`` at the end (the workers time out waits)."""
        batches = self._batches
        if batches is None:
            raise EOFError
        try:
            with self._taking:
                fetched = next(batches)
        except StopIteration:
            self._batches = None
            raise EOFError from None
        return self._finish(fetched)

    def stop(self) -> None:
        """End the epoch's pass in the workers (the generator's cleanup settles them)."""
        self._stopped[0] = True
        batches, self._batches = self._batches, None
        if batches is not None:
            batches.close()  # type: ignore[attr-defined]
            self._epoch.close()  # its pass, if only its reports were taken


class _Releasable:
    """The epoch's batches, which the loader lets go of when the epoch is over.

    The pipeline's run keeps its source until the garbage collector breaks the run's
    reference cycles; letting go of the sampler's iterator at once frees what it holds (a
    shuffled epoch's permutation, or the list a custom sampler made) then and there, not in a
    collection that a later loader or its freshly forked workers pay for (measured: 40-110 ms
    before their first batch).
    """

    def __init__(self, tasks: Iterator[Task]) -> None:
        self._tasks: Iterator[Task] | None = tasks

    def __iter__(self) -> Iterator[Task]:
        return self

    def __next__(self) -> Task:
        tasks = self._tasks
        if tasks is None:
            raise StopIteration
        return next(tasks)

    def release(self) -> None:
        """Drop the batches not drawn yet: the iterator ends."""
        self._tasks = None


class _Gate:
    """The epoch's batches, handed to where fetching runs, one part of the epoch at a time.

    Each part (threads, or worker processes) takes its batches from a :meth:`view`; after
    :meth:`pause`, that view ends, and the part hands out what it drew; the next part's view
    goes on from the next batch. Views are iterated one after another, never at once.
    """

    def __init__(self, tasks: Iterator[Task]) -> None:
        self._tasks = tasks
        self._open = True
        self._peeked: Task | None = None
        # A draw and pause() one at a time: no draw is under way as the view is paused, so
        # the batches it gave by then are all it gives.
        self._lock = threading.Lock()
        self._drawn = 0  # batches the current view gave
        self._final: int | None = None  # ... as it was paused

    def view(self) -> Iterator[Task]:
        """The batches from the next one on, until :meth:`pause`."""
        self._open, self._drawn, self._final = True, 0, None
        return self._view()

    def _view(self) -> Iterator[Task]:
        while True:
            with self._lock:
                if not self._open:
                    return
                task, self._peeked = self._peeked, None
                if task is None:
                    task = next(self._tasks, None)
                    if task is None:
                        return
                self._drawn += 1
            yield task

    def drained(self, taken: int) -> bool:
        """Whether the paused view's part has nothing more to hand out.

        ``taken``: its batches taken so far. ``False`` before :meth:`pause`.
        """
        final = self._final
        return final is not None and taken >= final

    def pause(self) -> None:
        """End the current view: it draws no more (waits for a draw under way)."""
        with self._lock:
            self._open = False
            self._final = self._drawn

    def more(self) -> bool:
        """Whether a batch is left (drawn now, and kept for the next view)."""
        if self._peeked is None:
            self._peeked = next(self._tasks, None)
        return self._peeked is not None

    def next_number(self) -> int:
        """The number of the next batch (after :meth:`more` said there is one)."""
        assert self._peeked is not None
        return self._peeked[0]


def _stays(dataset: Any) -> str | None:
    """Why fetching from ``dataset`` must stay on threads (``None``: it may move)."""
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        return "free-threaded Python runs dataset[i] calls on threads side by side"
    if is_stateful(dataset):
        return (
            "the dataset has state_dict() and load_state_dict(): its state is kept where it "
            "fetches, in this process"
        )
    return None


_HINTED = [False]  # the hint below was logged by this process


def _hint(why: str) -> None:
    if _HINTED[0]:
        return
    _HINTED[0] = True
    _log.warning(
        'feedline.DataLoader: %s; DataLoader(num_workers="auto") would try worker processes '
        "for it (dataset[i] holding the GIL slows the training loop beside threads)",
        why,
    )


def _numbered(
    batches: Iterator[Any],
    skip: int,
    replay: int,
    sampler: Any,
    ahead: frozenset[int],
    states: dict[int, Any],
    rewinder: GeneratorRewind,
    ledger: LoaderLedger | None,
    failed: list[Exception],
) -> Iterator[Task]:
    """Number the sampler's batches from ``skip``, past the ``replay`` already handed out.

    A stateful sampler's state is read after each batch is drawn, in the source's thread, and
    kept in ``states`` until the batch is handed out; so are the generators' (``rewinder``).
    Once the sampler is drawn to its end, ``ledger`` learns how many batches the epoch has.
    A sampler that raises ends the batches there, its error kept in ``failed``: the batches
    drawn before it are handed out, then it is raised (as PyTorch's loop without workers
    raises it in the place of the batch it could not draw).
    """
    if rewinder and replay == 0:
        rewinder.drawn(skip - 1)  # before the first batch is drawn
    drawn = skip
    rest = itertools.islice(batches, replay, None)
    for n in itertools.count(skip):
        if rewinder:
            rewinder.before_draw(n)
        try:
            b = next(rest, _NO_MORE)
        except Exception as error:
            failed.append(error)
            return
        if b is _NO_MORE:  # (not None: an iterable dataset's sampler yields None)
            break
        if sampler is not None:
            states[n] = copy.deepcopy(sampler.state_dict())  # it may change what it gave
        if rewinder:
            rewinder.drawn(n)
        drawn = n + 1
        if n not in ahead:
            yield n, b
    if ledger is not None:
        ledger.plan(drawn)


_NO_MORE: Any = object()  # the end of the sampler's batches


def _seed_chain(loader: DataLoader[Any], state: dict[str, Any] | None) -> tuple[int, int] | None:
    """The epoch's place in its persistent workers' seed chain (see ``Position``), if any."""
    tl = loader._torch_loader
    if not (tl.persistent_workers and tl.num_workers > 0):
        return None
    if state is not None:
        saved = state["persistent_seed"]
        return None if saved is None else (int(saved[0]), int(saved[1]))
    previous = loader._seed_chain
    return None if previous is None else (previous[0], previous[1] + 1)


def _stateful_sampler(tl: Any) -> Any:
    """The sampler whose own state to save: the batch sampler's, else the sampler's."""
    if tl.batch_sampler is not None and is_stateful(tl.batch_sampler):
        return tl.batch_sampler
    if tl.sampler is not None and is_stateful(tl.sampler):
        return tl.sampler
    return None


def _batch_items(tl: Any) -> int:
    # Items per batch: the batch sampler's size where it says (1 without batching).
    size = getattr(tl.batch_sampler, "batch_size", None) or tl.batch_size
    return size if isinstance(size, int) and size > 0 else 1


def _snapshot(dataset: Any) -> Callable[[], Any] | None:
    # A copy of the state as it is now: a dataset may hand out a dict it goes on changing.
    if not is_stateful(dataset):
        return None
    return lambda: copy.deepcopy(dataset.state_dict())


def _pin_numbered(torch: Any, item: Any) -> Any:
    if isinstance(item, _Abort):
        return item
    number, batch, dataset_state = item
    if batch is _SKIP or isinstance(batch, StateReport):
        return item
    return number, _pin(torch, batch), dataset_state


def _check_stream_workers(state: dict[str, Any], workers: int) -> None:
    # An iterable dataset's stream is split by the worker count: a position within it only
    # means something with as many workers.
    if state["finished"] or not state["batches_yielded"]:
        return
    taken = state["worker_batches"]
    saved = 0 if taken is None else len(taken)
    if saved != workers:
        raise ConfigurationError(
            f"this state was saved with num_workers={saved} and this loader has "
            f"num_workers={workers}: an IterableDataset's stream is split between the workers, "
            "so its position only holds with as many; resume with the same num_workers (or "
            "from the start of the next epoch)"
        )


def _ledger(loader: DataLoader[Any], state: dict[str, Any] | None) -> LoaderLedger | None:
    """The epoch's ledger: anew, or the saved epoch's (none where a saved state has none)."""
    if not ledger_check():
        return None
    tl = loader._torch_loader
    workers = tl.num_workers if loader._iterable and tl.num_workers > 0 else None
    if state is None or state["finished"]:
        return LoaderLedger(workers)
    saved = state.get("ledger")
    if not isinstance(saved, list) or len(saved) != (workers or 1):
        return None  # saved without one (or by another loader: iter() says so)
    return LoaderLedger(workers, saved)
