"""Reward functions (`env.reward=package.module:function`): the user's score of a finished task,
run in-process. No JAX.

    def score(task: dict, transcript: tiderl.envs.Episode) -> float | dict: ...
    async def score(task, transcript) -> float | dict: ...      # awaited on the event loop

`task` is the task spec (the row's fields plus tiderl's ids); `transcript` is the episode as
chat messages (`messages`, the last action's text as `completion`, the environment's own
`env_reward` and `/end` info when there is one). A dict return carries the reward under
"reward"; its other JSON-able keys land in the trajectory's info. Sync functions run on a
worker thread (never on the event loop), each call bounded by `env.reward_timeout_s`.
Failures are values: an exception or a timeout fails that task (`reward_error`, with the
message), a return that is not a finite number (NaN, inf, None, a string, a dict without
"reward") fails it `bad_reward`; the rest of its group still trains.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import inspect
import logging
import math
from collections.abc import Mapping
from typing import Any

from tiderl.envs.images import placeholders
from tiderl.envs.protocol import EndReason, EndResult, StartResult, StepResult
from tiderl.envs.suites import load_object

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class Episode:
    """A finished task as the reward function sees it."""

    messages: list[dict[str, Any]]
    """The conversation: the prompt's messages, then each action as an assistant message and
    each observation as a user (or tool) message."""
    completion: str
    """The last action's text (the answer, in a single-turn task)."""
    turns: int
    done: bool
    """The episode ended on its own (the env said done, the agent finished, the single-turn
    action stopped) rather than at a turn, token or context limit."""
    env_reward: float | None = None
    """The environment's own reward from /end (env tasks), else None."""
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    """The environment's /end info (env tasks), or what the agent reported."""


@dataclasses.dataclass(frozen=True)
class Score:
    reward: float = 0.0
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    error: str = ""
    reason: EndReason | None = None
    """Set with `error`: reward_error (raised, timed out) or bad_reward (returned no finite
    number)."""


class RewardFn:
    """The user's reward function, called safely (see the module docstring)."""

    def __init__(self, spec: str, *, timeout_s: float = 60.0, workers: int = 8):
        fn = load_object(spec, "env.reward")
        if not callable(fn):
            from tiderl.configlib import ConfigError

            raise ConfigError(f"config key 'env.reward'={spec!r} is a {type(fn).__name__}, not a "
                              "function (task, transcript) -> float | dict")
        self.spec, self.fn, self.timeout_s = spec, fn, timeout_s
        # An object with an async __call__ counts too (inspect does not see through it).
        self.is_async = inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
            type(fn).__call__)
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "tiderl-reward")
        self.calls = 0
        self.failures = 0

    async def __call__(self, task: Mapping[str, Any], episode: Episode) -> Score:
        self.calls += 1
        try:
            if self.is_async:
                out = await asyncio.wait_for(self.fn(task, episode), self.timeout_s)
            else:
                loop = asyncio.get_running_loop()
                out = await asyncio.wait_for(
                    loop.run_in_executor(self._pool, self.fn, task, episode), self.timeout_s)
            if inspect.isawaitable(out):  # a sync callable that returned a coroutine
                out = await asyncio.wait_for(out, self.timeout_s)
        except TimeoutError:
            return self._fail(task, f"reward function {self.spec} took longer than "
                                    f"env.reward_timeout_s={self.timeout_s:g}s",
                              EndReason.reward_error)
        except Exception as e:  # noqa: BLE001 - the user's code failing is this task's failure
            return self._fail(task, f"reward function {self.spec} raised {type(e).__name__}: {e}",
                              EndReason.reward_error)
        return self._parse(task, out)

    def _parse(self, task: Mapping[str, Any], out: Any) -> Score:
        info: dict[str, Any] = {}
        value = out
        if isinstance(out, Mapping):
            if "reward" not in out:
                return self._fail(task, f"reward function {self.spec} returned a dict without "
                                        f"'reward' (keys {sorted(out)[:6]}); return "
                                        "{'reward': float, ...}")
            value = out["reward"]
            info = {str(k): v for k, v in out.items() if k != "reward"}
        if isinstance(value, (bool, str, bytes)) or not isinstance(value, (int, float)) and (
                not hasattr(value, "__float__")):
            return self._fail(task, f"reward function {self.spec} returned {value!r}; return a "
                                    "float or {'reward': float, ...}")
        try:
            reward = float(value)
        except (TypeError, ValueError) as e:
            return self._fail(task, f"reward function {self.spec} returned {value!r} ({e}); "
                                    "return a float or {'reward': float, ...}")
        if not math.isfinite(reward):
            return self._fail(task, f"reward function {self.spec} returned {reward}; rewards "
                                    "must be finite")
        return Score(reward, info)

    def _fail(self, task: Mapping[str, Any], message: str,
              reason: EndReason = EndReason.bad_reward) -> Score:
        self.failures += 1
        if self.failures <= 5 or self.failures % 100 == 0:
            log.warning("task %s: %s (%d reward failures so far)", task.get("task_id", "?"),
                        message, self.failures)
        return Score(error=message, reason=reason)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclasses.dataclass
class _Log:
    task: dict[str, Any]
    messages: list[dict[str, Any]]
    actions: list[str] = dataclasses.field(default_factory=list)
    turns: int = 0
    done: bool = False


class RewardedEnv:
    """An env client whose final reward is `reward`'s score of the episode (the environment's
    own reward and info are passed to it); everything else goes to `env` unchanged."""

    def __init__(self, env: Any, reward: RewardFn):
        self.env, self.reward = env, reward
        self._logs: dict[str, _Log] = {}

    def __getattr__(self, name: str) -> Any:  # pause, resume, health, ...
        return getattr(self.env, name)

    async def start(self, task: dict[str, Any]) -> StartResult:
        r = await self.env.start(task)
        if r.ok:
            self._logs[r.session] = _Log(dict(task), [{"role": "user", "content": placeholders(
                r.observation, r.images)}])
        return r

    async def step(self, session: str, action: str) -> StepResult:
        lg = self._logs.get(session)
        r = await self.env.step(session, action)
        if lg is not None:
            lg.turns += 1
            lg.actions.append(action)
            lg.messages.append({"role": "assistant", "content": action})
            if r.ok and not r.done:
                lg.messages.append({"role": "user",
                                    "content": placeholders(r.observation, r.images)})
            lg.done = r.ok and r.done and r.truncated != "turn_limit"
        return r

    async def end(self, session: str) -> EndResult:
        e = await self.env.end(session)
        lg = self._logs.pop(session, None)
        if lg is None or not e.ok:
            return e
        ep = Episode(messages=lg.messages, completion=lg.actions[-1] if lg.actions else "",
                     turns=lg.turns, done=lg.done,
                     env_reward=e.reward, info=dict(e.info))
        s = await self.reward(lg.task, ep)
        if s.error:
            return EndResult(reason=s.reason or EndReason.reward_error, error=s.error)
        return EndResult(reward=s.reward, info={**e.info, **s.info})
