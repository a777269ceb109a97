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

import itertools
import logging
import threading
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Generic, TypeVar

from feedline.errors import ConfigurationError, PipelineFailure
from feedline.pipeline import Pipeline, PipelineBuilder

from ._fetch import BatchFetcher, FailureTally, Task
from ._workers import WorkerSet

__all__ = ["DataLoader"]

T = TypeVar("T")
_log = logging.getLogger("feedline.loader")
_STATE_VERSION = 1
_SKIP = object()


def _torch() -> Any:
    try:
        import torch
        import torch.utils.data
    except ImportError as exc:
        raise ImportError(
            "feedline.DataLoader builds on PyTorch's samplers and collation: "
            "pip install 'feedline[torch]'"
        ) from exc
    return torch


class _Abort:
    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


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
        pin_memory: Pin batches in a dedicated thread (when CUDA is available).
        timeout: Seconds to wait for a batch (``0``: no limit); a longer wait raises.
        worker_init_fn: Called with the worker id in each worker process, once, after it is
            seeded (as in PyTorch; it sees ``torch.utils.data.get_worker_info()``).
        multiprocessing_context: Start method of worker processes, by name or as a
            ``multiprocessing`` context; ``None`` means ``"forkserver"``. ``"fork"`` is
            refused: this process runs threads.
        prefetch_factor: Batches in flight per worker (per loader when ``num_workers=0``);
            default 2.
        persistent_workers: Keep worker processes between epochs.
        pin_memory_device: Deprecated in PyTorch; must be ``""``.
        fetch_concurrency: How many ``dataset[i]`` calls run at once (per process). Default:
            twice the batch size, at most 64.
        max_failures: How many failing ``dataset[i]`` calls to skip (logged, counted; the
            batch comes out smaller) before iteration raises :class:`~feedline.PipelineFailure`:
            an int, a float fraction of items, or ``None`` for no limit. Default 0: the first
            failure raises, naming the index.

    Example::

        loader = feedline.DataLoader(dataset, batch_size=32, shuffle=True, fetch_concurrency=64)
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
        num_workers: int = 0,
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
        fetch_concurrency: int | None = None,
        max_failures: int | float | None = 0,
    ) -> None:
        torch = _torch()
        if pin_memory_device:
            raise ConfigurationError(
                "pin_memory_device is deprecated in PyTorch and not supported: batches are "
                "pinned for the current CUDA device; move them with batch.to(device)"
            )
        if hasattr(multiprocessing_context, "get_start_method"):  # a context object
            multiprocessing_context = multiprocessing_context.get_start_method()
        if multiprocessing_context == "fork":
            raise ConfigurationError(
                "multiprocessing_context='fork' is unsafe here: feedline runs threads, and a "
                "forked child inherits their locks. Use 'forkserver' (default) or 'spawn'"
            )
        # PyTorch's own constructor validates the arguments and builds the samplers.
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
        self._iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        if self._iterable and num_workers > 0:
            raise ConfigurationError(
                "num_workers > 0 with an IterableDataset is not supported: each worker would "
                "need to shard the stream itself. Use num_workers=0 (the dataset is iterated "
                "in this process and its batches collated on threads), or a map-style dataset"
            )
        if fetch_concurrency is None:
            fetch_concurrency = min(64, 2 * batch_size) if batch_size else 16
        if (
            isinstance(fetch_concurrency, bool)
            or not isinstance(fetch_concurrency, int)
            or fetch_concurrency < 1
        ):
            raise ConfigurationError(
                f"fetch_concurrency must be an int >= 1, got {fetch_concurrency!r}"
            )
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
        if prefetch_factor is not None and (
            isinstance(prefetch_factor, bool)
            or not isinstance(prefetch_factor, int)
            or prefetch_factor < 1
        ):
            raise ConfigurationError(
                f"prefetch_factor must be an int >= 1, got {prefetch_factor!r}"
            )
        self.prefetch_factor = prefetch_factor or 2
        self.fetch_concurrency = fetch_concurrency
        self.max_failures = max_failures
        self.mp_context = multiprocessing_context or "forkserver"
        self._workers: WorkerSet | None = None
        self._current: weakref.ref[_LoaderIter[T]] | None = None
        self._pending: dict[str, Any] | None = None
        self._pin = bool(pin_memory) and bool(torch.cuda.is_available())
        if pin_memory and not self._pin:
            warnings.warn(
                "pin_memory=True but CUDA is not available: batches are not pinned",
                stacklevel=2,
            )
        holder: list[WorkerSet | None] = [None]
        self._finalizer = weakref.finalize(self, DataLoader._close_workers, holder)

    def __getattr__(self, name: str) -> Any:
        # dataset, batch_size, sampler, batch_sampler, collate_fn, generator, ... as PyTorch's.
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self._torch_loader, name)

    def __len__(self) -> int:
        return len(self._torch_loader)

    @property
    def in_flight(self) -> int:
        """Batches fetched ahead of the consumer."""
        loader = self._torch_loader
        per = self.prefetch_factor
        if loader.batch_size is None and loader.batch_sampler is None:
            return self.fetch_concurrency
        return per * max(1, int(loader.num_workers))

    def __iter__(self) -> Iterator[T]:
        previous = self._current() if self._current is not None else None
        if previous is not None and self._torch_loader.num_workers > 0:
            previous.supersede()  # the workers serve one epoch at a time, as in PyTorch
        state, self._pending = self._pending, None
        iterator: _LoaderIter[T] = _LoaderIter(self, state)
        self._current = weakref.ref(iterator)
        return iterator

    def _worker_set(self) -> WorkerSet:
        if self._workers is None:
            loader = self._torch_loader
            self._workers = WorkerSet(
                loader.dataset,
                num_workers=loader.num_workers,
                concurrency=self.fetch_concurrency,
                prefetch=self.prefetch_factor,
                worker_init_fn=loader.worker_init_fn,
                mp_context=self.mp_context,
                timeout=loader.timeout or None,
            )
            self._finalizer.detach()
            holder: list[WorkerSet | None] = [self._workers]
            self._finalizer = weakref.finalize(self, DataLoader._close_workers, holder)
        return self._workers

    def _epoch_ended(self) -> None:
        if self._workers is not None and not self._torch_loader.persistent_workers:
            self.close()

    @staticmethod
    def _close_workers(holder: list[WorkerSet | None]) -> None:
        for workers in holder:
            if workers is not None:
                workers.close()

    def close(self) -> None:
        """Stop the running epoch, if any, and the worker processes. Idempotent."""
        current = self._current() if self._current is not None else None
        if current is not None:
            current.close()
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def state_dict(self) -> dict[str, Any]:
        """Where iteration stands: enough to resume exactly, mid-epoch or between epochs.

        Costs one copy of the random state, made once per epoch when the epoch starts.
        """
        torch = _torch()
        current = self._current() if self._current is not None else None
        if self._pending is not None:
            return dict(self._pending)
        if current is not None and not current.finished:
            rng, batches, ahead = current.rng_at_start, current.yielded, current.yielded_ahead
        else:
            generator = self._torch_loader.generator
            rng = generator.get_state() if generator is not None else torch.get_rng_state()
            batches, ahead = 0, set()
        return {
            "version": _STATE_VERSION,
            "rng_state": rng.clone(),
            "own_generator": self._torch_loader.generator is not None,
            # Batches 0..batches_yielded-1 were handed out, and (with in_order=False) these
            # later ones too.
            "batches_yielded": batches,
            "yielded_ahead": sorted(ahead),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Resume from :meth:`state_dict`: the next ``iter()`` continues where it stood."""
        if not isinstance(state, dict) or state.get("version") != _STATE_VERSION:
            raise ValueError(
                "not a feedline DataLoader state (expected a dict from DataLoader.state_dict() "
                f"with version {_STATE_VERSION})"
            )
        if state["own_generator"] != (self._torch_loader.generator is not None):
            raise ValueError(
                "the state was saved by a loader "
                + ("with" if state["own_generator"] else "without")
                + " a generator=; resume with the same kind of loader"
            )
        self._pending = dict(state)


class _Finisher:
    """The collate stage: drops failed items, then collates.

    It holds no reference to the iterator, so dropping the iterator stops its pipeline at once
    (no reference cycle to wait for the garbage collector).
    """

    def __init__(self, tally: FailureTally, collate_fn: Callable[[Any], Any], auto: bool) -> None:
        self._tally = tally
        self._collate_fn = collate_fn
        self._auto = auto

    def __call__(self, fetched: tuple[int, list[Any]]) -> Any:
        number, items = fetched
        try:
            good = self._tally.keep(items)
            if not good:
                return number, _SKIP
            return number, self._collate_fn(good if self._auto else good[0])
        except PipelineFailure as failure:
            return _Abort(failure)


class _LoaderIter(Generic[T]):
    """One epoch of a DataLoader."""

    def __init__(self, loader: DataLoader[T], state: dict[str, Any] | None) -> None:
        torch = _torch()
        tl = loader._torch_loader
        generator = tl.generator
        if state is not None:
            if generator is not None:
                generator.set_state(state["rng_state"])
            else:
                torch.set_rng_state(state["rng_state"])
        self.rng_at_start = (
            generator.get_state() if generator is not None else torch.get_rng_state()
        )
        skip = 0 if state is None else int(state["batches_yielded"])
        self.yielded = skip  # every batch numbered below this was handed out
        self.yielded_ahead: set[int] = set() if state is None else set(state["yielded_ahead"])
        self.finished = False
        # A strong reference: ``for batch in DataLoader(...)`` drops the loader at once, and
        # its worker processes must live until the epoch ends.
        self._loader: DataLoader[T] | None = loader
        self._timeout = tl.timeout or None
        self._closed = False
        self._superseded = False
        self._lock = threading.Lock()
        # The same draws, in the same order, as PyTorch's iterator: sampler, then base seed.
        sampler_iter = iter(tl._index_sampler)
        base_seed = int(torch.empty((), dtype=torch.int64).random_(generator=generator).item())
        self._finish = _Finisher(
            FailureTally(loader.max_failures), tl.collate_fn, bool(tl._auto_collation)
        )
        self._fetcher: BatchFetcher | None = None
        self._first_pending: BatchFetcher | None = None
        self._pin_pool: ThreadPoolExecutor | None = None
        builder: PipelineBuilder[Any] = PipelineBuilder()
        self._numbered = not loader._iterable
        if loader._iterable:
            self._add_iterable_source(builder, tl, skip)
        else:
            self._add_map_source(builder, loader, sampler_iter, skip, base_seed)
        if loader._pin:
            self._pin_pool = ThreadPoolExecutor(1, thread_name_prefix="feedline-pin")
            builder.pipe(
                lambda batch: _pin(torch, batch), executor=self._pin_pool, name="pin_memory"
            )
        builder.add_sink(loader.in_flight)
        self._pipeline: Pipeline[Any] = builder.build(max_failures=0)
        self._finalizer = weakref.finalize(
            self, _LoaderIter._shutdown, self._pipeline, self._fetcher, self._pin_pool
        )
        self._pipeline.start()

    def _add_map_source(
        self,
        builder: PipelineBuilder[Any],
        loader: DataLoader[T],
        sampler_iter: Iterator[Any],
        skip: int,
        base_seed: int,
    ) -> None:
        tl = loader._torch_loader
        auto = tl._auto_collation
        batches = (b if auto else [b] for b in sampler_iter)
        ahead = frozenset(self.yielded_ahead)
        tasks: Iterator[Task] = (
            (n, b)
            for n, b in zip(itertools.count(skip), itertools.islice(batches, skip, None))
            if n not in ahead
        )
        first = list(itertools.islice(tasks, 1))  # the sampler draws its seed now, here
        tasks = itertools.chain(first, tasks)
        order = "input" if tl.in_order else "completion"
        if tl.num_workers > 0:
            builder.add_source(loader._worker_set().epoch(list(tasks), base_seed))
        else:
            self._fetcher = BatchFetcher(
                tl.dataset, loader.fetch_concurrency, wait_for_delivery=True
            )
            # Told when the consumer holds the first batch: only then do the other batches
            # start, so that their threads take no CPU from the first batch's collation and
            # hand-over (measured on 2 cores: up to 18 ms between the first batch's collation
            # and the consumer holding it, when the next batches started at collation).
            self._first_pending = self._fetcher
            builder.add_source(tasks)
            builder.pipe(
                self._fetcher.fetch,
                concurrency=loader.in_flight,
                output_order=order,
                name="fetch",
                buffer_size=max(2, loader.in_flight),  # whole batches: keep this queue short
            )
        builder.pipe(self._finish, name="collate_fn")

    def _add_iterable_source(self, builder: PipelineBuilder[Any], tl: Any, skip: int) -> None:
        items = iter(tl.dataset)
        if tl._auto_collation:
            drop = skip * tl.batch_size
            builder.add_source(itertools.islice(items, drop, None))
            builder.aggregate(tl.batch_size, drop_last=tl.drop_last)
        else:
            builder.add_source(itertools.islice(items, skip, None))
        builder.pipe(tl.collate_fn, name="collate_fn")

    def __iter__(self) -> _LoaderIter[T]:
        return self

    def __next__(self) -> T:
        while True:
            if self._closed:
                if self._superseded:
                    raise RuntimeError(
                        "this DataLoader iterator was stopped because a new iteration over the "
                        "loader started, and its worker processes serve one at a time; finish "
                        "(or drop) one loop before starting the next"
                    )
                raise StopIteration
            try:
                item = self._pipeline.get_item(timeout=self._timeout)
                fetcher, self._first_pending = self._first_pending, None
                if fetcher is not None:
                    fetcher.first_delivered()  # the other batches may start now
            except EOFError:
                self.finished = True
                self.close()
                raise StopIteration from None
            except TimeoutError:
                self.close()
                raise RuntimeError(
                    f"DataLoader timed out after {self._timeout} seconds waiting for a batch"
                ) from None
            except BaseException:
                self.close()
                raise
            if isinstance(item, _Abort):
                self.close()
                raise item.error
            if self._numbered:
                number, item = item
                self._count(number)
                if item is _SKIP:
                    continue
            else:
                self.yielded += 1
            return item  # type: ignore[no-any-return]

    def _count(self, number: int) -> None:
        # Out of order, a batch may come before those numbered below it: keep the watermark
        # and the few handed out above it.
        if number != self.yielded:
            self.yielded_ahead.add(number)
            return
        self.yielded += 1
        while self.yielded in self.yielded_ahead:
            self.yielded_ahead.remove(self.yielded)
            self.yielded += 1

    def supersede(self) -> None:
        """Stop this epoch because a newer one needs the worker processes."""
        self._superseded = True
        self.close()

    def close(self) -> None:
        """Stop this epoch's threads (and its pass in the worker processes)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self._finalizer()
        loader, self._loader = self._loader, None  # a closed iterator kept alive keeps no loader
        if loader is not None:
            loader._epoch_ended()

    @staticmethod
    def _shutdown(
        pipeline: Pipeline[Any], fetcher: BatchFetcher | None, pin: ThreadPoolExecutor | None
    ) -> None:
        pipeline.stop()
        if fetcher is not None:
            fetcher.close()
        if pin is not None:
            pin.shutdown(wait=True, cancel_futures=True)

    def __del__(self) -> None:
        if hasattr(self, "_finalizer"):  # __init__ may have raised before it was set
            self.close()
