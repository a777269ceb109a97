"""What a test may leave behind in the system (zombie children, shared-memory segments), and
how long a test that starts processes may take."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

PROCESSES_TIMEOUT = 300
"""Seconds a test that starts processes may run before it counts as hung (others: 60, in
pyproject.toml). A worker started by forkserver or spawn imports torch, a child Python imports
feedline: seconds each beside other work (load 9-14 on 2 cores), and a test may start dozens.
The tests themselves are no slower for it; a hang still fails, later."""

starts_processes = pytest.mark.timeout(PROCESSES_TIMEOUT)
"""The mark of such a test (``pytestmark = starts_processes`` for a module of them)."""


def zombies() -> list[int]:
    """Children of this process that exited and were not waited for (read, not reaped:
    waiting here would take the exit status from multiprocessing's own bookkeeping)."""
    pid = os.getpid()
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:  # pragma: no cover - not Linux
        return []
    found = []
    for child in children:
        try:
            stat = Path(f"/proc/{child}/stat").read_text()
        except OSError:
            continue
        if stat[stat.rfind(")") + 2 :].startswith("Z"):
            found.append(int(child))
    return found


def own_segments(pid: int | None = None) -> set[str]:
    """The shared-memory segments in /dev/shm that feedline made for this process.

    feedline names every segment after the process that started the tree of processes it
    was made in (``psm_fl<pid>_``, see ``feedline._proc.shm``): this test process's own,
    its children's and theirs. Other programs on the machine (another test run, PyTorch)
    make segments too, at any time: counting theirs fails a test for what it did not do.

    Args:
        pid: Another process's instead (a program the test started); default: this one.

    """
    prefix = f"psm_fl{os.getpid() if pid is None else pid}_"
    try:
        names = os.listdir("/dev/shm")
    except OSError:  # pragma: no cover - not Linux
        return set()
    return {name for name in names if name.startswith(prefix)}
