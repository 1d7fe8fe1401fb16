"""A reward-model server on localhost for the secret-handling tests: it lists the tiny model and scores each sequence
by its length times `scale`, only for requests whose Authorization header is `expected` (HTTP 401 otherwise), and
records every request's header."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from conftest import TINY_MODEL


class AuthServer:
    """Serves on ``127.0.0.1:port`` until `close`; `seen` holds each request's Authorization header."""

    def __init__(self, expected: str, scale: float = 1.0):
        self.expected, self.seen = expected, []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._answer({"object": "list", "data": [{"id": str(TINY_MODEL), "object": "model"}]})

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                self._answer({"data": [{"index": i, "probs": [len(ids) * scale]} for i, ids in enumerate(body["input"])]})

            def _answer(self, payload):
                server.seen.append(self.headers.get("Authorization"))
                ok = self.headers.get("Authorization") == server.expected
                data = json.dumps(payload if ok else {"error": {"message": "unauthorised"}}).encode()
                self.send_response(200 if ok else 401)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    @property
    def authorised(self) -> int:
        """Requests that carried the expected header."""
        return sum(header == self.expected for header in self.seen)

    @property
    def refused(self) -> int:
        """Requests that did not."""
        return len(self.seen) - self.authorised

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()
