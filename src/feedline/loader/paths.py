"""``PathList``: millions of file paths in two NumPy buffers instead of millions of objects.

A Python list of 2 million path strings costs about 200 MB (an object, a header and a
reference count per string), and worse, every worker process that touches the strings writes
to their reference counts, so the pages that ``fork`` shared get copied into each worker. A
``PathList`` holds the UTF-8 bytes of all paths in one ``uint8`` buffer and their end offsets
in one ``int64`` buffer: about (average length + 8) bytes per path, no per-path object, nothing
written on read, and it pickles as two buffers.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from itertools import islice
from typing import Any, overload

import numpy as np

__all__ = ["PathList"]


class PathList(Sequence[str]):
    """An immutable sequence of strings stored compactly (see the module doc).

    Args:
        paths: Any iterable of ``str`` (or ``os.PathLike``); it is consumed once.

    Example::

        files = PathList(str(p) for p in root.rglob("*.jpg"))
        files[123_456]      # 'train/n01440764/n01440764_10026.JPEG'

    """

    __slots__ = ("_data", "_ends")

    def __init__(self, paths: Iterable[Any] = ()) -> None:
        # Encoded in chunks into one growing buffer, so that neither a list of the paths nor a
        # second copy of the bytes ever exists: the peak is about the final size.
        data = bytearray()
        lengths: list[np.ndarray[Any, Any]] = []
        iterator = iter(paths)
        while True:
            chunk = [str(p).encode("utf-8", "surrogateescape") for p in islice(iterator, 65536)]
            if not chunk:
                break
            lengths.append(np.fromiter(map(len, chunk), dtype=np.int64, count=len(chunk)))
            data += b"".join(chunk)
        sizes = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
        self._ends: np.ndarray[Any, Any] = np.cumsum(sizes, dtype=np.int64)
        self._data: np.ndarray[Any, Any] = np.frombuffer(data, dtype=np.uint8)
        self._data.flags.writeable = False

    @classmethod
    def from_buffers(cls, data: np.ndarray[Any, Any], ends: np.ndarray[Any, Any]) -> PathList:
        """Wrap existing buffers (UTF-8 bytes and end offsets), e.g. loaded with ``np.load``."""
        data, ends = np.asarray(data), np.asarray(ends)
        if data.dtype != np.uint8 or data.ndim != 1 or ends.ndim != 1:
            raise ValueError("data must be a 1-D uint8 array and ends a 1-D integer array")
        if ends.size and (ends[-1] != data.size or (np.diff(ends) < 0).any() or ends[0] < 0):
            raise ValueError("ends must be non-decreasing offsets ending at len(data)")
        new = cls.__new__(cls)
        new._data, new._ends = data, ends.astype(np.int64, copy=False)
        return new

    def __len__(self) -> int:
        return int(self._ends.size)

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> PathList: ...
    def __getitem__(self, index: int | slice) -> str | PathList:
        if isinstance(index, slice):
            return PathList(self[i] for i in range(*index.indices(len(self))))
        n = len(self)
        i = int(index)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"PathList index {index} out of range for {n} paths")
        start = int(self._ends[i - 1]) if i else 0
        return self._data[start : int(self._ends[i])].tobytes().decode("utf-8", "surrogateescape")

    def __iter__(self) -> Iterator[str]:
        for i in range(len(self)):
            yield self[i]

    @property
    def nbytes(self) -> int:
        """Bytes held by the two buffers."""
        return int(self._data.nbytes + self._ends.nbytes)

    def __reduce__(self) -> tuple[Any, ...]:
        return (PathList.from_buffers, (self._data, self._ends))

    def __repr__(self) -> str:
        return f"PathList({len(self)} paths, {self.nbytes / 2**20:.1f} MiB)"
