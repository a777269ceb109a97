"""A moto S3 server on loopback for the storage tests (fixture ``s3`` in conftest.py)."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

BUCKET = "feedline-test"
CREDENTIALS = {"access_key_id": "test", "secret_access_key": "test", "region": "us-east-1"}


def _body(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 1000 + 37 * i, dtype=np.uint8).tobytes()


def s3_server() -> Iterator[str]:
    """A moto S3 server on loopback holding 40 objects ``data/<i>``; yields its endpoint."""
    import boto3
    from moto import server as moto_server

    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        endpoint = f"http://{host}:{port}"
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            aws_access_key_id="test",
            aws_secret_access_key="test",
            region_name="us-east-1",
        )
        client.create_bucket(Bucket=BUCKET)
        for i in range(40):
            client.put_object(Bucket=BUCKET, Key=f"data/{i}", Body=_body(i))
        yield endpoint
    finally:
        server.stop()
        inner = getattr(server, "_server", None)  # stop() leaves the listening socket open
        if inner is not None:
            inner.server_close()
