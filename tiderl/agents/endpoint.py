"""The OpenAI-compatible endpoint a run serves to black-box agents (aiohttp). No JAX.

    POST /tasks/{task_id}/{secret}/v1/chat/completions   messages, tools, tool_choice,
                                                         max_tokens, stop, logprobs,
                                                         temperature (see below)
    GET  /tasks/{task_id}/{secret}/v1/models             the run's model id
    POST /tasks/{task_id}/{secret}/reward                {"reward": float, "info": {...}?}
    GET  /health

`task_id` is the task spec's id, percent-encoded (`train%2Fe0%2Fr3%2Fm0`); `secret` is a random
per-task capability (`secrets.token_urlsafe`) made when the task opens. Each task's base URL,
`.../tasks/{task_id}/{secret}/v1`, is what its agent function is given, and only the agent:
the secret is never put into a prompt, an observation or a reply, so the model cannot post its
own reward. Task ids are predictable and env.endpoint.token is shared by every task, so the
secret is what stops one agent (or anyone holding the token) from acting on another's task: a
task route without it is 401, with the wrong one 403 (compared in constant time).

A request waits for its turn (the scheduler admits, pauses and resumes the task like any
other) and is answered once the action is sampled. One request per task at a time; a retried
request (same messages) gets the first one's reply, so the openai client's own retries are
safe. Errors are OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`) with a 4xx:
malformed JSON or fields (400), a history that does not extend the task's (400, code
`history_mismatch`), a missing or wrong bearer token or task secret (401, 403), an unknown
task (404), a second request in flight or a second reward, or a reward after the task ended
(409), a request to a task that has ended (410), a body over the limit (413).
Images: `image_url` content parts with base64 data URLs (`data:image/png;base64,...`, PNG or
JPEG; the endpoint fetches no URL) are decoded, checked against env.images (count, bytes, total
bytes, pixels: 400 `image_too_large`; not an image, not a data URL: 400 `invalid_image`) and
kept with their message; images go in user messages only (400 `invalid_image` elsewhere). A
vision-language policy (the manager's `image_prompt`) reads them: each image's placeholder of
the chat template where its part comes in the message (parts listed before the text lead it,
as the Qwen-VL templates render parts in order), expanded to its token count, the image patched
and handed to the engine with its turn's new tokens (`agent_turn(images=...)`); a repeated
history's images are in the context already and never sent again, and `Trajectory.images` holds
every image in placeholder order. A text policy refuses a request with images (400
`no_vision`). Nothing a request sends stops the server or another task.

Sampling follows the run, not the request: the behaviour policy must be the one the trainer
corrects for, so `temperature` is the run's (rollout.temperature; evaluation's for eval tasks)
and `top_p` < 1, penalties, `logit_bias`, `n` > 1 and `top_logprobs` > 0 are refused (400).
`max_tokens` is capped at rollout.max_action_tokens; `stop` strings cut the returned text (the
trajectory keeps the tokens as sampled). `stream: true` is answered as server-sent events
carrying the whole reply in one chunk. Extension: `return_token_ids: true` adds the sampled
ids (`choices[0].token_ids`), `prompt_token_ids` and the per-token weight `versions`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import json
import logging
import math
import secrets
import time
import uuid
from collections.abc import AsyncIterator, Mapping
from typing import Any
from urllib.parse import quote

from aiohttp import web

from tiderl.agents.chat import ChatError
from tiderl.envs.config import EndpointConfig

log = logging.getLogger(__name__)
_ENDED = 16384  # ended tasks remembered (a late request gets 410, not 404)
_REFUSED = {"n": 1, "top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}


class Session:
    """One open agent task: the requests waiting for its episode, and its posted reward."""

    def __init__(self, task_id: str):
        self.task_id = task_id
        self.secret = secrets.token_urlsafe(24)  # in the agent's base URL, nowhere else
        self.queue: asyncio.Queue[tuple[dict[str, Any], asyncio.Future]] = asyncio.Queue()
        self.inflight: asyncio.Future | None = None
        self.last: tuple[str, asyncio.Future] | None = None
        self.reward: tuple[float, dict[str, Any]] | None = None
        self.closed = ""

    def submit(self, body: dict[str, Any]) -> asyncio.Future:
        key = json.dumps([body.get("messages"), body.get("tools")], sort_keys=True, default=str)
        if self.last is not None and self.last[0] == key:
            return self.last[1]  # a retry of the last request: its reply, not a second turn
        if self.inflight is not None and not self.inflight.done():
            raise ChatError(409, f"task {self.task_id!r} already has a request in flight; send "
                                 "one request at a time per task (wait for the reply)",
                            code="request_in_flight")
        fut = asyncio.get_running_loop().create_future()
        previous = self.last

        def settled(f: asyncio.Future) -> None:
            # A refused request is not replayed: a retry of the last turn still is.
            if (f.cancelled() or f.exception() is not None) and self.last == (key, f):
                self.last = previous

        fut.add_done_callback(settled)
        self.inflight, self.last = fut, (key, fut)
        self.queue.put_nowait((body, fut))
        return fut


class AgentEndpoint:
    """Routes requests to open sessions; `serve()` runs it and yields its root URL."""

    def __init__(self, cfg: EndpointConfig):
        self.cfg = cfg
        self.sessions: dict[str, Session] = {}
        # Ended tasks: (why, secret), so a late request with the right secret is told so.
        self._ended: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self.root = ""
        self.requests: collections.Counter[int] = collections.Counter()
        self.app = web.Application(client_max_size=cfg.max_request_bytes,
                                   middlewares=[self._errors, self._auth])
        self.app.add_routes([
            web.post("/tasks/{task_id}/{secret}/v1/chat/completions", self._chat),
            web.get("/tasks/{task_id}/{secret}/v1/models", self._models),
            web.post("/tasks/{task_id}/{secret}/reward", self._reward),
            # A task's routes without its secret: 401, saying where the secret is.
            web.post("/tasks/{task_id}/v1/chat/completions", self._no_secret),
            web.get("/tasks/{task_id}/v1/models", self._no_secret),
            web.post("/tasks/{task_id}/reward", self._no_secret),
            web.get("/health", self._health),
        ])

    @contextlib.asynccontextmanager
    async def serve(self) -> AsyncIterator[str]:
        runner = web.AppRunner(self.app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, self.cfg.host, self.cfg.port)
        await site.start()
        sock = site._server.sockets[0]  # type: ignore[union-attr]  # aiohttp exposes no getter
        host, port = sock.getsockname()[:2]
        self.root = f"http://{host}:{port}"
        log.info("agent endpoint: %s/tasks/{task_id}/{secret}/v1", self.root)
        try:
            yield self.root
        finally:
            for s in list(self.sessions.values()):
                self.close(s.task_id, "the run ended")
            await runner.cleanup()

    def base_url(self, task_id: str) -> str:
        """The open task's base URL, its secret included: for its agent only."""
        secret = self.sessions[task_id].secret
        return f"{self.root}/tasks/{quote(task_id, safe='')}/{secret}/v1"

    def open(self, task_id: str) -> Session:
        s = self.sessions[task_id] = Session(task_id)
        self._ended.pop(task_id, None)
        return s

    def close(self, task_id: str, why: str) -> None:
        s = self.sessions.pop(task_id, None)
        if s is None:
            return
        s.closed = why
        self._ended[task_id] = (why, s.secret)
        while len(self._ended) > _ENDED:
            self._ended.popitem(last=False)
        err = ChatError(410, f"task {task_id!r} has ended ({why})", code="task_ended")
        while not s.queue.empty():
            _, fut = s.queue.get_nowait()
            if not fut.done():
                fut.set_exception(err)

    # ---------------------------------------------------------------- middleware

    @web.middleware
    async def _errors(self, request: web.Request, handler) -> web.StreamResponse:
        try:
            response = await handler(request)
        except ChatError as e:
            response = web.json_response(e.body(), status=e.status)
        except web.HTTPException as e:
            msg = {413: f"request body exceeds env.endpoint.max_request_bytes="
                        f"{self.cfg.max_request_bytes}",
                   404: f"no route {request.path}; an agent's base URL is "
                        f"{self.root}/tasks/{{task_id}}/{{secret}}/v1 (POST "
                        ".../chat/completions)",
                   405: f"method {request.method} not allowed on {request.path}"}.get(
                e.status, e.text or e.reason)
            response = web.json_response(ChatError(e.status, msg).body(), status=e.status)
        self.requests[response.status] += 1
        return response

    @web.middleware
    async def _auth(self, request: web.Request, handler) -> web.StreamResponse:
        if self.cfg.token:
            scheme, _, value = request.headers.get("Authorization", "").partition(" ")
            if scheme.lower() != "bearer" or not hmac.compare_digest(
                    value.strip().encode(), self.cfg.token.encode()):
                raise ChatError(401, "missing or wrong bearer token; send env.endpoint.token as "
                                     "the api_key", kind="authentication_error")
        return await handler(request)

    # ---------------------------------------------------------------- routes

    def _session(self, request: web.Request, *, ended_status: int = 410) -> Session:
        """The request's open task, its secret checked; an ended one is `ended_status`."""
        tid = request.match_info["task_id"]
        s = self.sessions.get(tid)
        why, secret = ("", s.secret) if s is not None else self._ended.get(tid, ("", ""))
        if not secret:
            raise ChatError(404, f"unknown task {tid!r}: no open task has this id; use the "
                                 "base_url your agent function was given",
                            code="task_not_found")
        if not hmac.compare_digest(request.match_info["secret"].encode(), secret.encode()):
            raise ChatError(403, f"wrong task secret for task {tid!r}; use the base_url your "
                                 "agent function was given for this task",
                            kind="permission_error", code="wrong_task_secret")
        if s is None:
            raise ChatError(ended_status, f"task {tid!r} has ended ({why})", code="task_ended")
        return s

    async def _no_secret(self, request: web.Request) -> web.Response:
        raise ChatError(401, f"missing task secret: a task's routes are under the base_url its "
                             f"agent function was given ({self.root}/tasks/{{task_id}}/{{secret}}"
                             "/v1; its reward route is .../{secret}/reward)",
                        kind="authentication_error", code="missing_task_secret")

    @staticmethod
    async def _json(request: web.Request) -> dict[str, Any]:
        try:
            body = json.loads(await request.read())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ChatError(400, f"malformed JSON body ({e}); send a chat.completions request "
                                 "object") from None
        except RecursionError:
            raise ChatError(400, "JSON body nested too deeply") from None
        if not isinstance(body, dict):
            raise ChatError(400, f"request body must be a JSON object, got "
                                 f"{type(body).__name__}")
        return body

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        s = self._session(request)
        body = await self._json(request)
        _check_sampling(body)
        fut = s.submit(body)
        try:
            reply = await asyncio.wait_for(asyncio.shield(fut), self.cfg.request_timeout_s)
        except TimeoutError:
            raise ChatError(504, f"no turn for task {s.task_id!r} within "
                                 f"env.endpoint.request_timeout_s={self.cfg.request_timeout_s:g}",
                            kind="server_error", code="timeout") from None
        if body.get("stream"):
            return await _stream(request, reply)
        return web.json_response(reply)

    async def _models(self, request: web.Request) -> web.Response:
        self._session(request)
        return web.json_response({"object": "list", "data": [
            {"id": self.cfg.model_name, "object": "model", "created": 0, "owned_by": "tiderl"}]})

    async def _reward(self, request: web.Request) -> web.Response:
        s = self._session(request, ended_status=409)
        body = await self._json(request)
        value = body.get("reward")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                value):
            raise ChatError(400, f"'reward' must be a finite number, got {value!r}",
                            param="reward")
        info = body.get("info", {})
        if not isinstance(info, dict):
            raise ChatError(400, "'info' must be a JSON object", param="info")
        if s.closed:  # it ended while the body was read: the runner has taken its reward
            raise ChatError(409, f"task {s.task_id!r} has ended ({s.closed}); a reward must be "
                                 "posted before the agent function returns", code="task_ended")
        if s.reward is not None:
            raise ChatError(409, f"task {s.task_id!r} already has a reward", code="reward_posted")
        s.reward = (float(value), info)
        return web.json_response({"task_id": s.task_id, "reward": float(value)})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "tasks": len(self.sessions)})


