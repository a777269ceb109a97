"""feedline: feed training data to models as fast as the hardware allows.

One process, a pipeline of stages, each stage in a thread pool sized for it, bounded queues in
between, and I/O functions that release the GIL. Start with :class:`PipelineBuilder`, or with
:class:`DataLoader` where ``torch.utils.data.DataLoader`` is used today.
"""

import typing as _typing

from . import _ast_lock
from .errors import (
    ConfigurationError,
    FeedlineError,
    LedgerError,
    PipelineFailure,
    RemoteNotFoundError,
    RemoteReadError,
    SubprocessDied,
    SubprocessFailure,
)
from .loader import DataLoader, PathList
from .pipeline import (
    Auto,
    Mixture,
    Pipeline,
    PipelineBuilder,
    PipelineStats,
    StageStats,
    SubprocessIterable,
    iterate_in_subprocess,
    run_pipeline_in_subprocess,
)

if _typing.TYPE_CHECKING:
    from .source import RemoteStore

__version__ = "0.1.0"

_ast_lock.install()  # threads parsing at once corrupt the AST constructor of some CPythons

__all__ = [
    "Auto",
    "ConfigurationError",
    "DataLoader",
    "FeedlineError",
    "LedgerError",
    "Mixture",
    "PathList",
    "Pipeline",
    "PipelineBuilder",
    "PipelineFailure",
    "PipelineStats",
    "RemoteNotFoundError",
    "RemoteReadError",
    "RemoteStore",
    "StageStats",
    "SubprocessDied",
    "SubprocessFailure",
    "SubprocessIterable",
    "__version__",
    "iterate_in_subprocess",
    "run_pipeline_in_subprocess",
]


def __getattr__(name: str) -> _typing.Any:
    # RemoteStore loads on first use, so that `import feedline` does not pay for the
    # storage modules (about 14 ms: tempfile, ISA-L, their classes) unless they are used.
    if name == "RemoteStore":
        from .source import RemoteStore

        return RemoteStore
    raise AttributeError(f"module 'feedline' has no attribute {name!r}")
