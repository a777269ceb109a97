"""A slow object store for the benchmarks: an HTTP/1.1 server that waits before each reply.

Runs in its own process (``python -m feedline.bench._server DELAY RATE FILE...``), so that
serving does not compete for the benchmark's GIL, and on asyncio with keep-alive connections,
so that its own cost per request stays small next to the delay it adds, as a remote store's
would. ``GET /<i>`` returns file ``i % len(files)``; ``GET /stats`` how many GETs and bytes it
served and refused; ``GET /delay/<spec>`` changes the wait from then on (a store that slows
down), ``GET /cap/<requests per second>`` the cap on requests (0: none; a store that throttles,
or stops). ``DELAY`` is seconds or a lognormal spread (:class:`Delay`). ``RATE`` is
``TOTAL[:CONNECTION[:REQUESTS]]``: a ``TOTAL`` above 0 caps the bytes per second of all
replies together (a token bucket: the shared file system of a cluster, scaled down), a
``CONNECTION`` above 0 those of each reply (one connection of an object store, which sends a
large object sooner as several range requests), ``REQUESTS`` above 0 the GETs per second:
those above it are refused with ``503 SlowDown``, as S3 refuses a prefix's requests above its
rate (a token bucket holding :data:`BURST` seconds of the rate). ``Range: bytes=A-B`` is
honoured (206, ``Content-Range``). It prints its port on stdout when ready.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

__all__ = ["BURST", "Delay", "ServerProcess", "served"]

BURST = 0.05
"""Seconds of the request cap a burst may take at once, above the rate."""

_SLOW_DOWN = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code><Message>Please reduce '
    b"your request rate.</Message></Error>"
)


class _Bucket:
    """Bytes per second for all connections together: a reply waits until its bytes are due."""

    def __init__(self, rate: float) -> None:
        self._rate = rate
        self._due = 0.0  # when the bytes granted so far have all been sent

    async def take(self, size: int) -> None:
        if self._rate <= 0:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        self._due = max(self._due, now) + size / self._rate
        await asyncio.sleep(self._due - now)


class _Requests:
    """Requests per second for all connections together: those above the rate are refused."""

    def __init__(self, rate: float) -> None:
        self.rate = rate
        self._tokens = 0.0
        self._at = 0.0

    def admit(self, now: float) -> bool:
        if self.rate <= 0:
            return True
        burst = max(1.0, self.rate * BURST)
        self._tokens = min(burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


class Delay:
    """How long the server waits before a reply: fixed, or lognormal within bounds.

    ``spec``: seconds (``"0.02"``), or ``"lognormal:MEDIAN:SIGMA:LOW:HIGH"`` (seconds; each
    wait drawn from a lognormal distribution around ``MEDIAN``, clipped to ``LOW``-``HIGH``).
    """

    def __init__(self, spec: str) -> None:
        import random

        self.spec = spec
        self._random = random.Random(0)
        if spec.startswith("lognormal:"):
            median, sigma, low, high = (float(x) for x in spec.split(":")[1:])
            self._args: tuple[float, ...] = (median, sigma, low, high)
        else:
            self._args = (float(spec),)

    def draw(self) -> float:
        """The next wait, in seconds."""
        import math

        if len(self._args) == 1:
            return self._args[0]
        median, sigma, low, high = self._args
        return min(high, max(low, self._random.lognormvariate(math.log(median), sigma)))


_CHUNK = 64 << 10  # bytes written at a time by a reply capped per connection


def _range(request: bytes, size: int) -> tuple[int, int] | None:
    # The [start, end) a "Range: bytes=A-B" (or "bytes=-N", the last N) header asks for, or
    # None for the whole body. ValueError: a range the body cannot satisfy (416).
    for line in request.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"range" and value.strip().startswith(b"bytes="):
            first, _, last = value.strip()[6:].partition(b"-")
            if not first:  # a suffix: the last N bytes
                start, end = max(0, size - int(last)), size
            else:
                start = int(first)
                end = min(size, int(last) + 1) if last else size
            if start >= size or end <= start:
                raise ValueError(f"bytes {start}-{end} of {size}")
            return start, end
    return None


async def _send(writer: asyncio.StreamWriter, body: memoryview, rate: float) -> None:
    # The body, at most ``rate`` bytes per second when ``rate`` is above 0.
    if rate <= 0:
        writer.write(body)
        await writer.drain()
        return
    loop = asyncio.get_running_loop()
    start = loop.time()
    for offset in range(0, len(body), _CHUNK):
        chunk = body[offset : offset + _CHUNK]
        due = start + (offset + len(chunk)) / rate
        writer.write(chunk)
        await writer.drain()
        await asyncio.sleep(max(0.0, due - loop.time()))


async def _serve(delay_spec: str, rates: str, bodies: list[bytes]) -> None:
    total, per_connection, cap = [*rates.split(":"), "0", "0"][:3]
    bucket = _Bucket(float(total))
    connection_rate = float(per_connection or 0)
    requests = _Requests(float(cap or 0))
    served = {"gets": 0, "bytes": 0, "refused": 0}
    delay = [Delay(delay_spec)]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                target = request.split(b" ", 2)[1].strip(b"/")
                if target == b"stats" or target.startswith((b"delay/", b"cap/")):
                    setting, _, value = target.partition(b"/")
                    if setting == b"delay":  # GET /delay/<spec>: wait as the spec says from now
                        delay[0] = Delay(value.decode())
                    elif setting == b"cap":  # GET /cap/<n>: refuse GETs above n per second
                        requests.rate = float(value)
                    counts = json.dumps(served).encode()
                    writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(counts))
                    writer.write(counts)
                    await writer.drain()
                    continue
                await asyncio.sleep(delay[0].draw())
                if not requests.admit(asyncio.get_running_loop().time()):
                    served["refused"] += 1
                    writer.write(
                        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
                        b"Content-Length: %d\r\n\r\n%s" % (len(_SLOW_DOWN), _SLOW_DOWN)
                    )
                    await writer.drain()
                    continue
                try:
                    whole = memoryview(bodies[int(target) % len(bodies)])
                except ValueError:
                    writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")
                    await writer.drain()
                    continue
                try:
                    asked = _range(request, len(whole))
                except ValueError:
                    writer.write(
                        b"HTTP/1.1 416 Range Not Satisfiable\r\nContent-Length: 0\r\n"
                        b"Content-Range: bytes */%d\r\n\r\n" % len(whole)
                    )
                    await writer.drain()
                    continue
                if asked is None:
                    body = whole
                    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
                else:
                    body = whole[asked[0] : asked[1]]
                    head = (
                        b"HTTP/1.1 206 Partial Content\r\nContent-Length: %d\r\n"
                        b"Content-Range: bytes %d-%d/%d\r\n\r\n"
                        % (len(body), asked[0], asked[1] - 1, len(whole))
                    )
                await bucket.take(len(body))
                served["gets"] += 1
                served["bytes"] += len(body)
                writer.write(head)
                await _send(writer, body, connection_rate)
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


def served(url: str) -> dict[str, int]:
    """GETs and bytes the server at ``url`` has served so far, and GETs it refused."""
    import urllib.request

    with urllib.request.urlopen(f"{url}/stats", timeout=30) as reply:
        counts: dict[str, int] = json.loads(reply.read())
    return counts


class ServerProcess:
    """Start the server in a child process; ``url`` is where it listens. Close it when done."""

    def __init__(
        self,
        files: list[Path],
        delay: float | str,
        rate: float = 0.0,
        connection_rate: float = 0.0,
        requests: float = 0.0,
    ) -> None:
        self._process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "feedline.bench._server",
                str(delay),
                f"{rate}:{connection_rate}:{requests}",
                *map(str, files),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        assert self._process.stdout is not None
        port = self._process.stdout.readline().strip()
        if not port:
            self.close()
            raise RuntimeError("the benchmark's HTTP server did not start")
        self.url = f"http://127.0.0.1:{port}"
        self.pid = self._process.pid

    def served(self) -> dict[str, int]:
        """GETs and bytes served so far, GETs refused: ``{"gets", "bytes", "refused"}``."""
        return served(self.url)

    def set_cap(self, requests: float) -> None:
        """Refuse GETs above ``requests`` per second from now on (0: refuse none)."""
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/cap/{requests:g}", timeout=30) as reply:
            reply.read()

    def set_delay(self, spec: float | str) -> None:
        """Wait as ``spec`` says (see :class:`Delay`) before each reply from now on."""
        import urllib.request

        with urllib.request.urlopen(f"{self.url}/delay/{spec}", timeout=30) as reply:
            reply.read()

    def cpu_seconds(self) -> float:
        """CPU time the server process has used so far (Linux ``/proc``)."""
        import os

        fields = Path(f"/proc/{self._process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def close(self) -> None:
        """Stop the server process and wait for it."""
        self._process.terminate()
        self._process.wait()
        if self._process.stdout is not None:
            self._process.stdout.close()

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


if __name__ == "__main__":
    _bodies = [Path(p).read_bytes() for p in sys.argv[3:]] or [b"x" * 1024]
    asyncio.run(_serve(sys.argv[1], sys.argv[2], _bodies))
