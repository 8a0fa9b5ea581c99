"""The Prometheus endpoint: bind address configurable, a bearer token whenever it is not on
loopback. No JAX.

prometheus_client's own `start_http_server` has no authentication, so its WSGI app is served
here behind a token check. Off loopback with no `controller.prometheus_token`, a token is
generated and logged once (configure it as the scraper's `authorization: credentials`).
"""

from __future__ import annotations

import hmac
import logging
import secrets
import threading
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from tiderl.configlib import LOOPBACK

log = logging.getLogger(__name__)



class _Quiet(WSGIRequestHandler):
    def log_message(self, *args: Any) -> None:  # scrapes are not news
        pass


class MetricsServer:
    """A running endpoint: `port` (resolved when 0 was asked), `token` ('' for none)."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int, token: str = ""):
        if not token and host not in LOOPBACK:
            token = secrets.token_urlsafe(24)
            log.warning("Prometheus metrics on %s:%d need 'Authorization: Bearer %s' (no "
                        "controller.prometheus_token was set and the address is not loopback)",
                        host, port, token)
        self.token = token
        app = make_wsgi_app(registry)
        want = f"Bearer {token}".encode()

        def guarded(environ: dict, start_response: Any) -> Any:
            got = environ.get("HTTP_AUTHORIZATION", "").encode()
            if token and not hmac.compare_digest(got, want):
                start_response("401 Unauthorized", [("Content-Type", "text/plain"),
                                                    ("WWW-Authenticate", "Bearer")])
                return [b"missing or wrong bearer token (controller.prometheus_token)\n"]
            return app(environ, start_response)

        self.httpd: WSGIServer = make_server(host, port, guarded, handler_class=_Quiet)
        self.port = self.httpd.server_port
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="tiderl-prometheus")
        self._thread.start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
