"""Run an iterable in a child process and iterate it from the parent, one pass per epoch.

The "multi-threading in a subprocess" pattern: a child process runs a pipeline with its own
event loop and thread pool (decoding, collation: work that may hold the GIL; see
:func:`~feedline.run_pipeline_in_subprocess`), and the parent receives finished items,
typically batches, through a bounded inter-process queue, keeping its own GIL for the
training loop. Arrays cross through shared memory (see :mod:`.shm`). When the child leaves,
it closes what the factory made, if that has a ``close()`` (a pipeline and its executors).

Protocol (parent -> child on the command queue, child -> parent on the data queue)::

    child:  ("ready",) | ("init-error", exc, tb)
    parent: "epoch"  -> child: ("item", x)* then ("end",) | ("error", exc, tb)
    parent: "close"  -> child exits

An epoch that the parent abandons is interrupted through an Event; the child answers with
("end",), and the parent drains what was in flight. A child whose parent dies exits on its own.
"""

from __future__ import annotations

import contextlib
import gc
import multiprocessing as mp
import os
import pickle
import queue
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any, Generic, TypeVar

from feedline._watchdog import StallWatch, describe_child, dump_stacks_on_signal
from feedline.errors import (
    ConfigurationError,
    PipelineFailure,
    SubprocessDied,
    SubprocessFailure,
    add_note,
    not_rebuilt,
    portable,
)

from .lifetime import die_with_parent
from .queues import close_queue, write_first
from .settings import (
    CHILD_CLOSE_GRACE,
    CHILD_DRAIN_SECONDS,
    CHILD_POLL,
    CHILD_STARTUP_SECONDS,
    SHM_MIN_BYTES,
)
from .shm import (
    SHM_AVAILABLE,
    SegmentNames,
    pack,
    release,
    remove_prefixed,
    set_segment_names,
    unpack,
)

__all__ = ["Abandoned", "SubprocessIterable", "iterate_in_subprocess"]

T = TypeVar("T")


def _send(data_q: Any, stop: Any, message: Any, packed: Any = None) -> bool:
    # Put with a timeout so that an interrupted epoch never leaves the child stuck on a full queue.
    while True:
        try:
            data_q.put(message, timeout=CHILD_POLL)
            return True
        except queue.Full:
            if stop.is_set():
                release(message if packed is None else packed)  # never to be mapped
                return False


def _pickled(packed: Any) -> bytes:
    # The item's message, pickled here: a queue pickles in its feeder thread, where a
    # failure is only printed and the item lost (an epoch would end short, silently).
    message = ("item", packed)
    try:
        return bytes(ForkingPickler.dumps(message))
    except Exception as error:
        release(packed)
        add_note(
            error,
            f"feedline: an item of type {type(packed).__name__} cannot be sent to the parent "
            "process (it must pickle: memoryviews, open files, lambdas and locks do not); "
            "return bytes, arrays or plain data instead",
        )
        raise


def _child_main(
    factory: Callable[[], Iterable[Any]],
    cmd_q: Any,
    data_q: Any,
    stop: Any,
    shm_min: float,
    shm_prefix: str,
    begin: bool = False,
) -> None:
    # Ctrl-C reaches the whole process group; the parent decides what happens to this child
    # (it ends it at once), so an interrupt here would only garble a message mid-send.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # What a fork inherited is never collected here: the garbage collector would walk it all
    # (a sampler's permutation of 1.3 million indices cost a worker 43 ms before its first
    # item) and write to each object's header, copying the parent's pages into this process.
    gc.freeze()
    die_with_parent()
    dump_stacks_on_signal()  # a stall report in the parent asks for them
    names = SegmentNames(shm_prefix)
    set_segment_names(names)  # shared_empty's segments, too, are this child's
    try:
        iterable = factory()
    except BaseException as error:
        data_q.put(("init-error", *portable(error)))
        return
    # Without starting the feeder thread: that waits for the thread to run (about 1.5 ms on
    # cores busy with the other workers' starts), before this child's first item.
    if not write_first(data_q, ("ready",)):
        data_q.put(("ready",))
    try:
        _serve(iterable, cmd_q, data_q, stop, shm_min, names, begin)
    finally:
        close = getattr(iterable, "close", None)
        if callable(close):  # what the factory made is this process's to close (a pipeline)
            close()


