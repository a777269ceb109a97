"""A cache of fetched objects, in memory and on local disk, each tier within a byte budget.

Training reads the same objects every epoch; from the second on, a cache turns each remote read
into a memory lookup or a local file read. :class:`ObjectCache` keeps the most recently used
objects in memory up to ``memory_bytes`` and, with a ``directory``, on disk up to
``disk_bytes``; the least recently used go first. Pass it to :class:`RemoteStore` as
``cache=``.

Files are written to a temporary name and renamed into place, so a reader never sees half an
object, and each starts with the object's length, so a file cut short (a full disk, a crash)
is found and dropped instead of returned. A file is named by the SHA-256 of its key.

Several processes (DataLoader workers) may share a directory: each keeps its own index of the
files, adds what it fetched and evicts what it knows of, so the directory can exceed the budget
by what the other processes added since they last looked. Files are not sharded into
subdirectories: keep a directory under a few million objects.
"""

from __future__ import annotations

import hashlib
import os
import struct
import tempfile
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from feedline.errors import ConfigurationError

__all__ = ["CacheStats", "ObjectCache"]


@dataclass(frozen=True)
class CacheStats:
    """What an :class:`ObjectCache` holds and how often it was asked.

    Attributes:
        memory_hits: Lookups answered from memory.
        disk_hits: Lookups answered from disk (the object is then kept in memory too).
        misses: Lookups that found nothing.
        memory_bytes: Bytes held in memory now.
        disk_bytes: Bytes this process knows to be on disk now.
        evictions: Objects dropped to stay within a budget (either tier).

    """

    memory_hits: int
    disk_hits: int
    misses: int
    memory_bytes: int
    disk_bytes: int
    evictions: int


