"""Optional dependencies, imported where first needed, with the extra that installs each.

``import feedline`` needs only NumPy; a feature that builds on another library imports it
through here, so that a missing one is an :class:`ImportError` that says what to install.
"""

from __future__ import annotations

from typing import Any

__all__ = ["require_torch"]


def require_torch(what: str) -> Any:
    """The ``torch`` module (with ``torch.utils.data``), for ``what`` (a feature, for the message).

    Raises:
        ImportError: If PyTorch is not installed; the message names the extra to install.

    """
    try:
        import torch
        import torch.utils.data
    except ImportError as exc:
        raise ImportError(
            f"{what} needs PyTorch: pip install 'feedline[torch]' (or torch itself) ({exc})"
        ) from exc
    return torch
