"""feedline: feed training data to models as fast as the hardware allows.

One process, a pipeline of stages, each stage in a thread pool sized for it, bounded queues in
between, and I/O functions that release the GIL. Start with :class:`PipelineBuilder`, or with
:class:`DataLoader` where ``torch.utils.data.DataLoader`` is used today.
"""

from __future__ import annotations

from .errors import (
    ConfigurationError,
    FeedlineError,
    PipelineFailure,
    RemoteNotFoundError,
    RemoteReadError,
    SubprocessFailure,
)
from .loader import DataLoader, PathList
from .pipeline import (
    Pipeline,
    PipelineBuilder,
    PipelineStats,
    StageStats,
    SubprocessIterable,
    iterate_in_subprocess,
    run_pipeline_in_subprocess,
)
from .source import RemoteStore

__version__ = "0.1.0"

__all__ = [
    "ConfigurationError",
    "DataLoader",
    "FeedlineError",
    "PathList",
    "Pipeline",
    "PipelineBuilder",
    "PipelineFailure",
    "PipelineStats",
    "RemoteNotFoundError",
    "RemoteReadError",
    "RemoteStore",
    "StageStats",
    "SubprocessFailure",
    "SubprocessIterable",
    "__version__",
    "iterate_in_subprocess",
    "run_pipeline_in_subprocess",
]
