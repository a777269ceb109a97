"""PipelineBuilder: collects stage definitions, validates them, and builds a Pipeline."""

from __future__ import annotations

import copy
import dataclasses
import math
import pickle
from collections.abc import AsyncIterable, Callable, Iterable, Sequence
from concurrent.futures import Executor, ProcessPoolExecutor, ThreadPoolExecutor
from typing import Any, Generic, TypeGuard, TypeVar

from feedline._watchdog import STALL_AFTER, check_after
from feedline.errors import ConfigurationError

from ._defs import (
    AggregateConfig,
    DisaggregateConfig,
    OpKind,
    PipeConfig,
    PipelineConfig,
    SinkConfig,
    SourceConfig,
    StageConfig,
    op_kind,
)
from ._gated import GatedSource
from ._hooks import TaskHook, hooked
from ._pipeline import Pipeline
from ._placement import Placement, cannot_move
from ._region import RegionPool, RunOfStages
from ._resume import TaggedAsyncGenerator, TaggedGenerator, TaggedOp
from ._settings import DEFAULT_SINK, MAX_DEFAULT_SINK, MAX_DEFAULT_THREADS, THREAD_HIGH
from ._tuning import Auto, Tuning

__all__ = ["PipelineBuilder"]

T = TypeVar("T")

# Items travel as Tagged records (see _resume): each op is wrapped to work on the value (a
# coroutine stage calls its op on the value itself).
_TAGGED: dict[OpKind, Callable[[Any], Callable[..., Any]]] = {
    OpKind.FUNCTION: TaggedOp,
    OpKind.COROUTINE: lambda op: op,
    OpKind.GENERATOR: TaggedGenerator,
    OpKind.ASYNC_GENERATOR: TaggedAsyncGenerator,
}
_HOOK_METHODS = ("stage_start", "stage_end", "task_start", "task_end")


