"""A threaded HTTP server on loopback for the storage tests, run for the length of a block."""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Callable, Iterator


class _Server(http.server.ThreadingHTTPServer):
    # Room for every connection a test opens at once: beyond socketserver's backlog of 5, a
    # connection's SYN is dropped and the client sends it again a second later.
    request_queue_size = 128


@contextlib.contextmanager
def serving(
    handler: type[http.server.BaseHTTPRequestHandler],
    before_stop: Callable[[], None] = lambda: None,
) -> Iterator[str]:
    """Serve ``handler`` on a free port; yields the base URL. ``before_stop`` unblocks handlers."""
    server = _Server(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        before_stop()
        server.shutdown()
        server.server_close()
        thread.join(10)


class Handler(http.server.BaseHTTPRequestHandler):
    """A request handler that logs nothing and replies in one call."""

    def reply(self, code: int, body: bytes, headers: dict[str, str] | None = None) -> None:
        """Send a whole response; a client that gave up meanwhile is not an error."""
        with contextlib.suppress(OSError):
            self.send_response(code)
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    def log_message(self, format: str, *args: object) -> None:
        """Quiet: the tests assert on what the handlers count instead."""
