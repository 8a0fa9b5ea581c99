"""The env HTTP protocol: request/response schemas, EndReason, and request validation. No JAX.

JSON over HTTP:

    POST /start       {task, options?, images?, request_id?}  -> {session, observation, images?}
    POST /observation {session, action, images?, request_id?}
                                          -> {observation, images?, done, reward, turn}
    POST /end         {session, request_id?}         -> {reward, info}
    POST /pause       {session}                      -> {session, paused: true}
    POST /resume      {session}                      -> {session, paused: false}
    GET  /health                                     -> {status, sessions, paused, ...}
    GET  /metrics                                    -> Prometheus text

Errors are `{"error": message}` with a 4xx (the caller's fault) or 500 (the environment's).
`options` ({key: value} strings) are the job's env.options: they override the server's own
suite options for that session, so an external server plays the task the job configured. A
client may set only the options its adapter lists in `client_options` (an option equal to the
server's own value is no override and always passes); any other answers 400 naming it. Paths
and other server-side settings never come from a client.
A reward in a reply is a finite number or null (none this step); an adapter's reward that is
not one is sent as null with a `reward_error` message, and the client ends that task
`bad_reward`.
Images: an observation may carry images beside its text, `"images": [{"data": "<base64 of a
PNG or JPEG file>", "mime": "image/png"}, ...]` (absent when there are none; see
tiderl/envs/images.py). A /start or /observation request may carry images the same way (a task's
picture, an action's attachment) for adapters that take them (`accepts_images`); an adapter
that does not answers 422. Every image, either way, is checked against env.images: over a limit
(count, bytes, total bytes, pixels) answers 413, not a PNG or JPEG (or bad base64) 422, each
naming the limit's config key; the session is not touched.
`request_id` is an idempotency key: a retried request with the same key gets the first reply
instead of being applied twice, which is what makes client retries of /observation safe.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

from tiderl.envs.config import ImageConfig
from tiderl.envs.images import Image, ImageError, from_wire


class EndReason(enum.StrEnum):
    """Why a task's trajectory ended; env failures are values, not exceptions."""

    done = "done"
    turn_limit = "turn_limit"
    context_limit = "context_limit"
    env_error = "env_error"
    reward_error = "reward_error"
    """The reward function (env.reward) raised or timed out."""
    bad_reward = "bad_reward"
    """A reward that is not a finite number: NaN, inf, null, a string, or none at all in an
    /end reply, from the environment or returned by the reward function. The task fails (no
    verdict); its group trains on the rest."""
    action_too_long = "action_too_long"
    """The action was longer than the env server accepts (env.max_action_chars, HTTP 413): the
    episode ends there with a verdict (the env's /end reward of the episode so far) and
    trains, like turn_limit."""
    timeout = "timeout"
    cancelled = "cancelled"


