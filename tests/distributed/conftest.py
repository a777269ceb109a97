from __future__ import annotations

import multiprocessing
import time
from collections.abc import Iterator

import pytest

from .._system import zombies


@pytest.fixture(autouse=True)
def no_process_left() -> Iterator[None]:
    """Every rank a test starts is gone after it: no child process, no zombie."""
    yield
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []
    assert zombies() == []
