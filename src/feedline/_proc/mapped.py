"""Mapping a shared-memory segment without keeping a file descriptor open for it.

``mmap.mmap(fd, size)`` keeps a duplicate of ``fd`` for as long as the mapping lives, so every
array received from a worker held a descriptor: a program that kept a few hundred batches (a
cache, a list of results) ran into the open-files limit (``OSError: [Errno 24]``; PyTorch's
``test_fd_limit_exceeded`` keeps 200). A mapping needs no descriptor once made. Python 3.13
says so with ``trackfd=False``; before it, :class:`_Mapping` calls libc's ``mmap`` through
ctypes.

Either way :func:`map_shared` returns the object that owns the mapping (``close()`` unmaps it,
and so does its deallocation) and the buffer to view it through, which keeps the owner alive.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import sys
from typing import Any

import numpy as np

__all__ = ["map_shared"]


def map_shared(fd: int, size: int) -> tuple[Any, Any]:
    """Map ``size`` bytes of ``fd`` shared and writable; the descriptor may be closed at once.

    Returns:
        ``(mapping, buffer)``: ``mapping.close()`` unmaps (also when it is garbage);
        ``buffer`` (for ``np.frombuffer``) keeps ``mapping`` alive while anything views it.

    """
    if sys.version_info >= (3, 13):
        mapping = mmap.mmap(fd, size, trackfd=False)
        return mapping, mapping
    owner = _Mapping(fd, size)
    return owner, owner.buffer()


class _Mapping:
    # A mapping made by libc's mmap (Python before 3.13). Unlike mmap.mmap, close() cannot
    # tell whether a view still uses the memory: it is called once the arrays viewing it are
    # garbage (see .unmap), and under the GIL nothing views it then, since every view keeps
    # the buffer, and so this object, alive.

    __slots__ = ("_address", "_size")

    def __init__(self, fd: int, size: int) -> None:
        libc = _libc()
        address = libc.mmap(None, size, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
        if address is None or address == _MAP_FAILED:
            error = ctypes.get_errno()
            raise OSError(error, f"mmap of a shared-memory segment: {os.strerror(error)}")
        self._address: int | None = address
        self._size = size

    @property
    def __array_interface__(self) -> dict[str, Any]:
        # What NumPy views: the mapping's bytes. The array keeps this object as its base.
        return {
            "data": (self._address, False),
            "shape": (self._size,),
            "typestr": "|u1",
            "version": 3,
        }

    def buffer(self) -> memoryview:
        """The mapping's bytes, keeping this object alive.

        A memoryview, not the array: an array made from an array takes its base, so views of
        it would not keep the array that :func:`~.unmap.hand_over` watches.
        """
        assert self._address is not None
        array: Any = np.asarray(self)
        return memoryview(array)

    def close(self) -> None:
        """Unmap (once); call only when nothing views the memory."""
        address, self._address = self._address, None
        if address is not None:
            _libc().munmap(address, self._size)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # (at exit, this module's globals may be gone)
            self.close()


_MAP_FAILED = ctypes.c_void_p(-1).value
_functions: Any = None


def _libc() -> Any:
    # libc's mmap and munmap with their C types, looked up on first use.
    global _functions
    if _functions is None:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        libc.munmap.restype = ctypes.c_int
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        _functions = libc
    return _functions