def _serve(
    iterable: Iterable[Any],
    cmd_q: Any,
    data_q: Any,
    stop: Any,
    shm_min: float,
    names: SegmentNames,
    begin: bool,
) -> None:
    # One pass over the iterable per "epoch" command, until another command comes.
    while True:
        command = "epoch" if begin else cmd_q.get()  # begin: the first pass is asked already
        begin = False
        if command != "epoch":
            return
        try:
            for item in iterable:
                if stop.is_set():
                    break
                packed = pack(item, shm_min, names)
                if not _send(data_q, stop, _pickled(packed), packed):
                    break
            data_q.put(("end",))
        except BaseException as error:
            data_q.put(("error", *portable(error)))


class Abandoned(Exception):
    """The consumer's pipeline stopped while this epoch waited for the child."""


class _Closed(Abandoned):
    """close() ended (or is ending) the child of this epoch: the epoch ends, as if stopped."""


class _Child:
    """The process and queues behind a SubprocessIterable (what its finalizer may touch).

    Closing is re-entrant: each of its steps may be taken again, and the process stays
    recorded, with ``closing`` set, until the last one is done. An interrupt in the middle
    (a second Ctrl-C) leaves it so; the next call, the next epoch or the finalizer finishes
    the job.
    """

    def __init__(self) -> None:
        self.process: Any = None
        self.cmd_q: Any = None
        self.stop: Any = None
        self.shm_prefix = ""
        # Two threads may close at once (the consumer, and a reader that found the child
        # dead); re-entrant, so that a close interrupted and called again goes on.
        self.lock = threading.RLock()
        self.owner = os.getpid()  # a forked copy (a worker of another loader) owns no child
        # The child serves no further epoch: a close is under way, or an interrupt cut one
        # short, or the child was asked to leave. Set before anything is done to the child,
        # so that a reader who sees it gone knows it was ended, not that it died.
        self.closing = False
        # An epoch was asked of the child and its end ("end" or "error") not read: its items
        # may still come, and the next epoch would take them for its own. A clean-up that an
        # interrupt cut short leaves it set.
        self.epoch_open = False

    def ask_to_leave(self) -> None:
        """Ask the child to end its epoch after its current item, then exit."""
        process = self.process
        if process is None or getattr(process, "_popen", None) is None:
            return
        if process.exitcode is None:
            self.closing = True
            if self.stop is not None:
                self.stop.set()
            with contextlib.suppress(OSError, ValueError):
                self.cmd_q.put("close")

    def close(self, grace: float = CHILD_CLOSE_GRACE) -> None:
        if os.getpid() != self.owner:
            return
        with self.lock:
            if self.process is not None:
                self.closing = True
            self._close(grace)

    def _close(self, grace: float) -> None:
        # Every step may run again (after an interrupt): the joins, Queue.close and the
        # removal of what is left are idempotent. The process is forgotten last (its pid
        # and exit code stay readable until then; what Process.close frees, a collection
        # frees too).
        process = self.process
        if process is None:
            return
        if getattr(process, "_popen", None) is not None:  # started (or being started)
            if process.exitcode is None and grace > 0:
                self.ask_to_leave()
                process.join(grace)
            if process.exitcode is None:
                process.terminate()
                process.join(1.0)
            if process.exitcode is None:
                process.kill()
                process.join()
        if self.cmd_q is not None:
            close_queue(self.cmd_q)  # the reader is gone: never wait to flush to it
        # What the child made and nobody mapped: items in flight or in the queue.
        remove_prefixed(self.shm_prefix)
        self.epoch_open = False
        self.process = None
        self.closing = False
        with contextlib.suppress(ValueError):
            process.close()


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C back while a child is started, then raise it.

    An interrupt in the middle of ``Process.start()`` (while the child's arguments are being
    written to it) loses the child's pid: nobody would wait for it, and it stays a zombie.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[int] = []
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    except (ValueError, TypeError):  # pragma: no cover - not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received and callable(previous):
        previous(signal.SIGINT, None)  # the handler the user had: KeyboardInterrupt by default


