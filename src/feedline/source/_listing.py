"""One listing per job: a prefix's keys, listed once and kept as a manifest beside the cache.

Every process of a job that lists the same prefix (each rank, each DataLoader worker) would
otherwise send the same LIST requests: a thousand keys per request on S3, so a 100,000-key
prefix costs a hundred requests per process, and start-up waits for them. With a cache
directory, :class:`RemoteStore.keys` lists once and writes the sorted keys to a manifest
there; the other processes that share the directory (workers of one machine; ranks, where it is
a shared file system) read the manifest instead. A lock file makes the processes that ask at
once wait for the first one's listing rather than all list.

With a ``torch.distributed`` group, the ranks share one listing too (:func:`shared_listing`):
the group's first rank lists (or reads its manifest) and broadcasts the keys, which each
other rank keeps as the manifest of its own cache directory, for its workers.

A manifest is a header (magic, when it was listed, the key count and the CRC-32 of the body)
and the keys, UTF-8, each ended by a NUL byte (a key may hold any other character). It is
written to a temporary name and renamed into place. One that is too old (``max_age``), damaged,
or not of this store's URL and prefix is listed again.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import struct
import tempfile
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from feedline.errors import rebuilds

__all__ = ["listed_once", "save_manifest", "shared_listing"]

_MAGIC = b"feedline-keys-1\n"
_HEADER = struct.Struct("<dQI")  # listed at (Unix time), key count, CRC-32 of the body
_PARTIAL = ".partial-"  # ObjectCache removes such files that a killed process left


def _paths(directory: Path, url: str, prefix: str) -> tuple[Path, Path]:
    name = hashlib.sha256(f"{url}\0{prefix}".encode()).hexdigest()[:32]
    return directory / f"listing-{name}.keys", directory / f"listing-{name}.lock"


def _read(path: Path, max_age: float | None) -> list[str] | None:
    # The manifest's keys, or None: missing, too old, or not what was written.
    try:
        data = path.read_bytes()
    except OSError:
        return None
    head = len(_MAGIC) + _HEADER.size
    if len(data) < head or not data.startswith(_MAGIC):
        return None
    listed_at, count, crc = _HEADER.unpack_from(data, len(_MAGIC))
    if max_age is not None and time.time() - listed_at > max_age:
        return None
    body = data[head:]
    if zlib.crc32(body) != crc:
        return None
    keys = body.decode("utf-8").split("\0")[:-1] if body else []
    return keys if len(keys) == count else None


def _write(path: Path, keys: list[str]) -> None:
    body = b"".join(key.encode("utf-8") + b"\0" for key in keys)
    header = _MAGIC + _HEADER.pack(time.time(), len(keys), zlib.crc32(body))
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_PARTIAL)
        with os.fdopen(fd, "wb") as f:
            f.write(header)
            f.write(body)
        os.replace(tmp, path)
        tmp = None
    except OSError:
        pass  # a full disk: the next process lists for itself
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    # An exclusive lock on ``path`` across processes (released if the process dies).
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError:  # a read-only directory: no lock, each process lists
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def listed_once(
    directory: Path,
    url: str,
    prefix: str,
    list_keys: Callable[[], list[str]],
    *,
    max_age: float | None,
    refresh: bool,
) -> tuple[list[str], bool]:
    """The sorted keys under ``prefix``: from its manifest, or ``list_keys()`` (then saved).

    Returns the keys and whether they were listed now (``False``: read from the manifest).
    ``max_age``: seconds after which a manifest is listed again (``None``: never);
    ``refresh``: list again whatever the manifest's age.
    """
    manifest, lock = _paths(directory, url, prefix)
    if not refresh:
        keys = _read(manifest, max_age)
        if keys is not None:
            return keys, False
    with _locked(lock):
        if not refresh:  # another process may have listed while this one waited
            keys = _read(manifest, max_age)
            if keys is not None:
                return keys, False
        keys = list_keys()
        _write(manifest, keys)
        return keys, True


def save_manifest(directory: Path, url: str, prefix: str, keys: list[str]) -> None:
    """Keep ``keys`` (all of the prefix's, sorted) as its manifest in ``directory``."""
    _write(_paths(directory, url, prefix)[0], keys)


def shared_listing(
    group: Any,
    listing: Callable[[], tuple[list[str], bool]],
    failed: Callable[[str], BaseException],
) -> tuple[list[str], bool]:
    """``listing()`` on the first rank of the ``torch.distributed`` ``group``, sent to the rest.

    Every rank of the group must call it. Returns the keys and whether this rank listed them.
    The first rank's error is raised on every rank (as it is where it pickles, else as
    ``failed(its message)``), so that no rank waits for keys that never come.
    """
    import torch.distributed as dist

    first = dist.get_global_rank(group, 0)
    message: list[Any] = [None]
    if dist.get_rank() == first:
        try:
            keys, listed = listing()
        except Exception as error:
            message[0] = ("error", error if rebuilds(error) else str(error))
            dist.broadcast_object_list(message, src=first, group=group)
            raise
        message[0] = ("keys", keys)
        dist.broadcast_object_list(message, src=first, group=group)
        return keys, listed
    dist.broadcast_object_list(message, src=first, group=group)
    kind, value = message[0]
    if kind == "error":
        raise value if isinstance(value, BaseException) else failed(str(value))
    return value, False
