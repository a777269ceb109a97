"""Where a benchmark's figures were taken: the machine, the software and the code's version."""

from __future__ import annotations

import functools
import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["LIBRARIES", "machine_info"]

LIBRARIES = (
    "feedline",
    "numpy",
    "torch",
    "opencv-python-headless",
    "simplejpeg",
    "pillow",
    "spdl",
    "av",
    "obstore",
    "isal",
)
"""Distributions whose versions a result records (those installed)."""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
    return round(pages / 2**30, 1)


def _versions() -> dict[str, str]:
    found = {}
    for name in LIBRARIES:
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return found


def _git(*args: str) -> str:
    here = Path(__file__).resolve().parent
    done = subprocess.run(
        ["git", "-C", str(here), *args], capture_output=True, text=True, timeout=10, check=True
    )
    return done.stdout.strip()


def _commit() -> str | None:
    """The git commit of the feedline source that runs (with ``+dirty`` when edited)."""
    try:
        top = Path(_git("rev-parse", "--show-toplevel"))
        if not (top / "src" / "feedline" / "bench").samefile(Path(__file__).parent):
            return None  # installed inside someone else's repository (a venv in a checkout)
        head = _git("rev-parse", "--short=12", "HEAD")
        dirty = _git("status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None  # an installed wheel, or no git
    return head + ("+dirty" if dirty else "") if head else None


@functools.lru_cache(maxsize=1)
def _fixed() -> tuple[tuple[str, Any], ...]:
    # What does not change during a run: looked up once (the commit costs two git calls).
    return (
        ("cpu", _cpu_model()),
        ("cpus", os.cpu_count()),
        ("memory_gib", _memory_gib()),
        ("platform", platform.platform()),
        ("python", sys.version.split()[0]),
        ("versions", _versions()),
        ("commit", _commit()),
    )


def machine_info() -> dict[str, Any]:
    """The machine (CPU model, cores, memory), Python, library versions, commit and time."""
    info = {key: (dict(value) if isinstance(value, dict) else value) for key, value in _fixed()}
    info["time"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    return info