def _budget(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(f"ObjectCache({name}=...) must be an int >= 0, got {value!r}")
    return value


class ObjectCache:
    """Objects by key, the most recently used kept in memory and on disk within byte budgets.

    Thread-safe. An object larger than a tier's whole budget is not kept in that tier.

    Args:
        memory_bytes: The most bytes kept in memory (0: none).
        directory: Where to keep objects on disk (created if missing); ``None``: memory only.
        disk_bytes: The most bytes kept in ``directory``.

    Raises:
        ConfigurationError: A budget is not an int >= 0.

    """

    def __init__(
        self,
        memory_bytes: int = 1 << 30,
        *,
        directory: str | os.PathLike[str] | None = None,
        disk_bytes: int = 32 << 30,
    ) -> None:
        self._memory_budget = _budget("memory_bytes", memory_bytes)
        self._disk_budget = _budget("disk_bytes", disk_bytes)
        self._lock = threading.Lock()
        self._memory: OrderedDict[str, bytes] = OrderedDict()
        self._memory_bytes = 0
        self._disk: OrderedDict[str, int] = OrderedDict()  # file name -> size, oldest first
        self._disk_bytes = 0
        self._hits_memory = self._hits_disk = self._misses = self._evictions = 0
        self.directory = None if directory is None else Path(directory)
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._scan(self.directory)

    def __repr__(self) -> str:
        where = f", directory={str(self.directory)!r}" if self.directory else ""
        return f"ObjectCache(memory_bytes={self._memory_budget}{where})"

    def __reduce__(self) -> tuple[object, ...]:
        # A copy in another process starts with an empty memory tier and the same directory.
        return (_rebuild, (self._memory_budget, self.directory, self._disk_budget))

    def peek(self, key: str) -> bytes | None:
        """The object if it is in memory (counted as a hit), else ``None`` (not counted).

        Never touches the disk: for an event loop, which should leave file reads to a thread.
        """
        with self._lock:
            return self._from_memory(key)

    def disk_size(self, key: str) -> int | None:
        """The size of ``key``'s file if this cache knows of one (no disk access), else ``None``.

        Lets an event loop read small files itself and leave large ones to a thread.
        """
        if self.directory is None:
            return None
        name = hashlib.sha256(key.encode()).hexdigest()
        with self._lock:
            return self._disk.get(name)

    def get(self, key: str) -> bytes | None:
        """The object cached under ``key`` (from memory, else from disk), or ``None``."""
        with self._lock:
            data = self._from_memory(key)
        if data is not None:
            return data
        data = self._read_file(key)
        with self._lock:
            if data is None:
                self._misses += 1
                return None
            self._hits_disk += 1
            self._remember(key, data)
        return data

    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Keep ``data`` under ``key`` (a copy; replaces what was there)."""
        blob = bytes(data)
        with self._lock:
            self._remember(key, blob)
        if self.directory is not None and len(blob) <= self._disk_budget:
            self._write_file(key, blob)

    def stats(self) -> CacheStats:
        """Hits, misses, bytes held and evictions so far."""
        with self._lock:
            return CacheStats(
                memory_hits=self._hits_memory,
                disk_hits=self._hits_disk,
                misses=self._misses,
                memory_bytes=self._memory_bytes,
                disk_bytes=self._disk_bytes,
                evictions=self._evictions,
            )

    # -- memory tier (call with the lock held) ---------------------------------------------------

    def _from_memory(self, key: str) -> bytes | None:
        data = self._memory.get(key)
        if data is not None:
            self._memory.move_to_end(key)
            self._hits_memory += 1
        return data

    def _remember(self, key: str, data: bytes) -> None:
        if len(data) > self._memory_budget:
            return
        old = self._memory.pop(key, None)
        if old is not None:
            self._memory_bytes -= len(old)
        self._memory[key] = data
        self._memory_bytes += len(data)
        while self._memory_bytes > self._memory_budget:
            _, dropped = self._memory.popitem(last=False)
            self._memory_bytes -= len(dropped)
            self._evictions += 1

    # -- disk tier -------------------------------------------------------------------------------

    def _path(self, key: str) -> Path:
        assert self.directory is not None  # only called with a directory
        return self.directory / hashlib.sha256(key.encode()).hexdigest()

    def _scan(self, directory: Path) -> None:
        found = []
        for entry in os.scandir(directory):
            if len(entry.name) != 64 or not entry.is_file():
                continue  # not ours, or a .partial- file being written
            try:
                stat = entry.stat()
            except FileNotFoundError:  # removed by another process meanwhile
                continue
            found.append((stat.st_mtime, entry.name, max(0, stat.st_size - _HEADER.size)))
        for _, name, size in sorted(found):
            self._disk[name] = size
            self._disk_bytes += size
        for name in self._evict_files():
            (directory / name).unlink(missing_ok=True)

    def _read_file(self, key: str) -> bytes | None:
        if self.directory is None:
            return None
        path = self._path(key)
        try:
            with open(path, "rb") as f:
                head = f.read(_HEADER.size)
                data = f.read()
        except FileNotFoundError:
            self._forget(path.name)
            return None
        if len(head) != _HEADER.size or _HEADER.unpack(head)[0] != len(data):
            self._forget(path.name)  # cut short (a full disk, a crash): drop it
            path.unlink(missing_ok=True)
            return None
        with self._lock:
            if path.name not in self._disk:  # written by another process
                self._disk_bytes += len(data)
            self._disk[path.name] = len(data)
            self._disk.move_to_end(path.name)
        return data

    def _write_file(self, key: str, data: bytes) -> None:
        path = self._path(key)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".partial-")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(_HEADER.pack(len(data)))
                f.write(data)
            os.replace(tmp, path)
        except OSError:  # a full disk or a vanished directory: the cache is best effort
            Path(tmp).unlink(missing_ok=True)
            return
        with self._lock:
            old = self._disk.pop(path.name, None)
            if old is not None:
                self._disk_bytes -= old
            self._disk[path.name] = len(data)
            self._disk_bytes += len(data)
            doomed = self._evict_files()
        for name in doomed:
            (path.parent / name).unlink(missing_ok=True)

    def _evict_files(self) -> list[str]:
        # Drop the oldest files from the index until within budget; the caller deletes them
        # (outside the lock). Call with the lock held, or during construction.
        doomed = []
        while self._disk_bytes > self._disk_budget and self._disk:
            name, size = self._disk.popitem(last=False)
            self._disk_bytes -= size
            self._evictions += 1
            doomed.append(name)
        return doomed

    def _forget(self, name: str) -> None:
        with self._lock:
            size = self._disk.pop(name, None)
            if size is not None:
                self._disk_bytes -= size


_HEADER = struct.Struct("<Q")  # each file starts with the object's length: a short file is found


def _rebuild(memory_bytes: int, directory: Path | None, disk_bytes: int) -> ObjectCache:
    return ObjectCache(memory_bytes, directory=directory, disk_bytes=disk_bytes)
