"""A process pool with a pipe each way to every worker: one hand-off per call, no helper threads.

``concurrent.futures.ProcessPoolExecutor`` moves each call through a queue the workers share,
fed by a thread, and a management thread that dispatches calls and collects results; each
worker sends its result through a feeder thread of its own. Every call so wakes several threads
on both sides, which a stage of a few milliseconds per item pays for with a good part of a core
on a small machine. :class:`PipePool` sends each call straight down the pipe of the worker with
the fewest calls, from the submitting thread, and one thread per pool waits on every worker's
result pipe and exit at once. A worker reads its next call only when it has answered the last.

Writes never block the submitting thread (the event loop, for a pipeline): the task pipes do
not block, and what a full pipe cannot take waits in the worker's outbox until the pool's
thread sees the pipe writable. A worker that dies fails the call it was running, with its exit
code or signal; the calls queued behind it go to its replacement. A worker that dies before it
answered anything (its initializer or the import of the function failed) breaks the pool: its
calls and every later one fail with :class:`~concurrent.futures.process.BrokenProcessPool`.
"""

from __future__ import annotations

import collections
import contextlib
import os
import pickle
import selectors
import signal
import struct
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from feedline.errors import add_note, rebuilds

__all__ = ["PipePool"]

T = TypeVar("T")

_HEADER = struct.Struct("<QQ?")  # payload bytes, call number, whether the call succeeded
_GRACE = 0.5  # seconds a closing pool gives its workers to end on their own
_IOV_MAX = 64  # buffers handed to one writev


def _read_exactly(fd: int, size: int) -> bytearray | None:
    # ``size`` bytes from a blocking pipe, or None at its end (the writer closed or died).
    data = bytearray(size)
    view = memoryview(data)
    got = 0
    while got < size:
        n = os.readv(fd, [view[got:]])
        if n == 0:
            return None
        got += n
    return data


def _write_all(fd: int, *parts: bytes | bytearray) -> None:
    views = [memoryview(p) for p in parts if len(p)]
    while views:
        n = os.writev(fd, views[:_IOV_MAX])
        while n and views:
            if n >= len(views[0]):
                n -= len(views.pop(0))
            else:
                views[0], n = views[0][n:], 0


def _answer(fn: Callable[..., Any], args: Any, kwargs: Any) -> tuple[bytes, bool]:
    try:
        return pickle.dumps(fn(*args, **kwargs), pickle.HIGHEST_PROTOCOL), True
    except Exception as error:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        return pickle.dumps((error if rebuilds(error) else None, text)), False


def _serve(
    tasks: Connection,
    results: Connection,
    initializer: Callable[..., Any] | None,
    initargs: tuple[Any, ...],
) -> None:
    # A worker's life: answer calls in order until the parent closes the task pipe.
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle
    if initializer is not None:
        initializer(*initargs)
    fd_in, fd_out = tasks.fileno(), results.fileno()
    os.set_blocking(fd_in, True)
    while True:
        header = _read_exactly(fd_in, _HEADER.size)
        if header is None:
            return
        size, call, _ = _HEADER.unpack(header)
        body = _read_exactly(fd_in, size)
        if body is None:
            return
        try:
            fn, args, kwargs = pickle.loads(body)
        except Exception as error:  # the function or an argument cannot be rebuilt here
            text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
            payload, ok = pickle.dumps((error if rebuilds(error) else None, text)), False
        else:
            del body
            payload, ok = _answer(fn, args, kwargs)
        try:
            _write_all(fd_out, _HEADER.pack(len(payload), call, ok), payload)
        except BrokenPipeError:
            return


class _Worker:
    # The parent's side of one worker: its process, its pipes and the calls sent to it.

    def __init__(self, process: Any, tasks: Connection, results: Connection) -> None:
        self.process = process
        self.tasks, self.results = tasks, results  # the parent's ends (kept open by these)
        self.fd_out, self.fd_in = tasks.fileno(), results.fileno()
        os.set_blocking(self.fd_out, False)
        # The calls sent, in order (the first is running), with their payloads to send again
        # should the worker die with calls queued behind the one it ran.
        self.calls: dict[int, tuple[Future[Any], bytes]] = {}
        self.outbox: collections.deque[memoryview] = collections.deque()
        self.answered = 0
        self.writing = False  # registered with the selector for writes
        self.ended = False  # its result pipe reached its end

    def send(self, call: int, future: Future[Any], payload: bytes) -> None:
        # With the pool's lock held.
        self.calls[call] = (future, payload)
        pending = bool(self.outbox)
        self.outbox.append(memoryview(_HEADER.pack(len(payload), call, True)))
        self.outbox.append(memoryview(payload))
        if not pending:
            self.flush()

    def flush(self) -> None:
        # Write what the task pipe takes now, without blocking.
        outbox = self.outbox
        while outbox:
            try:
                n = os.writev(self.fd_out, list(outbox)[:_IOV_MAX])
            except BlockingIOError:
                return
            except OSError:  # the worker is gone: its exit is handled by the pool's thread
                outbox.clear()
                return
            while n and outbox:
                if n >= len(outbox[0]):
                    n -= len(outbox.popleft())
                else:
                    outbox[0], n = outbox[0][n:], 0


