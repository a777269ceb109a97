"""A process pool with a pipe each way to every worker: one hand-off per call, no helper threads.

``concurrent.futures.ProcessPoolExecutor`` moves each call through a queue the workers share,
fed by a thread, and a management thread that dispatches calls and collects results; each
worker sends its result through a feeder thread of its own. Every call so wakes several threads
on both sides, which a stage of a few milliseconds per item pays for with a good part of a core
on a small machine. :class:`PipePool` sends each call straight down the pipe of the worker with
the fewest calls, from the submitting thread, and one thread per pool waits on every worker's
result pipe and exit at once. A worker reads its next call only when it has answered the last
(the worker's side: ``pipe_worker``).

Writes never block the submitting thread (the event loop, for a pipeline): the task pipes do
not block, and what a full pipe cannot take waits in the worker's outbox until the pool's
thread sees the pipe writable. A worker that dies fails the call it was running, with its exit
code or signal, and a replacement runs the calls queued behind it. A worker that dies before
it said it is ready (its initializer failed, or its start) breaks the pool: its calls and every
later one fail with :class:`~concurrent.futures.process.BrokenProcessPool` until :meth:`close`.
"""

from __future__ import annotations

import contextlib
import fcntl
import multiprocessing.util
import os
import pickle
import selectors
import signal
import sys
import termios
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import CancelledError, Executor, Future
from concurrent.futures.process import BrokenProcessPool
from multiprocessing.connection import Connection
from typing import Any, TypeVar

from feedline.errors import add_note, not_rebuilt

from .pipe_worker import HEADER, READY, read_message, serve, write_views
from .settings import POOL_CLOSE_GRACE

__all__ = ["PipePool", "rebuilt"]

T = TypeVar("T")

_pools: weakref.WeakSet[PipePool] = weakref.WeakSet()
_exiting = False


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
        self.outbox: list[memoryview] = []
        self.ready = False  # it said so: a death from now on is an item's doing
        self.writing = False  # registered with the selector for writes
        self.ended = False  # its result pipe reached its end
        self.gone = False  # a write found the worker gone: what it did not take stays here

    def send(self, call: int, future: Future[Any], payload: bytes) -> None:
        # With the pool's lock held.
        self.calls[call] = (future, payload)
        pending = bool(self.outbox)
        self.outbox += [memoryview(HEADER.pack(len(payload), call, True)), memoryview(payload)]
        if not pending:
            self.flush()

    def flush(self) -> None:
        # Write what the task pipe takes now, without blocking (with the pool's lock held).
        try:
            while self.outbox and not self.gone:
                write_views(self.fd_out, self.outbox)
        except BlockingIOError:
            pass
        except OSError:  # the worker is gone: its exit is handled by the pool's thread
            self.gone = True

    def never_read(self) -> list[tuple[Future[Any], bytes]]:
        # After the worker's death, with the lock held: the calls it never read (those whose
        # bytes are all still in its pipe or outbox), to run elsewhere. The one call it read
        # and did not answer (it reads the next only after answering) is what it ran.
        unread = sum(len(v) for v in self.outbox)
        try:
            buffered = bytearray(4)
            fcntl.ioctl(self.fd_out, termios.FIONREAD, buffered)
            unread += int.from_bytes(buffered, sys.byteorder)
        except OSError:  # not known here: the first call is taken to be the one it ran
            return list(self.calls.values())[1:]
        found: list[tuple[Future[Any], bytes]] = []
        for future, payload in reversed(self.calls.values()):
            size = HEADER.size + len(payload)
            if unread < size:
                break
            unread -= size
            found.append((future, payload))
        return found[::-1]


