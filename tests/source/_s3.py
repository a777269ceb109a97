"""A moto S3 server on loopback for the storage tests (fixture ``s3`` in conftest.py)."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

import numpy as np

BUCKET = "feedline-test"
CREDENTIALS = {"access_key_id": "test", "secret_access_key": "test", "region": "us-east-1"}


def _body(i: int) -> bytes:
    return np.random.default_rng(i).integers(0, 256, 1000 + 37 * i, dtype=np.uint8).tobytes()


def s3_server() -> Iterator[str]:
    """A moto S3 server on loopback holding 40 objects ``data/<i>``; yields its endpoint."""
    with moto_bucket(BUCKET, {f"data/{i}": _body(i) for i in range(40)}) as (endpoint, _):
        yield endpoint


@contextmanager
def moto_bucket(bucket: str, objects: Mapping[str, bytes]) -> Iterator[tuple[str, dict[str, int]]]:
    """A moto S3 server on loopback whose ``bucket`` holds ``objects``.

    Yields its endpoint and a dict whose ``"GET"`` counts the object GETs served so far, and
    ``"LIST"`` the listing requests (one per page of keys).
    """
    import boto3
    from moto import server as moto_server
    from werkzeug.serving import make_server

    counts = {"GET": 0, "LIST": 0}
    lock = threading.Lock()

    class Counting(moto_server.ThreadedMotoServer):
        def _server_entry(self) -> None:
            app = moto_server.DomainDispatcherApplication(moto_server.create_backend_app)

            def counted(environ: dict[str, str], start_response: object) -> object:
                if environ["REQUEST_METHOD"] == "GET":
                    kind = "GET" if environ["PATH_INFO"].strip("/").count("/") else "LIST"
                    with lock:
                        counts[kind] += 1
                return app(environ, start_response)  # type: ignore[arg-type]

            self._server = make_server(
                self._ip_address,
                self._port,
                counted,  # type: ignore[arg-type]
                True,
                request_handler=moto_server.MotoRequestHandler,
            )
            self._server_ready_event.set()
            self._server.serve_forever()

    server = Counting(ip_address="127.0.0.1", port=0, verbose=False)
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
        client.create_bucket(Bucket=bucket)
        for key, body in objects.items():
            client.put_object(Bucket=bucket, Key=key, Body=body)
        counts["GET"] = counts["LIST"] = 0
        yield endpoint, counts
    finally:
        server.stop()
        inner = getattr(server, "_server", None)  # stop() leaves the listening socket open
        if inner is not None:
            inner.server_close()
