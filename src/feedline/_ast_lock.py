"""A lock around ``ast.parse`` on interpreters whose AST constructor threads can corrupt.

CPython 3.11 before 3.11.8 and 3.12 before 3.12.2 count the AST constructor's recursion depth in
state that all threads share (CPython gh-106905). When a parse starts while another is under
way, in another thread or in a finalizer that a garbage collection inside the first one runs,
the first fails with ``SystemError: AST constructor recursion depth mismatch``. ``numpy.load``
parses every NPY header with ``ast.literal_eval``, so a dataset that loads arrays in feedline's
threads meets this where PyTorch's worker processes, one parse each, do not. On those
interpreters :func:`install` wraps the module's ``parse`` (which ``literal_eval`` calls): one
parse at a time (a lock), and no garbage collection during it, so no finalizer parses inside
it. Parsing holds the GIL from start to end, so neither takes parallelism away; elsewhere
nothing is changed.
"""

from __future__ import annotations

import ast
import functools
import gc
import os
import sys
import threading
from typing import Any

_lock = threading.RLock()  # re-entrant: a finalizer in the parsing thread may parse too


def _new_lock() -> None:
    """A forked child starts with a free lock, whichever thread held the parent's."""
    global _lock
    _lock = threading.RLock()


def affected(version: tuple[int, ...] = tuple(sys.version_info[:3])) -> bool:
    """Whether CPython ``version`` has the AST constructor race (gh-106905)."""
    return tuple(version) < (3, 11, 8) or (3, 12) <= tuple(version) < (3, 12, 2)


def install() -> bool:
    """Serialise ``ast.parse`` if this interpreter needs it; returns whether it is wrapped."""
    if getattr(ast.parse, "_feedline_locked", False):
        return True
    if not affected() or sys.implementation.name != "cpython":
        return False
    parse = ast.parse

    @functools.wraps(parse)
    def locked_parse(*args: Any, **kwargs: Any) -> Any:
        with _lock:
            collecting = gc.isenabled()
            gc.disable()  # under the lock: a parse in another thread waits, and enables none
            try:
                return parse(*args, **kwargs)
            finally:
                if collecting:
                    gc.enable()

    locked_parse._feedline_locked = True  # type: ignore[attr-defined]
    ast.parse = locked_parse
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_new_lock)
    return True
