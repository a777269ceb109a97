"""A DataLoader compatible with PyTorch's, fetching each batch's items concurrently.

See :class:`DataLoader`; :class:`PathList` holds millions of file paths compactly.
"""

from __future__ import annotations

from ._loader import DataLoader
from .paths import PathList

__all__ = ["DataLoader", "PathList"]
