"""Run an iterable, or a whole pipeline, in a child process and iterate it from the parent.

The "multi-threading in a subprocess" pattern: a child process runs a pipeline with its own
event loop and thread pool (decoding, collation: work that may hold the GIL), and the parent
receives finished items, typically batches, through a bounded inter-process queue, keeping its
own GIL for the training loop. Arrays cross through shared memory (see :mod:`._shm`).

Protocol (parent -> child on the command queue, child -> parent on the data queue)::

    child:  ("ready",) | ("init-error", exc, tb)
    parent: "epoch"  -> child: ("item", x)* then ("end",) | ("error", exc, tb)
    parent: "close"  -> child exits

An epoch that the parent abandons is interrupted through an Event; the child answers with
("end",), and the parent drains what was in flight. A child whose parent dies exits on its own.
"""

from __future__ import annotations

import contextlib
import functools
import multiprocessing as mp
import os
import pickle
import queue
import threading
import traceback
import weakref
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.connection import wait as wait_for
from typing import Any, Generic, TypeVar

from feedline.errors import ConfigurationError, SubprocessFailure

from ._builder import PipelineBuilder
from ._shm import SHM_AVAILABLE, pack, release, unpack

__all__ = ["SubprocessIterable", "iterate_in_subprocess", "run_pipeline_in_subprocess"]

T = TypeVar("T")

_POLL = 0.2  # seconds between liveness checks while waiting
_DEFAULT_SHM_MIN = 64 * 1024
_STARTUP_SECONDS = 120.0  # the least a child gets to start and make its iterable


def _watch_parent() -> None:
    parent = mp.parent_process()
    if parent is None:
        return

    def watch() -> None:
        wait_for([parent.sentinel])
        os._exit(3)  # the parent is gone: nobody will read what we produce

    threading.Thread(target=watch, name="feedline-parent-watch", daemon=True).start()


def _error_message(error: BaseException) -> tuple[BaseException | None, str]:
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    try:
        pickle.dumps(error)
    except Exception:
        return None, text
    return error, text


def _send(data_q: Any, stop: Any, message: tuple[Any, ...]) -> bool:
    # Put with a timeout so that an interrupted epoch never leaves the child stuck on a full queue.
    while True:
        try:
            data_q.put(message, timeout=_POLL)
            return True
        except queue.Full:
            if stop.is_set():
                release(message)  # its shared-memory segments will never be mapped
                return False


def _child_main(
    factory: Callable[[], Iterable[Any]], cmd_q: Any, data_q: Any, stop: Any, shm_min: float
) -> None:
    _watch_parent()
    try:
        iterable = factory()
    except BaseException as error:
        data_q.put(("init-error", *_error_message(error)))
        return
    data_q.put(("ready",))
    while True:
        command = cmd_q.get()
        if command != "epoch":
            return
        try:
            for item in iterable:
                if stop.is_set():
                    break
                if not _send(data_q, stop, ("item", pack(item, shm_min))):
                    break
            data_q.put(("end",))
        except BaseException as error:
            data_q.put(("error", *_error_message(error)))


class _Child:
    """The process and queues behind a SubprocessIterable (what its finalizer may touch)."""

    def __init__(self) -> None:
        self.process: Any = None
        self.cmd_q: Any = None

    def close(self, timeout: float = 5.0) -> None:
        process = self.process
        if process is None:
            return
        self.process = None
        if process.is_alive():
            with contextlib.suppress(OSError, ValueError):
                self.cmd_q.put("close")
            process.join(timeout)
            if process.is_alive():
                process.terminate()
                process.join(timeout)
            if process.is_alive():
                process.kill()
                process.join()
        process.close()


