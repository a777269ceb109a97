"""Hand arrays to a framework without copying, and batches to a GPU without stalling it.

* :func:`to_numpy`, :func:`to_torch`, :func:`to_jax` share memory (through the buffer protocol,
  ``torch.from_numpy`` or DLPack) and copy only when sharing is impossible or unsafe: a
  read-only NumPy array (one that views immutable ``bytes``, as :func:`load_npy` returns) gets
  copied for PyTorch, whose tensors are always writable, unless ``copy=False`` asks for an
  error instead.
* :func:`transfer` copies a batch (an array, a tensor, or a dict/list/tuple of them) to a CUDA
  device from page-locked memory on a CUDA stream owned by the calling thread, and returns when
  the copy is complete, so that the training loop's stream never waits on it. Run it in a
  stage with a one-thread executor (``pipe(transfer, executor=ThreadPoolExecutor(1))``) so that
  the same stream is used for every batch.

PyTorch and JAX are imported only when these functions are called.
"""

from __future__ import annotations

import sys
import threading
from typing import Any

import numpy as np

from feedline._extras import require_torch

__all__ = ["to_jax", "to_numpy", "to_torch", "transfer"]


def _torch() -> Any:
    return require_torch("converting arrays to and from torch tensors")


def to_numpy(x: Any) -> np.ndarray[Any, Any]:
    """Return ``x`` as a NumPy array, sharing memory when ``x`` is on the CPU.

    Accepts NumPy arrays, PyTorch CPU tensors, JAX CPU arrays, and anything with the buffer
    protocol, ``__array_interface__`` or ``__dlpack__``.

    Raises:
        ValueError: For a tensor on a GPU (copy it to the CPU first: that copy is explicit).
        TypeError: For a bfloat16 tensor (NumPy has no such type: the message says how to
            convert it).

    """
    if isinstance(x, np.ndarray):
        return x
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise ValueError(
                f"the tensor is on {x.device}; move it with .cpu() first (a device-to-host "
                "copy is never made implicitly)"
            )
        if x.dtype == torch.bfloat16:
            raise TypeError(
                "the tensor is bfloat16, which NumPy has no type for; convert it first "
                "(tensor.float(), or tensor.view(torch.int16) to keep its bits)"
            )
        array: np.ndarray[Any, Any] = x.detach().numpy()
        return array
    if hasattr(x, "__dlpack__") and not hasattr(x, "__array_interface__"):
        try:
            return np.from_dlpack(x)
        except (BufferError, RuntimeError, TypeError) as error:
            raise ValueError(f"cannot view {type(x).__name__} as a NumPy array: {error}") from error
    return np.asarray(x)


def to_torch(x: Any, *, copy: bool | None = None) -> Any:
    """Return ``x`` as a ``torch.Tensor`` that shares its memory when possible.

    Args:
        x: A NumPy array, a tensor, or anything :func:`to_numpy` accepts.
        copy: ``None`` (default): share memory, copy only a read-only array (PyTorch cannot
            mark a tensor read-only, and writing into immutable bytes would corrupt them).
            A big-endian array or a reversed view (negative strides) is copied too: torch
            cannot view either. ``False``: never copy; raise instead. ``True``: always copy.

    Raises:
        ValueError: ``copy=False`` and the array is read-only, big-endian or reversed.
        ImportError: PyTorch is not installed.

    """
    torch = _torch()
    if isinstance(x, torch.Tensor):
        return x.clone() if copy else x
    array = to_numpy(x)
    unshared = []  # why a tensor cannot view the array's memory
    if not array.flags.writeable:
        unshared.append(
            "the array is read-only (it views immutable memory such as bytes), and a tensor "
            "would be writable (load from a bytearray to get a writable array)"
        )
    if not array.dtype.isnative:
        unshared.append("its byte order is not this machine's, the only one torch reads")
    if any(stride < 0 for stride in array.strides):
        unshared.append("it has negative strides (a reversed view), which a tensor cannot have")
    if unshared and copy is False:
        raise ValueError(
            f"cannot share the array with a tensor: {'; '.join(unshared)}; pass "
            "copy=None to copy it"
        )
    if copy or unshared:  # a C-ordered copy in native byte order
        array = np.array(array, dtype=array.dtype.newbyteorder("="), order="C", copy=True)
    return torch.from_numpy(array)


