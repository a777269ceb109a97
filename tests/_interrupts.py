"""Ctrl-C at a chosen line: a SIGINT handled inside a call, and where one held back lands."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any


def ctrl_c_after(
    method: Callable[..., Any], when: Callable[..., bool] = lambda *args: True
) -> Callable[..., None]:
    """``method`` that, once it returned (where ``when(*args)``), has the main thread take a
    SIGINT before it goes on: a Ctrl-C that lands right there (for ``monkeypatch.setattr``)."""

    def interrupted(self: Any, *args: Any) -> None:
        method(self, *args)
        if when(*args):
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)  # type: ignore[arg-type]
            time.sleep(0.001)  # the handler runs here

    return interrupted


def where_the_ctrl_c_lands(items: Iterable[Any], leave: str) -> tuple[str | None, int]:
    """Loop over ``items`` (``leave``: ``"break"`` after the first, or ``"end"``); where a
    Ctrl-C sent meanwhile was raised (``"the loop"``, ``"after the loop"``, None) and how many
    items the loop took. The SIGINT handler must be back as it was."""
    handler = signal.getsignal(signal.SIGINT)
    got, where = 0, None
    try:
        for _ in items:
            got += 1
            if leave == "break":
                break
    except KeyboardInterrupt:
        where = "the loop"
    else:
        try:
            time.sleep(2)  # after the loop: where one left to __del__ comes
        except KeyboardInterrupt:
            where = "after the loop"
    assert signal.getsignal(signal.SIGINT) is handler, "the Ctrl-C relay stayed installed"
    return where, got
