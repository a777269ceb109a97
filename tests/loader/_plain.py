"""A dataset in a module that imports nothing heavy, for the worker start-up test."""

from __future__ import annotations

import sys
from typing import Any


class TorchAtStart:
    """Every item says whether torch was already imported when the dataset reached its worker.

    Unpickling this class imports only this module, so torch is there at that moment only if
    the worker was forked from a fork server that had imported it.
    """

    def __init__(self, n: int) -> None:
        self.n = n
        self.torch_first = False

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.torch_first = "torch" in sys.modules

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return int(self.torch_first)
