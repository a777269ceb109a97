"""Moving NumPy arrays between processes through shared memory instead of pickles.

The child copies each large array into a fresh POSIX shared-memory segment and sends only its
name, shape and dtype. The parent maps the segment, unlinks its name at once (the mapping stays
valid) and returns an array that views the mapping: one copy in the child, none in the parent,
and the memory is freed when the parent's array is garbage-collected, on a thread of its own
(:mod:`.unmap`). No file descriptor stays open for a mapping (:mod:`.mapped`). Segments that
never reach the parent (the parent died, an epoch was cut short) are removed by
multiprocessing's resource tracker, which both processes share.

Only plain containers are walked (dict, list, tuple, named tuples); plain CPU torch tensors
travel as their NumPy arrays (:class:`TensorRef`); anything else travels as a pickle.

Segments made for one child process share a name prefix that the parent chose, so that once
the child is gone (killed mid-epoch, interrupted, crashed) the parent removes every segment it
made and the parent did not map, at once rather than when the resource tracker exits.

Every name says which process made it: ``psm_fl<pid>_`` and the rest, where ``pid`` is the
process that started the tree of feedline processes (a child's prefix extends its parent's, so
does a grandchild's, started by a child), so that the segments of one program (or one test
run) can be told from those of any other on the machine.

An array made with :func:`shared_empty` lives in a segment from the start: code that fills
one (a worker's collation) saves the child its copy, and :func:`pack` sends its name as it is.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import secrets
import sys
import threading
import weakref
from dataclasses import dataclass
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory
from typing import Any

import numpy as np

from .mapped import map_shared
from .unmap import hand_over

__all__ = [
    "SHM_AVAILABLE",
    "abandon",
    "set_segment_names",
    "shared_empty",
    "ShmArray",
    "SegmentNames",
    "pack",
    "release",
    "remove_prefixed",
    "unpack",
]

_SHM_DIR = "/dev/shm"
SHM_AVAILABLE = sys.platform.startswith("linux") and os.path.isdir(_SHM_DIR)


@dataclass(frozen=True)
class TensorRef:
    """A CPU torch tensor crossing as its NumPy view (by value, or a :class:`ShmArray`).

    torch's own pickling in a ``multiprocessing`` queue moves each tensor's storage to shared
    memory and sends its file descriptor over a socket, a round trip of a millisecond or more
    per tensor: a batch of many small tensors (the items of a batch) paid tens of ms.
    """

    array: Any


def _numpy_view(obj: Any) -> np.ndarray[Any, Any] | None:
    # A plain, dense CPU tensor whose dtype NumPy has: its array view; else None (torch's
    # own pickling then applies).
    torch = sys.modules.get("torch")
    if torch is None or type(obj) is not torch.Tensor:
        return None
    if obj.device.type != "cpu" or obj.layout != torch.strided or obj.requires_grad:
        return None
    try:
        return obj.numpy()  # type: ignore[no-any-return]
    except (TypeError, RuntimeError):  # bfloat16, conjugated, ...: no NumPy view
        return None


@dataclass(frozen=True)
class ShmArray:
    """A reference to an array waiting in a shared-memory segment."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype[Any]


