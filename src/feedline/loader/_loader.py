"""``feedline.DataLoader``: PyTorch's DataLoader, fetching the items of each batch concurrently.

Arguments are validated, and the sampler, batch sampler and collate function built, by
constructing a ``torch.utils.data.DataLoader`` with the same arguments: the same errors, the
same defaults and, for the same ``generator`` seed, the same batches in the same order. Each
epoch then draws its seeds exactly as PyTorch's iterator does (the base seed, then the
sampler's), and runs a feedline pipeline::

    batch sampler -> fetch (every dataset[i] of a batch at once, on threads, or in worker
    processes) -> drop failed items -> collate_fn -> [pin memory] -> consumer

Resuming: :meth:`DataLoader.state_dict` is the random state at the start of the epoch (taken
once per epoch) and the number of batches handed out. Loading it restores that state, replays
the sampler (indices only, no data) past those batches, and goes on from there, so the rest of
the epoch, and the epochs after it, are what an uninterrupted run yields.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

from feedline._extras import require_torch
from feedline._ledger import ledger_check
from feedline._watchdog import STALL_AFTER, check_after
from feedline.errors import ConfigurationError
from feedline.pipeline import Auto, PipelineStats

from ._concurrency import FetchConcurrency
from ._epoch import EpochIterator
from ._ledgers import LoaderLedger
from ._move import Placement
from ._state import Position, check_state
from ._workers import WorkerSet

__all__ = ["DataLoader"]

T = TypeVar("T")
_log = logging.getLogger("feedline.loader")
# PyTorch's DataLoader refuses to have these set after construction (ValueError); the others
# may change between epochs. Changing one of _WORKER_SETTINGS restarts the worker processes.
_WORKER_SETTINGS = frozenset(
    {
        "worker_init_fn",
        "multiprocessing_context",
        "timeout",
        "in_order",
        "collate_fn",
    }
)


def _torch() -> Any:
    return require_torch("feedline.DataLoader (built on PyTorch's samplers and collation)")


class DataLoader(Generic[T]):
    """A drop-in for ``torch.utils.data.DataLoader`` that fetches each batch's items at once.

    Takes every argument of PyTorch's DataLoader, with the same meaning and defaults, and
    yields the same batches in the same order for the same ``generator`` seed. The difference
    is how items are fetched: all ``dataset[i]`` of a batch run concurrently on threads (a
    dataset that waits on storage or releases the GIL scales with them), several batches are
    in flight, and the first batch comes without waiting for worker processes to start.

    Args:
        dataset: A map-style dataset (``__getitem__`` and ``__len__``: a
            ``torch.utils.data.Dataset``, a list, a :class:`~feedline.loader.PathList`...)
            or a ``torch.utils.data.IterableDataset``.
        batch_size, shuffle, sampler, batch_sampler, collate_fn, drop_last, generator,
        in_order: As in PyTorch. ``in_order=False`` lets a batch overtake a slower one.
        num_workers: ``0`` (default): everything runs in this process, on threads, the
            right choice when ``__getitem__`` waits on I/O or releases the GIL. ``N > 0``:
            N worker processes, each fetching with ``fetch_concurrency`` threads, for datasets
            whose ``__getitem__`` holds the GIL. The dataset is sent to each worker once.
            ``"auto"``: start on threads, and move fetching to worker processes, at a batch
            boundary, where measurements show the threads holding the training loop back
            (its thread waiting for the GIL, or batches late while fetching cannot use more
            than one core); the move is kept only if the loop then takes batches faster.
            Reading ``num_workers`` gives the worker processes in use (0 on threads).
        pin_memory: Pin batches in a dedicated thread (when CUDA is available).
        timeout: Seconds to wait for a batch (``0``: no limit); a longer wait raises.
        worker_init_fn: Called with the worker id in each worker process, once, after it is
            seeded (as in PyTorch; it sees ``torch.utils.data.get_worker_info()``).
        multiprocessing_context: Start method of worker processes, by name or as a
            ``multiprocessing`` context; ``None``: the one ``multiprocessing.set_start_method()``
            set, if any. ``"fork"``, or nothing set: fork, as PyTorch does on Linux, when
            this process runs no other thread as an epoch starts (a fork copies only the
            calling thread, so no other thread's lock can be inherited held); otherwise the
            fork server.
        prefetch_factor: Batches in flight per worker (per loader when ``num_workers=0``);
            default 2. Without workers, the batches ahead of a consumer that does not wait:
            while it waits for one, more are drawn, as many as keep the threads busy.
        persistent_workers: Keep worker processes between epochs.
        pin_memory_device: Deprecated in PyTorch; must be ``""``.
        fetch_concurrency: How many ``dataset[i]`` calls run at once (per process): an int,
            or ``"auto"`` (default) or :class:`~feedline.Auto` with bounds on the calls at
            once (default at most 128): the loader sets the calls at once and the batches in
            flight while it runs, from what it measures (many for items that wait on
            storage, about one per core for items that compute). ``1``: one call at a time,
            PyTorch's order of random draws.
        max_failures: How many failing ``dataset[i]`` calls to skip (logged, counted; the
            batch comes out smaller) before iteration raises :class:`~feedline.PipelineFailure`:
            an int, a float fraction of items, or ``None`` for no limit. Default 0: the first
            failure raises, naming the index, and the loop may go on to the next batch.
        snapshot_every_n_steps: torchdata ``StatefulDataLoader``'s argument (an int >= 0 or
            ``None``), accepted so that it can be swapped in; :meth:`state_dict` is exact
            after every batch anyway.
        report_stall_after: Seconds the loop may wait for a batch with nothing moving before
            the stall is logged, once, as a WARNING on the ``feedline.watchdog`` logger: the
            batches and ``dataset[i]`` calls in flight and where each busy thread stands
            (its innermost frames, with the index), each worker process's state (a stopped
            one is named; a running one writes its threads' stacks to its stderr), reads
            waiting on a store. The loop goes on waiting (``timeout=`` raises instead).
            ``None``: never report.

    Example::

        loader = feedline.DataLoader(dataset, batch_size=32, shuffle=True)
        for batch in loader:
            ...
        checkpoint = {"loader": loader.state_dict(), ...}

    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = 0,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        fetch_concurrency: int | str | Auto | None = "auto",
        max_failures: int | float | None = 0,
        snapshot_every_n_steps: int | None = 1,
        report_stall_after: float | None = STALL_AFTER,
    ) -> None:
        torch = _torch()
        if pin_memory_device:
            raise ConfigurationError(
                "pin_memory_device is deprecated in PyTorch and not supported: batches are "
                "pinned for the current CUDA device; move them with batch.to(device)"
            )
        auto_workers = num_workers == "auto"
        if auto_workers:
            # Validated as workers would be (a start method, prefetch_factor); the epochs
            # start on threads, and move fetching where it pays.
            num_workers = 1
            if persistent_workers:
                raise ConfigurationError(
                    'persistent_workers=True needs a number of workers: num_workers="auto" '
                    "starts worker processes only when they pay, and ends them with each epoch"
                )
        elif isinstance(num_workers, str):
            raise ConfigurationError(
                f'num_workers must be an int >= 0 or "auto", got {num_workers!r}'
            )
        # PyTorch's own constructor validates the arguments (the context among them: only
        # with workers) and builds the samplers.
        self._torch_loader = torch.utils.data.DataLoader(
            dataset,
            batch_size,
            shuffle,
            sampler,
            batch_sampler,
            num_workers,
            collate_fn,
            pin_memory,
            drop_last,
            timeout,
            worker_init_fn,
            multiprocessing_context,
            generator,
            # Without workers, PyTorch refuses prefetch_factor; here it sets batches in flight.
            prefetch_factor=prefetch_factor if num_workers > 0 else None,
            persistent_workers=persistent_workers,
            in_order=in_order,
        )
        if auto_workers:
            self._torch_loader.num_workers = 0
        self._iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        pipes = tuple(getattr(torch.utils.data, n, ()) for n in ("IterDataPipe", "MapDataPipe"))
        if (auto_workers or num_workers > 0) and isinstance(dataset, pipes):
            raise ConfigurationError(
                "feedline.DataLoader does not shard DataPipes (deprecated by PyTorch) between "
                "worker processes: each worker would hand out every item. Use num_workers=0 "
                "(threads), torch.utils.data.DataLoader, or an IterableDataset that splits its "
                "items by torch.utils.data.get_worker_info()"
            )
        # Where fetching runs (num_workers="auto"), or where a hint is due (threads).
        self._placement = self._new_placement(auto_workers)
        self._fetch = FetchConcurrency.parse(fetch_concurrency)
        self._stale_workers = False  # a worker setting changed during an epoch
        if max_failures is not None and (
            isinstance(max_failures, bool)
            or not isinstance(max_failures, int | float)
            or max_failures < 0
            or (isinstance(max_failures, float) and max_failures >= 1)
        ):
            raise ConfigurationError(
                "max_failures must be an int >= 0 (a count), a float in [0, 1) (a fraction of "
                f"items) or None (no limit), got {max_failures!r}"
            )
        self._stall_after = check_after(report_stall_after)
        _check_count("prefetch_factor", prefetch_factor)
        if snapshot_every_n_steps != 0:  # torchdata takes 0 too
            _check_count("snapshot_every_n_steps", snapshot_every_n_steps)
        self.prefetch_factor = prefetch_factor or 2
        self.max_failures = max_failures
        self._workers: WorkerSet | None = None
        self._last_stats: PipelineStats | None = None
        self._current: weakref.ref[EpochIterator[T]] | None = None
        self._pending: dict[str, Any] | None = None
        self._position: Position | None = None  # of the current or last epoch
        self._seed_chain: tuple[int, int] | None = None  # persistent workers: see Position
        self._pin = bool(pin_memory) and bool(torch.cuda.is_available())
        if pin_memory and not self._pin:
            warnings.warn(
                "pin_memory=True but CUDA is not available: batches are not pinned",
                stacklevel=2,
            )
        holder: list[WorkerSet | None] = [None]
        self._finalizer = weakref.finalize(self, DataLoader._close_workers, holder, os.getpid())

    def __getattr__(self, name: str) -> Any:
        # dataset, batch_size, sampler, batch_sampler, collate_fn, generator, ... as PyTorch's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._torch_loader, name)

    def __setattr__(self, name: str, value: Any) -> None:
        inner = self.__dict__.get("_torch_loader")
        if (
            inner is None
            or name.startswith("_")
            or name in self.__dict__
            or isinstance(getattr(type(self), name, None), property)
        ):
            object.__setattr__(self, name, value)
            return
        # PyTorch's own loader raises ValueError for batch_size, sampler, drop_last, ...
        placement = self.__dict__.get("_placement")
        if name == "multiprocessing_context" and placement is not None and placement.auto:
            inner.num_workers = 1  # PyTorch takes a start method only for workers
            try:
                setattr(inner, name, value)
            finally:
                inner.num_workers = 0
        else:
            setattr(inner, name, value)
        if name in _WORKER_SETTINGS:
            self._settings_changed()

    def _settings_changed(self) -> None:
        # The next epoch starts workers with the new setting; an epoch under way keeps its
        # workers until it ends (as PyTorch's iterator keeps its own).
        if self._workers is None:
            return
        current = self._current() if self._current is not None else None
        if current is not None and not current._closed:
            self._stale_workers = True
        else:
            self._end_workers()

    def __len__(self) -> int:
        return len(self._torch_loader)

    @property
    def num_workers(self) -> int:
        """The worker processes that fetch: as given, or with ``"auto"`` those in use now.

        Setting it (an int or ``"auto"``) takes effect at the next epoch.
        """
        return self._fetch_workers()

    @num_workers.setter
    def num_workers(self, value: int | str) -> None:
        auto = value == "auto"
        if not auto and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise ConfigurationError(f'num_workers must be an int >= 0 or "auto", got {value!r}')
        tl = self._torch_loader
        if auto and tl.persistent_workers:
            raise ConfigurationError(
                'persistent_workers=True needs a number of workers, not num_workers="auto"'
            )
        tl.num_workers = 0 if auto else value  # PyTorch's own checks
        if self._placement is None or self._placement.auto != auto:
            self._placement = self._new_placement(auto)
        self._settings_changed()

    def _new_placement(self, auto: bool) -> Placement | None:
        # Where fetching runs (num_workers="auto"), or where a hint is due (threads); None
        # with a fixed number of workers.
        if not auto and self._torch_loader.num_workers > 0:
            return None
        if not self._iterable:
            return Placement(auto=auto)
        if not auto:
            return None
        placement = Placement(
            auto=True,
            stays="an IterableDataset is split between workers by get_worker_info(), so its "
            "stream stays where it started",
        )
        placement.note(f"fetch: stays on threads: {placement.stays}")
        return placement

    def _fetch_workers(self) -> int:
        # The worker processes the next epoch starts on.
        placement = self._placement
        if placement is not None and placement.auto:
            return placement.workers
        return int(self._torch_loader.num_workers)

    @property
    def mp_context(self) -> str | None:
        """How worker processes start: ``"spawn"``, ``"forkserver"``, or ``None`` (fork).

        From ``multiprocessing_context``, or without one the start method set for the whole
        program (``multiprocessing.set_start_method()``), as PyTorch's workers use it.
        ``None`` (neither set, or ``"fork"``): fork when no other thread runs as an epoch
        starts (as PyTorch forks on Linux, and a dataset holding a lambda works), else the
        fork server.
        """
        context = self._torch_loader.multiprocessing_context
        if context is None:
            method = mp.get_start_method(allow_none=True)
        else:
            method = context.get_start_method()
        return None if method == "fork" else method

    @property
    def fetch_concurrency(self) -> int | str | Auto:
        """The most ``dataset[i]`` calls at once per process, or ``"auto"`` / an :class:`Auto`.

        Setting it takes effect at the next epoch (and restarts worker processes).
        """
        auto = self._fetch.auto
        return self._fetch.threads if auto is None else ("auto" if auto == Auto() else auto)

    @fetch_concurrency.setter
    def fetch_concurrency(self, value: int | str | Auto) -> None:
        fetch = FetchConcurrency.parse(value)
        if fetch == self._fetch:
            return
        self._fetch = fetch
        self._settings_changed()

    def stats(self) -> PipelineStats | None:
        """The pipeline statistics of the current epoch (or the last one) in this process.

        Each stage's concurrency and timings, the bottleneck, and the tuner's decisions: the
        ``fetch`` stage's concurrency is the most batches it may hold (which of them are
        drawn when is the fetcher's to decide), ``collate_fn`` the collation. ``ledger`` counts the
        epoch's batches planned, handed out, failed, handed out twice and never (see the
        loader README). ``None`` before the first epoch. When the batches come straight from
        worker processes (``num_workers > 0`` without ``pin_memory``), no pipeline runs in
        this process: no stages, and the ledger alone.
        """
        current = self._current() if self._current is not None else None
        running = current is not None and not current._closed
        stats = current.stats() if running and current is not None else self._last_stats
        placement = self._placement
        position = self._position
        ledger = None if position is None or position.ledger is None else position.ledger.stats()
        if stats is None:
            if ledger is None:
                return None
            stats = PipelineStats(
                elapsed=0.0,
                stages=(),
                bottleneck="workers",
                reason="the batches come straight from the worker processes",
            )
        tuning = stats.tuning
        if placement is not None and placement.log:
            tuning = (*tuning, *placement.log)
        return dataclasses.replace(stats, ledger=ledger, tuning=tuning)

    @property
    def in_flight(self) -> int:
        """Batches fetched ahead of the consumer."""
        loader = self._torch_loader
        per = self.prefetch_factor
        if loader.batch_size is None and loader.batch_sampler is None:
            return self._fetch.threads if self._fetch.auto is None else 16
        return per * max(1, self._fetch_workers())

    def __iter__(self) -> Iterator[T]:
        previous = self._current() if self._current is not None else None
        placement = self._placement
        if previous is not None and (
            self._fetch_workers() > 0
            or self._workers is not None
            or (placement is not None and placement.auto)  # its fetching may move
            or self._pending is not None  # a resume: the earlier epoch is done with
        ):
            # The workers serve one epoch at a time, as in PyTorch; and an epoch left for a
            # loaded state fetches no more (its calls of dataset[i] would run beside the
            # resumed epoch's, drawing from the generators they share).
            previous.supersede()
        state, self._pending = self._pending, None
        iterator: EpochIterator[T] = EpochIterator(self, state)
        self._current = weakref.ref(iterator)
        return iterator

    def _worker_set(self) -> WorkerSet:
        count = self._fetch_workers()
        if self._workers is not None and len(self._workers.processes) != count:
            self._end_workers()
        if self._workers is None:
            loader = self._torch_loader
            self._workers = WorkerSet(
                loader.dataset,
                num_workers=count,
                concurrency=self._fetch,
                prefetch=self.prefetch_factor,
                worker_init_fn=loader.worker_init_fn,
                mp_context=self.mp_context,
                timeout=loader.timeout or None,
                persistent=bool(loader.persistent_workers),
                in_order=bool(loader.in_order),
                collate_fn=loader.collate_fn,
                auto_collation=bool(loader._auto_collation),
                stream=_stream_batches(self) if self._iterable else None,
                report_stall_after=self._stall_after,
            )
            self._finalizer.detach()
            holder: list[WorkerSet | None] = [self._workers]
            self._finalizer = weakref.finalize(self, DataLoader._close_workers, holder, os.getpid())
        return self._workers

    def _epoch_ended(self) -> None:
        if self._workers is not None and (
            self._stale_workers or not self._torch_loader.persistent_workers
        ):
            self._end_workers()
        self._stale_workers = False

    def _end_workers(self) -> None:
        workers = self._workers
        if workers is not None:
            workers.close()  # re-entrant: dropped only once it returns
            self._workers = None

    @staticmethod
    def _close_workers(holder: list[WorkerSet | None], owner: int) -> None:
        if os.getpid() != owner:
            return  # a forked child's copy of the loader: the workers are not its own
        for workers in holder:
            if workers is not None:
                workers.close()

    def close(self) -> None:
        """Stop the running epoch, if any, and the worker processes. Idempotent."""
        current = self._current() if self._current is not None else None
        if current is not None:
            current.close(end_workers=True)
        self._end_workers()

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: enough to resume exactly, mid-epoch or between epochs.

        Describes the last batch handed out, whether the epoch's iterator is still running,
        was dropped (``break``), was closed by an exception in the loop body, or ran to its
        end (then the state resumes at the start of the next epoch). A dataset or sampler with
        ``state_dict()`` and ``load_state_dict()`` of its own has its state saved with it: the
        dataset's from the start of the epoch on (with workers, each worker's, which waits for
        a worker that has not handed out a batch yet to start), after each batch, and after
        the last one, as torchdata's ``StatefulDataLoader`` saves it.
        The result is plain data: it can be pickled, given to ``torch.save``, or written as
        JSON. Costs one copy of the random state, made once per epoch when the epoch starts.
        """
        if self._pending is not None:
            return dict(self._pending)
        current = self._current() if self._current is not None else None
        if current is not None:
            current.read_dataset_states()  # workers that handed out nothing yet: as they start
        own = self._torch_loader.generator is not None
        position = self._position
        if position is None:
            position = Position(self._rng_state(), finished=True)
        return position.to_state(own, self._rng_state() if position.finished else None)

    def _rng_state(self) -> Any:
        generator = self._torch_loader.generator
        return generator.get_state() if generator is not None else _torch().get_rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues where it stood.

        Raises:
            ValueError: ``state`` is not a state this loader saved.
            LedgerError: The state's position does not match the batches its epoch handed
                out (its ledger): resuming from it would repeat or lose batches.

        """
        checked = check_state(state, self._torch_loader.generator is not None)
        tl = self._torch_loader
        streams = tl.num_workers if self._iterable and tl.num_workers > 0 else None
        saved = checked["ledger"]
        if (
            isinstance(saved, list)
            and len(saved) == (streams or 1)  # else iter() says the worker counts differ
            and not checked["finished"]
            and ledger_check()
        ):
            position = Position(
                None,
                yielded=int(checked["batches_yielded"]),
                ahead=set(checked["yielded_ahead"]),
                worker_batches=checked["worker_batches"],
            )
            LoaderLedger(streams, saved).check(position, end=False)
        self._pending = checked


def _check_count(name: str, value: Any) -> None:
    """Raise unless ``value`` is ``None`` or an int >= 1."""
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ConfigurationError(f"{name} must be an int >= 1, got {value!r}")


def _stream_batches(loader: Any) -> tuple[int, bool]:
    # An iterable dataset's batching in each worker: (items per batch, drop_last).
    tl = loader._torch_loader
    auto = bool(tl._auto_collation)
    return (tl.batch_size if auto else 1), bool(tl.drop_last) and auto
