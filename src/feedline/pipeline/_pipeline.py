"""Pipeline: the object users iterate. Each iteration is one epoch, run by a fresh ``Run``."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Generic, TypeVar

from feedline._grace import Closing, CtrlCHeld, claim_ctrl_c, close_relayed, release_ctrl_c
from feedline._watchdog import StallWatch
from feedline.errors import ConfigurationError

from ._defs import AggregateConfig, DisaggregateConfig, PipeConfig, PipelineConfig
from ._engine import Run
from ._epochs import Accounting, Passes
from ._lifecycle import own_thread
from ._placement import Placement
from ._region import RegionPool
from ._resume import Progress, Tagged, tag_async_source, tag_source
from ._settings import CONTINUOUS_AHEAD, SOURCE_POLL
from .stats import PipelineStats

__all__ = ["Pipeline"]

T = TypeVar("T")


class _Holder:
    """What the finalizer may touch: the current run and process regions, never the Pipeline."""

    __slots__ = ("hooks", "lock", "regions", "relayed", "run")

    def __init__(self, regions: list[RegionPool | Placement], hooks: list[tuple[Any, str]]) -> None:
        self.run: Run | None = None
        self.lock = threading.Lock()
        self.regions = regions
        self.hooks = hooks  # (TaskHook, stage) pairs: told when each epoch's stages end
        self.relayed = False  # the run of a resumable pipeline claimed the Ctrl-C relay

    def stop(self) -> None:
        # unlocked: one reference; a stop ordered after start() (by any means) sees its run,
        # and one racing with it may as well come first.
        run = self.run
        if self._elsewhere(run, self.stop):
            return
        if run is not None:
            # The run's join lock orders its stops' region closes (two stops never both see
            # the run as current, so neither holds a later run's regions: a start() comes only
            # after the run is let go, and reopens them). Not self.lock: state_dict() need
            # not wait for workers to end.
            if not run.life.finished:  # part-way: what the regions' workers run is dropped
                run.begin_stop()  # no new calls; those under way fail as the workers end
                with run.life.join_lock:
                    if self.run is run:
                        self.close_regions()
            run.stop()  # re-entrant: an interrupted stop keeps the run for the next call
            with run.life.join_lock:
                ended = self.run is run
                if ended:
                    if not run.life.finished:  # stopped part-way or failed: items are dropped
                        self.close_regions()
                    for pool in self.regions:
                        if pool.broken:  # its workers could not start: the next epoch retries
                            pool.close()
                    with self.lock:
                        self.run = None
                        if self.relayed:  # the relay start() claimed goes with the run
                            self.relayed = False
                            release_ctrl_c()
            if ended:
                for hook, stage in self.hooks:
                    hook.stage_end(stage)

    def close_regions(self) -> None:
        # held: a call that raced with the stop fails instead of starting workers that the
        # stop would wait for; the next run reopens them.
        for pool in self.regions:
            pool.close(hold=True)

    def close(self) -> None:
        """The pipeline is gone: stop its run and end its worker processes."""
        if self._elsewhere(self.run, self.close):
            return
        self.stop()
        self.close_regions()

    @staticmethod
    def _elsewhere(run: Run | None, then: Callable[[], None]) -> bool:
        # Whether ``then`` (the stop) runs on a thread of its own, because this one is the
        # run's (see own_thread); the thread does all of it, locks included.
        if run is None or not own_thread(run.life, run.on_loop_thread()):
            return False
        with contextlib.suppress(RuntimeError):  # at exit no thread starts: the run's are daemons
            threading.Thread(target=then, name="feedline-stop", daemon=True).start()
        return True


class Pipeline(Generic[T]):
    """A running (or ready-to-run) data pipeline, made by :meth:`PipelineBuilder.build`.

    Iterate it to run one epoch: ``for item in pipeline`` runs the source to its end once,
    then stops every thread it started. Iterating again runs another epoch::

        for epoch in range(3):
            for batch in pipeline:
                train_step(batch)

    To start loading ahead of the loop (and be sure threads stop on the way out), use
    :meth:`auto_stop`::

        with pipeline.auto_stop():
            for batch in pipeline:
                ...

    Iteration raises :class:`~feedline.PipelineFailure` when a stage exceeds the failure budget,
    and re-raises an exception from the source as it is. Breaking out of the loop, raising
    inside it, or dropping the pipeline stops its threads. A pipeline still running at
    interpreter exit is stopped too.

    A pipeline built with ``resumable=True`` can save where the epoch stands and resume there
    later, in another process::

        state = pipeline.state_dict()       # with the model's checkpoint, any time
        ...
        pipeline = builder.build(resumable=True)
        pipeline.load_state_dict(state)
        for batch in pipeline:              # the rest of the interrupted epoch
            ...
    """

    def __init__(self, config: PipelineConfig) -> None:
        self._config = config
        pipes = [s for s in config.stages if isinstance(s, PipeConfig)]
        regions: list[RegionPool | Placement] = [
            pool
            for s in pipes
            for pool in (s.executor, s.placement)
            if isinstance(pool, RegionPool | Placement)
        ]
        hooks = [(hook, stage) for stage in config.hooked_stages for hook in config.hooks]
        self._holder = _Holder(regions, hooks)
        self._last: Run | None = None
        # Held by the loop that iterates (a plain lock: the loop's end may come on another
        # thread, a garbage collection's): one loop at a time.
        self._iterating = threading.Lock()
        self._finalizer = weakref.finalize(self, _Holder.close, self._holder)
        self._progress = Progress()  # resumable: what the current (or last) epoch delivered
        self._loaded: Progress | None = None  # a loaded state, for the next epoch
        # build(continuous=True): the epoch the next loop runs, the current run's passes and
        # checkpoints, and items of later epochs that came early.
        self._next_epoch = 0
        self._accounting: Accounting | None = None
        self._held: dict[int, collections.deque[Any]] = {}  # per epoch
        # Reports a consumer that waits with nothing moving (see feedline._watchdog); a
        # DataLoader names it. No reference to this pipeline.
        holder = self._holder
        self.watch = StallWatch(
            "a feedline pipeline's consumer",
            describe=lambda: _in_flight(holder.run),
            progress=lambda: _moved(holder.run),
        )

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start loading the next epoch in the background. Does nothing if already started."""
        holder = self._holder
        previous = holder.run
        if previous is not None and previous.life.stopping:
            # A stop that an interrupt cut short, or one on its way on another thread:
            # finish it here, then start anew (never take over a run that is stopping).
            holder.stop()
        with holder.lock:
            if holder.run is not None:
                return
            run = self._new_run()
            run.watch(self.watch)
            holder.run = run
            self._last = run
            if self._config.resumable:
                # get_item() on the main thread counts its items inside CtrlCHeld too
                # (_unwrap): the relay that needs is claimed for the run, as a loop claims
                # it for its own.
                holder.relayed = claim_ctrl_c()
        for pool in holder.regions:
            pool.reopen()
        for hook, stage in holder.hooks:
            hook.stage_start(stage)
        run.start()

    def _new_run(self) -> Run:
        # Under the holder's lock, which state_dict() takes too. Items travel Tagged (see
        # _resume); a resumable run skips the items done and marks those received or skipped.
        config = self._carried(self._config)
        if config.continuous:
            passes = Passes(config.source.source, self._next_epoch, CONTINUOUS_AHEAD)
            accounting = self._accounting = Accounting(passes, config.stages)
            self._held.clear()  # a new run makes them again
            config = dataclasses.replace(config, stages=accounting.counted(config.stages))
            return Run(config, lambda source, run: passes, accounting.failed)
        progress: Progress | None = None
        on_failed = None
        if config.resumable:
            progress = self._loaded or Progress()
            self._progress = progress  # before _loaded is cleared: never a moment with neither
            self._loaded = None

            def on_failed(item: Tagged, stage: str) -> None:  # an uninterrupted run skips it too
                progress.mark(item.tag, failed=True)

        if config.source.is_async:
            source = tag_async_source(config.source.source, progress)  # type: ignore[arg-type]
            config = dataclasses.replace(
                config, source=dataclasses.replace(config.source, source=source)
            )

        def wrap(source: Any, run: Run) -> Any:  # a sync source
            return tag_source(source, progress, lambda: run.life.stopping)

        return Run(config, wrap, on_failed)

    def settled_concurrency(self) -> dict[str, int]:
        """Each tuned stage's concurrency, by name, as the current (or last) run's tuner kept it.

        A raise or a cut it is still trying is left out. Empty without a tuner.
        """
        last = self._last
        return last.tuner.settled() if last is not None and last.tuner is not None else {}

    def _carried(self, config: PipelineConfig) -> PipelineConfig:
        # Tuned stages start where the last epoch's tuner left them, and a default-sized
        # queue after one holds a result per call, as the build sizes it.
        settled = self.settled_concurrency()
        if not settled:
            return config
        stages = tuple(
            dataclasses.replace(
                s,
                concurrency=settled[s.name],
                buffer_size=max(s.buffer_size, settled[s.name]) if s.grows else s.buffer_size,
            )
            if isinstance(s, PipeConfig) and s.tune is not None and s.name in settled
            else s
            for s in config.stages
        )
        return dataclasses.replace(config, stages=stages)

    def _receiver(self, run: Run) -> Callable[[float | None], Any]:
        # The run's get, unwrapping each item (and, when resumable, marking it done).
        get = run.get
        if not self._config.resumable:
            return lambda timeout: get(timeout).take()
        unwrap = self._unwrap
        return lambda timeout: unwrap(get(timeout))

    def _unwrap(self, item: Tagged) -> Any:
        # A Tagged item reaches the consumer: its source numbers are done. Whole: a Ctrl-C
        # as they are counted would leave an item counted and not handed out (lost on
        # resume), or the position and the ledger apart; it comes a moment after.
        if not self._config.resumable:
            return item.take()
        with CtrlCHeld():
            self._progress.mark(item.tag)
            return item.take()

    def stop(self) -> None:
        """Stop the current epoch and join its threads. Idempotent; safe to call any time."""
        with Closing():  # a Ctrl-C held as get_item() counted an item comes as the stop ends
            self._holder.stop()

    @contextmanager
    def auto_stop(self) -> Iterator[Pipeline[T]]:
        """Start the pipeline on entry and stop it on exit, however the block ends."""
        self.start()
        try:
            yield self
        finally:
            self.stop()

    # -- consuming -------------------------------------------------------------------------------

    def get_item(self, *, timeout: float | None = None) -> T:
        """Return the next item of the running epoch.

        Args:
            timeout: Seconds to wait; ``None`` waits as long as it takes.

        Raises:
            RuntimeError: If the pipeline was not started (call :meth:`start`).
            EOFError: When the epoch has no more items (the pipeline then stops itself), or
                when the pipeline was stopped meanwhile.
            TimeoutError: If no item arrived within ``timeout``.
            PipelineFailure: If a stage exceeded the failure budget.
            ConfigurationError: With ``build(continuous=True)``, whose epochs are ``for`` loops.

        """
        if self._config.continuous:
            raise ConfigurationError(
                "get_item() on a pipeline built with continuous=True: its epochs end where "
                "each for loop ends, which get_item() cannot tell; iterate it with a for loop "
                "per epoch, or build it without continuous=True"
            )
        run = self._holder.run
        if run is None and self._last is not None:
            raise EOFError("the pipeline was stopped: call start() for another epoch")
        if run is None:
            raise RuntimeError(
                "the pipeline is not running: call start() (or use auto_stop()) before "
                "get_item(), or iterate it with a for loop"
            )
        try:
            item: T = self._unwrap(run.get(timeout))
        except EOFError:
            self._epoch_done(run)
            self.stop()
            raise
        except TimeoutError:
            raise
        except BaseException:
            self.stop()
            raise
        return item

    def __iter__(self) -> Iterator[T]:
        """Run one epoch (or continue the one started with :meth:`start`)."""
        if self._iterating.locked():
            raise _already_iterated()
        if self._config.continuous:
            return self._continuous_epoch()
        return self._epoch()

    @property
    def epoch(self) -> int:
        """With ``build(continuous=True)``: the epoch the next ``for`` loop runs."""
        return self._next_epoch

    def _continuous_epoch(self) -> Iterator[T]:
        # One epoch of a run that goes on across epochs: the items whose first source number
        # is of this epoch; later epochs' items that come early wait in _held.
        self._claim()
        left_early = True
        relayed = claim_ctrl_c()
        try:
            self.start()
            run, accounting = self._holder.run, self._accounting
            if run is None or accounting is None:
                return  # stopped from another thread as the loop began
            delivered, passes = accounting.consumer, accounting.passes
            epoch, held = self._next_epoch, self._held
            passes.consumer_at(epoch)
            early = held.setdefault(epoch, collections.deque())
            while True:
                while early:
                    yield early.popleft()
                if delivered.complete(epoch):
                    break
                try:
                    # The epoch may end with no item coming (the last ones failed, or made
                    # no output): look again now and then.
                    item = run.get(SOURCE_POLL)
                except TimeoutError:
                    continue
                except EOFError:  # the source ran out: this was its last pass
                    break
                home = delivered.epoch_of(item.tag)
                delivered.arrived(item.tag)
                if home == epoch:
                    yield item.take()
                else:
                    held.setdefault(home, collections.deque()).append(item.take())
            left_early = False
            del held[epoch]
            self._next_epoch = epoch + 1
            passes.consumer_at(epoch + 1)  # the next epoch's items may be read on
        finally:
            self._iterating.release()
            if left_early:  # a break or an exception: the run ends; the next loop starts anew
                self._held.clear()
                self._next_epoch += 1
            close_relayed(self.stop if left_early else _nothing, relayed)

    def iter_until(self, stopping: Callable[[], bool]) -> Iterator[T]:
        """Iterate one epoch, ending early once ``stopping()`` is true (checked every 0.1 s).

        Used when this pipeline is the source of another: it stops with the outer pipeline.
        """
        return self._epoch(stopping)

    def _claim(self) -> None:
        # As a loop's first item is asked for: it is the only one (two iterators taken
        # before either began, or two threads at once, would share one run).
        if not self._iterating.acquire(blocking=False):
            raise _already_iterated()

    def _epoch(self, stopping: Callable[[], bool] | None = None) -> Iterator[T]:
        self._claim()
        relayed = claim_ctrl_c()  # a Ctrl-C in the loop's body: its stop waits a moment only
        try:
            self.start()
            run = self._holder.run
            if run is None:
                return  # stopped from another thread as the loop began
            get, timeout = self._receiver(run), None if stopping is None else SOURCE_POLL
            while stopping is None or not stopping():
                try:
                    item = get(timeout)
                except TimeoutError:  # only with a timeout: look at stopping() again
                    continue
                except EOFError:
                    self._epoch_done(run)
                    return
                yield item
        finally:
            self._iterating.release()
            close_relayed(self.stop, relayed)

    def _epoch_done(self, run: Run) -> None:
        # The epoch ended (not stopped part-way): a state saved now starts the next one.
        if self._config.resumable and run.life.finished:
            # unlocked: one reference, as in _Holder.stop (state_dict() takes either).
            done, self._progress = self._progress, Progress()
            done.check_end()  # each source item delivered or failed, once (LedgerError)

    # -- resuming --------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Where the current epoch stands: which source items the consumer has received.

        Cheap (a lock and a small copy) and safe to call at any time from any thread: items
        still inside the pipeline count as not received and are loaded again on resume.
        Between epochs (before the first, or after one ended), the state starts an epoch
        from its beginning. The dict holds only ints and lists, ready for ``torch.save`` or
        JSON.

        Raises:
            ConfigurationError: If the pipeline was not built with ``resumable=True``.

        """
        self._check_resumable("state_dict()")
        with self._holder.lock:
            current = self._loaded or self._progress
        return current.state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next epoch resume from ``state`` (from :meth:`state_dict`).

        The next iteration (or :meth:`start`) iterates the source from its beginning and
        passes on only the items the saved epoch had not delivered: the source must yield the
        same items in the same order as it did then.

        Raises:
            ConfigurationError: If the pipeline was not built with ``resumable=True``.
            RuntimeError: If an epoch is running (call :meth:`stop` first).
            ValueError: If ``state`` is not a pipeline state.

        """
        self._check_resumable("load_state_dict()")
        progress = Progress.from_state(state)
        with self._holder.lock:
            if self._holder.run is not None:
                raise RuntimeError(
                    "load_state_dict() while an epoch runs: call stop() first (or load the "
                    "state before iterating)"
                )
            self._loaded = progress

    def _check_resumable(self, what: str) -> None:
        if not self._config.resumable:
            raise ConfigurationError(
                f"{what} needs a pipeline built with build(resumable=True), which keeps track "
                "of the source items delivered"
            )

    # -- introspection -----------------------------------------------------------------------------

    def __len__(self) -> int:
        """Items an epoch yields, where the source has a length (to log progress).

        One per source item through one-to-one stages, then ``aggregate``'s groups (the last
        one partial unless ``drop_last``). Items that fail within the budget are left out,
        so an epoch may yield fewer.

        Raises:
            TypeError: The source has no ``len()``, or a stage yields any number of items
                per input (a generator op, ``disaggregate``).

        """
        source = self._config.source.source
        try:
            count = len(source)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(
                f"this pipeline's source ({type(source).__name__}) has no len(), so neither has "
                "the pipeline"
            ) from None
        for stage in self._config.stages:
            if isinstance(stage, AggregateConfig):
                whole, part = divmod(count, stage.size)
                count = whole + (1 if part and not stage.drop_last else 0)
            elif isinstance(stage, DisaggregateConfig) or stage.kind.many:
                raise TypeError(
                    f"stage {stage.name!r} yields any number of items per input: the pipeline "
                    "has no len()"
                )
        return count

    def stats(self) -> PipelineStats:
        """Statistics of the current epoch (or the last one, once it ended).

        Raises:
            RuntimeError: If the pipeline has never run.

        """
        run = self._last
        if run is None:
            raise RuntimeError("the pipeline has not run yet: start or iterate it first")
        stats = run.stats()
        ledger = self._progress.ledger if self._config.resumable else None
        return stats if ledger is None else dataclasses.replace(stats, ledger=ledger.stats())

    def __repr__(self) -> str:
        names = [self._config.source.name] + [s.name for s in self._config.stages]
        state = "running" if self._holder.run is not None else "idle"
        return f"Pipeline({' -> '.join(names)}, {state})"


def _in_flight(run: Run | None) -> list[str]:
    """For a stall report: each stage's calls in flight, counts and queue."""
    if run is None:
        return ["the pipeline is not running"]
    return [
        f"stage {s.name!r}: {s.in_flight} call(s) running, {s.items_in} in, {s.items_out} out, "
        f"{s.failures} failed; the queue after it holds {s.queue.size} of {s.queue.capacity}"
        for s in run.stats().stages
    ]


def _moved(run: Run | None) -> int:
    """Items put in any queue of the run so far: grows while any stage gets work done."""
    return 0 if run is None else sum(channel.puts for channel in run.channels)


def _nothing() -> None:
    """A close with nothing to stop."""


def _already_iterated() -> RuntimeError:
    return RuntimeError(
        "this pipeline is already being iterated; a pipeline runs one epoch at a time, so "
        "finish (or break out of) the other loop first"
    )
