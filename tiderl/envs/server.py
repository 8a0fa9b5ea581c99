"""aiohttp env server hosting any adapter behind the env protocol (see protocol.py). No JAX.

Sessions live in memory. Each session's requests (/observation, /end, /pause, /resume) are
serialised by its own lock and mark it busy; the adapter of a session is never called
concurrently, and the reaper never closes a busy session. The reaper closes sessions idle for
`idle_timeout_s`; the idle clock stops while a session is paused (the point of /pause: CTB may
park a task for long). Those four routes, and the session records, are in `sessions.py` (the
SessionRoutes mixin EnvServer inherits); this module holds the server's lifecycle, its
middleware and helpers, /start, /health and /metrics.

A client's /start options are checked against the adapter's `client_options`; paths never
come from a client: adapters keep their files (TextWorld's compiled games) in the server's own
`state_dir`, a private folder made at startup unless the server is given one.

Images an adapter returns (reset's Observation, a Step's images) are checked against env.images
before they are sent: an adapter breaking a limit is the environment's failure (500, the
session closed). Images in a request are checked before the session is touched (413/422).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import hmac
import json
import os
import shutil
import tempfile
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import prometheus_client as prom
from aiohttp import web

from tiderl.configlib import ConfigError
from tiderl.envs.adapters.base import Adapter, Observation, TaskError
from tiderl.envs.config import EnvConfig
from tiderl.envs.images import Image, check_all, to_wire
from tiderl.envs.latency import LatencyModel
from tiderl.envs.protocol import ProtocolError, StartRequest
from tiderl.envs.sessions import ServerSession, SessionRoutes, Tombstone, json_reply

_TOMBSTONES = 16384  # ended sessions remembered (late requests get 410, a retried /end its reply)
_START_REPLIES = 8192  # /start replies kept for idempotent retries
_START_REPLY_IMAGE_BYTES = 64 << 20  # ... and at most this many bytes of their images


class _Metrics:
    """Prometheus metrics on a registry of this server's own (several servers per process)."""

    def __init__(self) -> None:
        self.registry = prom.CollectorRegistry()
        r = self.registry
        self.requests = prom.Counter("tiderl_env_requests", "HTTP requests",
                                     ["route", "status"], registry=r)
        self.started = prom.Counter("tiderl_env_sessions_started", "sessions started",
                                    registry=r)
        self.ended = prom.Counter("tiderl_env_sessions_ended", "sessions ended", ["why"],
                                  registry=r)
        self.live = prom.Gauge("tiderl_env_sessions_live", "live sessions", registry=r)
        self.paused = prom.Gauge("tiderl_env_sessions_paused", "paused sessions", registry=r)
        self.step_s = prom.Histogram("tiderl_env_step_seconds", "server time per /observation",
                                     registry=r)


