"""A live session of the env server: its records and the routes that act on it. No JAX.

`ServerSession` is what the server keeps of a live session, `Tombstone` what it remembers of
an ended one. `SessionRoutes` holds /observation, /end, /pause and /resume: each runs under the
session's lock and marks it busy (see `server.py`), and an adapter's reward and info are made
wire-safe here before they are sent. A mixin so `server.py` stays about the server's lifecycle,
its middleware and /start; it reads the server's state (`cfg`, `_latency`, `_sessions`,
`_tombs`, `metrics`) and calls its helpers (`_body`, `_live`, `_check_request_images`, `_call`,
`_observation`, `_adapter_failed`, `_gauges`, `_tomb`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import time
from collections.abc import Mapping
from typing import Any

from aiohttp import web

from tiderl.envs.adapters.base import Adapter
from tiderl.envs.protocol import ProtocolError, SessionRequest, StepRequest


@dataclasses.dataclass
class ServerSession:
    """A live session: its adapter, its lock and busy count, its idle and paused clocks, and
    the last /observation reply (replayed to a retry with the same request id)."""

    id: str
    task_id: str
    adapter: Adapter
    lock: asyncio.Lock
    last_active: float
    paused: bool = False
    paused_at: float = 0.0
    busy: int = 0
    turn: int = 0
    done: bool = False
    last_request_id: str | None = None
    last_reply: tuple[int, dict[str, Any]] | None = None


@dataclasses.dataclass(slots=True)
class Tombstone:
    """An ended session: why it ended (a late request's 410) and its /end reply, if any."""

    why: str
    end_request_id: str | None = None
    end_reply: tuple[int, bytes] | None = None
    """The /end reply as sent (JSON bytes: thousands of tombstones stay small)."""


class SessionRoutes:
    """/observation, /end, /pause and /resume of `EnvServer` (see the module docstring)."""

    cfg: Any
    _latency: Any
    _sessions: dict[str, ServerSession]
    _tombs: Any
    metrics: Any

    async def _step(self, request: web.Request) -> web.Response:
        req = StepRequest.parse(await self._body(request),
                                max_action_chars=self.cfg.action_chars, images=self.cfg.images)
        s = self._live(req.session)
        self._check_request_images(req.images, "/observation")
        s.busy += 1
        try:
            async with s.lock:
                if req.request_id is not None and req.request_id == s.last_request_id:
                    status, body = s.last_reply  # type: ignore[misc]  # set with the id
                    return json_reply(body, status)
                if req.session not in self._sessions:
                    return json_reply({"error": f"session {s.id!r} ended while this request "
                                                "waited"}, 410)
                if s.paused:
                    raise ProtocolError(409, f"session {s.id!r} is paused; POST /resume "
                                             "before /observation")
                if s.done:
                    raise ProtocolError(409, f"session {s.id!r}'s episode is done; POST /end "
                                             "to collect the reward")
                t0 = time.perf_counter()
                delay = self._latency.sample(s.task_id, s.turn + 1)
                if delay:
                    await asyncio.sleep(delay)
                try:
                    step = await self._call(s.adapter, s.adapter.step, req.action,
                                            **({"images": req.images} if req.images else {}))
                    observation = self._observation(step.observation,
                                                    getattr(step, "images", ()),
                                                    "step's observation")
                except Exception as e:  # noqa: BLE001 - env failure: 500, session closed
                    return await self._adapter_failed(s, "step", e)
                s.turn += 1
                done = bool(step.done) or s.turn >= self.cfg.max_turns
                s.done = done
                reward, bad = _reward(step.reward, optional=True)
                body = {**observation, "done": done, "reward": reward, "turn": s.turn}
                if bad:
                    body["reward_error"] = bad
                if done and not step.done:
                    body["truncated"] = "turn_limit"
                s.last_request_id, s.last_reply = req.request_id, (200, body)
                self.metrics.step_s.observe(time.perf_counter() - t0)
                return json_reply(body)
        finally:
            s.busy -= 1
            s.last_active = asyncio.get_running_loop().time()

    async def _end(self, request: web.Request) -> web.Response:
        req = SessionRequest.parse(await self._body(request))
        tomb = self._tombs.get(req.session)
        if tomb is not None and req.request_id is not None and req.request_id == (
                tomb.end_request_id):
            status, raw = tomb.end_reply  # type: ignore[misc]  # set with the id
            return web.Response(body=raw, status=status, content_type="application/json")
        s = self._live(req.session)
        s.busy += 1
        try:
            async with s.lock:
                if req.session not in self._sessions:
                    return await self._end(request)  # ended while we waited: replay or 410
                self._sessions.pop(s.id)
                self._gauges()
                try:
                    value, info = await self._call(s.adapter, s.adapter.close)
                    reward, bad = _reward(value, optional=False)
                    status, body = 200, {"reward": reward, "info": _jsonable(info),
                                         "turns": s.turn}
                    if bad:
                        body["reward_error"] = bad
                    why = "ended by /end"
                except Exception as e:  # noqa: BLE001 - env failure: 500, session closed
                    status, body = 500, {"error": f"environment failed in close: "
                                                  f"{type(e).__name__}: {e}; session "
                                                  f"{s.id!r} closed"}
                    why = f"adapter error in close: {type(e).__name__}"
                self._tomb(s.id, Tombstone(why, req.request_id,
                                           (status, json.dumps(body).encode())))
                self.metrics.ended.labels(why.split(" ")[0]).inc()
                return json_reply(body, status)
        finally:
            s.busy -= 1

    async def _pause(self, request: web.Request) -> web.Response:
        return await self._park(request, paused=True)

    async def _resume(self, request: web.Request) -> web.Response:
        return await self._park(request, paused=False)

    async def _park(self, request: web.Request, *, paused: bool) -> web.Response:
        """/pause or /resume: under the session's lock and marked busy, like /observation, so
        the adapter's pause never runs beside its step and the reaper never closes it midway."""
        req = SessionRequest.parse(await self._body(request))
        s = self._live(req.session)
        where = "pause" if paused else "resume"
        s.busy += 1
        try:
            async with s.lock:
                if req.session not in self._sessions:
                    return json_reply({"error": f"session {s.id!r} ended while this request "
                                                "waited"}, 410)
                if s.paused != paused:
                    try:
                        await self._call(s.adapter, s.adapter.pause if paused
                                         else s.adapter.resume)
                    except Exception as e:  # noqa: BLE001
                        return await self._adapter_failed(s, where, e)
                    s.paused = paused
                    s.paused_at = asyncio.get_running_loop().time()  # the paused clock starts
                    self._gauges()
                return json_reply({"session": s.id, "paused": paused})
        finally:
            s.busy -= 1
            s.last_active = asyncio.get_running_loop().time()


def json_reply(body: dict[str, Any], status: int = 200,
               headers: Mapping[str, str] | None = None) -> web.Response:
    return web.json_response(body, status=status, headers=headers)


def _reward(value: Any, *, optional: bool) -> tuple[float | None, str]:
    """An adapter's reward as the reply carries it: (a finite float, ''), or (None, why not)
    for NaN, inf, a non-number, or None where a reward is due (/end). The JSON stays standard
    (no NaN literal); the client ends such a task bad_reward."""
    if value is None:
        return None, "" if optional else "the adapter returned no reward (None)"
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        number = float(value)
    except (TypeError, ValueError):
        return None, f"the adapter returned reward {value!r} ({type(value).__name__}), not a number"
    if not math.isfinite(number):
        return None, f"the adapter returned reward {number}, not a finite number"
    return number, ""


def _jsonable(value: Any) -> Any:
    """Adapter info made JSON-safe (numpy scalars, tuples, sets) without failing the reply."""
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return json.loads(json.dumps(value, default=_fallback))


def _fallback(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, (set, frozenset, tuple)):
        return list(value)
    return repr(value)