def to_jax(x: Any) -> Any:
    """Return ``x`` as a JAX array, through DLPack where it can go without a copy.

    JAX shares the memory of a writable array or tensor aligned to 64 bytes (a
    :class:`~feedline.io.BufferPool` batch, most large NumPy arrays) and of a tensor on a
    device JAX uses; it copies anything else: read-only arrays (which DLPack cannot mark as
    such), unaligned memory, and other array-likes (converted with :func:`to_numpy` first).

    Raises:
        ImportError: JAX is not installed (pip install jax).

    """
    try:
        import jax
        import jax.numpy as jnp
    except ImportError:
        raise ImportError("this needs JAX: pip install jax") from None
    source = x if hasattr(x, "__dlpack__") else to_numpy(x)
    try:
        return jax.dlpack.from_dlpack(source)
    except (BufferError, TypeError, ValueError, RuntimeError):
        return jnp.asarray(to_numpy(x))  # read-only, or nothing DLPack carries: a copy


_local = threading.local()


def _stream(torch: Any, device: Any) -> Any:
    streams: dict[Any, Any] = getattr(_local, "streams", None) or {}
    _local.streams = streams
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device)
    return stream


def transfer(batch: Any, device: Any = "cuda") -> Any:
    """Copy a batch to a CUDA device on this thread's own stream and wait until it is there.

    The tensors are marked as used by the device's default stream (``record_stream``), where
    training loops run. A loop that runs on a stream of its own should call
    ``tensor.record_stream(its_stream)`` on the batch it receives.

    Args:
        batch: An array, a tensor, or a dict / list / tuple of them (nested); other leaves
            pass through unchanged.
        device: A CUDA device (``"cuda"``, ``"cuda:1"``, ``torch.device``).

    Returns:
        The same structure with tensors on ``device``.

    Raises:
        RuntimeError: If PyTorch has no CUDA device here (the message says what was found).
        ImportError: If PyTorch is not installed.

    """
    torch = _torch()
    target = torch.device(device)
    if target.type != "cuda" or not torch.cuda.is_available():
        found = (
            f"torch.cuda.is_available() is False (PyTorch {torch.__version__})"
            if not torch.cuda.is_available()
            else f"device {target} is not a CUDA device"
        )
        raise RuntimeError(
            f"transfer() copies to a CUDA device, but {found}. On a machine without a GPU, "
            "leave the batch on the CPU (skip this stage), or use to_torch() for a CPU tensor"
        )
    stream = _stream(torch, target)

    def move(obj: Any) -> Any:
        if isinstance(obj, dict):
            return {k: move(v) for k, v in obj.items()}
        if isinstance(obj, (list, tuple)):
            moved = [move(v) for v in obj]
            return type(obj)(moved) if isinstance(obj, tuple) else moved
        if isinstance(obj, (np.ndarray, torch.Tensor)):
            tensor = to_torch(obj)
            if tensor.device.type == "cpu" and not tensor.is_pinned():
                tensor = tensor.pin_memory()  # an async copy needs page-locked memory
            moved = tensor.to(target, non_blocking=True)
            # Allocated on this thread's stream but used on the training loop's: tell the
            # caching allocator, so that once the loop drops the batch, its memory is not
            # handed to the next copy while the loop's queued kernels still read it.
            moved.record_stream(consumer)
            return moved
        return obj

    consumer = torch.cuda.default_stream(target)
    with torch.cuda.stream(stream):
        out = move(batch)
    stream.synchronize()
    return out