class EnvServer(SessionRoutes):
    """Hosts `adapter_cls` sessions; `app` is the aiohttp application, `serve()` runs it."""

    def __init__(self, adapter_cls: type[Adapter] | Callable[..., Adapter], cfg: EnvConfig,
                 *, options: Mapping[str, str] | None = None, suite: str | None = None,
                 workers: int = 8, state_dir: str | None = None):
        self.cfg = cfg
        self.suite = suite or cfg.suite_name
        self._make = adapter_cls
        self._options = dict(cfg.option_dict() if options is None else options)
        self.client_options: frozenset[str] = frozenset(
            getattr(adapter_cls, "client_options", frozenset()))
        """Options a /start may set (the adapter's allow-list)."""
        self.accepts_images = bool(getattr(adapter_cls, "accepts_images", False))
        self._own_state_dir = state_dir is None
        self.state_dir = tempfile.mkdtemp(prefix="tiderl-env-") if state_dir is None else (
            os.path.abspath(state_dir))
        """The adapters' folder (caches): private to this server (mode 0700) unless given, and
        then removed at shutdown."""
        os.makedirs(self.state_dir, mode=0o700, exist_ok=True)
        self._drop_state_dir = weakref.finalize(
            self, shutil.rmtree, self.state_dir, ignore_errors=True) if self._own_state_dir \
            else (lambda: None)
        """Removes a private folder once: at shutdown, or when a server that never served (or
        failed to start) is collected, or at interpreter exit."""
        try:  # bad suite options fail here, at startup, not at the first /start
            self._new_adapter(self._options)
        except ValueError as e:  # TaskError, or an adapter's own check of an option's value
            self._drop_state_dir()
            opts = [f"{k}={v}" for k, v in self._options.items()]
            raise ConfigError(f"config key 'env.options'={opts}: {e}; fix that option "
                              "(env.options, or --option of python -m tiderl.envs serve)") from e
        self._latency = LatencyModel(cfg.latency)
        self._sessions: dict[str, ServerSession] = {}
        self._tombs: collections.OrderedDict[str, Tombstone] = collections.OrderedDict()
        self._start_replies: collections.OrderedDict[str, tuple[dict[str, Any], int]] = (
            collections.OrderedDict())
        self._start_reply_bytes = 0
        self._start_inflight: dict[str, asyncio.Future] = {}
        self._starting = 0
        cap = getattr(adapter_cls, "max_workers", None)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            min(workers, cap) if cap else workers, "tiderl-env")
        self._t0 = time.monotonic()
        self.metrics = _Metrics()
        self.app = web.Application(client_max_size=cfg.max_request_bytes,
                                   middlewares=[self._errors, self._auth])
        self.app.add_routes([
            web.post("/start", self._start), web.post("/observation", self._step),
            web.post("/end", self._end), web.post("/pause", self._pause),
            web.post("/resume", self._resume), web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])
        self.app.cleanup_ctx.append(self._reaper_ctx)

    # ---------------------------------------------------------------- lifecycle

    @contextlib.asynccontextmanager
    async def serve(self, host: str | None = None, port: int | None = None
                    ) -> AsyncIterator[str]:
        """Runs the server; yields its base URL (port 0 resolved to the bound port)."""
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host or self.cfg.host,
                           self.cfg.port if port is None else port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]  # aiohttp exposes no getter
        bound_host, bound_port = sock.getsockname()[:2]
        try:
            yield f"http://{bound_host}:{bound_port}"
        finally:
            await runner.cleanup()

    async def _reaper_ctx(self, app: web.Application) -> AsyncIterator[None]:
        task = asyncio.create_task(self._reaper())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for s in list(self._sessions.values()):
            await self._close(s, "server shutdown")
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._drop_state_dir()

    async def _reaper(self) -> None:
        period = min(self.cfg.idle_timeout_s, self.cfg.max_pause_s) / 4
        period = min(max(period, 0.01), 1.0)
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(period)
            now = loop.time()
            for s in list(self._sessions.values()):
                if s.busy:
                    continue
                if s.paused and now - s.paused_at > self.cfg.max_pause_s:
                    await self._close(s, f"reaped after {self.cfg.max_pause_s:g}s paused "
                                         "(env.max_pause_s)")
                elif not s.paused and now - s.last_active > self.cfg.idle_timeout_s:
                    await self._close(s, f"reaped after {self.cfg.idle_timeout_s:g}s idle "
                                         "(env.idle_timeout_s)")

    # ---------------------------------------------------------------- middleware

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        route = request.path if request.path in _ROUTES else "other"
        try:
            response = await handler(request)
        except ProtocolError as e:
            headers = {"Retry-After": "1"} if e.status == 429 else None
            response = json_reply({"error": e.message}, e.status, headers=headers)
        except web.HTTPException as e:
            if e.status == 413:
                msg = (f"request body exceeds the limit of {self.cfg.max_request_bytes} bytes; "
                       "send less or raise env.max_request_bytes on the server")
            elif e.status == 405:
                msg = f"method {request.method} not allowed on {request.path}"
            elif e.status == 404:
                msg = f"no route {request.path}; routes are {', '.join(sorted(_ROUTES))}"
            else:
                msg = e.text or e.reason
            response = json_reply({"error": msg}, e.status, headers=_plain_headers(e))
        self.metrics.requests.labels(route, str(response.status)).inc()
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        token = self.cfg.token
        if token:
            got = request.headers.get("Authorization", "")
            if not got:
                raise ProtocolError(401, "missing 'Authorization: Bearer <token>' header; this "
                                         "server requires env.token")
            scheme, _, value = got.partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    value.strip().encode(), token.encode()):
                raise ProtocolError(401, "wrong bearer token; send the server's env.token")
        return await handler(request)

    # ---------------------------------------------------------------- helpers

    async def _body(self, request: web.Request) -> Any:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ProtocolError(400, f"malformed JSON body ({e}); send a JSON object") from None
        except RecursionError:
            raise ProtocolError(400, "JSON body nested too deeply; send a flat JSON object"
                                ) from None

    def _live(self, session_id: str) -> ServerSession:
        s = self._sessions.get(session_id)
        if s is not None:
            return s
        tomb = self._tombs.get(session_id)
        if tomb is not None:
            raise ProtocolError(410, f"session {session_id!r} has ended ({tomb.why}); start a "
                                     "new one")
        raise ProtocolError(404, f"unknown session {session_id!r}; use the id /start returned")

    def _new_adapter(self, options: Mapping[str, str]) -> Adapter:
        adapter = self._make(options)
        adapter.state_dir = self.state_dir
        return adapter

    def _check_client_options(self, options: Mapping[str, str]) -> None:
        """Refuses (400) a client's option the adapter does not let clients set, unless it only
        repeats the server's own value (a job sends its env.options to its in-process server)."""
        for key, value in options.items():
            if key not in self.client_options and self._options.get(key) != value:
                allowed = ", ".join(sorted(self.client_options)) or "none"
                raise ProtocolError(400, f"option {key!r} may not be set by a client (suite "
                                         f"{self.suite}; clients may set: {allowed}); drop it "
                                         "from env.options, or set it when starting the server")

    def _check_request_images(self, images: tuple[Image, ...], where: str) -> None:
        if images and not self.accepts_images:
            raise ProtocolError(422, f"{where} carries {len(images)} images but suite "
                                     f"{self.suite} takes none (its adapter does not set "
                                     "accepts_images); send text only")

    def _observation(self, text: Any, images: Any, where: str) -> dict[str, Any]:
        """An adapter's observation text and images as reply fields; an ImageError when its
        images break env.images."""
        out: dict[str, Any] = {"observation": str(text)}
        if images:
            out["images"] = to_wire(check_all(list(images), self.cfg.images, where=where))
        return out

    def _keep_start_reply(self, request_id: str, body: dict[str, Any]) -> None:
        size = sum(len(im["data"]) for im in body.get("images", ()))
        self._start_replies[request_id] = (body, size)
        self._start_reply_bytes += size
        while len(self._start_replies) > _START_REPLIES or (
                self._start_reply_bytes > _START_REPLY_IMAGE_BYTES and self._start_replies):
            self._start_reply_bytes -= self._start_replies.popitem(last=False)[1][1]

    async def _call(self, adapter: Adapter, fn: Callable[..., Any], *args: Any,
                    **kwargs: Any) -> Any:
        if adapter.blocking:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, lambda: fn(*args, **kwargs))
        return fn(*args, **kwargs)

    async def _close(self, s: ServerSession, why: str) -> tuple[float, dict[str, Any]] | None:
        """Removes `s` and closes its adapter; returns the adapter's (reward, info) if it can."""
        if self._sessions.pop(s.id, None) is None:
            return None
        self._tomb(s.id, Tombstone(why))
        self.metrics.ended.labels(why.split(" ")[0]).inc()
        self._gauges()
        try:
            return await self._call(s.adapter, s.adapter.close)
        except Exception:  # noqa: BLE001 - the session is gone either way; close must not fail
            return None

    def _tomb(self, session_id: str, tomb: Tombstone) -> None:
        self._tombs[session_id] = tomb
        while len(self._tombs) > _TOMBSTONES:
            self._tombs.popitem(last=False)

    def _gauges(self) -> None:
        self.metrics.live.set(len(self._sessions))
        self.metrics.paused.set(sum(s.paused for s in self._sessions.values()))

    async def _adapter_failed(self, s: ServerSession, where: str, e: Exception) -> web.Response:
        await self._close(s, f"adapter error in {where}: {type(e).__name__}")
        return json_reply({"error": f"environment failed in {where}: {type(e).__name__}: {e}; "
                                    f"session {s.id!r} closed"}, 500)

    # ---------------------------------------------------------------- routes

    async def _start(self, request: web.Request) -> web.Response:
        req = StartRequest.parse(await self._body(request), images=self.cfg.images)
        self._check_client_options(req.options)
        self._check_request_images(req.images, "/start")
        if req.request_id is not None:
            if req.request_id in self._start_replies:
                return json_reply(self._start_replies[req.request_id][0])
            pending = self._start_inflight.get(req.request_id)
            if pending is not None:
                status, body = await asyncio.shield(pending)
                return json_reply(body, status)
        if len(self._sessions) + self._starting >= self.cfg.max_sessions:
            raise ProtocolError(429, f"server holds {self.cfg.max_sessions} live sessions "
                                     "(env.max_sessions); end or wait for some, then retry")
        future: asyncio.Future = asyncio.get_running_loop().create_future()
        if req.request_id is not None:
            self._start_inflight[req.request_id] = future
        self._starting += 1
        try:
            task = {**req.task, "images": req.images} if req.images else req.task
            status, body = await self._do_start(task, req.options)
        except BaseException as e:
            future.set_exception(e)
            future.exception()  # mark retrieved: a waiting retry re-raises it, or nobody does
            raise
        finally:
            self._starting -= 1
            if req.request_id is not None:
                self._start_inflight.pop(req.request_id, None)
        future.set_result((status, body))
        if req.request_id is not None and status == 200:
            self._keep_start_reply(req.request_id, body)
        return json_reply(body, status)

    async def _do_start(self, task: dict[str, Any], options: Mapping[str, str] | None = None
                        ) -> tuple[int, dict[str, Any]]:
        session_id = uuid.uuid4().hex
        task_id = str(task.get("task_id", session_id))
        try:
            adapter = self._new_adapter({**self._options, **(options or {})})
        except TaskError as e:
            return 422, {"error": f"bad suite options: {e}"}
        except ValueError as e:
            if options:  # the job's options: the caller's fault
                return 422, {"error": f"bad suite options {dict(options)}: {e}; fix env.options"}
            return 500, {"error": f"environment failed to start: {type(e).__name__}: {e}"}
        except Exception as e:  # noqa: BLE001 - an env failure is a 500 value, not a crash
            return 500, {"error": f"environment failed to start: {type(e).__name__}: {e}"}
        delay = self._latency.sample(task_id, 0) + max(0.0, float(adapter.start_delay_s))
        if delay:
            await asyncio.sleep(delay)
        try:
            first = await self._call(adapter, adapter.reset, task)
            observation = self._observation(first.text, first.images, "reset's observation") \
                if isinstance(first, Observation) else {"observation": str(first)}
        except TaskError as e:
            with contextlib.suppress(Exception):
                await self._call(adapter, adapter.close)
            return 422, {"error": f"bad task: {e}"}
        except Exception as e:  # noqa: BLE001 - an env failure is a 500 value, not a crash
            with contextlib.suppress(Exception):
                await self._call(adapter, adapter.close)
            return 500, {"error": f"environment failed in reset: {type(e).__name__}: {e}"}
        loop = asyncio.get_running_loop()
        self._sessions[session_id] = ServerSession(session_id, task_id, adapter, asyncio.Lock(),
                                                   loop.time())
        self.metrics.started.inc()
        self._gauges()
        return 200, {"session": session_id, **observation}

    async def _health(self, request: web.Request) -> web.Response:
        return json_reply({"status": "ok", "suite": self.suite, "sessions": len(self._sessions),
                           "paused": sum(s.paused for s in self._sessions.values()),
                           "uptime_s": round(time.monotonic() - self._t0, 3)})

    async def _metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=prom.generate_latest(self.metrics.registry),
                            content_type="text/plain", charset="utf-8")

    @property
    def live_sessions(self) -> int:
        return len(self._sessions)


@contextlib.asynccontextmanager
async def endpoint(cfg: EnvConfig) -> AsyncIterator[str]:
    """The env server URL a job talks to: `cfg.url`, or (when '') one served in-process."""
    if cfg.url:
        yield cfg.url
        return
    from tiderl.envs.suites import adapter_class

    async with EnvServer(adapter_class(cfg.suite_name), cfg).serve() as url:
        yield url


_ROUTES = {"/start", "/observation", "/end", "/pause", "/resume", "/health", "/metrics"}


def _plain_headers(e: web.HTTPException) -> dict[str, str]:
    # Keep Allow (405) and Retry-After; drop Content-Type/Length of the plain-text body.
    return {k: v for k, v in e.headers.items() if k in ("Allow", "Retry-After")}