class _Generation:
    # The workers started together (at the first call after a close) and the thread serving them.

    def __init__(self, initargs: tuple[Any, ...]) -> None:
        self.initargs = initargs  # of the workers' initializer
        self.workers: list[_Worker] = []
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        os.set_blocking(self.wake_w, False)
        self.closing = False
        self.wake_open = True
        self.broken: str | None = None
        self.thread: threading.Thread | None = None

    def wake(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):  # a full pipe wakes it already
            os.write(self.wake_w, b"\0")

    def end(self, name: str) -> None:
        # Stop the thread, end the workers, cancel what they had; safe to call again after an
        # interruption (a second Ctrl-C), each step picking up where the last stopped.
        if self.thread is not None:
            self.thread.join()
        for worker in self.workers:
            worker.tasks.close()  # an idle worker reads the end of its pipe and exits
        _end(self.workers)
        for worker in self.workers:
            worker.results.close()
            for future, _ in worker.calls.values():
                if not future.done():
                    future.set_exception(CancelledError(f"{name}: the pool was closed"))
        if self.wake_open:
            self.wake_open = False
            os.close(self.wake_r)
            os.close(self.wake_w)


class PipePool(Executor):
    """Worker processes, each fed calls through a pipe of its own (see the module's docstring).

    The workers start at the first call; :meth:`close` ends them, and the next call starts new
    ones (after ``close(hold=True)``, only once :meth:`reopen` is called). Functions and
    arguments travel pickled, as for any process pool. The workers are not daemonic (an op may
    start processes of its own); pools still open at interpreter exit are closed before
    ``multiprocessing`` joins its children.

    Args:
        processes: How many worker processes.
        context: The multiprocessing context that starts them (a fork server or spawn).
        name: What errors call the pool (a stage's name).
        initializer: Called with ``initargs`` first thing in each worker.
        initargs: Arguments of ``initializer``, or a function that makes them anew for each
            start of the workers (the first call after a close).
        on_end: Called with a start's ``initargs`` once its workers have ended (a process
            region removes the shared memory they made and nobody mapped).
        on_result: Applied to each result in this process, on the pool's thread, before the
            caller gets it (a process region maps the result's shared memory there).

    """

    def __init__(
        self,
        processes: int,
        context: multiprocessing.context.BaseContext,
        name: str,
        initializer: Callable[..., Any] | None = None,
        initargs: tuple[Any, ...] | Callable[[], tuple[Any, ...]] = (),
        on_result: Callable[[Any], Any] | None = None,
        on_end: Callable[[tuple[Any, ...]], object] | None = None,
    ) -> None:
        self.processes = processes
        self.name = name
        self._context: Any = context
        self._initializer, self._initargs = initializer, initargs
        self._on_result, self._on_end = on_result, on_end
        self._lock = threading.Lock()
        self._generation: _Generation | None = None
        self._held = False  # closed with hold=True: calls fail until reopen()
        self._ending: list[_Generation] = []  # closed, not yet fully ended (an interrupt)
        self._close_lock = threading.Lock()
        self._calls = 0
        _pools.add(self)

    @property
    def broken(self) -> bool:
        """Whether a worker died before it was ready: calls fail until :meth:`close`."""
        gen = self._generation
        return gen is not None and gen.broken is not None

    @property
    def idle(self) -> bool:
        """Whether no call is under way (none sent, or every one answered)."""
        with self._lock:
            gen = self._generation
            return gen is None or not any(w.calls for w in gen.workers)

    def submit(self, fn: Callable[..., T], /, *args: Any, **kwargs: Any) -> Future[T]:
        """Send ``fn(*args, **kwargs)`` to the worker with the fewest calls (starting workers).

        Raises:
            BrokenProcessPool: A worker of this pool died before it was ready.

        """
        payload = pickle.dumps((fn, args, kwargs), pickle.HIGHEST_PROTOCOL)
        future: Future[T] = Future()
        future.set_running_or_notify_cancel()  # sent at once: it can no longer be cancelled
        with self._lock:
            if _exiting:
                raise RuntimeError(f"{self.name}: the interpreter is exiting")
            gen = self._generation
            if gen is None:
                if self._held:  # a stop closed it: a call that raced with the stop starts none
                    future.set_exception(CancelledError(f"{self.name}: the pool was closed"))
                    return future
                gen = self._generation = self._start()
            if gen.broken is not None:
                raise BrokenProcessPool(gen.broken)
            worker = min(gen.workers, key=lambda w: len(w.calls))
            self._calls += 1
            worker.send(self._calls, future, payload)
            if worker.outbox and not worker.writing:
                gen.wake()  # the pool's thread writes the rest when the pipe drains
        return future

    def close(self, hold: bool = False) -> None:
        """End the workers; calls under way fail with ``CancelledError``.

        Workers running a call are ended at once; idle ones are given a moment to exit. Safe
        to call again, also after an interruption part-way (it finishes the job).

        Args:
            hold: Until :meth:`reopen`, later calls fail with ``CancelledError`` instead of
                starting new workers (a stop closes the pool so: a call that raced with it
                must not start workers that the stop would then wait for).

        """
        with self._lock:
            self._held = self._held or hold
            gen, self._generation = self._generation, None
            if gen is not None:
                gen.closing = True
                gen.wake()
                self._ending.append(gen)
        with self._close_lock:  # one caller ends them; another waits for it to finish
            while self._ending:
                ending = self._ending[0]
                ending.end(self.name)
                if self._on_end is not None:
                    self._on_end(ending.initargs)
                with self._lock:
                    del self._ending[0]

    def reopen(self) -> None:
        """Let the next call start workers again after ``close(hold=True)``."""
        with self._lock:
            self._held = False

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """As :meth:`close` (for ``Executor``'s API)."""
        self.close()

    # -- starting workers ------------------------------------------------------------------------

    def _start(self) -> _Generation:
        made = self._initargs
        gen = _Generation(made() if callable(made) else made)
        try:
            gen.workers = [self._new_worker(gen.initargs) for _ in range(self.processes)]
        except BaseException:
            gen.end(self.name)
            raise
        gen.thread = threading.Thread(
            target=self._serve_results, args=(gen,), name=f"feedline-pool-{self.name}", daemon=True
        )
        gen.thread.start()
        return gen

    def _new_worker(self, initargs: tuple[Any, ...]) -> _Worker:
        task_r, task_w = self._context.Pipe(duplex=False)
        result_r, result_w = self._context.Pipe(duplex=False)
        process = self._context.Process(
            target=serve,
            args=(task_r, result_w, self._initializer, initargs),
            name=f"feedline-{self.name}",
        )
        try:
            process.start()
        finally:
            task_r.close()
            result_w.close()
        return _Worker(process, task_w, result_r)

    # -- the pool's thread -----------------------------------------------------------------------

    def _serve_results(self, gen: _Generation) -> None:
        try:
            self._serve(gen)
        except BaseException as error:  # a bug here must fail the calls, not leave them hanging
            self._break(gen, f"{self.name}: the pool's thread failed ({error!r})", [])
            raise

    def _serve(self, gen: _Generation) -> None:
        # Wait on every worker's results and exit (and on writable task pipes with an outbox).
        with selectors.DefaultSelector() as selector:
            selector.register(gen.wake_r, selectors.EVENT_READ)
            watched: set[_Worker] = set()
            while True:
                with self._lock:
                    if gen.closing:
                        return
                    _watch(gen, selector, watched)
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

    def _take_result(self, worker: _Worker) -> bool:
        # Read one answer (the worker writes it whole); False at the pipe's end.
        got = read_message(worker.fd_in)
        if got is None:
            return False
        call, ok, body = got
        if call == READY:
            worker.ready = True
            return True
        with self._lock:
            future, _ = worker.calls.pop(call, (None, b""))
        if future is None:  # a call the pool failed when it broke: nobody waits for it
            return True
        pid = worker.process.pid
        try:
            value = pickle.loads(body)
        except Exception as error:
            future.set_exception(
                RuntimeError(
                    f"{self.name}: a result from worker process {pid} cannot be rebuilt in "
                    f"this process ({type(error).__name__}: {error})"
                )
            )
            return True
        if not ok:
            future.set_exception(rebuilt(value, self.name, pid))
            return True
        if self._on_result is not None:
            try:
                value = self._on_result(value)
            except Exception as error:
                future.set_exception(error)
                return True
        future.set_result(value)
        return True

    def _worker_ended(
        self, gen: _Generation, worker: _Worker, selector: Any, watched: set[_Worker]
    ) -> None:
        # A worker exited while the pool runs: take what it answered, then fail or move the rest.
        os.set_blocking(worker.fd_in, False)
        with contextlib.suppress(BlockingIOError):
            while not worker.ended and self._take_result(worker):
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
        if not worker.ready:
            self._break(
                gen,
                f"{self.name}: worker process {pid} {how} as it started (its initializer or "
                "its start failed: its output is above); close the pool to try again",
                [worker],
            )
            return
        with self._lock:
            calls = list(worker.calls.values())
            unread = worker.never_read()
            worker.calls.clear()
            worker.outbox.clear()
            gen.workers.remove(worker)
            worker.tasks.close()
            worker.results.close()
            try:
                gen.workers.append(self._new_worker(gen.initargs))
            except Exception as error:  # no replacement: the pool is broken
                gen.broken = f"{self.name}: could not start a worker process ({error})"
            else:
                for future, payload in unread:  # never started: others run them
                    self._calls += 1
                    min(gen.workers, key=lambda w: len(w.calls)).send(self._calls, future, payload)
                calls = calls[: len(calls) - len(unread)]
        for future, _ in calls:
            future.set_exception(
                BrokenProcessPool(
                    f"{self.name}: worker process {pid} {how} while it ran this item; a crash "
                    "in native code or running out of memory are the usual causes"
                )
            )
        if gen.broken is not None:
            self._break(gen, gen.broken, [])

    def _break(self, gen: _Generation, reason: str, gone: list[_Worker]) -> None:
        # Every call fails with ``reason``, and later ones at once, until the pool is closed.
        with self._lock:
            gen.broken = reason
            calls = [c for w in gen.workers for c, _ in w.calls.values()]
            for w in gen.workers:
                w.calls.clear()
                w.outbox.clear()
            for w in gone:
                if w in gen.workers:
                    gen.workers.remove(w)
                w.tasks.close()
                w.results.close()
        for future in calls:
            future.set_exception(BrokenProcessPool(reason))