class SubprocessIterable(Generic[T]):
    """Items of an iterable that runs in a child process; iterate it once per epoch.

    Made by :func:`iterate_in_subprocess` and :func:`run_pipeline_in_subprocess`. The child
    starts on the first iteration and lives until :meth:`close` (or garbage collection, or
    interpreter exit); each ``for`` loop asks it for one more pass over its iterable.
    """

    def __init__(
        self,
        factory: Callable[[], Iterable[T]],
        *,
        buffer_size: int,
        timeout: float | None,
        mp_context: str,
        shm_min_bytes: float,
    ) -> None:
        self._factory = factory
        self._ctx = mp.get_context(mp_context)
        self._buffer_size = buffer_size
        self._timeout = timeout
        self._shm_min = shm_min_bytes if SHM_AVAILABLE else float("inf")
        self._child = _Child()
        self._finalizer = weakref.finalize(self, _Child.close, self._child)
        self._data_q: Any = None
        self._stop: Any = None
        self._iterating = False

    def _start(self) -> None:
        if self._child.process is not None:
            return
        ctx = self._ctx
        self._child.cmd_q = ctx.Queue()
        self._data_q = ctx.Queue(maxsize=self._buffer_size)
        self._stop = ctx.Event()
        process = ctx.Process(  # type: ignore[attr-defined]
            target=_child_main,
            args=(self._factory, self._child.cmd_q, self._data_q, self._stop, self._shm_min),
            name="feedline-subprocess",
            daemon=True,
        )
        process.start()
        self._child.process = process
        # Start-up (the interpreter, imports, the factory) is not an item: a per-item limit
        # tuned for a steady stream would fail it on a slow or busy machine.
        startup = None if self._timeout is None else max(self._timeout, _STARTUP_SECONDS)
        message = self._receive(startup)
        if message[0] != "ready":
            self.close()
            self._raise(message, "while creating the iterable in the child process")

    def _receive(self, timeout: float | None) -> tuple[Any, ...]:
        waited = 0.0
        while True:
            try:
                message: tuple[Any, ...] = self._data_q.get(timeout=_POLL)
                return message
            except queue.Empty:
                process = self._child.process
                if process is None or not process.is_alive():
                    code = None if process is None else process.exitcode
                    self._child.close()
                    raise SubprocessFailure(
                        f"the child process died (exit code {code}) without finishing; a crash "
                        "in native code or running out of memory are the usual causes"
                    ) from None
                waited += _POLL
                if timeout is not None and waited >= timeout:
                    raise TimeoutError(
                        f"no item from the child process within {timeout} s"
                    ) from None

    @staticmethod
    def _raise(message: tuple[Any, ...], when: str) -> None:
        _, error, text = message
        failure = SubprocessFailure(f"error {when}:\n{text}", error)
        raise failure from error

    def __iter__(self) -> Iterator[T]:
        """One epoch: ask the child for one pass over its iterable."""
        if self._iterating:
            raise RuntimeError(
                "this subprocess iterable is already being iterated; finish the other loop first"
            )
        return self._epoch()

    def _epoch(self) -> Iterator[T]:
        self._iterating = True
        finished = False
        try:
            self._start()
            self._stop.clear()
            self._child.cmd_q.put("epoch")
            while True:
                message = self._receive(self._timeout)
                kind = message[0]
                if kind == "item":
                    yield unpack(message[1])
                elif kind == "end":
                    finished = True
                    return
                else:
                    finished = True
                    self._raise(message, "in the child process")
        finally:
            self._iterating = False
            if not finished and self._child.process is not None:
                self._interrupt()

    def _interrupt(self) -> None:
        # Abandoned mid-epoch: tell the child, then drain until it acknowledges.
        self._stop.set()
        try:
            while True:
                message = self._receive(timeout=10.0)
                if message[0] == "item":
                    unpack(message[1])  # maps and releases shared memory
                else:
                    return
        except (TimeoutError, SubprocessFailure):
            self.close()

    def close(self) -> None:
        """Stop the child process. Idempotent; iterating again later starts a new child."""
        self._child.close()  # the finalizer stays armed for whichever child runs last

    def __enter__(self) -> SubprocessIterable[T]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iterate_in_subprocess(
    factory: Callable[[], Iterable[T]],
    *,
    buffer_size: int = 3,
    timeout: float | None = None,
    mp_context: str = "spawn",
    shm_min_bytes: int = _DEFAULT_SHM_MIN,
) -> SubprocessIterable[T]:
    """Iterate, in a child process, the iterable that ``factory()`` makes there.

    Args:
        factory: A picklable callable (a module-level function, a ``functools.partial``) that
            returns the iterable. It is called once, in the child; each epoch iterates the
            iterable again.
        buffer_size: Items that may wait in the inter-process queue.
        timeout: Seconds to wait for any one item (``None``: no limit). The child's start-up
            (imports, ``factory()``) gets at least 120 s. The child's liveness is checked
            while waiting either way.
        mp_context: The multiprocessing start method. ``"spawn"`` (default) and
            ``"forkserver"`` are safe in a process that runs threads; ``"fork"`` is not.
        shm_min_bytes: NumPy arrays at least this large travel through shared memory.

    Returns:
        A :class:`SubprocessIterable`; close it (or use it as a context manager) when done.

    Raises:
        ConfigurationError: On invalid arguments or an unpicklable factory.

    """
    if not callable(factory):
        raise ConfigurationError(f"factory must be callable, got {type(factory).__name__}")
    if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
        raise ConfigurationError(f"buffer_size must be an int >= 1, got {buffer_size!r}")
    if mp_context not in mp.get_all_start_methods():
        raise ConfigurationError(
            f"mp_context {mp_context!r} is not available here; choose one of "
            f"{mp.get_all_start_methods()}"
        )
    if mp_context != "fork":
        try:
            pickle.dumps(factory)
        except Exception as error:
            raise ConfigurationError(
                f"the factory cannot be sent to a child process: {error}. Use module-level "
                "functions and functools.partial, not lambdas or local functions"
            ) from error
    return SubprocessIterable(
        factory,
        buffer_size=buffer_size,
        timeout=timeout,
        mp_context=mp_context,
        shm_min_bytes=shm_min_bytes,
    )


def _build(builder: PipelineBuilder[Any], options: dict[str, Any]) -> Iterable[Any]:
    return builder.build(**options)


def run_pipeline_in_subprocess(
    builder: PipelineBuilder[T],
    *,
    num_threads: int | None = None,
    max_failures: int | float | None = 0,
    report_stats_interval: float | None = None,
    buffer_size: int = 3,
    timeout: float | None = None,
    mp_context: str = "spawn",
    shm_min_bytes: int = _DEFAULT_SHM_MIN,
) -> SubprocessIterable[T]:
    """Build and run the pipeline that ``builder`` describes in a child process.

    The builder (its source and ops) is pickled to the child, which builds the pipeline with
    ``num_threads``, ``max_failures`` and ``report_stats_interval`` (see
    :meth:`PipelineBuilder.build`) and runs one epoch each time the result is iterated. The
    other arguments are those of :func:`iterate_in_subprocess`. The result is iterable, so it
    can be the source of another pipeline (for example one that moves batches to the GPU).
    """
    options: dict[str, Any] = {
        "num_threads": num_threads,
        "max_failures": max_failures,
        "report_stats_interval": report_stats_interval,
    }
    builder.build(**options)  # validate here, where the error is easy to read
    return iterate_in_subprocess(
        functools.partial(_build, builder, options),
        buffer_size=buffer_size,
        timeout=timeout,
        mp_context=mp_context,
        shm_min_bytes=shm_min_bytes,
    )