class SubprocessIterable(Generic[T]):
    """Items of an iterable that runs in a child process; iterate it once per epoch.

    Made by :func:`iterate_in_subprocess` and :func:`run_pipeline_in_subprocess`. The child
    starts when the first iteration begins and lives until :meth:`close` (or garbage
    collection, or interpreter exit); each ``for`` loop asks it for one more pass over its
    iterable.

    Interruption: an epoch left early (``break``) asks the child to stop after its current
    item and drains what was in flight, so that the next epoch reuses the child. An exception
    in the consumer (``KeyboardInterrupt``) ends the child at once instead, and the next epoch
    starts a new one: the exception reaches the caller without waiting for the child's item.
    Nothing the child made (shared-memory segments) outlives it. A clean-up that a second
    Ctrl-C cuts short is finished by the next :meth:`close` or the next epoch, which then
    starts a new child: that epoch yields every item, never the ones (or the end) the
    interrupted epoch's child was still sending.

    Closing from another thread: :meth:`close` (or :meth:`ask_to_leave`) while an epoch is
    being iterated ends that iteration as the end of the epoch does, without an error, as
    :meth:`Pipeline.stop() <feedline.Pipeline.stop>` from another thread ends a pipeline's
    loop; the items still on their way are dropped. An error is raised only for a child
    that died by itself (:class:`~feedline.SubprocessDied`) or failed.
    """

    def __init__(
        self,
        factory: Callable[[], Iterable[T]],
        *,
        buffer_size: int,
        timeout: float | None,
        mp_context: str,
        shm_min_bytes: float,
        name: str = "the child process",
        reraise: bool = False,
    ) -> None:
        self._factory = factory
        self._ctx = mp.get_context(mp_context)
        self._buffer_size = buffer_size
        self._timeout = timeout
        self._shm_min = shm_min_bytes if SHM_AVAILABLE else float("inf")
        self._name = name
        self._reraise = reraise  # raise the child's own exception (with a note), not a wrapper
        self._child = _Child()
        self._finalizer = weakref.finalize(self, _Child.close, self._child)
        self._data_q: Any = None
        self._ready = False
        self._iterating = False
        self._requested = False  # the child was asked for its next pass ahead (request_epoch)
        self._settled = False  # the epoch in progress was ended from outside (settle)
        # Reports a wait with nothing coming (see feedline._watchdog); an owner of several
        # children (the DataLoader's workers) gives them one watch of its own.
        self.watch = StallWatch(
            f"the consumer of {name}",
            describe=lambda: [self.describe()],
        )

    def describe(self) -> str:
        """The child's state, for a stall report (see :func:`feedline._watchdog.describe_child`)."""
        return describe_child(self._name, self.pid, self._ready)

    @property
    def pid(self) -> int | None:
        """The child's process id, once it started."""
        process = self._child.process
        return None if process is None else process.pid

    def start(self, method: str | None = None, *, begin: bool = False) -> None:
        """Start the child now, without waiting for it (iterating starts it otherwise).

        Args:
            method: A start method for this child only (``"fork"`` from a thread-free
                process, say), instead of the one given at construction.
            begin: The child begins its first pass as soon as it runs, as if
                :meth:`request_epoch` had been called (no message to wait for).

        """
        try:
            self._launch(method, begin)
        except BaseException:
            self.close()
            raise

    def _launch(self, method: str | None = None, begin: bool = False) -> None:
        # Start the child without waiting for it: several children start at once.
        if self._child.closing:
            self.close()  # one that an interrupt cut short, or a child asked to leave
        if self._child.process is not None:
            return
        ctx = self._ctx if method is None else mp.get_context(method)
        child = self._child
        child.cmd_q = ctx.Queue()
        self._data_q = ctx.Queue(maxsize=self._buffer_size)
        child.stop = ctx.Event()
        child.shm_prefix = SegmentNames.new_prefix()
        self._ready = False
        self._requested = begin
        child.epoch_open = begin
        process = ctx.Process(  # type: ignore[attr-defined]
            target=_child_main,
            args=(
                self._factory,
                child.cmd_q,
                self._data_q,
                child.stop,
                self._shm_min,
                child.shm_prefix,
                begin,
            ),
            name="feedline-subprocess",
            daemon=True,
        )
        child.process = process  # recorded first, so that close() finds it whatever happens
        with _sigint_deferred():
            process.start()

    def _await_ready(self, stopping: Callable[[], bool] | None = None) -> None:
        if self._ready:
            return
        # Start-up (the interpreter, imports, the factory) is not an item: a per-item limit
        # tuned for a steady stream would fail it on a slow or busy machine.
        startup = None if self._timeout is None else max(self._timeout, CHILD_STARTUP_SECONDS)
        message = self._receive(startup, stopping)
        if message[0] != "ready":
            self.close()
            self._raise(message, "while creating the iterable in the child process")
        self._ready = True

    def _receive(
        self, timeout: float | None, stopping: Callable[[], bool] | None = None
    ) -> tuple[Any, ...]:
        start = time.monotonic()
        while True:
            if self._closed():
                # What is still queued refers to segments the close removed.
                raise _Closed
            waited = time.monotonic() - start
            try:
                message: Any = self._data_q.get(
                    timeout=CHILD_POLL
                    if timeout is None
                    else max(1e-3, min(CHILD_POLL, timeout - waited))
                )
                if type(message) is bytes:  # an item, pickled by the child (see _pickled)
                    message = pickle.loads(message)
                return message  # type: ignore[no-any-return]
            except (queue.Empty, EOFError, OSError) as error:
                if stopping is not None and stopping():
                    raise Abandoned from None
                self.watch.tick(start)
                process = self._child.process
                if process is not None and not isinstance(error, queue.Empty):
                    process.join(1.0)  # the pipe broke: the child is gone or going
                if process is None or process.exitcode is not None:
                    # Looked at after the exit was seen: close() marks the child first.
                    if process is None or self._closed():
                        raise _Closed from None  # ended by close(), not dead
                    pid, code = process.pid, process.exitcode
                    self._child.close()
                    raise self._died(pid, code) from None
                if timeout is not None and time.monotonic() - start >= timeout:
                    raise TimeoutError(f"no item from {self._name} within {timeout} s") from None

    def _closed(self) -> bool:
        # close() (from another thread) or ask_to_leave() ended, or is ending, the child.
        return self._child.closing or self._child.process is None

    def _died(self, pid: int, code: int | None) -> SubprocessDied:
        error = SubprocessDied("", pid, code)
        how = (
            f"was killed by {error.signal}"
            if error.signal is not None
            else f"exited (exit code {code})"
        )
        if error.signal == "SIGKILL":
            hint = "; SIGKILL is what the out-of-memory killer sends"
        elif not self._ready and code == 1:
            # Python itself failed before the child could start its iterable: its traceback
            # went to stderr. Under the fork server or spawn, the usual cause is a main
            # script that starts processes at import time, which the child imports again.
            hint = (
                " (exit code 1 while starting: its traceback is on stderr above). With the "
                "fork server or spawn, the child imports the main script again: put the code "
                "that iterates the loader under `if __name__ == '__main__':`"
            )
        else:
            hint = "; a crash in native code or running out of memory are the usual causes"
        error.args = (f"{self._name} (pid {pid}) {how} before it finished{hint}",)
        return error

    def _raise(self, message: tuple[Any, ...], when: str) -> None:
        _, error, text = message
        where = "" if when == "in the child process" else f" {when}"
        if self._reraise and error is not None and not isinstance(error, PipelineFailure):
            add_note(error, f"raised in {self._name}{where}")
            add_note(error, f"Original traceback in {self._name}:\n{text}")
            raise error
        if self._reraise and error is None:
            raise not_rebuilt(text, f"{self._name}{where}", self._name)
        failure = SubprocessFailure(f"error {when}:\n{text}", error)
        raise failure from error

    def __iter__(self) -> Iterator[T]:
        """One epoch: start the child if needed and ask it for one pass over its iterable.

        The request goes out at once, before the first item is asked for, so that several
        subprocess iterables started one after another work at the same time.
        """
        return self.iter_until(None)

    def iter_until(
        self, stopping: Callable[[], bool] | None, *, settle: bool = True
    ) -> Iterator[T]:
        """One epoch, as :meth:`__iter__`, that ends early once ``stopping()`` is true.

        ``stopping`` is checked while waiting for the child (every 0.2 s). When it turns true,
        the child gets :data:`CHILD_DRAIN_SECONDS` to finish its item and is ended otherwise; the
        iterator then ends without error. A pipeline whose source this is passes its own
        stop, so stopping that pipeline (Ctrl-C, ``break``) does not wait for the child.
        With ``settle=False`` the iterator leaves the child as it is and raises
        ``Abandoned`` instead: its owner settles several children together (it raises that,
        too, when :meth:`close` ended the child meanwhile).
        """
        if self._iterating:
            raise RuntimeError(
                "this subprocess iterable is already being iterated; finish the other loop first"
            )
        self._iterating = True
        try:
            self._end_unsettled()
            self._launch()
            if not self._requested:
                self._ask_epoch()
            self._requested = False
        except BaseException:
            self._iterating = False
            self.close()
            raise
        self._settled = False
        epoch = self._epoch(stopping, settle)
        next(epoch)  # into its try block: closing it now, unstarted, still cleans up
        return epoch

    def _end_unsettled(self) -> None:
        # An epoch whose clean-up an interrupt cut short (a second Ctrl-C) may have left its
        # child sending that epoch's items, or its "end", which this epoch would take for
        # its own (and end with no item): that child is ended, and a new one serves.
        if self._child.epoch_open and not self._requested:
            self.close()

    def _epoch(self, stopping: Callable[[], bool] | None, settle: bool) -> Iterator[T]:
        finished = False
        graceful = False  # left by the consumer (break, a stop): the child may be kept
        try:
            yield None  # type: ignore[misc]  # taken by __iter__
            self._await_ready(stopping)
            while True:
                message = self._receive(self._timeout, stopping)
                kind = message[0]
                if kind == "item":
                    try:
                        value = unpack(message[1])
                    except FileNotFoundError:
                        if self._closed():  # taken as a close removed its segments
                            raise _Closed from None
                        raise
                    yield value
                elif kind == "end":
                    finished = True
                    self._child.epoch_open = False
                    return
                else:
                    finished = True
                    self._child.epoch_open = False
                    self._raise(message, "in the child process")
        except _Closed:
            finished = True  # whoever closed it ends the child: nothing to settle
            if not settle:
                raise  # an Abandoned: the owner ends its epoch
            return
        except Abandoned:
            if not settle:
                self._settled = True  # the owner settles this child
                raise
            graceful = True
            return
        except GeneratorExit:
            graceful = True
            raise
        finally:
            self._iterating = False
            if not finished and not self._settled and self._child.process is not None:
                self.settle(time.monotonic() + CHILD_DRAIN_SECONDS if graceful else 0.0)

    def request_epoch(self) -> None:
        """Ask the child for its next pass now, starting it if needed; iterating takes it.

        For an owner that knows the next epoch before it iterates: the child begins its pass
        at once instead of when the iteration starts. The next iteration must follow (or
        :meth:`close`): the child's items wait for it.
        """
        if self._iterating:
            raise RuntimeError("this subprocess iterable is being iterated; finish that loop first")
        try:
            self._end_unsettled()
            self._launch()
            if not self._requested:
                self._ask_epoch()
                self._requested = True
        except BaseException:
            self.close()
            raise

    def _ask_epoch(self) -> None:
        # Ask the child for a pass (read by the child once it is ready).
        self._child.stop.clear()
        self._child.epoch_open = True
        self._child.cmd_q.put("epoch")

    def wait_handles(self) -> list[Any]:
        """What ``multiprocessing.connection.wait`` can wait on for this child's next message.

        The data queue's reading end (readable once a message, or the child's end of the
        pipe, is there) and the process's sentinel (ready when it exits). Empty before the
        child starts. Used to take items from several children in the order they come.
        """
        process = self._child.process
        if process is None or self._data_q is None:
            return []
        # The queue's reading connection: multiprocessing.Queue has no public accessor.
        return [self._data_q._reader, process.sentinel]

    def wait_ready(self, stopping: Callable[[], bool] | None = None) -> None:
        """Wait until the child has made its iterable (once per child)."""
        self._await_ready(stopping)

    def request_stop(self) -> None:
        """Ask the child to stop its epoch after its current item (see :meth:`settle`)."""
        if self._child.stop is not None and self._child.process is not None:
            self._child.stop.set()

    def settle(self, deadline: float) -> None:
        """End the epoch in progress: drain until the child acknowledges, by ``deadline``.

        A child that has not acknowledged by ``deadline`` (a ``time.monotonic()`` value; 0
        ends it at once) is ended, and the next epoch starts a new one. Several children are
        settled together by calling :meth:`request_stop` on each first.
        """
        self._settled = True
        kept = False
        try:
            kept = self._drain(deadline)
        finally:
            if not kept:  # interrupted, or the child did not answer: end it
                self.close()

    def _drain(self, deadline: float) -> bool:
        # Whether the child acknowledged (and is still usable for another epoch).
        self.request_stop()
        if not self._ready:
            return False  # it never came up: a new one will serve the next epoch
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                message = self._receive(left)
                if message[0] == "item":
                    release(message[1])  # never mapped: its segments are just removed
                else:
                    self._child.epoch_open = False
                    return True
        except (TimeoutError, SubprocessFailure, _Closed):
            return False

    def ask_to_leave(self) -> None:
        """Ask the child to exit after its current item, without waiting (see :meth:`close`)."""
        self._child.ask_to_leave()

    def close(self, grace: float = CHILD_CLOSE_GRACE) -> None:
        """Stop the child process; returns within about a second, even mid-epoch.

        The child gets ``grace`` seconds to leave by itself, then is terminated. Idempotent
        and safe to call again after an interrupt; iterating again later starts a new child.
        Shared-memory segments the child made and nobody mapped are removed. Called from
        another thread mid-epoch, the loop iterating this ends quietly (``StopIteration``),
        as after :meth:`Pipeline.stop() <feedline.Pipeline.stop>`: it is not a failure.
        """
        self._ready = False
        self._child.close(grace)  # the finalizer stays armed for whichever child runs last

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
    shm_min_bytes: int = SHM_MIN_BYTES,
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
