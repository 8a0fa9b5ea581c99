"""Hypothesis fuzz of the env server: random requests never break it or other sessions."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tiderl.envs.adapters.default import GuessNumber
from tiderl.envs.config import EnvConfig
from tiderl.envs.server import EnvServer

PATHS = ["/start", "/observation", "/end", "/pause", "/resume", "/health", "/metrics", "/x", "/"]
FIELDS = ["task", "session", "action", "request_id", "seed"]
json_leaf = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(allow_nan=False),
                      st.text(max_size=40))
json_value = st.recursive(json_leaf, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12)
body = st.one_of(
    st.binary(max_size=200),
    json_value.map(lambda v: json.dumps(v).encode()),
    st.dictionaries(st.sampled_from(FIELDS), json_value, max_size=4).map(
        lambda d: json.dumps(d).encode()),
)
request = st.tuples(st.sampled_from(["GET", "POST", "PUT"]), st.sampled_from(PATHS), body)


class ThreadServer:
    """A real EnvServer on 127.0.0.1:0, run on its own event loop in a thread."""

    def __init__(self, cfg: EnvConfig):
        self.loop = asyncio.new_event_loop()
        self.server = EnvServer(GuessNumber, cfg)
        ready = threading.Event()
        self._stop: asyncio.Event | None = None

        async def main():
            self._stop = asyncio.Event()
            async with self.server.serve() as url:
                self.url = url
                ready.set()
                await self._stop.wait()

        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(main(),),
                                       daemon=True)
        self.thread.start()
        assert ready.wait(10)
        self.host, self.port = self.url.removeprefix("http://").split(":")

    def request(self, method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, int(self.port), timeout=10)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()

    def post(self, path: str, payload: dict) -> dict:
        status, raw = self.request("POST", path, json.dumps(payload).encode())
        assert status == 200, raw
        return json.loads(raw)

    def close(self):
        self.loop.call_soon_threadsafe(self._stop.set)
        self.thread.join(10)


@pytest.fixture(scope="module")
def fuzz_server():
    srv = ThreadServer(EnvConfig(max_request_bytes=512))
    # Well-formed sessions that live through the whole fuzz: target 5, one step taken each.
    sessions = [srv.post("/start", {"task": {"task_id": f"w{i}", "target": 5}})["session"]
                for i in range(4)]
    for s in sessions:
        assert srv.post("/observation", {"session": s, "action": "3"})["observation"] == "higher"
    yield srv, sessions
    srv.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow,
                                                                  HealthCheck.function_scoped_fixture])
@given(requests=st.lists(request, min_size=1, max_size=8))
def test_random_requests_get_answers_and_never_break_the_server(fuzz_server, requests):
    srv, _ = fuzz_server
    for method, path, payload in requests:
        status, raw = srv.request(method, path, payload)
        assert status < 500, (method, path, payload, raw)
        if path != "/metrics" and status != 200:
            assert "error" in json.loads(raw), raw  # every refusal says why, as JSON


def test_after_the_fuzz_the_server_is_healthy_and_sessions_intact(fuzz_server):
    srv, sessions = fuzz_server
    status, raw = srv.request("GET", "/health")
    assert status == 200 and json.loads(raw)["status"] == "ok"
    for s in sessions:
        r = srv.post("/observation", {"session": s, "action": "5"})
        assert (r["observation"], r["done"], r["turn"]) == ("correct", True, 2)
        assert srv.post("/end", {"session": s})["reward"] == 1.0