def _check_positive_int(what: str, value: object, hint: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{what} must be an int >= 1, got {value!r}. {hint}")
    return value


def _check_picklable(
    stage: str, op: Callable[..., Any], instead: str = "or use a ThreadPoolExecutor"
) -> None:
    # Each call sends the op to a worker process: refuse one that cannot go now, rather than
    # fail every item at run time.
    try:
        pickle.dumps(op)
    except Exception as error:
        raise ConfigurationError(
            f"stage {stage!r}: the op {_op_name(op)!r} cannot be sent to the worker "
            f"processes ({type(error).__name__}: {error}); define it at module level (not a "
            f"lambda or a nested function), make what it holds picklable, {instead}"
        ) from error


def _op_name(op: Callable[..., Any]) -> str:
    func = getattr(op, "func", op)  # functools.partial
    name = getattr(func, "__name__", None) or type(func).__name__
    return str(name)


def _in_pool(stage: StageConfig) -> TypeGuard[PipeConfig]:
    # A sync op stage that runs in the pipeline's thread pool.
    return isinstance(stage, PipeConfig) and stage.executor is None and not stage.kind.on_loop


def _pool_slots(stage: StageConfig) -> int:
    # The pool threads a stage may use at once: its most calls, one for an aggregating stage.
    if _in_pool(stage):
        return (stage.auto.high or THREAD_HIGH) if stage.auto else stage.concurrency
    return 0 if isinstance(stage, PipeConfig) else 1


def _hookable(stage: StageConfig) -> bool:
    # Op stages run in this process: hooks wrap their ops.
    return isinstance(stage, PipeConfig) and not isinstance(
        stage.executor, ProcessPoolExecutor | _RegionPlaceholder
    )


class _RegionPlaceholder(Executor):
    # Stands for a process region's pool until build() makes one per pipeline.
    def __init__(self, processes: int, mp_context: str | None) -> None:
        self.processes, self.mp_context = processes, mp_context


class PipelineBuilder(Generic[T]):
    """Describes a pipeline stage by stage; :meth:`build` turns the description into a Pipeline.

    Each method returns the builder, so calls chain::

        pipeline = (
            PipelineBuilder()
            .add_source(range(1000))
            .pipe(fetch, concurrency=32)      # async def: runs on the event loop
            .pipe(decode, concurrency=4)      # def: runs in the thread pool
            .aggregate(32)
            .add_sink(buffer_size=3)
            .build(num_threads=8)
        )

    Nothing runs until the pipeline is iterated or started. A builder can build several
    pipelines; each gets its own threads.
    """

    def __init__(self) -> None:
        self._source: SourceConfig | None = None
        self._stages: list[StageConfig] = []
        self._has_sink = False  # add_sink() was called
        self._sink_size: int | None = None  # what it asked for (None: the default)
        self._names: set[str] = set()

    def _claim(self, name: str | None, default: str) -> str:
        if name is None:
            name, n = default, 2
            while name in self._names:
                name, n = f"{default}#{n}", n + 1
        elif not isinstance(name, str) or not name:
            raise ConfigurationError(f"a stage name must be a non-empty str, got {name!r}")
        elif name in self._names:
            raise ConfigurationError(
                f"two stages are named {name!r}; give each stage a unique name= so that "
                "statistics and errors can tell them apart"
            )
        self._names.add(name)
        return name

    def _check_open(self, what: str) -> None:
        if self._source is None:
            raise ConfigurationError(f"{what} before add_source(): call add_source() first")
        if self._has_sink:
            raise ConfigurationError(f"{what} after add_sink(): the sink must be the last stage")

    # -- stages -------------------------------------------------------------------------------

    def add_source(
        self,
        source: Iterable[T] | AsyncIterable[T],
        *,
        name: str = "source",
        buffer_size: int | None = None,
    ) -> PipelineBuilder[T]:
        """Set where items come from.

        Args:
            source: An ``Iterable`` (a list, a sampler, a generator, another
                :class:`~feedline.Pipeline`) or an ``AsyncIterable``. It is iterated once per
                epoch, so a re-iterable object (a list, a sampler) gives the same items each
                epoch, and a one-shot iterator gives them only once. A sync iterable runs in
                the thread pool; an async one on the event loop.
            name: The stage's name in statistics and errors.
            buffer_size: Capacity of the queue after the source; defaults to twice the first
                stage's concurrency, at least 4, growing as a default queue after a stage
                does (see :meth:`pipe`): up to 512 items ahead of a cheap first stage. A
                ``break`` leaves what the queues hold read from the source and not
                delivered: a resumable pipeline reads those again, a one-shot iterator that
                other code shares does not. An explicit size is fixed: the source is read at
                most this many items ahead of the first stage. Without stages, the sink's
                ``buffer_size`` applies instead.

        Raises:
            ConfigurationError: If a source was already set, ``source`` is not iterable, or
                ``buffer_size`` is not a positive int.

        """
        if self._source is not None:
            raise ConfigurationError("add_source() was called twice; a pipeline has one source")
        if isinstance(source, Pipeline) and source._config.resumable:
            raise ConfigurationError(
                "a pipeline built with resumable=True cannot be the source of another: it would "
                "count its items as received when the outer pipeline takes them, not when the "
                "outer consumer does; build the inner one without resumable=True"
            )
        is_async = hasattr(source, "__aiter__")
        if not is_async and not hasattr(source, "__iter__"):
            raise ConfigurationError(
                f"the source must be an Iterable or an AsyncIterable, got {type(source).__name__}"
                "; wrap a function that makes items in a generator"
            )
        if buffer_size is not None:
            buffer_size = _check_positive_int("buffer_size", buffer_size, "It bounds the queue.")
        self._source = SourceConfig(source, self._claim(name, "source"), is_async, buffer_size)
        return self

    def pipe(
        self,
        op: Callable[..., Any],
        *,
        concurrency: int | str | Auto | None = None,
        executor: Executor | str | None = None,
        output_order: str = "completion",
        name: str | None = None,
        buffer_size: int | None = None,
    ) -> PipelineBuilder[Any]:
        """Apply ``op`` to every item.

        Args:
            op: A function or coroutine function of one argument returning one result, or a
                generator / async generator function yielding any number of results per
                input. Sync ops run in the pipeline's thread pool (or ``executor``), so they
                should release the GIL for their heavy part; async ops run on the event loop.
            concurrency: The most calls of ``op`` in flight at once: an int (>= 1), fixed;
                ``"auto"`` or :class:`~feedline.pipeline.Auto` (with bounds), set while the
                pipeline runs from what it measures (see :meth:`build`'s ``autotune``); or
                ``None`` (default): 1, or ``"auto"`` with ``build(autotune=True)``.
            executor: Where a sync op's calls run. ``None`` (default): the pipeline's thread
                pool. ``"auto"``: there at first, and the tuner moves the stage to worker
                processes (as many as the cores its calls could use) if its calls hold the
                GIL (more threads do not pay while cores are idle and the calls compute),
                keeping the move only if the output rises; the concurrency is tuned too (an
                int is refused). ``stats()`` says where each stage runs, and why one cannot
                move; its op then runs in other processes, so it must not count on this one's
                state. ``"threads"``: the thread pool (as ``None``).
                An ``Executor``: that executor, which the pipeline does not shut down: a
                one-thread ``ThreadPoolExecutor`` for work that keeps per-thread state (a CUDA
                stream), a ``ProcessPoolExecutor`` (sync functions only).
            output_order: ``"completion"`` (default) passes results on as soon as they are
                ready; ``"input"`` keeps the order of the input, at the cost of head-of-line
                waiting.
            name: Name in statistics and errors; defaults to the op's ``__name__``.
            buffer_size: Capacity of the queue after this stage (after the last stage, the
                sink's ``buffer_size`` applies instead); defaults to ``max(2, concurrency)``,
                and ``max(8, concurrency)`` for an async op (longer bursts on the event
                loop). A default-sized queue doubles when it held the next stage up, while
                this stage is cheap (under 20 µs a call) and the doubled queue holds under 8
                ms of the next stage's calls at its concurrency, up to 512 items and 16 MiB
                of items like those measured (see :meth:`add_sink`). An explicit size is fixed:
                pass a smaller one for large items, since each queued item holds its memory.

        Raises:
            ConfigurationError: On an argument that cannot work, saying what would.

        """
        self._check_open("pipe()")
        if not callable(op):
            raise ConfigurationError(f"pipe() needs a callable, got {type(op).__name__}")
        unset = concurrency is None
        auto = Auto() if concurrency == "auto" else None
        auto = concurrency if isinstance(concurrency, Auto) else auto
        if auto is not None:
            concurrency = auto.start or auto.low
        concurrency = _check_positive_int(
            "concurrency",
            1 if unset else concurrency,
            "It is how many calls of the op may run at once; or pass 'auto' to have the "
            "pipeline set it.",
        )
        if output_order not in ("completion", "input"):
            raise ConfigurationError(
                f"output_order must be 'completion' or 'input', got {output_order!r}"
            )
        kind = op_kind(op)
        stage_name = self._claim(name, _op_name(op))
        if executor is not None and kind.on_loop:
            raise ConfigurationError(
                f"stage {stage_name!r}: {kind.value} ops run on the event loop, so "
                "executor= has no effect; drop executor= or pass a sync function"
            )
        placement = executor if isinstance(executor, str) else None
        if placement is not None:
            executor = None
            if placement not in ("auto", "threads"):
                raise ConfigurationError(
                    f"stage {stage_name!r}: executor must be 'auto', 'threads', None or a "
                    f"concurrent.futures.Executor, got {placement!r}"
                )
            if placement == "auto" and not unset and auto is None:
                raise ConfigurationError(
                    f"stage {stage_name!r}: executor='auto' tunes the stage, so "
                    f"concurrency={concurrency} cannot hold; drop concurrency=, or pass "
                    "'auto' or Auto(low, high) for bounds"
                )
            if placement == "auto" and auto is None:
                auto = Auto()
                concurrency = auto.start or auto.low
        if executor is not None:
            if not isinstance(executor, Executor):
                raise ConfigurationError(
                    f"stage {stage_name!r}: executor must be a concurrent.futures.Executor "
                    f"(ThreadPoolExecutor or ProcessPoolExecutor), got {type(executor).__name__}"
                )
            if kind is OpKind.GENERATOR and not isinstance(executor, ThreadPoolExecutor):
                raise ConfigurationError(
                    f"stage {stage_name!r}: a generator op cannot run in a "
                    f"{type(executor).__name__} (generators do not cross process boundaries); "
                    "make it a function that returns a list, or use a ThreadPoolExecutor"
                )
            if isinstance(executor, ProcessPoolExecutor):
                _check_picklable(stage_name, op)
        if output_order == "input" and (concurrency > 1 or auto is not None) and kind.many:
            raise ConfigurationError(
                f"stage {stage_name!r}: output_order='input' with a {kind.value} op needs "
                "concurrency=1 (each input's outputs are then kept together and in order); "
                "or use output_order='completion'"
            )
        grows = buffer_size is None
        if buffer_size is None:
            # A coroutine stage's bursts each cost a wake-up on the loop: fewer, larger ones.
            buffer_size = max(8 if kind.on_loop else 2, concurrency)
        buffer_size = _check_positive_int("buffer_size", buffer_size, "It bounds the queue.")
        self._stages.append(
            PipeConfig(
                op=op,
                kind=kind,
                name=stage_name,
                concurrency=concurrency,
                executor=executor,
                output_order="input" if output_order == "input" else "completion",
                buffer_size=buffer_size,
                grows=grows,
                auto=auto,
                default_concurrency=unset,
                placement=placement,
            )
        )
        return self

    def pipe_in_processes(
        self,
        ops: Callable[[Any], Any] | Sequence[Callable[[Any], Any]],
        *,
        processes: int = 2,
        concurrency: int | None = None,
        output_order: str = "completion",
        name: str | None = None,
        mp_context: str | None = None,
    ) -> PipelineBuilder[Any]:
        """Apply a run of functions to every item in worker processes: a process region.

        For stages that hold the GIL, which threads cannot run side by side. Each worker
        applies the whole run to an item, so only the item and the run's result cross the
        process boundary; NumPy arrays and CPU tensors in the result of 64 KiB or more come
        back through shared memory. The pipeline owns the processes: they start with the
        first item (from the fork server), serve the epochs that run to their end, end if
        this process is killed, and are shut down when an epoch is stopped part-way or fails
        (the next item starts new ones) and when the pipeline is dropped.

        Args:
            ops: The run: one function, or several applied in turn (module-level functions
                or picklable callables, since they travel to the workers).
            processes: Worker processes.
            concurrency: Items in the workers at once (default: twice ``processes``, so that
                a worker finds its next item waiting).
            output_order: As in :meth:`pipe`.
            name: Name in statistics and errors; defaults to the functions' names joined
                by ``+``.
            mp_context: Start method of the workers (default ``"forkserver"``; ``"spawn"``
                also works; a fork of a process running the pipeline's threads is unsafe).

        Raises:
            ConfigurationError: On an argument that cannot work, saying what would.

        """
        run = [ops] if callable(ops) else list(ops)
        if not run or not all(callable(op) for op in run):
            raise ConfigurationError(
                "pipe_in_processes() needs a function or a non-empty list of functions"
            )
        for op in run:
            if op_kind(op) is not OpKind.FUNCTION:
                raise ConfigurationError(
                    f"pipe_in_processes(): {_op_name(op)!r} is a {op_kind(op).value}; a process "
                    "region runs plain functions of one item (make it return a list, or keep "
                    "it in a pipe() stage)"
                )
        processes = _check_positive_int("processes", processes, "It is how many workers run.")
        if mp_context not in (None, "forkserver", "spawn"):
            raise ConfigurationError(
                f"mp_context must be 'forkserver' or 'spawn', got {mp_context!r}: the pipeline's "
                "threads make a fork unsafe"
            )
        region = name or "+".join(_op_name(op) for op in run)
        op = RunOfStages(run, region)
        _check_picklable(region, op, "or keep it in a pipe() stage on threads")
        return self.pipe(
            op,
            concurrency=2 * processes if concurrency is None else concurrency,
            executor=_RegionPlaceholder(processes, mp_context),
            output_order=output_order,
            name=region,
        )

    def aggregate(
        self, num_items: int, *, drop_last: bool = False, name: str | None = None
    ) -> PipelineBuilder[list[Any]]:
        """Group every ``num_items`` consecutive items into a list.

        Args:
            num_items: Items per group (>= 1).
            drop_last: Drop a last group that is smaller than ``num_items``.
            name: Name in statistics; defaults to ``aggregate(N)``.

        Raises:
            ConfigurationError: ``num_items`` is not a positive int, the name is taken, or
                the sink was already added.

        """
        self._check_open("aggregate()")
        num_items = _check_positive_int("num_items", num_items, "It is the group size.")
        name = self._claim(name, f"aggregate({num_items})")
        self._stages.append(AggregateConfig(num_items, bool(drop_last), name, buffer_size=2))
        return self  # type: ignore[return-value]  # the item type changes to a list

    def disaggregate(self, *, name: str | None = None) -> PipelineBuilder[Any]:
        """Pass on the elements of each incoming iterable one by one (undo :meth:`aggregate`).

        Args:
            name: Name in statistics; defaults to ``disaggregate``.

        Raises:
            ConfigurationError: The name is taken, or the sink was already added.

        """
        self._check_open("disaggregate()")
        self._stages.append(DisaggregateConfig(self._claim(name, "disaggregate"), buffer_size=2))
        return self

    def add_sink(self, buffer_size: int | None = None) -> PipelineBuilder[T]:
        """Set how many finished items may wait for the consumer (>= 1).

        Optional: by default the buffer starts at 3 items, or two per slot of a last stage
        that runs more calls at once (64 at most), so that its bursts of results find room.
        It doubles each time the consumer finds it empty after it became full since it last
        did (its size, not the pipeline's speed, kept the consumer waiting), up to 64 items
        and 64 MiB of items like those measured (arrays, tensors, buffers, and lists, dicts
        and dataclasses of them; 16 items of objects whose size cannot be told), and shrinks
        if items grow. ``stats()`` shows the size reached (the last stage's
        ``queue.capacity``). An explicit ``buffer_size`` is fixed: a longer one rides out a
        consumer's pauses (a checkpoint, an evaluation) at the cost of memory.

        Args:
            buffer_size: The most finished items held for the consumer (``None``: the
                growing default above).

        Raises:
            ConfigurationError: ``buffer_size`` is not a positive int, or a sink was already
                added.

        """
        self._check_open("add_sink()")
        if buffer_size is not None:
            buffer_size = _check_positive_int(
                "buffer_size", buffer_size, "It is how many results wait for the consumer."
            )
        self._has_sink = True
        self._sink_size = buffer_size
        return self

    def _with_executors(self, swap: Callable[[str, Executor], Executor]) -> PipelineBuilder[T]:
        # A copy whose stages run in swap(stage name, executor) instead of their executors
        # (those sent to a child process as recipes, and made again there: see _in_subprocess).
        clone = copy.copy(self)
        clone._names = set(self._names)
        clone._stages = [
            dataclasses.replace(s, executor=swap(s.name, s.executor))
            if isinstance(s, PipeConfig) and s.executor is not None
            else s
            for s in self._stages
        ]
        return clone

    # -- build --------------------------------------------------------------------------------

    def build(
        self,
        *,
        num_threads: int | None = None,
        max_failures: int | float | None = 0,
        report_stats_interval: float | None = None,
        resumable: bool = False,
        hooks: Sequence[TaskHook] = (),
        continuous: bool = False,
        autotune: bool = False,
        memory_budget: int | None = None,
        cpu_budget: float | None = None,
        report_stall_after: float | None = STALL_AFTER,
    ) -> Pipeline[T]:
        """Validate the definition and return a :class:`~feedline.Pipeline` (not yet running).

        Args:
            num_threads: Size of the pipeline's thread pool, shared by the sync stages that have
                no executor of their own (a sync source is read on a thread of its own).
                Defaults to the sum of those stages' concurrency, capped at 64.
            max_failures: The failure budget of each stage. An int is the number of failed items
                a stage may skip (0, the default: the first failure stops the pipeline); a float
                in (0, 1) is a fraction of the stage's items, taken of at least 100 items so
                that early failures do not stop a run; ``None`` skips failures without limit.
                Failures are always logged and counted (see :meth:`Pipeline.stats`).
            report_stats_interval: If set, log the statistics table every this many seconds,
                at INFO level on the ``feedline.pipeline`` logger (Python shows only warnings
                unless told: ``logging.basicConfig(level=logging.INFO)``).
            resumable: Keep track of which source items the consumer has received, so that
                :meth:`Pipeline.state_dict` can save the position mid-epoch and
                :meth:`Pipeline.load_state_dict` resume from it with no item lost or
                repeated. The source must yield the same items in the same order on every
                pass; each stage must turn one item into one (functions and coroutine
                functions, ``aggregate``), and the source cannot be another Pipeline. Costs
                a small wrapper per item and stage.
            hooks: :class:`~feedline.pipeline.TaskHook` objects, called when each epoch's
                stages start and end and around every call of every op stage (not those in
                other processes), on the thread that runs it: for tracing and statistics of
                your own. None (the default) costs nothing.
            continuous: Run across epochs without stopping: when the source's pass ends,
                the next begins at once (after ``source.set_epoch(epoch)`` where it has
                one). Each ``for`` loop still yields one epoch (the items of its source
                items; the next epoch's that finish early wait for their loop), and
                ``aggregate`` groups each epoch apart, as a pipeline built anew for each
                epoch would. The source must be iterable again (a list, a
                :class:`~feedline.Mixture`, a dataset). Leaving a loop early ends the run
                (the next loop runs the next epoch). Not with ``resumable``.
            autotune: Tune every stage whose ``concurrency`` was not given (as if it were
                ``"auto"``; not a generator that keeps input order). A tuned stage starts at
                the cores this process may use (4 on the event loop); while the pipeline
                runs, a tuner doubles the stage that limits the output, keeps the raise if
                the output and the stage's capacity grew (an op waiting on I/O) and else
                tries half (an op that holds the GIL or computes on busy cores), raises
                nothing while the consumer is slower or the cores are busy, and lowers
                stages that use few of their slots. Each epoch starts where the last left
                off. ``stats()`` shows its decisions (logged at DEBUG). A stage given a
                number is never changed, and no stage moves to processes unless it asks to
                (``executor="auto"``).
            memory_budget: The most bytes of items held in the queues and in the calls in
                flight, measured with ``approx_nbytes`` (arrays, tensors, bytes, numbers, and
                lists, dicts or dataclasses of them) on one item in eight put in each queue.
                Tuned stages and default queues stay within it, and are lowered if items
                grow; stages and queues with sizes of their own count, but are never changed.
            cpu_budget: Cores the pipeline may keep busy, this process's other threads
                included (default: the cores it may use): tuned stages are not raised while
                the process uses that much. Only tuned stages are held to it.
            report_stall_after: Seconds the consumer may wait for an item with no progress
                anywhere before the stall is logged, once, as a WARNING on the
                ``feedline.watchdog`` logger: each stage's calls in flight and queues, the
                source items the busy threads work on and where each stands, reads waiting on
                a store. The consumer goes on waiting (``get_item(timeout=...)`` raises).
                ``None``: never report.

        Raises:
            ConfigurationError: If the definition cannot run, saying how to fix it.

        """
        source = self._source
        if source is None:
            raise ConfigurationError("the pipeline has no source: call add_source() first")
        if not isinstance(autotune, bool):
            raise ConfigurationError(f"autotune must be True or False, got {autotune!r}")
        Tuning.check(memory_budget, cpu_budget)
        stall = check_after(report_stall_after)
        stages = [_autotuned(s) for s in self._stages] if autotune else list(self._stages)
        if num_threads is None:
            pooled = sum(_pool_slots(s) for s in stages)
            num_threads = min(MAX_DEFAULT_THREADS, max(1, pooled))
        else:
            num_threads = _check_positive_int(
                "num_threads", num_threads, "It is the size of the pipeline's thread pool."
            )
        tuned = any(isinstance(s, PipeConfig) and s.auto is not None for s in stages)
        stages = [_resolve_auto(s, num_threads) for s in stages]
        for s in stages:
            if _in_pool(s) and s.concurrency > num_threads:
                raise ConfigurationError(
                    f"stage {s.name!r} has concurrency={s.concurrency} but the thread pool has "
                    f"num_threads={num_threads}, so it could never reach it; raise num_threads, "
                    "lower the concurrency, or give the stage its own executor="
                )
        _check_failures(max_failures)
        if report_stats_interval is not None and (
            not isinstance(report_stats_interval, (int, float))
            or not math.isfinite(report_stats_interval)
            or report_stats_interval <= 0
        ):
            raise ConfigurationError(
                f"report_stats_interval must be a positive number of seconds or None, "
                f"got {report_stats_interval!r}"
            )
        if not isinstance(resumable, bool):
            raise ConfigurationError(f"resumable must be True or False, got {resumable!r}")
        if continuous and resumable:
            raise ConfigurationError(
                "continuous=True and resumable=True cannot go together yet: a continuous run "
                "numbers items across epochs; build two pipelines, or drop one of them"
            )
        if continuous and source.is_async:
            raise ConfigurationError(
                "continuous=True needs a sync source (an iterable it can iterate again)"
            )
        if continuous and isinstance(source.source, GatedSource):
            raise ConfigurationError(
                "continuous=True cannot gate a GatedSource: the run reads its passes ahead on "
                "its own terms; build without continuous=True to keep the source's gate"
            )
        if resumable:
            _check_resumable(source, stages)
        hooks = tuple(hooks)
        for hook in hooks:
            missing = [m for m in _HOOK_METHODS if not callable(getattr(hook, m, None))]
            if missing:
                raise ConfigurationError(
                    f"hooks: {type(hook).__name__} has no {', '.join(missing)}; subclass "
                    "feedline.pipeline.TaskHook and override the methods you need"
                )
        pipeline: Pipeline[T] = Pipeline(
            PipelineConfig(
                source=source,
                stages=tuple(_built(s, hooks) for s in stages),
                sink=self._sink_config(stages),
                num_threads=num_threads,
                max_failures=max_failures,
                report_stats_interval=report_stats_interval,
                resumable=resumable,
                continuous=bool(continuous),
                hooks=hooks,
                hooked_stages=tuple(s.name for s in stages if _hookable(s)) if hooks else (),
                tuning=Tuning(memory_budget, float(cpu_budget or 0.0))
                if tuned or memory_budget is not None
                else None,
            )
        )
        pipeline.watch.after = stall
        return pipeline

    def _sink_config(self, stages: list[StageConfig]) -> SinkConfig:
        if self._sink_size is not None:
            return SinkConfig(buffer_size=self._sink_size)
        last = getattr(stages[-1], "concurrency", 1) if stages else 1
        size = max(DEFAULT_SINK, min(MAX_DEFAULT_SINK, 2 * last))
        return SinkConfig(buffer_size=size, grow_to=MAX_DEFAULT_SINK)

    def __repr__(self) -> str:
        names = [self._source.name] if self._source else []
        names += [s.name for s in self._stages]
        return f"PipelineBuilder({' -> '.join(names) or 'empty'})"


def _check_failures(max_failures: object) -> None:
    if max_failures is None:
        return
    if isinstance(max_failures, bool) or not isinstance(max_failures, (int, float)):
        raise ConfigurationError(
            f"max_failures must be an int, a float in (0, 1) or None, got {max_failures!r}"
        )
    if isinstance(max_failures, float) and not (0.0 < max_failures < 1.0):
        raise ConfigurationError(
            f"a float max_failures is a fraction of items and must be in (0, 1), got "
            f"{max_failures}; pass an int for a count"
        )
    if isinstance(max_failures, int) and max_failures < 0:
        raise ConfigurationError(
            f"max_failures must be >= 0, got {max_failures}; pass None for no limit"
        )


def _check_resumable(source: SourceConfig, stages: list[StageConfig]) -> None:
    # Refuses what cannot be resumed exactly.
    if isinstance(source.source, Pipeline):
        raise ConfigurationError(
            "resumable=True cannot resume a pipeline whose source is another Pipeline "
            "(its items may come in a different order on the next pass); move the inner "
            "pipeline's source and stages into this one, or build without resumable=True"
        )
    for s in stages:
        if isinstance(s, DisaggregateConfig):
            what, instead = "disaggregate()", "keep the groups whole (one item each)"
        elif isinstance(s, PipeConfig) and s.kind.many:
            what = "an async generator" if s.kind is OpKind.ASYNC_GENERATOR else "a generator"
            instead = "make the op return a list of its results (one item)"
        else:
            continue
        raise ConfigurationError(
            f"stage {s.name!r}: resumable=True needs stages that turn one item into one, "
            f"and {what} stage turns one into many, which cannot be resumed part-way; "
            f"{instead}, or build without resumable=True"
        )


def _built(stage: StageConfig, hooks: tuple[TaskHook, ...]) -> StageConfig:
    # A stage as the pipeline runs it: its op hooked and tagged, its region a pool of its own.
    if not isinstance(stage, PipeConfig):
        return stage
    op = hooked(stage.op, stage.kind, stage.name, hooks) if hooks and _hookable(stage) else stage.op
    executor, placement = stage.executor, stage.placement
    if isinstance(executor, _RegionPlaceholder):  # closed by the pipeline
        executor = RegionPool(executor.processes, executor.mp_context, stage.name)
    if placement == "auto":  # may move to processes; closed by the pipeline
        if stage.kind is not OpKind.FUNCTION:
            stays: str | None = f"a {stage.kind.value} op does not cross to processes"
        elif hooks:
            stays = "task hooks run in this process"
        else:
            stays = cannot_move(op)
        placement = Placement(op, stage.name, stays)
    return dataclasses.replace(
        stage, op=_TAGGED[stage.kind](op), executor=executor, placement=placement
    )


def _autotuned(stage: StageConfig) -> StageConfig:
    # build(autotune=True): a stage without a concurrency of its own is tuned, unless it is
    # a generator that keeps input order (each input's outputs together needs one call).
    if not isinstance(stage, PipeConfig) or not stage.default_concurrency:
        return stage
    if stage.kind.many and stage.output_order == "input":
        return stage
    return dataclasses.replace(stage, auto=Auto())


def _resolve_auto(stage: StageConfig, num_threads: int) -> StageConfig:
    # A tuned stage's bounds and start, now that the thread pool's size is known.
    if not isinstance(stage, PipeConfig) or stage.auto is None:
        return stage
    on_loop = stage.kind.on_loop
    pool: int | None = None
    if stage.executor is None and not on_loop:
        pool = num_threads
    elif stage.executor is not None:
        pool = getattr(stage.executor, "_max_workers", None)
        if isinstance(stage.executor, ProcessPoolExecutor) and pool is not None:
            pool *= 2  # a call waiting in the pool's queue keeps each process fed
    if pool is not None and stage.auto.low > pool:
        raise ConfigurationError(
            f"stage {stage.name!r}: Auto(low={stage.auto.low}) but it can have at most {pool} "
            "calls at once (the thread pool's num_threads, or its executor's workers); lower "
            "low, or raise num_threads"
        )
    low, high, start = stage.auto.bounds(on_loop and stage.executor is None, pool)
    return dataclasses.replace(stage, concurrency=start, tune=(low, high))