def _watch(gen: _Generation, selector: selectors.BaseSelector, watched: set[_Worker]) -> None:
    # With the pool's lock held: register new workers, and task pipes for writes while an
    # outbox waits.
    for worker in gen.workers:
        if worker not in watched:
            watched.add(worker)
            selector.register(worker.fd_in, selectors.EVENT_READ, ("results", worker))
            selector.register(worker.process.sentinel, selectors.EVENT_READ, ("exit", worker))
        if bool(worker.outbox and not worker.gone) != worker.writing:
            worker.writing = not worker.writing
            if worker.writing:
                selector.register(worker.fd_out, selectors.EVENT_WRITE, ("tasks", worker))
            else:
                selector.unregister(worker.fd_out)


def rebuilt(value: Any, name: str, pid: int | None) -> BaseException:
    """The exception a worker sent as ``portable(error)``, with where it was raised."""
    error, text = value
    where = f"worker process {pid} of {name}" if pid is not None else f"a worker process of {name}"
    if error is not None:
        add_note(error, f"Original traceback in {where}:\n{text}")
        return error  # type: ignore[no-any-return]
    return not_rebuilt(text, where, where)


def _exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _end(workers: list[_Worker]) -> None:
    # Workers with calls under way are ended at once (what they run is dropped); idle ones
    # are given a moment to exit on their own, having read the end of their task pipe.
    for worker in workers:
        if worker.calls and worker.process.exitcode is None:
            worker.process.terminate()
    deadline = time.monotonic() + POOL_CLOSE_GRACE
    for worker in workers:
        worker.process.join(max(0.0, deadline - time.monotonic()))
    for worker in workers:
        if worker.process.exitcode is None:
            worker.process.terminate()
            worker.process.join(1.0)
        if worker.process.exitcode is None:
            worker.process.kill()
            worker.process.join()


def _close_all_at_exit() -> None:
    # Before multiprocessing joins its (non-daemonic) children at exit: end the pools' workers,
    # which would otherwise wait for calls forever.
    global _exiting
    _exiting = True
    for pool in list(_pools):
        with contextlib.suppress(Exception):
            pool.close()


multiprocessing.util.Finalize(None, _close_all_at_exit, exitpriority=100)
