"""The cores this process may run on: shared by the engine's tuner, the loaders and the bench."""

from __future__ import annotations

import os

__all__ = ["machine_idle", "usable_cores"]

_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not Linux
        return max(1, os.cpu_count() or 1)


def machine_idle() -> float | None:
    """CPU seconds the whole machine has been idle (Linux's ``/proc/stat``; ``None`` elsewhere).

    The difference of two reads over the seconds between them is the cores left idle, by this
    process and every other one.
    """
    try:
        with open("/proc/stat", "rb") as f:
            fields = f.readline().split()
        return (int(fields[4]) + int(fields[5])) / _TICK  # idle and iowait
    except (OSError, ValueError, IndexError):
        return None
