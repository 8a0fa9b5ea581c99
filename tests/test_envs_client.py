"""EnvClient against broken servers: bounded retries, then env_error/timeout, never a hang."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import pytest
from aiohttp import web

from tiderl.envs.client import EnvClient
from tiderl.envs.config import EnvConfig
from tiderl.envs.protocol import EndReason

pytestmark = pytest.mark.asyncio

CFG = EnvConfig(retries=2, backoff_s=0.01, backoff_max_s=0.05, connect_timeout_s=0.5,
                request_timeout_s=0.3, call_deadline_s=5.0)
# "Never hangs": a guard that fails the test if a call outlives its deadline by this much
# (generous for a loaded CI box); the assertions themselves count attempts, not seconds.
SLACK_S = 3.0


@contextlib.asynccontextmanager
async def app_serving(app: web.Application):
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def bounded(call, cfg: EnvConfig = CFG):
    """Runs `call`, failing the test (TimeoutError) if it hangs past the client's deadline."""
    return await asyncio.wait_for(call, cfg.call_deadline_s + SLACK_S)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_dead_server_gives_env_error_after_bounded_retries():
    async with EnvClient(f"http://127.0.0.1:{free_port()}", CFG) as env:
        r = await bounded(env.start({"seed": 0}))
        assert r.reason == EndReason.env_error and "/start" in r.error
        assert env.attempts == CFG.retries + 1
        s = await bounded(env.step("abc", "1"))
        assert s.done and s.reason == EndReason.env_error


async def test_503_server_is_retried_then_env_error():
    hits = []

    async def unavailable(request):
        hits.append(await request.json())
        return web.json_response({"error": "overloaded"}, status=503)

    app = web.Application()
    app.router.add_post("/observation", unavailable)
    async with app_serving(app) as url, EnvClient(url, CFG) as env:
        r = await bounded(env.step("s", "1"))
    assert r.reason == EndReason.env_error and "503" in r.error and "overloaded" in r.error
    assert len(hits) == CFG.retries + 1
    # Every retry carries the same idempotency key, so a server applies the step at most once.
    assert len({h["request_id"] for h in hits}) == 1


async def test_silent_server_gives_timeout_within_the_deadline():
    accepted = []

    async def never_answer(reader, writer):
        accepted.append(writer)
        await reader.read(1 << 16)
        await asyncio.sleep(3600)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        async with EnvClient(f"http://127.0.0.1:{port}", CFG) as env:
            r = await bounded(env.end("s"))
            assert r.reason == EndReason.timeout and "no reply" in r.error
            assert env.attempts == CFG.retries + 1
            # A deadline shorter than the retries would need cuts them off: each attempt waits
            # out its 0.3 s request timeout, so a 1 s deadline leaves room for at most 4 of 51.
            env.cfg = EnvConfig(retries=50, backoff_s=0.01, request_timeout_s=0.3,
                                call_deadline_s=1.0)
            before = env.attempts
            r = await bounded(env.start({}), env.cfg)
            assert r.reason == EndReason.timeout
            assert 1 <= env.attempts - before <= 4
    finally:
        for w in accepted:
            w.close()
        server.close()


async def test_429_with_retry_after_is_retried_to_success():
    calls = []

    async def busy_then_ok(request):
        calls.append(1)
        if len(calls) <= 2:
            return web.json_response({"error": "busy"}, status=429, headers={"Retry-After": "0"})
        return web.json_response({"session": "s1", "observation": "hi"})

    app = web.Application()
    app.router.add_post("/start", busy_then_ok)
    async with app_serving(app) as url, EnvClient(url, CFG) as env:
        r = await bounded(env.start({}))
    assert r.ok and (r.session, r.observation) == ("s1", "hi") and len(calls) == 3


async def test_4xx_is_not_retried():
    calls = []

    async def bad(request):
        calls.append(1)
        return web.json_response({"error": "missing field 'session'"}, status=400)

    app = web.Application()
    app.router.add_post("/pause", bad)
    async with app_serving(app) as url, EnvClient(url, CFG) as env:
        r = await env.pause("s")
    assert r.reason == EndReason.env_error and "missing field 'session'" in r.error
    assert len(calls) == 1


async def test_concurrency_is_bounded():
    live, peak = [0], [0]

    async def slow(request):
        live[0] += 1
        peak[0] = max(peak[0], live[0])
        await asyncio.sleep(0.02)
        live[0] -= 1
        return web.json_response({"status": "ok"})

    app = web.Application()
    app.router.add_get("/health", slow)
    cfg = EnvConfig(concurrency=4)
    async with app_serving(app) as url, EnvClient(url, cfg) as env:
        results = await asyncio.gather(*(env.health() for _ in range(40)))
    assert all(r.ok for r in results) and peak[0] <= 4
