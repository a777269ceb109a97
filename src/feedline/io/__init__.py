"""Functions a pipeline stage calls to turn bytes into arrays, releasing the GIL where it counts.

Each function is stateless and thread-safe, and avoids copies: ``load_npy`` returns a view of
the bytes it is given, ``load_npz`` views stored members in place and inflates compressed ones
with zlib (which releases the GIL while it works).
"""

from __future__ import annotations

from .arrays import NpzArrays, load_npy, load_npz
from .buffers import BufferPool
from .transfer import to_jax, to_numpy, to_torch, transfer

__all__ = [
    "BufferPool",
    "NpzArrays",
    "load_npy",
    "load_npz",
    "to_jax",
    "to_numpy",
    "to_torch",
    "transfer",
]
