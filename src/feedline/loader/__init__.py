"""A DataLoader compatible with PyTorch's, fetching each batch's items concurrently.

See :class:`DataLoader`; :class:`PathList` holds millions of file paths compactly;
:func:`get_item_info` and :func:`seeded` make random augmentation reproducible when items are
fetched concurrently.
"""

from __future__ import annotations

from ._loader import DataLoader
from ._seeds import ItemInfo, get_item_info, seeded
from .paths import PathList

__all__ = ["DataLoader", "ItemInfo", "PathList", "get_item_info", "seeded"]
