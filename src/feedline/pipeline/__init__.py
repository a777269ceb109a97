"""The pipeline engine: build a pipeline of stages, run it in background threads, iterate it.

See ``README.md`` in this folder for how the parts fit together.
"""

from __future__ import annotations

from feedline._proc.lifetime import die_with_parent
from feedline._proc.subprocess import SubprocessIterable, iterate_in_subprocess

from ._builder import PipelineBuilder
from ._gated import GatedSource
from ._hooks import TaskHook
from ._in_subprocess import run_pipeline_in_subprocess
from ._mixture import Mixture
from ._pipeline import Pipeline
from ._queue_stats import ChannelStats
from ._tuning import Auto
from .stats import PipelineStats, StageStats

__all__ = [
    "Auto",
    "ChannelStats",
    "GatedSource",
    "Mixture",
    "Pipeline",
    "PipelineBuilder",
    "PipelineStats",
    "StageStats",
    "SubprocessIterable",
    "TaskHook",
    "die_with_parent",
    "iterate_in_subprocess",
    "run_pipeline_in_subprocess",
]
