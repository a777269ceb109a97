"""Preallocated batch buffers, filled slot by slot from many threads and recycled when dropped.

A decoder that writes each sample straight into ``batch[i]`` saves the copy that collating
separately decoded arrays would cost. :class:`BufferPool` owns a fixed number of such batch
arrays. :meth:`BufferPool.acquire` hands one out as an ordinary ``numpy.ndarray``; when the
last reference to it goes away (the array, any view of it, a tensor made from it without a
copy), its memory returns to the pool. So memory stays flat over an epoch, and a buffer can
never be reused while something still reads it. ``acquire`` blocks while every buffer is in
use: that is the pool's backpressure.

Memory is page-locked (pinned) when ``pin_memory`` asks for it and PyTorch with CUDA is
available, so that a host-to-GPU copy can run asynchronously; otherwise it is ordinary memory
aligned to 64 bytes (a cache line, and what SIMD decoders like).
"""

from __future__ import annotations

import ctypes
import math
import operator
import sys
import threading
import time
import weakref
from typing import Any

import numpy as np

from feedline.errors import ConfigurationError

__all__ = ["BufferPool"]

_ALIGN = 64


def _cuda_available() -> bool:
    torch = sys.modules.get("torch")  # never import torch just to ask
    return torch is not None and bool(torch.cuda.is_available())


def _allocate(nbytes: int, pinned: bool) -> tuple[np.ndarray[Any, Any], Any]:
    """Return a uint8 array of ``nbytes`` (aligned or pinned) and the object that owns it."""
    if pinned:
        import torch

        tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)
        return tensor.numpy()[:nbytes], tensor
    raw = np.empty(nbytes + _ALIGN, dtype=np.uint8)
    offset = (-raw.ctypes.data) % _ALIGN
    return raw[offset : offset + nbytes], raw


class BufferPool:
    """A fixed set of batch arrays of one shape and dtype, handed out and recycled.

    Args:
        shape: Shape of one batch, e.g. ``(32, 224, 224, 3)``.
        dtype: Element type (default ``uint8``).
        count: How many batches may be in use at once (>= 1). Two or three cover a
            pipeline that fills one batch while the consumer uses another.
        pin_memory: ``True``: page-locked memory (needs PyTorch with CUDA; raises otherwise).
            ``False``: ordinary aligned memory. ``None`` (default): pinned if PyTorch is
            already imported and CUDA is available.

    Example::

        pool = BufferPool((32, 224, 224, 3), count=3)
        batch = pool.acquire()  # (32, 224, 224, 3) uint8, contents undefined
        decode_image(data, size=(224, 224), out=batch[i])  # many threads, a slot each
        ...  # drop `batch` and its memory is reused

    """

    def __init__(
        self,
        shape: tuple[int, ...],
        dtype: Any = np.uint8,
        *,
        count: int = 3,
        pin_memory: bool | None = None,
    ) -> None:
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigurationError(f"count must be an int >= 1, got {count!r}")
        try:
            shape = tuple(operator.index(d) for d in shape)
        except TypeError:
            raise ConfigurationError(f"shape must be a tuple of ints, got {shape!r}") from None
        if any(d < 0 for d in shape):
            raise ConfigurationError(f"shape must not have negative dimensions, got {shape}")
        self.shape = shape
        self.dtype = np.dtype(dtype)
        if self.dtype.hasobject or self.dtype.itemsize == 0:
            raise ConfigurationError(
                f"a buffer of {self.dtype} cannot be shared: use a numeric dtype of a fixed size"
            )
        if math.prod(shape) * self.dtype.itemsize > sys.maxsize:
            raise ConfigurationError(
                f"a buffer of shape {shape} and {self.dtype} would hold more bytes than this "
                "machine can address; check the shape"
            )
        cuda = _cuda_available()
        if pin_memory and not cuda:
            raise ConfigurationError(
                "pin_memory=True needs PyTorch with CUDA (pinned memory only helps copies to a "
                "GPU); import torch first on a CUDA machine, or pass pin_memory=False"
            )
        self.pinned = bool(cuda if pin_memory is None else pin_memory)
        self.count = count
        self._items = math.prod(shape)
        nbytes = self._items * self.dtype.itemsize
        self.nbytes = nbytes
        self._memory: list[np.ndarray[Any, Any]] = []  # flat uint8, one per buffer
        self._owners: list[Any] = []
        for _ in range(count):
            flat, owner = _allocate(max(nbytes, 1), self.pinned)
            self._memory.append(flat)
            self._owners.append(owner)
        self._free = list(range(count))
        # Re-entrant: a batch's finalizer (_give_back) may run on a thread that holds it, when
        # an allocation there (the TimeoutError's message) collects a batch held in a cycle.
        self._cond = threading.Condition(threading.RLock())
        self._acquired = 0

    def acquire(self, timeout: float | None = None) -> np.ndarray[Any, Any]:
        """Take a free batch array (contents undefined), waiting while all are in use.

        Raises:
            TimeoutError: If none was free within ``timeout`` seconds.

        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._cond:
            while not self._free:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError(
                        f"all {self.count} buffers of shape {self.shape} are still in use "
                        f"after {timeout} s; a batch returns to the pool when the last "
                        "reference to it (views and tensors made from it included) is "
                        "dropped. Drop old batches sooner, or create the pool with a larger "
                        "count"
                    )
                self._cond.wait(remaining)
            index = self._free.pop()
            self._acquired += 1
        # Each hand-out gets its own owner object over the pool's memory. NumPy points every
        # view's .base at the object that owns the memory, so the owner lives exactly as long
        # as any array made from this hand-out; its finalizer returns the buffer. (A plain
        # view would not do: a slice of it points past it, at the pool's own array.)
        memory: Any = self._memory[index]
        owner: Any = (ctypes.c_uint8 * len(memory)).from_buffer(memory)
        weakref.finalize(owner, self._give_back, index)
        flat: np.ndarray[Any, Any] = np.frombuffer(owner, dtype=self.dtype, count=self._items)
        return flat.reshape(self.shape)

    def _give_back(self, index: int) -> None:
        with self._cond:
            self._free.append(index)
            self._cond.notify()

    @property
    def free(self) -> int:
        """Buffers not in use right now."""
        with self._cond:
            return len(self._free)

    @property
    def acquired(self) -> int:
        """How many times a buffer was handed out (reuses included)."""
        return self._acquired

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "aligned"
        return (
            f"BufferPool(shape={self.shape}, dtype={self.dtype}, count={self.count}, {kind}, "
            f"free={self.free})"
        )
