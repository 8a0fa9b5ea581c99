"""Env server + client over real aiohttp on 127.0.0.1: sessions, pause/resume, bad input."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses

import aiohttp
import pytest

from tiderl.envs.adapters.base import Adapter, Step
from tiderl.envs.adapters.default import GuessNumber, target_of
from tiderl.envs.client import EnvClient
from tiderl.envs.config import EnvConfig
from tiderl.envs.protocol import EndReason
from tiderl.envs.server import EnvServer

pytestmark = pytest.mark.asyncio


@contextlib.asynccontextmanager
async def serving(adapter=GuessNumber, **cfg_kw):
    cfg = EnvConfig(**{"retries": 1, "backoff_s": 0.01, **cfg_kw})
    server = EnvServer(adapter, cfg)
    async with server.serve() as url, EnvClient(url, cfg) as env:
        yield server, url, env


async def binary_search(env: EnvClient, task: dict) -> tuple[float, int]:
    """Plays one default-task episode by bisection; returns (reward, turns)."""
    s = await env.start(task)
    assert s.ok, s.error
    lo, hi, turns = 1, 8, 0
    while True:
        guess = (lo + hi) // 2
        r = await env.step(s.session, str(guess))
        assert r.ok, r.error
        turns = r.turn
        if r.done:
            break
        lo, hi = (guess + 1, hi) if r.observation == "higher" else (lo, guess - 1)
    e = await env.end(s.session)
    assert e.ok, e.error
    return e.reward, turns


async def test_256_concurrent_sessions_complete_with_right_rewards():
    async with serving(concurrency=256) as (server, _, env):
        tasks = [{"task_id": f"t{i}", "group_id": i // 8, "seed": i} for i in range(256)]
        results = await asyncio.gather(*(binary_search(env, t) for t in tasks))
        # Bisection of 1..8 with 3 guesses finds 1..7 (guesses 4, 2/6, 1/3/5/7) and misses 8.
        expected = [0.0 if target_of(t["seed"], 8) == 8 else 1.0 for t in tasks]
        assert [r for r, _ in results] == expected
        assert 0 < sum(expected) < 256
        assert server.live_sessions == 0
        health = await env.health()
        assert health.ok and health.body["sessions"] == 0
        async with aiohttp.ClientSession() as http:
            async with http.get(env.url + "/metrics") as resp:
                text = await resp.text()
        assert "tiderl_env_sessions_started_total 256.0" in text


async def test_paused_session_outlives_idle_timeout_and_resumes():
    async with serving(idle_timeout_s=0.2) as (server, _, env):
        parked = await env.start({"task_id": "parked", "target": 8})
        idle = await env.start({"task_id": "idle", "target": 8})
        assert (await env.step(parked.session, "4")).observation == "higher"
        assert (await env.pause(parked.session)).body == {"session": parked.session,
                                                          "paused": True}
        blocked = await env.step(parked.session, "6")  # paused sessions take no actions
        assert blocked.reason == EndReason.env_error and "paused" in blocked.error
        await asyncio.sleep(1.0)  # > 4 idle timeouts
        gone = await env.step(idle.session, "4")
        assert gone.reason == EndReason.env_error and "idle" in gone.error
        assert (await env.resume(parked.session)).ok
        r = await env.step(parked.session, "6")  # continues where it stopped: turn 2
        assert (r.observation, r.turn, r.done) == ("higher", 2, False)
        r = await env.step(parked.session, "8")
        assert (r.observation, r.done, r.reward) == ("correct", True, 1.0)
        assert (await env.end(parked.session)).reward == 1.0


async def test_step_retry_with_same_request_id_is_applied_once():
    async with serving() as (_, url, env):
        s = await env.start({"task_id": "t", "target": 3})
        async with aiohttp.ClientSession() as http:
            body = {"session": s.session, "action": "5", "request_id": "r1"}
            replies = []
            for _ in range(2):
                async with http.post(url + "/observation", json=body) as resp:
                    replies.append(await resp.json())
        assert replies[0] == replies[1] == {"observation": "lower", "done": False,
                                            "reward": 0.0, "turn": 1}
        assert (await env.step(s.session, "3")).turn == 2


class Boom(Adapter):
    """Raises on the action 'boom'."""

    def reset(self, task):
        return "ready"

    def step(self, action):
        if action == "boom":
            raise ValueError("kaboom")
        return Step("ok", False, 0.0)

    def close(self):
        return 0.0, {}


async def _post(http, url, path, *, data=None, json=None, headers=None):
    async with http.post(url + path, data=data, json=json, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_bad_input_gets_4xx_json_naming_the_problem():
    async with serving(Boom, max_action_chars=16, max_request_bytes=200_000) as (server, url, env):
        s = await env.start({"task_id": "t"})
        async with aiohttp.ClientSession() as http:
            status, body = await _post(http, url, "/observation", data=b"{not json")
            assert status == 400 and "malformed JSON" in body["error"]
            status, body = await _post(http, url, "/start", data=b"[" * 100_000)
            assert status == 400 and "nested too deeply" in body["error"]
            status, body = await _post(http, url, "/observation", json=[1, 2])
            assert status == 400 and "JSON object" in body["error"]
            status, body = await _post(http, url, "/observation",
                                       json={"session": s.session, "action": 7})
            assert status == 422 and "'action'" in body["error"]
            status, body = await _post(http, url, "/start", json={"task": "x"})
            assert status == 422 and "'task'" in body["error"]
            status, body = await _post(http, url, "/observation", json={"action": "a"})
            assert status == 400 and "missing field 'session'" in body["error"]
            status, body = await _post(http, url, "/observation",
                                       json={"session": "nope", "action": "a"})
            assert status == 404 and "unknown session 'nope'" in body["error"]
            status, body = await _post(http, url, "/observation",
                                       json={"session": s.session, "action": "a" * 17})
            assert status == 413 and "max_action_chars" in body["error"]
            status, body = await _post(http, url, "/observation",
                                       json={"session": s.session, "action": "a" * 300_000})
            assert status == 413 and "max_request_bytes" in body["error"]
            async with http.get(url + "/start") as resp:
                assert resp.status == 405 and "not allowed" in (await resp.json())["error"]
            ended = await env.start({"task_id": "u"})
            assert (await env.end(ended.session)).ok
            for path in ("/observation", "/end", "/pause"):
                status, body = await _post(http, url, path,
                                           json={"session": ended.session, "action": "a"})
                assert status == 410 and "has ended" in body["error"], path
        # An adapter exception: 500 with the message, that session closed, server serving.
        r = await env.step(s.session, "boom")
        assert r.reason == EndReason.env_error and "HTTP 500" in r.error
        assert "ValueError: kaboom" in r.error and "closed" in r.error
        assert "has ended" in (await env.step(s.session, "ok")).error
        other = await env.start({"task_id": "v"})
        assert (await env.step(other.session, "ok")).observation == "ok"
        assert (await env.health()).body["sessions"] == 1


async def test_bearer_token_guards_every_route():
    async with serving(token="s3cret") as (_, url, env):
        assert (await env.health()).ok  # the client sends its configured token
        async with aiohttp.ClientSession() as http:
            for method, path in [("GET", "/health"), ("GET", "/metrics"), ("POST", "/start"),
                                 ("POST", "/observation"), ("POST", "/end"), ("POST", "/pause"),
                                 ("POST", "/resume")]:
                async with http.request(method, url + path, json={"task": {}}) as resp:
                    assert resp.status == 401, path
                    assert "Authorization" in (await resp.json())["error"]
                async with http.request(method, url + path, json={"task": {}},
                                        headers={"Authorization": "Bearer wrong"}) as resp:
                    assert resp.status == 401, path
                    assert "wrong bearer token" in (await resp.json())["error"]


async def test_session_cap_answers_429_and_client_reports_it():
    async with serving(max_sessions=2, retries=1, backoff_max_s=0.05) as (_, _, env):
        a, b = await env.start({"seed": 1}), await env.start({"seed": 2})
        assert a.ok and b.ok
        c = await env.start({"seed": 3})
        assert c.reason == EndReason.env_error and "429" in c.error and "max_sessions" in c.error
        await env.end(a.session)
        assert (await env.start({"seed": 3})).ok


async def test_bad_task_is_422_and_bad_suite_option_fails_at_startup():
    async with serving() as (_, _, env):
        r = await env.start({"seed": 1, "n": "many"})
        assert r.reason == EndReason.env_error and "422" in r.error and "'n'" in r.error
    with pytest.raises(ValueError, match="env.options"):
        EnvServer(GuessNumber, dataclasses.replace(EnvConfig(), options=("n=50",)))


async def test_injected_latency_keeps_results_and_shows_in_metrics():
    from tiderl.envs.config import LatencyConfig

    latency = LatencyConfig(dist="pareto", scale_s=0.005, alpha=2.0, cap_s=0.05)
    async with serving(latency=latency) as (server, _, env):
        tasks = [{"task_id": f"t{i}", "seed": i} for i in range(16)]
        results = await asyncio.gather(*(binary_search(env, t) for t in tasks))
        assert [r for r, _ in results] == [0.0 if target_of(i, 8) == 8 else 1.0
                                           for i in range(16)]
        # Each step waited at least its injected delay (a lower bound: sleep never returns
        # early by more than the loop's clock resolution, 1 ms here).
        from tiderl.envs.latency import LatencyModel

        model = LatencyModel(latency)
        injected = sum(model.sample(t["task_id"], turn) for t, (_, turns) in zip(tasks, results, strict=True)
                       for turn in range(1, turns + 1))
        total = server.metrics.step_s.collect()[0].samples
        step_sum = next(s.value for s in total if s.name.endswith("_sum"))
        assert step_sum >= injected - 0.001 * len(tasks) * 3


async def test_endpoint_serves_in_process_when_no_url_is_configured():
    from tiderl.envs.server import endpoint

    async with endpoint(EnvConfig()) as url:
        async with EnvClient(url) as env:
            assert (await env.health()).body["suite"] == "default"
    async with endpoint(EnvConfig(url="http://127.0.0.1:9")) as url:
        assert url == "http://127.0.0.1:9"
