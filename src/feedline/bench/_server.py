"""A slow object store for the benchmarks: an HTTP/1.1 server that waits before each reply.

Runs in its own process (``python -m feedline.bench._server DELAY FILE...``), so that serving
does not compete for the benchmark's GIL, and on asyncio with keep-alive connections, so that
its own cost per request stays small next to the delay it adds, as a remote store's would.
``GET /<i>`` returns file ``i % len(files)``; it prints its port on stdout when ready.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
from pathlib import Path

__all__ = ["ServerProcess"]


async def _serve(delay: float, bodies: list[bytes]) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                request = await reader.readuntil(b"\r\n\r\n")
                target = request.split(b" ", 2)[1]
                await asyncio.sleep(delay)
                try:
                    body = bodies[int(target.strip(b"/")) % len(bodies)]
                    head = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body)
                except ValueError:
                    body, head = b"", b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n"
                writer.write(head + body)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0, backlog=1024)
    print(server.sockets[0].getsockname()[1], flush=True)
    async with server:
        await server.serve_forever()


class ServerProcess:
    """Start the server in a child process; ``url`` is where it listens. Close it when done."""

    def __init__(self, files: list[Path], delay: float) -> None:
        self._process = subprocess.Popen(
            [sys.executable, "-m", "feedline.bench._server", str(delay), *map(str, files)],
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
    _bodies = [Path(p).read_bytes() for p in sys.argv[2:]] or [b"x" * 1024]
    asyncio.run(_serve(float(sys.argv[1]), _bodies))
