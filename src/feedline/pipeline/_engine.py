"""One run (epoch) of a pipeline: the event-loop thread, the thread pool, and the stages.

``Run`` turns a :class:`~._defs.PipelineConfig` into channels and stage runtimes, starts them,
hands items to the consumer, and stops and joins everything it started (see "Failures and
stopping" in the README): its loop thread, its pool, and every job it submitted, also to the
users' executors (which it does not shut down).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from feedline._failures import FailureBudget
from feedline._grace import stop_grace
from feedline._watchdog import StallWatch

from ._defs import AggregateConfig, OpKind, PipeConfig, PipelineConfig
from ._executors import Submitter, WorkerPool
from ._gated import GatedSource
from ._growth import Growth
from ._lifecycle import RunLifecycle
from ._placement import PlacedWork, Placement
from ._queue import EMPTY, Channel
from ._resume import Tagged
from ._settings import (
    MAX_DEFAULT_QUEUE,
    QUEUE_GROW_BYTES,
    QUEUE_SPAN,
    SINK_GROW_BYTES,
    STOP_WARN_AFTER,
)
from ._stages._async import AsyncSource, AsyncStage
from ._stages._common import StageBase
from ._stages._sink import SinkReader
from ._stages._threaded import AggregateWork, ThreadedSource, ThreadedStage
from ._tuner import Knob, Tuner
from .stats import PipelineStats, find_bottleneck

__all__ = ["Run"]


_log = logging.getLogger("feedline.pipeline")


class Run:
    """One epoch of a pipeline. Created stopped; ``start`` it, ``get`` from it, ``stop`` it.

    Args:
        config: As ``build()`` made it: items travel as ``Tagged`` records (see ``_resume``).
        source_wrapper: Makes what a sync source's stage iterates, from the source and run.
        on_failed: Told of each ``Tagged`` item a stage failed on and skipped, and the stage.

    """

    def __init__(
        self,
        config: PipelineConfig,
        source_wrapper: Callable[[Any, Run], Any],
        on_failed: Callable[[Tagged, str], None] | None = None,
    ) -> None:
        self.config = config
        self._on_failed = on_failed
        self.loop = asyncio.new_event_loop()
        self.life = RunLifecycle()  # read by the stages: ``life.stopping`` with no call
        self.pool = WorkerPool(config.num_threads, "feedline-worker", self.life.lock)
        # A sync source is read on a thread of its own: it never takes a stage's thread, and
        # the stages' calls stay on as many threads as they have slots (a job moved between
        # more threads than cores costs each of them its caches, and on free-threaded Python
        # a lock held by a thread the scheduler took off its core spins the others).
        self.source_pool = WorkerPool(1, "feedline-source", self.life.lock)
        self.budget = FailureBudget(config.max_failures)
        self._thread = threading.Thread(
            target=self._loop_main, name="feedline-event-loop", daemon=True
        )
        self._loop_ready = threading.Event()
        self._stop_event = asyncio.Event()  # bound to the loop when _main awaits it
        self._t0 = time.perf_counter()

        # A channel after the source and after each stage (see "Queue sizes and growth" in
        # the README): the source's holds two items per slot of the first stage, so that each
        # refill from its low-water mark (half full) moves a slot's worth; one after a stage
        # at least one per slot of the next; the last is the sink.
        stages = config.stages
        slots = [getattr(cfg, "concurrency", 1) for cfg in stages]
        sizes = [config.source.buffer_size or max(4, 2 * slots[0])] if stages else []
        sizes += [max(cfg.buffer_size, n) for cfg, n in zip(stages, slots[1:], strict=False)]
        sizes.append(config.sink.buffer_size)
        names = [config.source.name, *(cfg.name for cfg in stages)]
        self.stages: list[StageBase] = []  # filled in below: the growths read them when asked
        self.channels = [
            Channel(f"{name}->", size, self._growth(i, size))
            for i, (name, size) in enumerate(zip(names, sizes, strict=True))
        ]
        src = config.source
        if src.is_async:
            self.stages.append(AsyncSource(self, src.name, src.source, self.channels[0]))  # type: ignore[arg-type]
            self.stages[0].counters.where = "event loop"
        else:
            wrapped = source_wrapper(src.source, self)
            gated = next((s for s in (wrapped, src.source) if isinstance(s, GatedSource)), None)
            self.stages.append(ThreadedSource(self, src.name, wrapped, self.channels[0], gated))
        knobs: list[Knob] = []
        for i, cfg in enumerate(stages):
            inp, out = self.channels[i], self.channels[i + 1]
            stage = self._make_stage(cfg, inp, out)
            if isinstance(cfg, PipeConfig) and cfg.tune is not None:
                placement = cfg.placement if isinstance(cfg.placement, Placement) else None
                knobs.append(Knob(stage, i + 1, *cfg.tune, placement=placement))
            inp.connect(self.stages[-1], stage)
            self.stages.append(stage)
        spin = isinstance(self.stages[-1], AsyncStage | AsyncSource)
        self._sink = SinkReader(self.channels[-1], spin=spin)
        self.channels[-1].connect(self.stages[-1], self._sink)
        tuning = config.tuning
        budgeted = tuning is not None and tuning.memory_budget is not None
        self.tuner = Tuner(knobs, self.channels, tuning, self.stages) if knobs or budgeted else None

    def _growth(self, index: int, capacity: int) -> Growth | None:
        # How the channel after stage ``index`` (0: the source) may grow (see _growth): the
        # sink and a queue between stages when they have the default size; a queue between
        # stages only while its producer is cheap, by QUEUE_SPAN of its consumer's calls.
        config = self.config
        sink_bytes, queue_bytes = SINK_GROW_BYTES, QUEUE_GROW_BYTES
        if config.tuning is not None and config.tuning.memory_budget is not None:
            # Half the budget for the queues, shared: the rest is for the calls in flight.
            share = config.tuning.memory_budget // (2 * (len(config.stages) + 1))
            sink_bytes, queue_bytes = min(sink_bytes, share), min(queue_bytes, share)
        if index == len(config.stages):
            grow_to = config.sink.grow_to
            return Growth(capacity, grow_to, sink_bytes) if grow_to > capacity else None
        grows = config.stages[index - 1].grows if index else config.source.buffer_size is None
        if not grows or capacity >= MAX_DEFAULT_QUEUE:
            return None
        stages = self.stages  # filled in after the channels: read when growth is asked for

        def may_double(n: int) -> bool:
            # Called with the channel's lock held: reads the stages' counters only.
            producer, consumer = stages[index], stages[index + 1]
            if not producer.cheap():
                return False
            c = consumer.counters
            return 0 <= 2 * n * c.ewma < QUEUE_SPAN * c.concurrency

        return Growth(capacity, MAX_DEFAULT_QUEUE, queue_bytes, may_double, on_fill=True)

    def _make_stage(self, cfg: Any, inp: Channel, out: Channel) -> StageBase:
        if isinstance(cfg, AggregateConfig):
            work = AggregateWork(cfg.size, cfg.drop_last, cfg.collect, cfg.epochs)
            return ThreadedStage(self, cfg.name, "aggregate", work, inp, out)
        if not isinstance(cfg, PipeConfig):
            return ThreadedStage(self, cfg.name, "disaggregate", cfg.split, inp, out)
        # With one slot (and no tuner to add more), order is kept for free.
        most = cfg.tune[1] if cfg.tune is not None else 0
        ordered = cfg.output_order == "input" and max(cfg.concurrency, most) > 1
        if cfg.kind.on_loop or not (
            cfg.executor is None or isinstance(cfg.executor, ThreadPoolExecutor)
        ):
            loop_stage = AsyncStage(self, cfg, ordered, inp, out)
            loop_stage.counters.where = _runs_in(cfg.executor)
            return loop_stage
        op: Any = cfg.op  # a TaggedOp, or a TaggedGenerator whose calls are iterated
        placement = cfg.placement if isinstance(cfg.placement, Placement) else None
        if placement is not None and placement.stays is None:  # threads or processes
            op = PlacedWork(placement)
        stage = ThreadedStage(
            self,
            cfg.name,
            "pipe",
            op,
            inp,
            out,
            iterates=cfg.kind is OpKind.GENERATOR,
            concurrency=cfg.concurrency,
            executor=cfg.executor,
            ordered=ordered,
        )
        if placement is not None:
            stage.counters.where = placement.where
        elif cfg.executor is not None:
            stage.counters.where = "threads (its own executor)"
        return stage

    # -- what the stages ask of the run ----------------------------------------------------------

    def on_loop_thread(self) -> bool:
        """Whether the caller runs on the event-loop thread."""
        return threading.current_thread() is self._thread

    def submit(self, executor: Submitter, fn: Callable[[], None]) -> bool:
        """Run ``fn`` in ``executor``, counted so that ``stop`` can wait for it."""
        if not self.life.job_begin():
            return False
        job = [fn]
        try:
            executor.submit(self.life.run_job, job)
        except BaseException as error:  # shut down under us, or a Ctrl-C while it queued
            self.life.drop_job(job)
            if not isinstance(error, RuntimeError):
                raise
            if not self.life.stopping:
                self.begin_stop(
                    RuntimeError(
                        f"could not submit work to {type(executor).__name__}: {error}. An "
                        "executor passed to pipe(executor=...) must stay open while the "
                        "pipeline runs"
                    )
                )
            return False
        return True

    async def call_in_executor(self, executor: Any, fn: Callable[[Any], Any], item: Any) -> Any:
        """Run ``fn(item)`` in a non-thread executor (a process pool) and await the result.

        The call counts as a job: if the run stops while it is running (a process cannot be
        interrupted), ``stop()`` waits for it, so calls never outlive their run.
        """
        life = self.life
        if not life.job_begin():
            raise asyncio.CancelledError
        try:
            future = executor.submit(fn, item)
        except BaseException:
            life.job_done()
            raise
        future.add_done_callback(lambda _: life.job_done())
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            # 3.11+; on 3.10 a cancel of this task in the same turn as the pool's is taken
            # for the pool's: the run stops then, and the worker's loop ends on that.
            cancelling = getattr(asyncio.current_task(), "cancelling", None)
            if cancelling is not None and cancelling():
                raise  # this worker is cancelled (the run stops)
            error = future.exception() if future.done() and not future.cancelled() else None
            if not isinstance(error, futures.CancelledError):
                raise
            # The pool cancelled the call (it was closed): an Exception the stage records,
            # not counted while the run stops, instead of a BaseException ending the worker.
            raise error from None

    def item_failed(self, item: Any, stage: str) -> None:
        """The stage named ``stage`` failed on ``item`` within the failure budget, skipping it."""
        if self._on_failed is not None and isinstance(item, Tagged):
            self._on_failed(item, stage)

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> None:
        """Start the event-loop thread and the stages (nothing, if already stopping)."""
        if not self.life.start(self._start_thread):
            return
        self._loop_ready.wait()
        source = self.stages[0]
        if isinstance(source, ThreadedSource):
            source.start()

    def _start_thread(self) -> None:
        # Under the lifecycle's lock: a concurrent stop() sees the thread started, or none.
        self._t0 = time.perf_counter()
        self._thread.start()

    def _loop_main(self) -> None:
        asyncio.set_event_loop(self.loop)
        try:
            self.loop.run_until_complete(self._main())
        except BaseException as error:  # SystemExit or Ctrl-C from a coroutine op: the run's
            self.begin_stop(error)
        finally:
            self._loop_ready.set()  # never leave start() waiting, even if _main failed early
            try:
                # Left pending only by a _main that an exception ended: cancelled and awaited,
                # as asyncio.run does, so that none is destroyed pending as the loop closes.
                left = asyncio.all_tasks(self.loop)
                for task in left:
                    task.cancel()
                if left:
                    gathered = asyncio.gather(*left, return_exceptions=True)
                    self.loop.run_until_complete(gathered)
                self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            finally:
                asyncio.set_event_loop(None)

    async def _main(self) -> None:
        tasks = [
            asyncio.ensure_future(s.run_stage())
            for s in self.stages
            if isinstance(s, AsyncStage | AsyncSource)
        ]
        for task in tasks:
            task.add_done_callback(self._task_done)
        interval = self.config.report_stats_interval
        if interval is not None:
            tasks.append(asyncio.ensure_future(self._report(interval)))
        if self.tuner is not None:
            tasks.append(asyncio.ensure_future(self.tuner.run()))
        self._loop_ready.set()
        await self._stop_event.wait()  # set by begin_stop, also one before the loop ran
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _task_done(self, task: asyncio.Future[None]) -> None:
        # A stage's task ended before the run stops: it failed (or was cancelled by an op
        # that raised CancelledError, which no stage counts as an op's failure): the run ends
        # with the error, rather than leave the consumer waiting for the stage's output.
        if task.cancelled():
            if not self.life.stopping:
                self.begin_stop(
                    RuntimeError(
                        "a coroutine stage ended by asyncio.CancelledError from its op (it "
                        "awaited something cancelled elsewhere): catch it in the op, or raise "
                        "another exception there to have the item counted as failed"
                    )
                )
        elif task.exception() is not None:
            self.begin_stop(task.exception())

    async def _report(self, interval: float) -> None:
        # Each report covers the interval since the last one, so that it names the stage
        # limiting the pipeline now, not on average since the start.
        previous = self.stats()
        while True:
            await asyncio.sleep(interval)
            current = self.stats()
            _log.info(
                "pipeline statistics over the last %.3g s:\n%s",
                current.elapsed - previous.elapsed,
                current.since(previous),
            )
            previous = current

    def watch(self, watch: StallWatch) -> None:
        """Have the consumer's waits tick ``watch`` (see :mod:`feedline._watchdog`)."""
        self._sink.watch = watch

    def get(self, timeout: float | None) -> Any:
        """Next item for the consumer.

        Raises:
            EOFError: At the end of the epoch.
            TimeoutError: If nothing arrived in time.
            BaseException: The error that stopped the run (failure budget, source error).

        """
        life = self.life
        if life.error is not None:
            raise life.error
        item = self._sink.get(timeout)
        if item is EMPTY:
            if life.error is not None:
                raise life.error
            if life.stopping:  # set before the sink is interrupted
                raise EOFError("the pipeline was stopped before the end of its epoch")
            life.finished = True
            raise EOFError("the pipeline has no more items in this epoch")
        return item

    def begin_stop(self, error: BaseException | None = None) -> None:
        """Stop taking work and wake every waiter; safe from any thread, returns at once.

        ``error``: why (the first is kept, and the consumer's next ``get`` raises it).
        """
        if self.life.begin_stop(error):
            self._wake_all()

    def _wake_all(self) -> None:
        # Abort the channels and wake every waiter: the consumer, the loop. Done again by the
        # stop that joins, in case an interrupt cut the first short (the flag was set).
        for channel in self.channels:
            channel.abort()
        self._sink.interrupt()
        with contextlib.suppress(RuntimeError):  # the loop already closed
            self.loop.call_soon_threadsafe(self._stop_event.set)

    def stop(self) -> None:
        """Stop and join everything this run started; not from one of its own threads.

        (The pipeline's holder hands a stop asked for on one of them to a thread of its own:
        see ``_lifecycle.own_thread``.) Idempotent and re-entrant: a stop interrupted part-way
        (a second Ctrl-C while it joins) is finished by the next call; only a stop that ran to
        its end makes later calls return at once. It waits for calls still inside ops as long
        as they run (a warning every :data:`STOP_WARN_AFTER` s), but on Ctrl-C or at exit
        only a moment (``feedline._grace``): then they are left on their daemon threads.
        """
        grace = stop_grace()
        self.begin_stop()
        life = self.life
        life.begin_stop(asked=True)
        with life.join_lock:  # one thread joins; another caller waits for it to finish
            if not life.stopped:
                self._wake_all()
                self._join_all(grace)
                life.stopped = True

    def _join_all(self, grace: float | None) -> None:
        # The thread was started under the lifecycle's lock, before the stop began, or never.
        if self._thread.ident is not None:
            self._thread.join()
        waited = 0.0
        while (left := self.life.wait_jobs(grace or STOP_WARN_AFTER)) is not None:
            if grace is not None:
                # Left running: their stages are not closed (a job may be inside one's
                # generator), and the pool's threads end as their jobs do.
                _log.warning(
                    "stopping the pipeline on Ctrl-C or at exit: %d job(s) still inside stage "
                    "ops after %g s are left running on daemon threads",
                    left,
                    grace,
                )
                self.pool.shutdown(wait=False)
                self.source_pool.shutdown(wait=False)
                if not self.loop.is_closed():
                    self.loop.close()
                return
            waited += STOP_WARN_AFTER
            _log.warning(
                "stopping the pipeline: %d job(s) still inside stage ops after %.0f s; "
                "an op that never returns keeps its thread (and this stop) waiting",
                left,
                waited,
            )
        self.pool.shutdown(wait=True)
        self.source_pool.shutdown(wait=True)
        for stage in self.stages:  # no job left: sum up what the logs held back, close
            stage.flush_failures()
            stage.close()
        if not self.loop.is_closed():
            self.loop.close()

    # -- statistics ------------------------------------------------------------------------------

    def stats(self) -> PipelineStats:
        """A snapshot of every stage's statistics."""
        snaps = []
        for i, stage in enumerate(self.stages):
            in_q = self.channels[i - 1].stats() if i > 0 else None
            out_q = self.channels[i].stats()
            snaps.append(stage.counters.snapshot(in_q, out_q))
        stages = tuple(snaps)
        name, reason = find_bottleneck(stages)
        return PipelineStats(
            elapsed=time.perf_counter() - self._t0,
            stages=stages,
            bottleneck=name,
            reason=reason,
            tuning=tuple(self.tuner.decisions) if self.tuner is not None else (),
            tuner_cpu=self.tuner.cpu_s if self.tuner is not None else 0.0,
        )


def _runs_in(executor: Any) -> str:
    # StageStats.runs_in of a stage on the event loop.
    if executor is None:
        return "event loop"
    processes = getattr(executor, "processes", None)  # a process region
    return f"processes ({processes})" if processes else "process pool"