class SegmentNames:
    """Names for the segments of one child: ``<prefix><counter>``, unique on this machine."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self._count = itertools.count()

    def __call__(self) -> str:
        return f"{self.prefix}{next(self._count)}"

    @staticmethod
    def new_prefix() -> str:
        """A fresh prefix, in the ``psm_`` namespace that ``SharedMemory`` itself uses.

        ``psm_fl<pid>_<random>_`` in a process that was not given names; in a child that was
        (:func:`set_segment_names`), its own prefix then ``<random>_``: the segments of the
        processes a child starts are named after the process that started it, and go with
        its prefix (:func:`remove_prefixed`).
        """
        return f"{_names.prefix if _names is not None else _own_prefix()}{secrets.token_hex(4)}_"


def _own_prefix() -> str:
    # This process's namespace: the segments it makes where it was given no names.
    return f"psm_fl{os.getpid()}_"


def _fresh_name() -> str:
    # A name of this process's, for a segment made where no names were given. Never the
    # start of a prefix of new_prefix (16 hex digits, not 8 and "_").
    return f"{_own_prefix()}{secrets.token_hex(8)}"


_names: SegmentNames | None = None  # this child's, once set_segment_names was called
_abandoned = False  # the parent is gone: segments made now are removed at once
_made: dict[int, tuple[str, weakref.ref[np.ndarray[Any, Any]]]] = {}  # address -> segment
_made_lock = threading.Lock()


def set_segment_names(names: SegmentNames) -> None:
    """Name the segments :func:`shared_empty` makes in this (child) process."""
    global _names
    _names = names


def shared_empty(shape: tuple[int, ...], dtype: Any) -> np.ndarray[Any, Any]:
    """A new array in a shared-memory segment of its own, which :func:`pack` sends uncopied.

    Off Linux (no ``/dev/shm``), a plain array. A segment never sent is removed when its
    array is garbage-collected.
    """
    dtype = np.dtype(dtype)
    if not SHM_AVAILABLE:
        return np.empty(shape, dtype)
    size = max(1, math.prod(shape) * dtype.itemsize)
    name = _names() if _names is not None else _fresh_name()
    path = os.path.join(_SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
        _, buffer = map_shared(fd, size)  # unmapped when the array is garbage
        if _abandoned:  # made as abandon() removed the others: none is left behind
            raise RuntimeError("the parent process is gone: no segment is made for it")
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    resource_tracker.register("/" + name, "shared_memory")  # removed if this process dies
    count = math.prod(shape)
    array = np.frombuffer(buffer, dtype=dtype, count=count).reshape(shape)
    address = array.__array_interface__["data"][0]
    with _made_lock:
        _made[address] = (name, weakref.ref(array))
    weakref.finalize(array, _forget, address, name)
    return array


def _forget(address: int, name: str) -> None:
    # The array is gone: a segment not sent is removed (a sent one the parent unlinked).
    with _made_lock:
        entry = _made.get(address)
        if entry is None or entry[0] != name:
            return  # sent
        del _made[address]
    with contextlib.suppress(FileNotFoundError):
        os.unlink(os.path.join(_SHM_DIR, name))
    with contextlib.suppress(Exception):  # the tracker may already be gone at exit
        resource_tracker.unregister("/" + name, "shared_memory")


def _made_segment(obj: np.ndarray[Any, Any]) -> str | None:
    # The segment ``obj`` fills entirely, if shared_empty made it (and it was not sent).
    if not _made or not obj.flags.c_contiguous:
        return None
    address = obj.__array_interface__["data"][0]
    with _made_lock:
        entry = _made.get(address)
        if entry is None:
            return None
        array = entry[1]()
        if array is None or array.nbytes != obj.nbytes:
            return None
        del _made[address]  # sent: the parent unlinks it
        return entry[0]


def pack(obj: Any, min_bytes: float, names: SegmentNames | None = None) -> Any:
    """Replace arrays of at least ``min_bytes`` in ``obj`` by shared-memory references.

    ``names`` names the segments (default: fresh names in this process's namespace,
    ``psm_fl<pid>_``). An array that
    :func:`shared_empty` made is sent as its segment, whatever its size.
    """
    if isinstance(obj, np.ndarray):
        made = _made_segment(obj)
        if made is not None:
            return ShmArray(made, obj.shape, obj.dtype)
        if obj.nbytes < min_bytes or obj.dtype.hasobject:
            return obj
        name = _fresh_name() if names is None else names()
        shm = SharedMemory(name=name, create=True, size=max(1, obj.nbytes))
        view: np.ndarray[Any, Any] = np.ndarray(obj.shape, dtype=obj.dtype, buffer=shm.buf)
        view[...] = obj
        del view
        shm.close()
        return ShmArray(shm.name, obj.shape, obj.dtype)
    array = _numpy_view(obj)
    if array is not None:
        return TensorRef(pack(array, min_bytes, names))
    kind = type(obj)
    if kind is dict:
        return {k: pack(v, min_bytes, names) for k, v in obj.items()}
    if kind is list:
        return [pack(v, min_bytes, names) for v in obj]
    if kind is tuple:
        return tuple(pack(v, min_bytes, names) for v in obj)
    if _is_named_tuple(obj):
        return kind._make(pack(v, min_bytes, names) for v in obj)
    return obj


def _is_named_tuple(obj: Any) -> bool:
    return isinstance(obj, tuple) and hasattr(type(obj), "_make")


def _children(obj: Any) -> list[Any]:
    if isinstance(obj, TensorRef):
        return [obj.array]
    kind = type(obj)
    if kind is dict:
        return list(obj.values())
    if kind is list or kind is tuple or _is_named_tuple(obj):
        return list(obj)
    return []


def release(obj: Any) -> None:
    """Remove the segments that ``obj`` (a packed item) refers to, without mapping them."""
    if isinstance(obj, ShmArray):
        name = ref_name = obj.name.lstrip("/")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_SHM_DIR, name))
        resource_tracker.unregister("/" + ref_name, "shared_memory")
        return
    for child in _children(obj):
        release(child)


def abandon() -> int:
    """The parent is gone: remove the segments this process (and its children) made.

    Sent or not, nobody will map them; a segment made from now on is removed at once.
    Returns how many. The resource tracker removes those it was told of once the last
    process that shares it ends; not a segment half made (created, not yet registered) when
    the process ended, nor one the parent had taken off the tracker's list but not unlinked.
    """
    global _abandoned
    _abandoned = True
    return remove_prefixed(_names.prefix if _names is not None else _own_prefix())


def remove_prefixed(prefix: str) -> int:
    """Remove every segment whose name starts with ``prefix``; return how many.

    Call it once the process that made them is gone: what it made and nobody mapped.
    """
    if not SHM_AVAILABLE:
        return 0
    try:
        names = [n for n in os.listdir(_SHM_DIR) if n.startswith(prefix)]
    except OSError:
        return 0
    removed = 0
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(_SHM_DIR, name))
            removed += 1
        with contextlib.suppress(Exception):  # the tracker may already be gone at exit
            resource_tracker.unregister("/" + name, "shared_memory")
    return removed


def _attach(ref: ShmArray) -> np.ndarray[Any, Any]:
    path = os.path.join(_SHM_DIR, ref.name.lstrip("/"))
    fd = os.open(path, os.O_RDWR)
    try:
        size = os.fstat(fd).st_size
        mapping, buffer = map_shared(fd, size)  # keeps no descriptor open
    finally:
        os.close(fd)
        os.unlink(path)
        # The child registered the segment with the shared resource tracker; it is ours now.
        resource_tracker.unregister("/" + ref.name.lstrip("/"), "shared_memory")
    count = math.prod(ref.shape)
    flat = np.frombuffer(buffer, dtype=ref.dtype, count=count)
    hand_over(flat, mapping)  # unmapped off the thread that drops the last view (see .unmap)
    return flat.reshape(ref.shape)


def unpack(obj: Any) -> Any:
    """Turn shared-memory references back into arrays (views of the mapped segments)."""
    if isinstance(obj, ShmArray):
        return _attach(obj)
    if isinstance(obj, TensorRef):
        import torch

        return torch.from_numpy(unpack(obj.array))
    kind = type(obj)
    if kind is dict:
        return {k: unpack(v) for k, v in obj.items()}
    if kind is list:
        return [unpack(v) for v in obj]
    if kind is tuple:
        return tuple(unpack(v) for v in obj)
    if _is_named_tuple(obj):
        return kind._make(unpack(v) for v in obj)
    return obj
