"""The exceptions feedline raises.

Every error feedline raises on its own account derives from :class:`FeedlineError`::

    FeedlineError
    ├── ConfigurationError (also ValueError)   a pipeline or argument that cannot work
    ├── PipelineFailure                        a running pipeline gave up
    │   └── SubprocessFailure                  ... in a child process
    │       └── SubprocessDied (also RuntimeError) ... because the child process died
    ├── LedgerError (also RuntimeError)        an epoch delivered a sample twice, or never
    └── RemoteReadError (also OSError)         a read from object storage failed
        └── RemoteNotFoundError                ... because the object does not exist
                                               (also FileNotFoundError)

Errors raised by user code travel unchanged where that is what a user would expect (an exception
in the source of a pipeline is re-raised as it is); errors that a pipeline *absorbs* (failures of
individual items, counted against the failure budget) surface, once the budget is spent, as a
:class:`PipelineFailure` that names the stage, the number of failures, the sample that failed
last and the last exception (also available as ``__cause__``).
"""

from __future__ import annotations

import errno

__all__ = [
    "ConfigurationError",
    "FeedlineError",
    "LedgerError",
    "PipelineFailure",
    "RemoteNotFoundError",
    "RemoteReadError",
    "SubprocessDied",
    "SubprocessFailure",
    "add_note",
]


class FeedlineError(Exception):
    """Base class of the errors feedline raises on its own account."""


class ConfigurationError(FeedlineError, ValueError):
    """A pipeline definition or an argument that cannot work.

    Raised before any thread starts (by the builder or at ``build()``), with a message that says
    what was received and how to fix it. Also raised by a ``RemoteStore`` read in a process
    that cannot run obstore (forked after obstore's runtime started in its parent): the same
    for every key, so it is no failed read to count and skip.
    """


class PipelineFailure(FeedlineError):
    """A running pipeline stopped because a stage exceeded its failure budget.

    Attributes:
        stage: Name of the stage whose failures exceeded the budget.
        num_failures: How many items that stage had failed on when the pipeline stopped.
        num_items: How many items that stage had received by then.
        sample: A short ``repr`` of the last item that failed (``None`` when unknown).
        source: Which item of the source that sample came from: its number and, when the
            stages changed it on the way, a short ``repr`` of it (the path or key the pipeline
            started with); ``None`` when unknown.
        last_error: The last exception the stage raised (also the ``__cause__``).

    """

    def __init__(
        self,
        stage: str,
        num_failures: int,
        num_items: int,
        sample: str | None,
        last_error: BaseException | None,
        budget: str,
        hint: str = "raise the budget with build(max_failures=...)",
        source: str | None = None,
    ) -> None:
        self.stage = stage
        self.num_failures = num_failures
        self.num_items = num_items
        self.sample = sample
        self.source = source
        self.last_error = last_error
        last = f"{type(last_error).__name__}: {last_error}" if last_error is not None else "?"
        where = f" ({source})" if source is not None else ""
        super().__init__(
            f"stage {stage!r} failed on {num_failures} of {num_items} items, more than the "
            f"failure budget ({budget}); last failure on sample {sample}{where}: {last}. "
            f"Fix the cause, or {hint} "
            "(an int is a count, a float in (0, 1) a fraction of the stage's items)."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (
            type(self),
            (self.stage, self.num_failures, self.num_items, self.sample, self.last_error, ""),
            {"args": self.args, "source": self.source},
        )


class SubprocessFailure(PipelineFailure):
    """A pipeline or iterable running in a child process failed or the child died.

    The message carries the child's traceback (as text) when the child could send it. When
    the child's pipeline gave up on a stage's failure budget, ``stage``, ``num_failures``,
    ``num_items``, ``sample`` and ``last_error`` are that stage's, as the child saw them;
    otherwise ``stage`` is ``"<subprocess>"``.
    """

    def __init__(self, message: str, origin: BaseException | None = None) -> None:
        Exception.__init__(self, message)
        self.stage = "<subprocess>"
        self.num_failures = 1
        self.num_items = 0
        self.sample: str | None = None
        self.source: str | None = None
        self.last_error: BaseException | None = origin
        if isinstance(origin, PipelineFailure):
            self.stage, self.num_failures = origin.stage, origin.num_failures
            self.num_items, self.sample = origin.num_items, origin.sample
            self.source = origin.source
            self.last_error = origin.last_error

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.__cause__))