class _Generation:
    # The workers started together (at the first call after a close) and the thread serving them.

    def __init__(self) -> None:
        self.workers: list[_Worker] = []
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.closing = False
        self.broken: str | None = None
        self.thread: threading.Thread | None = None

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # a full pipe wakes it already
            os.write(self.wake_w, b"\0")


class PipePool(Executor):
    """Worker processes, each fed calls through a pipe of its own (see the module's docstring).

    The workers start at the first call; :meth:`close` ends them, and the next call starts new
    ones. Functions and arguments travel pickled, as for any process pool.

    Args:
        processes: How many worker processes.
        context: The multiprocessing context that starts them (a fork server or spawn).
        name: What errors call the pool (a stage's name).
        initializer: Called with ``initargs`` first thing in each worker.
        initargs: Arguments of ``initializer``.
        on_result: Applied to each result in this process, on the pool's thread, before the
            caller gets it (a process region maps the result's shared memory there).

    """

    def __init__(
        self,
        processes: int,
        context: Any,
        name: str,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] = (),
        on_result: Callable[[Any], Any] | None = None,
    ) -> None:
        self.processes = processes
        self.name = name
        self._context = context
        self._initializer, self._initargs = initializer, initargs
        self._on_result = on_result
        self._lock = threading.Lock()
        self._generation: _Generation | None = None
        self._calls = 0

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Send ``fn(*args, **kwargs)`` to the worker with the fewest calls (starting workers).

        Raises:
            BrokenProcessPool: A worker of this pool died before it answered any call.

        """
        payload = pickle.dumps((fn, args, kwargs), pickle.HIGHEST_PROTOCOL)
        future: Future[T] = Future()
        future.set_running_or_notify_cancel()  # sent at once: it can no longer be cancelled
        with self._lock:
            gen = self._generation
            if gen is None:
                gen = self._generation = self._start()
            if gen.broken is not None:
                raise BrokenProcessPool(gen.broken)
            worker = min(gen.workers, key=lambda w: len(w.calls))
            self._calls += 1
            worker.send(self._calls, future, payload)
            if worker.outbox and not worker.writing:
                gen.wake()  # the pool's thread writes the rest when the pipe drains
        return future

    def close(self) -> None:
        """End the workers (calls under way fail with ``CancelledError``); safe to call again."""
        with self._lock:
            gen, self._generation = self._generation, None
            if gen is None:
                return
            gen.closing = True
            gen.wake()
        if gen.thread is not None:
            gen.thread.join()
        for worker in gen.workers:
            worker.tasks.close()  # the worker reads the end of its pipe and exits
        _end(gen.workers)
        for worker in gen.workers:
            worker.results.close()
            for future, _ in worker.calls.values():
                future.set_exception(CancelledError(f"{self.name}: the pool was closed"))
            worker.calls.clear()
        os.close(gen.wake_r)
        os.close(gen.wake_w)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As :meth:`close` (for ``Executor``'s API)."""
        self.close()

    # -- the pool's thread -------------------------------------------------------------------

    def _start(self) -> _Generation:
        gen = _Generation()
        try:
            gen.workers = [self._new_worker() for _ in range(self.processes)]
        except BaseException:
            _end(gen.workers)
            os.close(gen.wake_r)
            os.close(gen.wake_w)
            raise
        gen.thread = threading.Thread(
            target=self._serve_results, args=(gen,), name=f"feedline-pool-{self.name}", daemon=True
        )
        gen.thread.start()
        return gen

    def _new_worker(self) -> _Worker:
        task_r, task_w = self._context.Pipe(duplex=False)
        result_r, result_w = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=_serve,
            args=(task_r, result_w, self._initializer, self._initargs),
            name=f"feedline-{self.name}",
            daemon=True,
        )
        try:
            process.start()
        finally:
            task_r.close()
            result_w.close()
        return _Worker(process, task_w, result_r)

    def _serve_results(self, gen: _Generation) -> None:
        # Wait on every worker's results and exit (and on writable task pipes with an outbox).
        with selectors.DefaultSelector() as selector:
            selector.register(gen.wake_r, selectors.EVENT_READ)
            watched: set[_Worker] = set()
            while True:
                with self._lock:
                    if gen.closing:
                        return
                    self._watch(gen, selector, watched)
                for key, _ in selector.select():
                    if key.fd == gen.wake_r:
                        with contextlib.suppress(BlockingIOError):
                            os.read(gen.wake_r, 4096)
                        continue
                    what, worker = key.data
                    if worker not in watched:  # it ended earlier in this round
                        continue
                    if what == "results":
                        if not self._take_result(worker):  # it exited: its sentinel follows
                            worker.ended = True
                            selector.unregister(worker.fd_in)
                    elif what == "tasks":
                        with self._lock:
                            worker.flush()
                    else:  # its exit: after the results it sent
                        self._worker_ended(gen, worker, selector, watched)

    def _watch(self, gen: _Generation, selector: Any, watched: set[_Worker]) -> None:
        # With the lock held: register new workers, and task pipes for writes while they wait.
        for worker in gen.workers:
            if worker not in watched:
                watched.add(worker)
                selector.register(worker.fd_in, selectors.EVENT_READ, ("results", worker))
                selector.register(worker.process.sentinel, selectors.EVENT_READ, ("exit", worker))
            if bool(worker.outbox) != worker.writing:
                worker.writing = not worker.writing
                if worker.writing:
                    selector.register(worker.fd_out, selectors.EVENT_WRITE, ("tasks", worker))
                else:
                    selector.unregister(worker.fd_out)

    def _take_result(self, worker: _Worker) -> bool:
        # Read one answer (the worker writes it whole); False at the pipe's end.
        header = _read_exactly(worker.fd_in, _HEADER.size)
        body = None if header is None else _read_exactly(worker.fd_in, _HEADER.unpack(header)[0])
        if header is None or body is None:
            return False
        _, call, ok = _HEADER.unpack(header)
        with self._lock:
            future, _ = worker.calls.pop(call)
            worker.answered += 1
        try:
            value = pickle.loads(body)
            if ok and self._on_result is not None:
                value = self._on_result(value)
        except Exception as error:
            future.set_exception(
                RuntimeError(
                    f"{self.name}: a result from worker process {worker.process.pid} cannot be "
                    f"rebuilt in this process ({type(error).__name__}: {error})"
                )
            )
            return True
        if ok:
            future.set_result(value)
        else:
            future.set_exception(_rebuilt(value, self.name, worker.process.pid))
        return True

    def _worker_ended(
        self, gen: _Generation, worker: _Worker, selector: Any, watched: set[_Worker]
    ) -> None:
        # A worker exited while the pool runs: take what it answered, then fail or move the rest.
        os.set_blocking(worker.fd_in, False)
        with contextlib.suppress(BlockingIOError):
            while worker.calls and not worker.ended and self._take_result(worker):
                pass
        worker.process.join()
        if not worker.ended:
            selector.unregister(worker.fd_in)
        selector.unregister(worker.process.sentinel)
        if worker.writing:
            selector.unregister(worker.fd_out)
        watched.discard(worker)
        how = _exit_text(worker.process.exitcode)
        pid = worker.process.pid
        with self._lock:
            calls = list(worker.calls.items())
            worker.calls.clear()
            worker.outbox.clear()
            gen.workers.remove(worker)
            running, queued = calls[:1], calls[1:]
            if worker.answered == 0:
                gen.broken = (
                    f"{self.name}: worker process {pid} {how} before it answered a call (did "
                    "its start fail? its output is above)"
                )
            else:
                try:
                    gen.workers.append(self._new_worker())
                except Exception as error:  # no replacement: the pool is broken
                    gen.broken = f"{self.name}: could not start a worker process ({error})"
            if gen.broken is not None:  # every call fails, now and later
                running += queued + [c for w in gen.workers for c in w.calls.items()]
                queued = []
                for w in gen.workers:
                    w.calls.clear()
                    w.outbox.clear()
            for call, (future, payload) in queued:  # never started: others run them
                min(gen.workers, key=lambda w: len(w.calls)).send(call, future, payload)
        worker.tasks.close()
        worker.results.close()
        message = gen.broken or (
            f"{self.name}: worker process {pid} {how} while it ran this item; a crash in "
            "native code or running out of memory are the usual causes"
        )
        for _, (future, _) in running:
            future.set_exception(BrokenProcessPool(message))


def _rebuilt(value: Any, name: str, pid: int | None) -> BaseException:
    error, text = value
    where = f"worker process {pid} of {name}"
    if error is not None:
        add_note(error, f"Original traceback in {where}:\n{text}")
        return error  # type: ignore[no-any-return]
    last = text.strip().splitlines()[-1] if text.strip() else "an exception"
    return RuntimeError(
        f"{last} (raised in {where}; its class cannot be rebuilt in this process from its "
        "pickle, so it comes as a RuntimeError: give its __init__ the message as its only "
        f"required argument, or define __reduce__)\nOriginal traceback in {where}:\n{text}"
    )


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _end(workers: list[_Worker]) -> None:
    # Give the workers a moment to end on their own (their task pipe is closed), then end them.
    deadline = time.monotonic() + _GRACE
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.exitcode is None:
            worker.process.terminate()
            worker.process.join(1.0)
        if worker.process.exitcode is None:
            worker.process.kill()
            worker.process.join()
