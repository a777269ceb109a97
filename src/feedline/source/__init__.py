"""Where a pipeline's data comes from: object storage (S3, GCS, Azure, HTTP, local files).

:class:`RemoteStore` reads objects with many requests in flight, retries and timeouts; its
``read`` is meant for an async stage of a pipeline, ``read_sync`` for a dataset's
``__getitem__``. It needs the ``remote`` extra (``pip install 'feedline[remote]'``).
:class:`ObjectCache` keeps what it read in memory and on local disk for the next epoch.
"""

from __future__ import annotations

from .cache import CacheStats, ObjectCache
from .remote import RemoteStats, RemoteStore

__all__ = ["CacheStats", "ObjectCache", "RemoteStats", "RemoteStore"]