class SubprocessDied(SubprocessFailure, RuntimeError):
    """A child process (a DataLoader worker, a subprocess pipeline) died without finishing.

    A ``RuntimeError``, as PyTorch raises for a worker killed by a signal.

    Attributes:
        pid: The child's process id.
        exitcode: Its exit code; ``-N`` when signal ``N`` killed it (``None`` if unknown).
        signal: The signal's name (``"SIGKILL"``), or ``None`` when it exited by itself.

    """

    def __init__(self, message: str, pid: int | None = None, exitcode: int | None = None) -> None:
        super().__init__(message)
        self.pid = pid
        self.exitcode = exitcode
        self.signal: str | None = None
        if exitcode is not None and exitcode < 0:
            import signal

            try:
                self.signal = signal.Signals(-exitcode).name
            except ValueError:
                self.signal = f"signal {-exitcode}"

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (str(self), self.pid, self.exitcode))


class LedgerError(FeedlineError, RuntimeError):
    """An epoch handed out a sample (or batch) twice, or passed over one it never handed out.

    Raised by the epoch ledger (see ``feedline/_ledger.py``) at the end of an epoch, or when a
    saved state is loaded whose position does not match what was handed out. It means a bug
    in the bookkeeping of a resume (feedline's, or a dataset's or sampler's own state), never
    a problem with the data.

    Attributes:
        repeated: How many deliveries repeated one made already.

    """

    def __init__(self, message: str, *, repeated: int = 0) -> None:
        super().__init__(message)
        self.repeated = repeated


class RemoteReadError(FeedlineError, OSError):
    """A read from object storage failed, after the retries the error allowed.

    Attributes:
        url: The store's URL.
        key: The object's key under it.

    """

    def __init__(self, url: str, key: str, message: str) -> None:
        Exception.__init__(self, message)
        self.url = url
        self.key = key

    def __str__(self) -> str:
        return str(self.args[0])

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.url, self.key, self.args[0]))


class RemoteNotFoundError(RemoteReadError, FileNotFoundError):
    """The object to read does not exist (never retried); ``errno`` is ``ENOENT``."""

    def __init__(self, url: str, key: str, message: str) -> None:
        super().__init__(url, key, message)
        self.errno = errno.ENOENT
        self.filename = key


def rebuilds(error: BaseException) -> bool:
    """Whether ``error`` survives pickling as itself, so another process can re-raise it.

    An exception class whose ``__init__`` takes other arguments than its message pickles,
    but unpickling it raises a ``TypeError`` about that ``__init__`` instead.
    """
    import pickle

    try:
        copy = pickle.loads(pickle.dumps(error))
    except Exception:
        return False
    return type(copy) is type(error)


def portable(error: BaseException) -> tuple[BaseException | None, str]:
    """What another process can re-raise of ``error``, and its traceback as text.

    The error itself if it :func:`rebuilds` from its pickle, else ``None``.
    """
    import traceback

    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    return (error if rebuilds(error) else None), text


def not_rebuilt(text: str, raised_in: str, traceback_in: str) -> RuntimeError:
    """The ``RuntimeError`` that stands for an exception another process could not send.

    As PyTorch's DataLoader does where :func:`portable` gave ``None``: the exception's last
    line and its traceback.
    """
    last = text.strip().splitlines()[-1] if text.strip() else "an exception"
    return RuntimeError(
        f"{last} (raised in {raised_in}; its class cannot be rebuilt in this process from its "
        "pickle, so it comes as a RuntimeError: give its __init__ the message as its only "
        f"required argument, or define __reduce__)\nOriginal traceback in {traceback_in}:\n"
        f"{text}"
    )


def add_note(error: BaseException, note: str) -> None:
    """Attach ``note`` to ``error`` (PEP 678; shown below the traceback from Python 3.11).

    feedline re-raises the exceptions of user code as they are, so that ``except KeyError``
    around a loop keeps working, and says where they came from (the stage, the sample) here.
    """
    notes = getattr(error, "__notes__", None)
    if not isinstance(notes, list):
        notes = []
        try:
            error.__notes__ = notes  # type: ignore[attr-defined]  # 3.10 has no __notes__ yet
        except AttributeError:  # pragma: no cover - an exception type with __slots__
            return
    if note not in notes:
        notes.append(note)
