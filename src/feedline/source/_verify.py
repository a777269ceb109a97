"""Checking an object's bytes against what the store says about them, before anyone sees them.

A body can arrive damaged with nothing in the transfer noticing: a proxy or a faulty NIC flips
bits, or a server sends a consistent but short ``Content-Length``. What can be checked, cheapest
first, for a whole-object read:

* **the length** against the object's size that the response declares (every store);
* **the MD5** against the ETag, on S3 and S3-compatible stores (``s3://``), where a
  single-part object's ETag is the hex MD5 of its bytes, and on HTTP(S) stores, where a
  server in front of a bucket (a CDN, a bucket's public URL) passes such an ETag on. Only an
  ETag of 32 hex digits, quoted or not, is taken for an MD5: not a weak one (``W/"..."``),
  not a multipart one (``"...-N"``). Objects encrypted with SSE-KMS or SSE-C have ETags of
  that form that are no MD5s, and a server may make its own so: read those with
  ``RemoteStore(..., verify=False)``.

What obstore does not expose cannot be checked: a GET's result (``obstore.GetResult``) gives
the ETag in ``.meta["e_tag"]`` and a few headers in ``.attributes`` (``Content-Type``,
``Cache-Control``, ``Content-Disposition``, ``Content-Encoding``, ``Content-Language``, and
a store's user metadata), but neither ``Content-MD5`` nor GCS's ``x-goog-hash`` (MD5 and
CRC32C), nor S3's additional checksums (``x-amz-checksum-*``).

Byte-range reads are checked by obstore against the ``Content-Range`` they asked for; no
checksum covers a part of an object. The store retries a body that fails and raises once the
retries are spent; such bytes are never returned or cached.
"""

from __future__ import annotations

import hashlib
import re
from typing import Any

__all__ = ["Verifier"]

_MD5_ETAG = re.compile(r'^"?([0-9a-fA-F]{32})"?$')
_MD5_ETAG_SCHEMES = ("s3://", "s3a://", "http://", "https://")  # where such an ETag is an MD5


class Verifier:
    """What to check for one store. Stateless apart from its switches; thread-safe.

    Args:
        url: The store's URL (its scheme says whether an ETag may be an MD5).
        enabled: ``False`` checks nothing.

    """

    def __init__(self, url: str, enabled: bool) -> None:
        self.enabled = enabled
        self._md5 = enabled and url.lower().startswith(_MD5_ETAG_SCHEMES)

    def expected_md5(self, meta: Any) -> str | None:
        """The MD5 (hex) the ETag promises, or ``None`` where the ETag is no MD5."""
        if not self._md5:
            return None
        etag = meta.get("e_tag") if isinstance(meta, dict) else None
        match = _MD5_ETAG.match(etag or "")
        return match.group(1).lower() if match else None

    def problem(self, view: memoryview, meta: Any) -> tuple[str | None, bool]:
        """Check a whole object's bytes: ``(what is wrong or None, whether a checksum ran)``.

        Hashing releases the GIL (hashlib does for more than 2 KiB): call it in a thread for
        large bodies.
        """
        if not self.enabled:
            return None, False
        size = meta.get("size") if isinstance(meta, dict) else None
        if isinstance(size, int) and size != view.nbytes:
            return f"{view.nbytes} bytes arrived where the object has {size}", False
        expected = self.expected_md5(meta)
        if expected is None:
            return None, False
        got = hashlib.md5(view, usedforsecurity=False).hexdigest()
        if got != expected:
            return f"the MD5 of the bytes is {got}, the ETag says {expected}", True
        return None, True
