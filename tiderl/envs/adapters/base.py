"""The adapter interface every environment suite implements behind the HTTP server. No JAX."""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

from tiderl.envs.images import Image


class TaskError(ValueError):
    """The task spec itself is wrong (the caller's fault): the server answers 422, not 500."""


@dataclasses.dataclass(frozen=True)
class Step:
    """What one action produced; `images` (PNG or JPEG: `tiderl.envs.images.png(pil_image)`,
    or raw bytes) go with the observation."""

    observation: str
    done: bool
    reward: float | None = None
    images: Sequence[Image | bytes] = ()


@dataclasses.dataclass(frozen=True)
class Observation:
    """A first observation with images: what `reset` returns instead of a string."""

    text: str
    images: Sequence[Image | bytes] = ()


class Adapter(abc.ABC):
    """One live environment episode: reset -> step* -> close, with optional pause/resume.

    The server makes one adapter per session and never calls it concurrently. Methods are plain
    (sync) calls; adapters whose calls block for long (TextWorld compiles a game on reset) set
    `blocking = True` and the server runs them in a worker thread so other sessions keep going.
    Exceptions are the environment's failure: the server answers 500 and closes the session.
    """

    blocking: ClassVar[bool] = False
    max_workers: ClassVar[int | None] = None
    """Cap on the server's worker threads for this adapter (1: not thread-safe)."""
    client_options: ClassVar[frozenset[str]] = frozenset()
    """Options a client may set per session (/start `options`: a job's env.options reach an
    external server that way). Anything else a client sends is refused (400) unless it equals
    the server's own value. List only options that shape the task; never one that names a
    path, a command or a resource limit of the server."""
    accepts_images: ClassVar[bool] = False
    """Whether requests may carry images to this adapter: a /start's images reach `reset` as
    `task["images"]` and an /observation's as `step(action, images=...)` (tuples of checked
    `tiderl.envs.images.Image`). False: a request with images answers 422."""

    start_delay_s: float = 0.0
    """Seconds the server waits before `reset` (asynchronously: no worker thread is held), to
    mimic an environment that is slow to start (a VM booting); set it in `__init__`."""

    state_dir: str = ""
    """A folder private to the server hosting this adapter, for its files (caches); set by the
    server before `reset`, '' when the adapter runs outside one."""

    def __init__(self, options: Mapping[str, str] | None = None):
        self.options = dict(options or {})

    @classmethod
    def task_fields(cls, seed: int, options: Mapping[str, str]) -> dict[str, Any]:
        """Suite-specific fields of a task spec for env seed `seed` (used by task sources)."""
        return {"seed": seed}

    @classmethod
    def system_prompt(cls, options: Mapping[str, str]) -> str | None:
        """The system turn of this suite's tasks under suite `options` (the rules and answer
        format a chat model needs), or None. A run uses it when controller.system_prompt is
        '' (a template with no system role gets it ahead of the first observation)."""
        return None

    @abc.abstractmethod
    def reset(self, task: Mapping[str, Any]) -> str | Observation:
        """Starts the episode described by `task`; returns the first observation (a string, or
        an Observation with images)."""

    @abc.abstractmethod
    def step(self, action: str) -> Step:
        """Applies one action."""

    @abc.abstractmethod
    def close(self) -> tuple[float, dict[str, Any]]:
        """Ends the episode (done or not); returns (final reward, JSON-able info)."""

    def pause(self) -> None:  # noqa: B027 - optional hook, a no-op for most suites
        """The task is parked by the scheduler; stop any env-internal clocks."""

    def resume(self) -> None:  # noqa: B027 - optional hook, a no-op for most suites
        """The task continues after a pause."""


def int_option(options: Mapping[str, Any], name: str, default: int, *, lo: int = 1,
               hi: int = 1 << 30, where: str = "task") -> int:
    """An integer option from a task spec or suite options, checked against [lo, hi]."""
    raw = options.get(name, default)
    try:
        value = int(raw)
        if isinstance(raw, float) and raw != value:
            raise ValueError(raw)
    except (TypeError, ValueError):
        raise TaskError(f"{where} field '{name}' must be an integer, got {raw!r}") from None
    if not lo <= value <= hi:
        raise TaskError(f"{where} field '{name}'={value} is out of range {lo}..{hi}")
    return value
