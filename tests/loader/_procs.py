"""Waiting for what earlier tests started to be gone: worker processes and feeder threads."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest


def no_children_left() -> None:
    """Assert that no child process of this one outlives a few seconds' grace."""
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []


def alone() -> None:
    """Wait for threads an earlier test left ending (queue feeders); skip if some stay."""
    deadline = time.monotonic() + 5
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    if threading.active_count() > 1:
        pytest.skip(f"other threads run: {[t.name for t in threading.enumerate()]}")
