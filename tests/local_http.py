"""A real HTTP server on a free local port, in a thread, for tests of HTTP clients (no mocks of the client)."""

from __future__ import annotations

import http.server
import threading


def answer(handler: http.server.BaseHTTPRequestHandler, status: int, body: bytes, content_type: str) -> None:
    """Send ``status`` with ``body`` (``Content-Type`` and ``Content-Length`` set) from a request handler."""
    handler.send_response(status)
    handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


class LocalServer:
    """Serves ``handler`` (a ``BaseHTTPRequestHandler`` subclass) at ``self.url`` while used as a context manager."""

    def __init__(self, handler: type):
        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)
