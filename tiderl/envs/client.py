"""Async client of the env protocol; every failure comes back as a value. No JAX.

One `aiohttp.ClientSession` per client, an explicit timeout on every attempt, a deadline on every
call (retries included), retries with jittered exponential backoff on connection errors,
timeouts, 429, 502, 503 and 504, and a semaphore bounding requests in flight. Each logical call
carries a fresh `request_id`, reused across its retries, so the server applies it at most once.

    async with EnvClient(url, cfg) as env:
        s = await env.start(task)            # StartResult
        r = await env.step(s.session, "4")   # StepResult
        e = await env.end(s.session)         # EndResult

Observations' images come back decoded and checked against env.images (`StartResult.images`,
`StepResult.images`); a reply whose images break a limit or do not decode fails its task
(env_error naming the limit; a /start's session is ended). `start` and `step` send images of
their own (`images=`) to adapters that take them.
"""

from __future__ import annotations

import asyncio
import collections
import math
import random
import uuid
from typing import Any

import aiohttp

from tiderl.envs.config import EnvConfig
from tiderl.envs.images import Image, ImageError, from_wire, to_wire
from tiderl.envs.protocol import EndReason, EndResult, OpResult, StartResult, StepResult

RETRY_STATUS = frozenset({429, 502, 503, 504})


class _Failure:
    """A call that did not get a 200: why (EndReason), what we know, and the HTTP status (0
    when no reply came)."""

    __slots__ = ("reason", "error", "status")

    def __init__(self, reason: EndReason, error: str, status: int = 0):
        self.reason = reason
        self.error = error
        self.status = status


def parse_reward(reply: dict[str, Any], *, required: bool) -> tuple[float | None, str]:
    """(reward, '') from a reply, or (None, why) when its reward is not a finite number (NaN,
    inf, a string, a server's `reward_error`, or — when `required`, as in /end — null or
    missing). A null or missing reward where one is optional is (None, '')."""
    if reply.get("reward_error"):
        return None, f"the environment's reward is unusable: {reply['reward_error']}"
    value = reply.get("reward")
    if value is None:
        if required:
            return None, ("the reply has no reward" if "reward" not in reply
                          else "the reply's reward is null")
        return None, ""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None, f"the reply's reward {value!r} is not a number"
    if not math.isfinite(value):
        return None, f"the reply's reward is {value}, not a finite number"
    return float(value), ""


