"""How long a stop waits for calls still inside user code.

A stop joins what it started, and so waits for each call of user code to return: as long as
it takes, reported now and then. Not on Ctrl-C: a call that never returns (a read without a
timeout, a lock never released) would hold the program where a loop without threads would
have stopped at once. While a ``KeyboardInterrupt`` or ``SystemExit`` propagates, and at
interpreter exit, a stop waits :data:`STOP_GRACE` seconds, then leaves such calls on their
daemon threads (they end with the process).
"""

from __future__ import annotations

import sys
import threading

__all__ = ["STOP_GRACE", "stop_grace"]

STOP_GRACE = 1.0
"""Seconds a stop on Ctrl-C or at exit waits for calls still inside user code."""


def stop_grace() -> float | None:
    """:data:`STOP_GRACE` while an interrupt propagates (or is handled) or at exit, else None.

    Called in the ``except`` or ``finally`` block a stop runs in, where ``sys.exc_info()``
    holds the exception that ends the loop (a ``break`` that closes a generator is not one).
    """
    error = sys.exc_info()[1]
    interrupted = error is not None and not isinstance(error, Exception | GeneratorExit)
    if interrupted or not threading.main_thread().is_alive():  # at exit: its threads ended
        return STOP_GRACE
    return None
