from __future__ import annotations

from collections.abc import Iterator

import pytest

from ._s3 import s3_server


@pytest.fixture(scope="module")
def s3() -> Iterator[str]:
    """A moto S3 server on loopback holding 40 objects ``data/<i>``; yields its endpoint."""
    yield from s3_server()