class EnvClient:
    """Talks to one env server. Use as `async with`; results are values, never exceptions."""

    def __init__(self, url: str, cfg: EnvConfig | None = None, **overrides: Any):
        cfg = cfg or EnvConfig()
        if overrides:
            import dataclasses

            cfg = dataclasses.replace(cfg, **overrides)
        self.cfg = cfg
        self.url = url.rstrip("/")
        self._http: aiohttp.ClientSession | None = None
        self._sem = asyncio.Semaphore(cfg.concurrency)
        self._rng = random.Random()
        self.attempts = 0  # HTTP attempts made, retries included (tests and metrics read it)
        self.retried = 0
        self.latency_s: dict[str, collections.deque[float]] = {
            "start": collections.deque(maxlen=512), "step": collections.deque(maxlen=512)}
        """Seconds of the most recent /start and /observation calls (retries included): what
        a task waits on its env; the live progress line shows their p50/p95."""

    async def __aenter__(self) -> EnvClient:
        await self.open()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def open(self) -> None:
        if self._http is None:
            headers = {"Authorization": f"Bearer {self.cfg.token}"} if self.cfg.token else {}
            connector = aiohttp.TCPConnector(limit=self.cfg.concurrency)
            self._http = aiohttp.ClientSession(headers=headers, connector=connector)

    async def close(self) -> None:
        if self._http is not None:
            await self._http.close()
            self._http = None

    # ------------------------------------------------------------------ the protocol

    async def start(self, task: dict[str, Any], images: tuple[Image, ...] = ()) -> StartResult:
        """Opens a session for `task` (with `images` for an adapter that takes them)."""
        body: dict[str, Any] = {"task": task, "request_id": _rid()}
        if self.cfg.options:  # the job's suite options reach an external server too
            body["options"] = self.cfg.option_dict()
        if images:
            body["images"] = to_wire(images)
        t0 = asyncio.get_running_loop().time()
        out = await self._call("POST", "/start", body)
        self.latency_s["start"].append(asyncio.get_running_loop().time() - t0)
        if isinstance(out, _Failure):
            return StartResult(reason=out.reason, error=out.error)
        if not isinstance(out.get("session"), str):
            return StartResult(reason=EndReason.env_error, error=f"bad /start reply {out!r}")
        try:
            got = from_wire(out.get("images"), self.cfg.images, where="/start reply images")
        except ImageError as e:
            await self.end(out["session"])  # the session exists on the server: end it
            return StartResult(reason=EndReason.env_error, error=e.message)
        return StartResult(session=out["session"], observation=str(out.get("observation", "")),
                           images=got)

    async def step(self, session: str, action: str, images: tuple[Image, ...] = ()
                   ) -> StepResult:
        """Sends one action (with `images` for an adapter that takes them); a failure comes
        back with `done=True` and `reason` set."""
        t0 = asyncio.get_running_loop().time()
        body: dict[str, Any] = {"session": session, "action": action, "request_id": _rid()}
        if images:
            body["images"] = to_wire(images)
        out = await self._call("POST", "/observation", body)
        self.latency_s["step"].append(asyncio.get_running_loop().time() - t0)
        if isinstance(out, _Failure):
            if out.status == 413 and not images:  # over env.max_action_chars (or the body)
                return StepResult(done=True, reason=EndReason.action_too_long, error=out.error)
            return StepResult(done=True, reason=out.reason, error=out.error)
        try:
            got = from_wire(out.get("images"), self.cfg.images, where="/observation reply images")
        except ImageError as e:
            return StepResult(done=True, reason=EndReason.env_error, error=e.message)
        reward, bad = parse_reward(out, required=False)
        if bad:
            return StepResult(done=True, reason=EndReason.bad_reward,
                              error=f"/observation: {bad}")
        turn = out.get("turn", 0)
        return StepResult(observation=str(out.get("observation", "")), images=got,
                          done=bool(out.get("done", False)), reward=reward,
                          turn=turn if isinstance(turn, int) else 0,
                          truncated=str(out.get("truncated", "")))

    async def end(self, session: str) -> EndResult:
        """Closes the session; returns the episode's final reward and info."""
        out = await self._call("POST", "/end", {"session": session, "request_id": _rid()})
        if isinstance(out, _Failure):
            return EndResult(reason=out.reason, error=out.error)
        reward, bad = parse_reward(out, required=True)
        if bad or reward is None:
            return EndResult(reason=EndReason.bad_reward, error=f"/end: {bad}")
        info = out.get("info")
        return EndResult(reward=reward, info=info if isinstance(info, dict) else {})

    async def pause(self, session: str) -> OpResult:
        """Parks the session: the server's idle clock stops until resume."""
        return self._op(await self._call("POST", "/pause", {"session": session}))

    async def resume(self, session: str) -> OpResult:
        """Un-parks the session."""
        return self._op(await self._call("POST", "/resume", {"session": session}))

    async def health(self) -> OpResult:
        return self._op(await self._call("GET", "/health", None))

    @staticmethod
    def _op(out: dict[str, Any] | _Failure) -> OpResult:
        if isinstance(out, _Failure):
            return OpResult(reason=out.reason, error=out.error)
        return OpResult(body=out)

    # ------------------------------------------------------------------ transport

    async def _call(self, method: str, path: str, body: dict[str, Any] | None
                    ) -> dict[str, Any] | _Failure:
        if self._http is None:
            raise RuntimeError("EnvClient used outside `async with` (or after close()); "
                               "wrap calls in `async with EnvClient(...) as env:`")
        cfg = self.cfg
        loop = asyncio.get_running_loop()
        deadline = loop.time() + cfg.call_deadline_s
        failure = _Failure(EndReason.timeout, f"{path}: no attempt fit in env.call_deadline_s")
        for attempt in range(cfg.retries + 1):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            timeout = aiohttp.ClientTimeout(total=min(cfg.request_timeout_s, remaining),
                                            sock_connect=cfg.connect_timeout_s)
            retry_after = 0.0
            self.attempts += 1
            try:
                async with self._sem:
                    async with self._http.request(method, self.url + path, json=body,
                                                  timeout=timeout) as resp:
                        status = resp.status
                        try:
                            data = await resp.json(content_type=None)
                        except ValueError:
                            data = None
                        retry_after = _retry_after(resp.headers.get("Retry-After"))
            except TimeoutError:
                failure = _Failure(EndReason.timeout, f"{path}: no reply within "
                                   f"{timeout.total:.3g}s (attempt {attempt + 1})")
            except (aiohttp.ClientError, OSError) as e:
                failure = _Failure(EndReason.env_error, f"{path}: {type(e).__name__}: {e}")
            else:
                if status == 200 and isinstance(data, dict):
                    return data
                message = data.get("error") if isinstance(data, dict) else None
                failure = _Failure(EndReason.env_error,
                                   f"{path}: HTTP {status}: {message or 'no JSON error body'}",
                                   status)
                if status not in RETRY_STATUS:
                    return failure
            if attempt == cfg.retries:
                break
            delay = min(cfg.backoff_max_s, cfg.backoff_s * 2**attempt)
            delay = max(delay * (0.5 + 0.5 * self._rng.random()), min(retry_after,
                                                                          cfg.backoff_max_s))
            if loop.time() + delay >= deadline:
                break
            self.retried += 1
            await asyncio.sleep(delay)
        return failure


def _rid() -> str:
    return uuid.uuid4().hex


def _retry_after(value: str | None) -> float:
    try:
        return max(0.0, float(value)) if value else 0.0
    except ValueError:
        return 0.0

