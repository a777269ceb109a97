"""Samples streamed from tar shards (the WebDataset layout), shuffled, split, resumable.

:class:`TarShards` reads whole shards from a :class:`~feedline.RemoteStore` or a directory,
a few ahead of the one being read (each read waits on the store's latency on a thread of its
own), walks each with :func:`~feedline.io.tar.tar_samples` (no copy of the shard), and yields
the samples. Each epoch, the shards are shuffled from the seed and the epoch, split between
the ranks of a distributed job (``shards[rank::world]``) and then between the DataLoader
worker processes of a rank (by ``torch.utils.data.get_worker_info()``), and the samples are
shuffled in a buffer. Everything in that order is a function of the seed and the epoch, so a
resumed epoch passes over the samples already handed out and goes on with the next one.
"""

from __future__ import annotations

import collections
import random
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from feedline.errors import ConfigurationError
from feedline.io.tar import tar_samples

from .stored import StoredSamples

__all__ = ["TarShards"]

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
    order (as with PyTorch). :meth:`state_dict` says how far an iteration went; after
    :meth:`load_state_dict`, the next iteration goes on from there (it reads the shards
    again up to that point, but hands out nothing twice).

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
    ) -> None:
        self.shards = StoredSamples(store, keys)
        for name, value, least in (("shuffle", shuffle, 0), ("read_ahead", read_ahead, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ConfigurationError(f"{name} must be an int >= {least}, got {value!r}")
        self.shuffle, self.seed, self.read_ahead = shuffle, seed, read_ahead
        self.rank, self.world_size = _rank_and_world(rank, world_size)
        self.epoch = 0
        self._yielded = 0  # samples of self.epoch handed out by the last iteration
        self._skip = 0  # handed out before a resume: passed over by the next iteration

    def set_epoch(self, epoch: int) -> None:
        """Shuffle for ``epoch`` from the next iteration on."""
        if epoch != self.epoch:
            self.epoch, self._yielded, self._skip = epoch, 0, 0

    def state_dict(self) -> dict[str, int]:
        """The epoch and the samples of it handed out (in this process)."""
        return {"epoch": self.epoch, "yielded": self._yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Go on from ``state`` at the next iteration."""
        self.epoch, self._yielded = int(state["epoch"]), int(state["yielded"])
        self._skip = self._yielded

    def my_shards(self) -> list[str]:
        """The shards this rank (and worker process) reads this epoch, in order."""
        keys = list(self.shards.keys)
        if self.shuffle:
            random.Random(f"{self.seed}:{self.epoch}:shards").shuffle(keys)
        keys = keys[self.rank :: self.world_size]
        worker = _worker()
        return keys if worker is None else keys[worker[0] :: worker[1]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        skip, self._skip = self._skip, 0
        self._yielded = 0
        for sample in self._shuffled(self._samples(self.my_shards())):
            if self._yielded < skip:
                self._yielded += 1
                continue
            self._yielded += 1
            yield sample

    def _samples(self, keys: list[str]) -> Iterator[dict[str, Any]]:
        # Each shard's samples in order, the next shards read meanwhile.
        place = {key: k for k, key in enumerate(self.shards.keys)}
        upcoming = iter(keys)
        pending: collections.deque[tuple[str, Future[Any]]] = collections.deque()
        pool = ThreadPoolExecutor(self.read_ahead + 1, thread_name_prefix="feedline-shard")

        def read_next() -> bool:
            key = next(upcoming, None)
            if key is None:
                return False
            pending.append((key, pool.submit(self.shards.read, place[key])))
            return True

        try:
            # The first shard alone: the shards after it would share its bandwidth and
            # delay the first samples; they are read while its samples go on.
            read_next()
            while pending:
                key, future = pending.popleft()
                data = future.result()
                while len(pending) <= self.read_ahead and read_next():
                    pass
                yield from tar_samples(data, shard=key)
        finally:
            for _, future in pending:
                future.cancel()
            pool.shutdown(wait=True)

    def _shuffled(self, samples: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
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
        rng = random.Random(f"{self.seed}:{self.epoch}:{self.rank}:{number}")
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
