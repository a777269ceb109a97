"""What a failed request to a store says: the cause in one line, and advice that fits it.

obstore's message is a first line that repeats the request, then a multi-line debug dump;
a cloud store's error body is XML. :func:`describe` keeps what a user needs: the HTTP status,
the server's error code and words, or why no connection was made, and the retries spent.
:func:`failure` adds what to change, by the kind of failure:

* no such object: the key and the URL's prefix;
* no such bucket (S3's ``NoSuchBucket``, Azure's ``ContainerNotFound``, or a listing
  answered 404, since a missing prefix lists nothing): the bucket's name and the endpoint;
* credentials refused (401, 403): the credentials and the bucket's policy;
* no connection (refused, a name that does not resolve): the endpoint, and whether the
  server runs;
* a wrong request (a range past the end, a bad path): the key and the range;
* a local file: the file and its permissions;
* a reply without a length (a chunked one, which obstore's HTTP client cannot read): the
  server;
* the rest (5xx, timeouts, dropped connections), the errors obstore retries: the timeouts
  and retries to raise if the store is slow rather than down.

The full original text stays available as the ``__cause__`` of the error raised.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from feedline.errors import RemoteNotFoundError, RemoteReadError

__all__ = ["bad_range", "describe", "failure", "kind"]

_MESSAGE_CHARS = 300  # of the first line of the store's message (it may hold an XML body)

_STATUS = re.compile(r"status code: (\d{3})([^:]*)(?::\s*(.*))?")
_RETRIES = re.compile(r"after (\d+) retries")
_XML_FIELD = re.compile(r"<(Code|Message)>([^<]*)</\1>")
_REQUEST = re.compile(r"Error performing [A-Z]+ (\w+://[^/\s?]+)")
_CONNECT = re.compile(r'ConnectError\(\s*"([^"]*)"')
_CONNECT_KIND = re.compile(r"kind: Connect\b")  # not ConnectionReset: that one connected
_REASON = re.compile(r'(?:message|error): "([^"]*)"')
_NO_BUCKET = ("NoSuchBucket", "ContainerNotFound")  # S3 and S3-compatible; Azure
_THROTTLE_CODES = ("SlowDown", "ServerBusy", "Throttl", "TooManyRequests", "RequestLimitExceeded")
_NO_LENGTH = "Content-Length Header missing"  # obstore's HTTP client reads no chunked reply
_BUCKET_SCHEMES = ("s3://", "s3a://", "gs://", "az://", "azure://", "abfs://", "abfss://")


def describe(error: Exception, retried: int | None = None, refused: int = 0) -> str:
    """One line on why a request failed: the HTTP status, the retries, the server's words.

    The status (``HTTP 503 Service Unavailable``) and the body's code and message (or the
    first words of a plain body); or, where no connection was made, why (``tcp connect
    error: Connection refused``); then how many retries were spent: ``retried`` (and the
    ``refused`` attempts) where feedline sent them, else the count in obstore's message.
    """
    text = str(error)
    head = text.split("\n", 1)[0]
    found = _STATUS.search(head)
    connect = _connect_failure(text)
    if found is not None:
        code, reason, body = found.group(1), found.group(2).strip(), found.group(3) or ""
        cause = f"HTTP {code}" + (f" {reason}" if reason else "")
        if body.lstrip().startswith("<"):  # XML, which may go on past the first line
            fields = dict(_XML_FIELD.findall(text))
            body = ": ".join(v for v in (fields.get("Code"), fields.get("Message")) if v)
        if body.strip():
            cause += f": {_shorten(body, 160)}"
    elif connect is not None:
        cause = f"no connection: {connect}"
    elif "ConnectionReset" in text:
        cause = "the connection was reset"
    else:
        cause = f"{type(error).__name__}: {_shorten(head, _MESSAGE_CHARS)}"
    if retried is None:
        retries = _RETRIES.search(head)
        retried = 0 if retries is None else int(retries.group(1))
    if retried:
        cause += f", after {retried} {'retry' if retried == 1 else 'retries'}"
    if refused:
        cause += f", after {refused} {'refusal' if refused == 1 else 'refusals'}"
    if "TimedOut" in text or "kind: Timeout" in text:
        cause += " [timed out]"
    return cause


def kind(error: Exception, exceptions: Any, url: str) -> str:
    """Whether a failed request may be sent again: ``"refused"``, ``"passing"`` or ``"final"``.

    * ``"refused"``: the store throttles: HTTP 429, or a 503 that says so (S3's
      ``SlowDown``, Azure's ``ServerBusy``; a bare 503 is a server error): sent again
      more slowly;
    * ``"passing"``: what obstore itself would retry: another server error (5xx), a
      timeout, a dropped or refused connection;
    * ``"final"``: the rest (no such object, a refused credential, a wrong request, a
      changed object, a local file's error, a reply without a length).
    """
    text = str(error)
    status = _status(text)
    if _refused(status, text):
        return "refused"
    if (
        _NO_LENGTH in text
        or url.startswith(("file:", "memory:"))
        or bad_range(error)
        or not isinstance(error, exceptions.GenericError)  # typed: not found, denied, ...
    ):
        return "final"
    return "passing" if status is None or status >= 500 or status == 408 else "final"


def failure(
    store: Any,
    key: str,
    error: Exception,
    exceptions: Any,
    listing: bool = False,
    retried: int | None = None,
    refused: int = 0,
) -> RemoteReadError:
    """The error to raise for ``error``, a failed read of ``key`` (or a listing under it).

    Args:
        store: The :class:`RemoteStore` (its ``url``, ``retries`` and ``retry_timeout``).
        key: The key read, or the prefix listed.
        error: What obstore raised.
        exceptions: ``obstore.exceptions``.
        listing: Whether the request listed keys under ``key``.
        retried: The retries feedline sent (``None``: those obstore's message counts).
        refused: The attempts the store refused (throttling), sent again.

    """
    url = store.url
    cause = describe(error, retried, refused)
    text = str(error)
    status = _status(text)
    where = _origin(text) or "the store's endpoint"
    no_bucket = any(f"<Code>{code}</Code>" in text for code in _NO_BUCKET) or (
        # A missing prefix lists nothing: a listing answered 404 has no bucket to list.
        listing and status == 404 and url.lower().startswith(_BUCKET_SCHEMES)
    )
    if no_bucket:
        advice = (
            f"The bucket {_bucket(url)!r} does not exist at {where} (not retried): check the "
            "bucket's name in the URL, and the endpoint= and region= options"
        )
    elif isinstance(error, FileNotFoundError):
        return RemoteNotFoundError(
            url,
            key,
            f"no object {key!r} under {url} ({cause}). Check the key and the URL's prefix: "
            "keys are relative to it",
        )
    elif isinstance(error, exceptions.PermissionDeniedError | exceptions.UnauthenticatedError) or (
        status in (401, 403)
    ):
        advice = (
            "The store refused the request (not retried): check the credentials (options "
            "such as access_key_id, or the environment) and the bucket's policy"
        )
    elif _CONNECT_KIND.search(text):
        advice = (
            f"Nothing accepted a connection at {where}: check the endpoint (endpoint=, or "
            "the URL's host and port) and that the server is running and reachable from here"
        )
    elif isinstance(error, exceptions.InvalidPathError):
        advice = (
            "obstore cannot handle an object's path (an empty segment, as in 'a//b', or a '.' "
            "or '..' one), though S3 allows it: rename the object, or list and read under a "
            "prefix that leaves it out"
        )
    elif isinstance(error, exceptions.NotSupportedError):
        advice = (
            "The store does not support the request (not retried): byte ranges, most often; "
            "read whole objects (no start=/end=, part_size=None)"
        )
    elif _NO_LENGTH in text:
        advice = (
            "The server replied without a Content-Length (a chunked reply, as servers send "
            "for bodies they compress or make on the fly), which obstore's HTTP client cannot "
            "read (not retried): serve the objects as static files, or turn off the server's "
            "on-the-fly compression for them"
        )
    elif status == 412:
        advice = (
            "The object changed while it was read in parts (its ETag no longer matched): "
            "nothing was returned or cached; read it again"
        )
    elif (
        bad_range(error)
        or not isinstance(error, exceptions.BaseError)
        or (status is not None and 400 <= status < 500 and status not in (408, 429))
    ):
        advice = "The request itself is wrong (not retried): check the key and the range"
    elif url.startswith(("file:", "memory:")):
        advice = "Local reads are not retried: check the file and its permissions"
    elif _refused(status, text):
        advice = (
            f"The store refused requests as too many (throttling) for {store.retry_timeout:g} "
            "s, each sent again more slowly and with fewer in flight: give more time "
            "(retry_timeout=), read fewer objects at once (a stage's concurrency), or spread "
            "the keys over more prefixes (S3 scales per prefix)"
        )
    else:
        advice = (
            f"Errors that can pass were retried up to {store.retries} time(s) within "
            f"{store.retry_timeout:g} s; if the store is slow rather than down, raise "
            "timeout=, retries= or retry_timeout="
        )
    doing = f"listing keys under {key!r}" if listing else f"reading {key!r}"
    message = f"{doing} from {url} failed ({cause}). {advice}"
    if isinstance(error, FileNotFoundError):  # no bucket: nor any object in it
        return RemoteNotFoundError(url, key, message)
    return RemoteReadError(url, key, message)


def bad_range(error: Exception) -> bool:
    """Whether the store refused the byte range (past the end of the object, or any range)."""
    head = str(error).split("\n", 1)[0].lower()
    return "range" in head and any(
        w in head for w in ("invalid", "416", "not satisfiable", "not supported")
    )


def _refused(status: int | None, text: str) -> bool:
    # A refusal as too many: a 429, or a 503 that says the store refuses the rate (not that
    # it is down).
    if status == 429:
        return True
    lowered = text.lower()
    return status == 503 and (
        any(code in text for code in _THROTTLE_CODES) or "request rate" in lowered
    )


def _status(text: str) -> int | None:
    found = _STATUS.search(text.split("\n", 1)[0])
    return None if found is None else int(found.group(1))


def _origin(text: str) -> str | None:
    # Where the request went (scheme, host, port), from obstore's first line.
    found = _REQUEST.search(text.split("\n", 1)[0])
    return None if found is None else found.group(1)


def _bucket(url: str) -> str:
    parts = urlsplit(url)
    return parts.netloc or parts.path.strip("/").split("/", 1)[0]


def _connect_failure(text: str) -> str | None:
    # Why no connection was made ("tcp connect error: Connection refused", "dns error: ..."),
    # from the debug dump; None if a connection was made.
    if not _CONNECT_KIND.search(text):
        return None
    found = _CONNECT.search(text)
    if found is None:
        return "could not connect"
    reason = _REASON.search(text, found.end())
    return found.group(1) + (f": {reason.group(1)}" if reason else "")


def _shorten(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters at a word boundary, marked when cut."""
    text = " ".join(text.split())
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return cut.rstrip(",;:") + " ..."
