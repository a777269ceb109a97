from __future__ import annotations

import sys

import numpy as np
import pytest

import feedline
from feedline.distributed import DistributedLoader, GlobalSequence
from feedline.io import to_torch

INSTALL = r"pip install 'feedline\[torch\]'"


def test_what_needs_pytorch_says_which_extra_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # as if it were not installed
    with pytest.raises(ImportError, match=f"feedline.DataLoader .* needs PyTorch: {INSTALL}"):
        feedline.DataLoader([1, 2, 3], batch_size=2)
    with pytest.raises(ImportError, match=f"DistributedLoader .* needs PyTorch: {INSTALL}"):
        DistributedLoader([b"a", b"b"], batch_size=1, rank=0, world_size=1)
    with pytest.raises(ImportError, match=f"shuffled order needs PyTorch: {INSTALL}"):
        GlobalSequence(size=8, world=2, local_batch=2).order(0)
    with pytest.raises(ImportError, match=INSTALL):
        to_torch(np.zeros(3))
    # What does not need it still works.
    assert GlobalSequence(size=8, world=2, local_batch=2, shuffle=False).order(0).size == 8
