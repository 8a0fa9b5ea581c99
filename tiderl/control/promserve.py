"""The Prometheus endpoint: bind address configurable, a bearer token whenever it is not on
loopback. No JAX.

prometheus_client's own `start_http_server` has no authentication, so its WSGI app is served
here behind a token check, one thread per connection (a client that connects and stalls holds
its own thread, not the scrapes; an idle connection is dropped after `_Quiet.timeout`). Off
loopback with no `controller.prometheus_token`, a token is generated and written to
`<run_dir>/prometheus_token` (mode 0600); the log says where the file is, never the token
(configure its contents as the scraper's `authorization: credentials`, or `credentials_file`).
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socketserver
import threading
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from tiderl.configlib import LOOPBACK

log = logging.getLogger(__name__)

TOKEN_FILE = "prometheus_token"


class _Quiet(WSGIRequestHandler):
    timeout = 30.0  # seconds a connection may sit without sending; then it is closed

    def log_message(self, *args: Any) -> None:  # scrapes are not news
        pass


class _ThreadingServer(socketserver.ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a stalled client never holds up shutdown

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that timed out or hung up: nothing to print a traceback for.
        log.debug("Prometheus request from %s failed", client_address, exc_info=True)


def write_token(path: Path, token: str) -> None:
    """Writes `token` to `path`, readable by this user only (0600, whatever was there)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, f"{token}\n".encode())
    finally:
        os.close(fd)


class MetricsServer:
    """A running endpoint: `port` (resolved when 0 was asked), `token` ('' for none) and
    `token_file` (where a generated token was written; None otherwise)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, token: str = "",
                 run_dir: str | Path | None = None):
        generated = not token and host not in LOOPBACK
        if generated:
            token = secrets.token_urlsafe(24)
        self.token = token
        self.token_file: Path | None = None
        app = make_wsgi_app(registry)
        want = f"Bearer {token}".encode()

        def guarded(environ: dict, start_response: Any) -> Any:
            got = environ.get("HTTP_AUTHORIZATION", "").encode()
            if token and not hmac.compare_digest(got, want):
                start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                    ("WWW-Authenticate", "Bearer")])
                return [b"missing or wrong bearer token (controller.prometheus_token)\n"]
            return app(environ, start_response)

        self.httpd: WSGIServer = make_server(host, port, guarded, server_class=_ThreadingServer,
                                             handler_class=_Quiet)
        self.port = self.httpd.server_port
        if generated:
            if run_dir is not None:
                self.token_file = Path(run_dir) / TOKEN_FILE
                try:
                    write_token(self.token_file, token)
                except OSError:
                    self.httpd.server_close()
                    raise
                where = f"the token is in {self.token_file} (mode 0600)"
            else:
                where = "the token is held in this process only (no run folder to write it to)"
            log.warning("Prometheus metrics on %s:%d need 'Authorization: Bearer <token>' (no "
                        "controller.prometheus_token was set and the address is not loopback); "
                        "%s", host, self.port, where)
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="tiderl-prometheus")
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
