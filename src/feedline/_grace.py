"""What Ctrl-C does to a stop, and to the bookkeeping it must not cut in two.

A stop joins what it started, and so waits for each call of user code to return: as long as
it takes, reported now and then. Not on Ctrl-C: a call that never returns (a read without a
timeout, a lock never released) would hold the program where a loop without threads would
have stopped at once. While a ``KeyboardInterrupt`` or ``SystemExit`` propagates, and at
interpreter exit, a stop waits :data:`STOP_GRACE` seconds, then leaves such calls on their
daemon threads (they end with the process).

:class:`CtrlCHeld` keeps a Ctrl-C out of a few lines that must run whole (counting a batch
as handed out: a ledger and a position that must agree), and sends it again a moment later.
"""

from __future__ import annotations

import signal
import sys
import threading
from types import TracebackType
from typing import Any

__all__ = [
    "RESEND_AFTER",
    "STOP_GRACE",
    "CtrlCHeld",
    "claim_ctrl_c",
    "release_ctrl_c",
    "stop_grace",
]

STOP_GRACE = 1.0
"""Seconds a stop on Ctrl-C or at exit waits for calls still inside user code."""

RESEND_AFTER = 0.01
"""Seconds after a :class:`CtrlCHeld` block that a Ctrl-C it held back is sent again."""


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


class _Relay:
    """The SIGINT handler while a DataLoader iterates on the main thread.

    It passes each Ctrl-C on to the handler it stands in for (``KeyboardInterrupt`` by
    default), except inside a :class:`CtrlCHeld` block, after which it is sent again.
    Swapping the handler once per iteration, not twice per batch (two system calls, about
    40 µs a batch in a loop of small ones).
    """

    __slots__ = ("handler", "held", "noted", "users")

    def __init__(self, handler: Any) -> None:
        self.handler = handler
        self.held = 0  # blocks under way (main thread only)
        self.noted = False  # a Ctrl-C came during one
        self.users = 0  # iterations that claimed it

    def __call__(self, signum: int, frame: Any) -> Any:
        if self.held:
            self.noted = True
            return None
        return self.handler(signum, frame)


_relay: _Relay | None = None


def claim_ctrl_c() -> bool:
    """An iteration begins: on the main thread, SIGINT goes through the relay.

    Until :func:`release_ctrl_c`. False (nothing to release) elsewhere, or where Python's
    handler is not a function (ignored, or the default action).
    """
    global _relay
    if threading.current_thread() is not threading.main_thread():
        return False
    relay, current = _relay, signal.getsignal(signal.SIGINT)
    if relay is None or id(current) != id(relay):  # none yet, or replaced since (kept counting)
        if not callable(current):
            return False
        users = 0 if relay is None else relay.users
        relay = _relay = _Relay(current)
        relay.users = users
        signal.signal(signal.SIGINT, relay)
    relay.users += 1
    return True


def release_ctrl_c() -> None:
    """An iteration that claimed the relay ended: the last one puts the handler back.

    From the main thread, and only if no one replaced the relay meanwhile; else it stays,
    passing Ctrl-C on.
    """
    global _relay
    relay = _relay
    if relay is None:
        return
    relay.users -= 1
    if relay.users > 0 or threading.current_thread() is not threading.main_thread():
        return
    if id(signal.getsignal(signal.SIGINT)) == id(relay):
        signal.signal(signal.SIGINT, relay.handler)
    _relay = None


class CtrlCHeld:
    """``with CtrlCHeld():`` runs its block whole: a Ctrl-C meanwhile comes a moment after.

    Raised part-way, a ``KeyboardInterrupt`` would leave half of what the block records; raised
    at its end, it would cut off what comes next (handing out the batch the block counted).
    While the relay is claimed (:func:`claim_ctrl_c`), a SIGINT that arrives in the block is
    noted and sent again to the main thread :data:`RESEND_AFTER` s after it, on a timer
    thread. Elsewhere (another thread, no relay) the block runs as it is.
    """

    __slots__ = ("_relay",)

    def __enter__(self) -> None:
        relay = _relay
        if relay is not None and threading.current_thread() is threading.main_thread():
            relay.held += 1
            self._relay: _Relay | None = relay
        else:
            self._relay = None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        relay = self._relay
        if relay is None:
            return
        relay.held -= 1
        if relay.held or not relay.noted:
            return
        relay.noted = False
        main = threading.main_thread().ident
        timer = threading.Timer(RESEND_AFTER, signal.pthread_kill, (main, signal.SIGINT))
        timer.daemon = True
        timer.start()
