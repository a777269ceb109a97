"""The worker side of a :class:`~feedline._proc.pipe_pool.PipePool`, and its framing.

Each message on a pipe is a header (payload bytes, call number, whether the call succeeded)
and a pickle. A worker first sends an empty answer to call 0 once its initializer ran (it is
*ready*: a death after that is an item's doing, not the start's), then answers calls in the
order they come until the parent closes its task pipe.
"""

from __future__ import annotations

import os
import pickle
import signal
import struct
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from feedline.errors import portable

from .settings import WRITEV_BUFFERS

__all__ = ["HEADER", "READY", "read_message", "serve", "write_views"]

HEADER = struct.Struct("<QQ?")
"""Payload bytes, call number, whether the call succeeded."""

READY = 0
"""The call number of a worker's first message: its start went well."""


def _read_exactly(fd: int, size: int) -> bytearray | None:
    # ``size`` bytes from a pipe, or None at its end (the writer closed it or died).
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            return None
        got += n
    return data


def read_message(fd: int) -> tuple[int, bool, bytearray] | None:
    """One message from a pipe: (call number, whether the call succeeded, its pickle).

    ``None`` at the pipe's end (the writer closed it or died).
    """
    header = _read_exactly(fd, HEADER.size)
    if header is None:
        return None
    size, call, ok = HEADER.unpack(header)
    body = _read_exactly(fd, size)
    return None if body is None else (call, ok, body)


def write_views(fd: int, views: list[memoryview]) -> int:
    """Write what the pipe takes of ``views`` in one call; drop what was written from them.

    Returns the bytes written. Raises ``BlockingIOError`` on a full non-blocking pipe.
    """
    n = written = os.writev(fd, views[:WRITEV_BUFFERS])
    while n and views:
        if n >= len(views[0]):
            n -= len(views.pop(0))
        else:
            views[0], n = views[0][n:], 0
    return written


def _failure(error: BaseException) -> bytes:
    # The error itself where this process can rebuild it from its pickle, and its traceback.
    if not isinstance(error, Exception):  # SystemExit and the like end calls, not the worker
        cause = error
        error = RuntimeError(
            f"the op raised {type(cause).__name__}{cause.args!r} in a worker process; return "
            "or raise an exception instead"
        )
        error.__traceback__ = cause.__traceback__
    return pickle.dumps(portable(error))


def _answer(body: bytearray) -> tuple[bytes, bool]:
    try:
        fn, args, kwargs = pickle.loads(body)
        return pickle.dumps(fn(*args, **kwargs), pickle.HIGHEST_PROTOCOL), True
    except BaseException as error:
        return _failure(error), False


def serve(
    tasks: Connection,
    results: Connection,
    initializer: Callable[..., Any] | None,
    initargs: tuple[Any, ...],
) -> None:
    """A worker's life: say it is ready, then answer calls until the task pipe ends."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if initializer is not None:
        initializer(*initargs)
    fd_in, fd_out = tasks.fileno(), results.fileno()
    os.set_blocking(fd_in, True)
    os.set_blocking(fd_out, True)
    message = [memoryview(HEADER.pack(0, READY, True))]
    while True:
        try:
            while message:
                write_views(fd_out, message)
        except BrokenPipeError:  # the parent is gone
            return
        got = read_message(fd_in)
        if got is None:
            return
        call, _, body = got
        payload, ok = _answer(body)
        del got, body
        message = [memoryview(HEADER.pack(len(payload), call, ok)), memoryview(payload)]
