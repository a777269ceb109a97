"""Where a pipeline's data comes from: object storage (S3, GCS, Azure, HTTP, local files).

:class:`RemoteStore` reads objects with many requests in flight, retries and timeouts; its
``read`` is meant for an async stage of a pipeline, ``read_sync`` for a dataset's
``__getitem__``. It needs the ``remote`` extra (``pip install 'feedline[remote]'``).
:class:`ObjectCache` keeps what it read in memory and on local disk for the next epoch.
:class:`StoredSamples` is a dataset of objects' (or files') bytes, :class:`TarShards` the
samples of tar shards (the WebDataset layout), streamed.
"""

from __future__ import annotations

import typing as _typing

from .cache import CacheStats, ObjectCache
from .remote import RemoteStats, RemoteStore
from .stored import StoredSamples

__all__ = ["CacheStats", "ObjectCache", "RemoteStats", "RemoteStore", "StoredSamples", "TarShards"]


def __getattr__(name: str) -> _typing.Any:
    # TarShards is a torch IterableDataset where torch is installed: imported on first use,
    # so that this package does not import torch.
    if name == "TarShards":
        from .shards import TarShards

        return TarShards
    raise AttributeError(f"module 'feedline.source' has no attribute {name!r}")
