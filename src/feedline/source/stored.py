"""Raw samples kept as objects in a store or as files: a map-style dataset of their bytes."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["StoredSamples"]


class StoredSamples:
    """Sample ``i`` is the bytes of object (or file) ``keys[i]``.

    Args:
        store: A :class:`~feedline.RemoteStore` (objects are read with ``read_sync``, with
            its retries and checks), or a directory (files are read whole).
        keys: The objects' keys under the store, or the files' paths under the directory,
            in the dataset's order (``store.keys(...)`` lists them).

    Picklable when the store is.

    """

    def __init__(self, store: Any, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        if isinstance(store, str | os.PathLike):
            root = Path(store)
            if not root.is_dir():
                raise FileNotFoundError(f"no such directory: {str(root)!r}")
            self._root: Path | None = root
            self.store: Any = None
        else:
            if not hasattr(store, "read_sync"):
                raise TypeError(
                    f"store must be a feedline.RemoteStore or a directory, got "
                    f"{type(store).__name__}"
                )
            self._root = None
            self.store = store

    def __len__(self) -> int:
        return len(self.keys)

    def __getitem__(self, index: int) -> bytes:
        return bytes(self.read(index))

    def read(self, index: int) -> bytes | memoryview:
        """Sample ``index``'s bytes without a copy (a file's bytes, or the store's view)."""
        key = self.keys[index]
        if self._root is not None:
            return (self._root / key).read_bytes()
        view: memoryview = self.store.read_sync(key)
        return view

    def __repr__(self) -> str:
        where = self._root if self._root is not None else self.store
        return f"StoredSamples({where!r}, {len(self.keys)} keys)"