class ProtocolError(Exception):
    """A request the server refuses; `status` is the HTTP code, the message names the fix."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status
        self.message = message


MAX_ID_CHARS = 128


def _require_object(body: Any) -> Mapping[str, Any]:
    if not isinstance(body, Mapping):
        raise ProtocolError(400, f"request body must be a JSON object, got "
                                 f"{type(body).__name__}; send e.g. {{\"session\": \"...\"}}")
    return body


def _field(body: Mapping[str, Any], name: str, kind: type, *, required: bool = True) -> Any:
    if name not in body:
        if required:
            raise ProtocolError(400, f"missing field '{name}' ({kind.__name__}); add it to "
                                     "the request body")
        return None
    value = body[name]
    if kind is str and isinstance(value, str):
        return value
    if kind is dict and isinstance(value, Mapping):
        return value
    raise ProtocolError(422, f"field '{name}' must be a {'JSON object' if kind is dict else 'string'}"
                             f", got {type(value).__name__}")


def _session(body: Mapping[str, Any]) -> str:
    value = _id(body, "session", required=True)
    assert value is not None  # required=True raised otherwise
    return value


def _id(body: Mapping[str, Any], name: str, *, required: bool) -> str | None:
    value = _field(body, name, str, required=required)
    if value is not None and not 0 < len(value) <= MAX_ID_CHARS:
        raise ProtocolError(422, f"field '{name}' must be 1..{MAX_ID_CHARS} characters, got "
                                 f"{len(value)}")
    return value


def _images(body: Mapping[str, Any], limits: ImageConfig | None) -> tuple[Image, ...]:
    if body.get("images") is None:
        return ()
    try:
        return from_wire(body["images"], limits or ImageConfig(), where="images")
    except ImageError as e:
        raise ProtocolError(e.status, e.message) from None


@dataclasses.dataclass(frozen=True)
class StartRequest:
    task: dict[str, Any]
    request_id: str | None = None
    options: dict[str, str] = dataclasses.field(default_factory=dict)
    images: tuple[Image, ...] = ()

    @classmethod
    def parse(cls, body: Any, *, images: ImageConfig | None = None) -> StartRequest:
        body = _require_object(body)
        options = _field(body, "options", dict, required=False) or {}
        bad = [k for k, v in options.items() if not isinstance(v, str)]
        if bad:
            raise ProtocolError(422, f"field 'options' must map names to strings; {bad[0]!r} is "
                                     f"{type(options[bad[0]]).__name__}")
        task = dict(_field(body, "task", dict))
        return cls(task=task, request_id=_id(body, "request_id", required=False),
                   options=dict(options), images=_images(body, images))


@dataclasses.dataclass(frozen=True)
class StepRequest:
    session: str
    action: str
    request_id: str | None = None
    images: tuple[Image, ...] = ()

    @classmethod
    def parse(cls, body: Any, *, max_action_chars: int,
              images: ImageConfig | None = None) -> StepRequest:
        body = _require_object(body)
        session = _session(body)
        action = _field(body, "action", str)
        if len(action) > max_action_chars:
            raise ProtocolError(413, f"field 'action' has {len(action)} characters, over the "
                                     f"limit of {max_action_chars}; shorten the action or raise "
                                     "env.max_action_chars on the server")
        return cls(session=session, action=action,
                   request_id=_id(body, "request_id", required=False),
                   images=_images(body, images))


@dataclasses.dataclass(frozen=True)
class SessionRequest:
    """Body of /end, /pause and /resume."""

    session: str
    request_id: str | None = None

    @classmethod
    def parse(cls, body: Any) -> SessionRequest:
        body = _require_object(body)
        return cls(session=_session(body),
                   request_id=_id(body, "request_id", required=False))


class _Outcome:
    """A reply or why it failed: `reason` is set exactly when the call failed."""

    reason: EndReason | None

    @property
    def ok(self) -> bool:
        return self.reason is None


@dataclasses.dataclass(frozen=True)
class StartResult(_Outcome):
    """Reply to /start, or why it failed (`reason` set, `session` empty)."""

    session: str = ""
    observation: str = ""
    reason: EndReason | None = None
    error: str = ""
    images: tuple[Image, ...] = ()
    """The observation's images (checked against the client's env.images)."""


@dataclasses.dataclass(frozen=True)
class StepResult(_Outcome):
    """Reply to /observation, or why it failed (`reason` set, `done` true)."""

    observation: str = ""
    done: bool = False
    reward: float | None = None
    turn: int = 0
    truncated: str = ""
    """Why the server ended a not-finished episode ('turn_limit': its turn cap), else ''."""
    reason: EndReason | None = None
    error: str = ""
    images: tuple[Image, ...] = ()
    """The observation's images (checked against the client's env.images)."""


@dataclasses.dataclass(frozen=True)
class EndResult(_Outcome):
    """Reply to /end: the episode's final reward and the adapter's info, or why it failed."""

    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    reason: EndReason | None = None
    error: str = ""


@dataclasses.dataclass(frozen=True)
class OpResult(_Outcome):
    """Reply to /pause, /resume (and /health): ok, or why not."""

    body: dict[str, Any] = dataclasses.field(default_factory=dict)
    reason: EndReason | None = None
    error: str = ""


__all__ = [
    "EndReason",
    "EndResult",
    "OpResult",
    "ProtocolError",
    "SessionRequest",
    "StartRequest",
    "StartResult",
    "StepRequest",
    "StepResult",
]
