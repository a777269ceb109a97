"""Waiting for what earlier tests started to be gone: worker processes and feeder threads."""

from __future__ import annotations

import multiprocessing
import threading
import time

import pytest

from feedline._proc.forking import fork_hazards


def no_children_left() -> None:
    """Assert that no child process of this one outlives a few seconds' grace."""
    deadline = time.monotonic() + 5
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []


def alone() -> None:
    """Wait for threads an earlier test left ending; skip if some that forbid a fork stay.

    (A native runtime an earlier test started, obstore's, stays for the process.)
    """
    deadline = time.monotonic() + 5
    while fork_hazards() and time.monotonic() < deadline:
        time.sleep(0.05)
    if fork_hazards():
        pytest.skip(f"a fork is unsafe beside: {fork_hazards()}")


def only_this_thread() -> None:
    """Assert that this is the process's one thread, after a few seconds' grace for threads that
    end on their own (queue feeders, ``feedline-unmap``)."""
    deadline = time.monotonic() + 5
    while threading.active_count() > 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [t.name for t in threading.enumerate()] == [threading.current_thread().name]
