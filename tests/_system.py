"""What a test may leave behind in the system: zombie children and shared-memory segments."""

from __future__ import annotations

import os
from pathlib import Path


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


def segments() -> set[str]:
    """The shared-memory segments in /dev/shm that feedline (and SharedMemory) name."""
    return {f for f in os.listdir("/dev/shm") if f.startswith("psm_")}
