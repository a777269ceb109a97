"""What Ctrl-C does to a stop, and to the bookkeeping it must not cut in two.

A stop joins what it started, and so waits for each call of user code to return: as long as
it takes, reported now and then. Not on Ctrl-C: a call that never returns (a read without a
timeout, a lock never released) would hold the program where a loop without threads would
have stopped at once. On Ctrl-C and at interpreter exit (:func:`stop_grace`), a stop waits
:data:`STOP_GRACE` seconds, then leaves such calls on their daemon threads (they end with
the process).

While a loop runs on the main thread, SIGINT goes through a relay (:func:`claim_ctrl_c`),
which notes when a Ctrl-C came, and lets :class:`CtrlCHeld` keep one out of a few lines
that must run whole (counting a batch as handed out: a ledger and a position that must
agree). A held Ctrl-C is sent again a moment later, or raised as a close ends
(:class:`Closing`), never into a ``__del__``, where Python would drop it.
"""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType
from typing import Any

__all__ = [
    "RECENT",
    "RESEND_AFTER",
    "STOP_GRACE",
    "Closing",
    "CtrlCHeld",
    "claim_ctrl_c",
    "close_relayed",
    "release_ctrl_c",
    "stop_grace",
]

STOP_GRACE = 1.0
"""Seconds a stop on Ctrl-C or at exit waits for calls still inside user code."""

RESEND_AFTER = 0.01
"""Seconds after a :class:`CtrlCHeld` block that a Ctrl-C it held back is sent again."""

RECENT = 2.0
"""Seconds after a Ctrl-C during which a stop counts as one on Ctrl-C: a ``KeyboardInterrupt``
raised in a loop's body closes the loop's iterator while it unwinds, before any ``except``
block holds it (``sys.exc_info()`` is empty there)."""

_last_ctrl_c = -RECENT  # monotonic time of the last SIGINT the relay passed on


def stop_grace() -> float | None:
    """:data:`STOP_GRACE` on Ctrl-C or at exit, else None (wait as long as calls run).

    On Ctrl-C: while a ``KeyboardInterrupt`` or ``SystemExit`` is raised or handled
    (``sys.exc_info()`` in the ``except`` or ``finally`` block a stop runs in; a ``break``
    that closes a generator is not one), or within :data:`RECENT` s of a SIGINT that the
    relay passed on (a loop's iterator closed as the interrupt unwinds the loop). At exit:
    in the interpreter's atexit turn, on the main thread after its threads were joined (not
    in a thread that outlives the main thread's code).
    """
    error = sys.exc_info()[1]
    interrupted = error is not None and not isinstance(error, Exception | GeneratorExit)
    interrupted = interrupted or time.monotonic() - _last_ctrl_c < RECENT
    main = threading.main_thread()
    exiting = not main.is_alive() and threading.current_thread() is main  # atexit's turn
    return STOP_GRACE if interrupted or exiting else None


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
        global _last_ctrl_c, _relay
        # Held back or not, it is the user's Ctrl-C: a stop soon after is a stop on Ctrl-C
        # (a loop left with break before the held one comes must not wait on a call that
        # never returns).
        _last_ctrl_c = time.monotonic()
        if self.held:
            self.noted = True
            return None
        if not self.users:  # released off the main thread: put back now, on the main thread
            signal.signal(signal.SIGINT, self.handler)
            if _relay is self:
                _relay = None
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
        _owe()


_closing = 0  # the main thread is closing an iteration: a held Ctrl-C waits for its end
_owed = False  # a held Ctrl-C not sent again yet
_owed_lock = threading.Lock()  # between the main thread and the timer that sends it


class Closing:
    """``with Closing(deliver):`` on the main thread: a held Ctrl-C comes at the block's end.

    Raised there when ``deliver`` (the close in a loop's last ``next()``: the loop's
    ``except`` gets it), else sent again a moment after (a close in ``__del__``, where Python
    prints an exception and goes on). A Ctrl-C the user sends meanwhile is not held back: it
    may be the way out of a close that waits.
    """

    __slots__ = ("_deliver", "_main")

    def __init__(self, deliver: bool = True) -> None:
        self._deliver = deliver

    def __enter__(self) -> None:
        global _closing
        self._main = threading.current_thread() is threading.main_thread()
        if self._main:
            _closing += 1

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        global _closing, _owed
        if not self._main:
            return
        _closing -= 1
        if _closing:
            return
        with _owed_lock:
            owed, _owed = _owed, False
        if not owed:
            return
        if self._deliver and kind is None:
            signal.raise_signal(signal.SIGINT)  # its handler runs here, as the close returns
        else:
            _owe()


def _owe() -> None:
    # A held Ctrl-C, sent again to the main thread in a moment, unless a close takes it.
    global _owed
    with _owed_lock:
        _owed = True
    timer = threading.Timer(RESEND_AFTER, _resend)
    timer.daemon = True
    timer.start()


def _resend() -> None:
    global _owed
    with _owed_lock:
        if not _owed or _closing:  # sent already, or the close under way sends it
            return
        _owed = False
    main = threading.main_thread().ident
    if main is not None:
        signal.pthread_kill(main, signal.SIGINT)


def close_relayed(stop: Callable[[], None], relayed: bool) -> None:
    """An iteration's close, from its ``finally``: ``stop()``, then the relay given back.

    A Ctrl-C held while an item was counted is raised as ``stop()`` ends when the iteration
    ended in the loop's ``next()`` (the loop's ``except`` gets it), else (a loop left early,
    its iterator closed in ``__del__``) sent again after it (:class:`Closing`). ``relayed``:
    what :func:`claim_ctrl_c` returned; the relay is released also when ``stop()`` raises.
    """
    try:
        with Closing(deliver=sys.exc_info()[0] is not GeneratorExit):
            stop()
    finally:
        if relayed:
            release_ctrl_c()
