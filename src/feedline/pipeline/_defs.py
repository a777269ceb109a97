"""Stage definitions: small frozen records that the builder collects and validates.

Config is data, runtime is code: nothing here starts a thread. :mod:`._engine` turns a
:class:`PipelineConfig` into running stages.
"""

from __future__ import annotations

import enum
import inspect
from collections.abc import AsyncIterable, Callable, Iterable
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

from ._resume import merge_group, split_group

__all__ = [
    "AggregateConfig",
    "DisaggregateConfig",
    "OpKind",
    "PipeConfig",
    "PipelineConfig",
    "SinkConfig",
    "SourceConfig",
    "StageConfig",
    "op_kind",
]

OutputOrder = Literal["completion", "input"]


class OpKind(enum.Enum):
    """How a stage op is called and where it runs."""

    FUNCTION = "function"  # def f(x) -> y                  thread pool (or executor)
    GENERATOR = "generator"  # def f(x): yield ...          thread pool
    COROUTINE = "coroutine"  # async def f(x) -> y          event loop
    ASYNC_GENERATOR = "async generator"  # async def f(x): yield  event loop

    @property
    def on_loop(self) -> bool:
        """Whether the op is ``async def``: its stage runs on the event loop."""
        return self in (OpKind.COROUTINE, OpKind.ASYNC_GENERATOR)

    @property
    def many(self) -> bool:
        """Whether the op yields any number of results per input."""
        return self in (OpKind.GENERATOR, OpKind.ASYNC_GENERATOR)


def op_kind(op: Callable[..., Any]) -> OpKind:
    """Classify a stage op, looking through ``functools.partial`` and callable objects."""
    targets: list[Any] = [op]
    call = getattr(type(op), "__call__", None)  # noqa: B004 - we need the method itself
    if call is not None and not inspect.isfunction(op) and not inspect.ismethod(op):
        targets.append(call)
    for target in targets:
        if inspect.isasyncgenfunction(target):
            return OpKind.ASYNC_GENERATOR
        if inspect.iscoroutinefunction(target):
            return OpKind.COROUTINE
        if inspect.isgeneratorfunction(target):
            return OpKind.GENERATOR
    return OpKind.FUNCTION


@dataclass(frozen=True)
class SourceConfig:
    """Where items come from: an Iterable, an AsyncIterable or another Pipeline."""

    source: Iterable[Any] | AsyncIterable[Any]
    name: str
    is_async: bool
    buffer_size: int | None = None  # the queue after it; None: the default, which may grow


@dataclass(frozen=True)
class PipeConfig:
    """A stage that applies ``op`` to every item."""

    op: Callable[..., Any]
    kind: OpKind
    name: str
    concurrency: int
    executor: Executor | None
    output_order: OutputOrder
    buffer_size: int
    grows: bool = False  # buffer_size is the default: the queue after the stage may grow
    # Tuned: the bounds (low, high) the tuner keeps ``concurrency`` (its start) within.
    tune: tuple[int, int] | None = None
    auto: Any = None  # the Auto asked for (resolved by build() into concurrency and tune)
    default_concurrency: bool = False  # no concurrency given: build(autotune=True) tunes it
    # executor="auto": the stage may move to processes ("auto"; build() makes it a Placement),
    # "threads": it never moves, None: build(autotune=True) decides.
    placement: Any = None


@dataclass(frozen=True)
class AggregateConfig:
    """A stage that groups ``size`` consecutive items into a list."""

    size: int
    drop_last: bool
    name: str
    buffer_size: int
    collect: Callable[[list[Any]], Any] = merge_group  # makes what is emitted of a group
    grows: bool = True
    epochs: Any = None  # a continuous run's _epochs.Checkpoint: groups end with their epoch


@dataclass(frozen=True)
class DisaggregateConfig:
    """A stage that flattens each incoming iterable into its elements."""

    name: str
    buffer_size: int
    grows: bool = True
    split: Callable[[Any], Iterable[Any]] = split_group  # the elements of an item


StageConfig = PipeConfig | AggregateConfig | DisaggregateConfig


@dataclass(frozen=True)
class SinkConfig:
    """The buffer of finished items waiting for the consumer.

    ``grow_to`` above ``buffer_size`` lets it grow (the default sink, see
    :meth:`~feedline.PipelineBuilder.add_sink`) up to that many items and about
    :data:`SINK_GROW_BYTES`; otherwise it stays at ``buffer_size``.
    """

    buffer_size: int
    grow_to: int = 0


@dataclass(frozen=True)
class PipelineConfig:
    """Everything needed to run a pipeline; produced by :meth:`PipelineBuilder.build`."""

    source: SourceConfig
    stages: tuple[StageConfig, ...]
    sink: SinkConfig
    num_threads: int
    max_failures: int | float | None
    report_stats_interval: float | None
    resumable: bool = False  # items travel numbered (see _resume); the Pipeline unwraps them
    continuous: bool = False  # one run across epochs (see Pipeline._continuous_epoch)
    hooks: tuple[Any, ...] = ()  # TaskHooks (see _hooks), told when the stages start and end
    hooked_stages: tuple[str, ...] = ()  # the stages whose ops the hooks wrap
    tuning: Any = None  # a Tuning (see _tuning) if a stage is tuned or a budget was set
