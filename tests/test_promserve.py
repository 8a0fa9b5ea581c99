"""The Prometheus endpoint on a real socket: a generated token goes to a 0600 file in the run
folder and never into the log, and a client that connects and stalls does not hold up a
scrape (one thread per connection)."""

from __future__ import annotations

import logging
import os
import socket
import stat
import urllib.error
import urllib.request

from prometheus_client import CollectorRegistry, Gauge

from tiderl.control.metrics import MetricsSink
from tiderl.control.promserve import MetricsServer


def _get(url: str, token: str = "") -> int:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token
                                 else {})
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            r.read()
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def test_a_generated_token_is_written_to_the_run_folder_and_not_logged(
        tmp_path, caplog, capfd):
    caplog.set_level(logging.DEBUG)
    sink = MetricsSink(tmp_path, console=False, prometheus_port=0, prometheus_host="0.0.0.0")
    try:
        token = sink._server.token
        out, err = capfd.readouterr()
        assert len(token) >= 20 and token not in caplog.text and token not in out + err
        path = tmp_path / "prometheus_token"
        assert path.is_file()
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().strip() == token
        url = f"http://127.0.0.1:{sink.port}/metrics"
        assert _get(url) == 401 and _get(url, "wrong") == 401 and _get(url, token) == 200
        # The log says where the token is.
        (warning,) = [r for r in caplog.records if r.name == "tiderl.control.promserve"
                      and r.levelno == logging.WARNING]
        assert str(path) in warning.getMessage() and str(sink.port) in warning.getMessage()
    finally:
        sink.close()


def test_a_token_file_left_readable_is_made_private_again(tmp_path, caplog):
    path = tmp_path / "prometheus_token"
    path.write_text("old\n")
    os.chmod(path, 0o644)
    server = MetricsServer(CollectorRegistry(), "0.0.0.0", 0, run_dir=tmp_path)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().strip() == server.token != "old"
        assert server.token not in caplog.text
    finally:
        server.close()


def test_a_stalled_client_does_not_block_a_scrape():
    reg = CollectorRegistry()
    Gauge("tiderl_x", "x", registry=reg).set(1)
    server = MetricsServer(reg, "127.0.0.1", 0)
    stalled = []
    try:
        # One client that connects and says nothing, one that sends half a request; both stay.
        for partial in (b"", b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n"):
            s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
            s.sendall(partial)
            stalled.append(s)
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/metrics",
                                    timeout=10) as r:
            assert r.status == 200 and b"tiderl_x 1.0" in r.read()
    finally:
        for s in stalled:
            s.close()
        server.close()