def _check_sampling(body: Mapping[str, Any]) -> None:
    for key, default in _REFUSED.items():
        value = body.get(key)
        if value is not None and value != default:
            raise ChatError(400, f"{key}={value!r} is not supported: tiderl samples each task as "
                                 "the trainer expects (the run's temperature, full vocabulary, "
                                 f"one choice); drop {key} or set it to {default}", param=key)
    if body.get("logit_bias"):
        raise ChatError(400, "logit_bias is not supported (it would bias the behaviour policy)",
                        param="logit_bias")
    top = body.get("top_logprobs")
    if top not in (None, 0):
        raise ChatError(400, f"top_logprobs={top!r} is not supported: the engine returns the "
                             "sampled token's logprob only; use logprobs=true",
                        param="top_logprobs")


def completion(reply: Any, *, model: str, conv: Any, pending: Any, task_id: str
               ) -> dict[str, Any]:
    """A chat.completion object for one reply."""
    choice: dict[str, Any] = {"index": 0, "message": reply.message,
                              "finish_reason": reply.finish_reason, "logprobs": None}
    if pending.logprobs:
        choice["logprobs"] = {"content": conv.logprob_entries(reply)}
    out: dict[str, Any] = {
        "id": f"chatcmpl-{uuid.uuid4().hex[:24]}", "object": "chat.completion",
        "created": int(time.time()), "model": model, "choices": [choice],
        "usage": {"prompt_tokens": reply.prompt_len, "completion_tokens": len(reply.action_ids),
                  "total_tokens": reply.prompt_len + len(reply.action_ids)}}
    if pending.token_ids:
        choice["token_ids"] = list(reply.action_ids)
        out["prompt_token_ids"] = list(conv.tokens[:reply.prompt_len])
        out["tiderl"] = {"task_id": task_id, "versions": list(reply.versions),
                         "malformed_tool_call": reply.malformed_tool_call}
    return out


async def _stream(request: web.Request, reply: dict[str, Any]) -> web.StreamResponse:
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream",
                                       "Cache-Control": "no-cache"})
    await resp.prepare(request)
    choice = reply["choices"][0]
    delta = {k: v for k, v in choice["message"].items() if v is not None}
    if "tool_calls" in delta:
        delta["tool_calls"] = [{**c, "index": i} for i, c in enumerate(delta["tool_calls"])]
    base = {k: reply[k] for k in ("id", "created", "model")} | {"object": "chat.completion.chunk"}
    for ch in ({"index": 0, "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None},
               {"index": 0, "delta": {}, "finish_reason": choice["finish_reason"]}):
        await resp.write(f"data: {json.dumps({**base, 'choices': [ch]})}\n\n".encode())
    await resp.write(b"data: [DONE]\n\n")
    await resp.write_eof()
    return resp
