"""Episodes that are not the env loop: tasks driven by the user's agent through the endpoint,
and single-turn tasks scored by a reward function. No JAX.

Both run inside `RolloutManager` (it calls `EpisodeRunner` for each task instead of its env
loop), so the scheduler admits, pauses and resumes them like any other task: a turn goes
through `manager.agent_turn`, and between turns — while the agent runs its tools, or thinks —
the task waits like one waiting on its environment.

An agent task: `env.agent(task, base_url, api_key)` is called (a sync function on a worker
thread, an async one on the loop) and drives the conversation through its base URL (which
carries the task's secret; nothing the model sees does); each chat request is one turn. The
task ends when the function returns. Its reward, in order: a `POST` to the base URL's
`.../reward` (`/v1` replaced), the function's return value (a number or `{"reward": ...}`),
env.reward's score of the conversation; with none of them the task fails (reward_error). An
agent that raises, or sends nothing for env.endpoint.idle_timeout_s, fails its task
(env_error, timeout); the run goes on.

A single-turn task: the row's `messages` (or `prompt` as one user message) rendered with the
chat template, one action, scored by env.reward.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import inspect
import logging
import math
from collections.abc import AsyncIterator, Mapping
from typing import Any

from tiderl.agents.chat import ChatError, ChatRenderer
from tiderl.agents.conversation import Conversation
from tiderl.agents.endpoint import AgentEndpoint, completion
from tiderl.agents.toolcalls import parser_for
from tiderl.envs.config import EnvConfig
from tiderl.envs.protocol import EndReason
from tiderl.envs.rewards import Episode, RewardedEnv, RewardFn
from tiderl.envs.suites import load_object
from tiderl.serving.pages import StopReason
from tiderl.serving.trajectory import Trajectory

log = logging.getLogger(__name__)


class EpisodeRunner:
    """Plays agent or single-turn tasks for a RolloutManager (its `runner`)."""

    def __init__(self, cfg: EnvConfig, renderer: ChatRenderer, *, max_action_tokens: int,
                 temperature: float, reward: RewardFn | None = None,
                 endpoint: AgentEndpoint | None = None, system: str | None = None):
        self.cfg, self.renderer, self.reward = cfg, renderer, reward
        self.endpoint, self.system = endpoint, system
        self.max_action_tokens, self.temperature = max_action_tokens, temperature
        self.parser = parser_for(renderer.source, cfg.endpoint.tool_parser)
        self.agent: Any = None
        self.api_key = cfg.endpoint.token or "tiderl"
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._warned_temperature = False
        if cfg.kind == "agent":
            self.agent = load_object(cfg.agent, "env.agent")
            if not callable(self.agent):
                from tiderl.configlib import ConfigError

                raise ConfigError(f"config key 'env.agent'={cfg.agent!r} is not callable; name "
                                  "a function (task, base_url, api_key)")
            self._pool = concurrent.futures.ThreadPoolExecutor(cfg.concurrency, "tiderl-agent")
        self.agent_async = inspect.iscoroutinefunction(self.agent)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    async def __call__(self, manager: Any, ep: Any) -> Trajectory:
        traj = Trajectory(task_id=ep.task.task_id, group_id=ep.task.group_id,
                          is_eval=ep.task.is_eval, tokens=[], loss_mask=[], logprobs=[],
                          versions=[], reward=0.0, end_reason=EndReason.cancelled, turns=0)
        conv = Conversation(self.renderer, self.parser, self.cfg.images,
                            vision=getattr(manager, "image_prompt", None))
        try:
            if self.agent is not None:
                await self._agent(manager, ep, conv, traj)
            else:
                await self._single(manager, ep, conv, traj)
            return traj
        finally:
            traj.tokens, traj.loss_mask = list(conv.tokens), list(conv.loss_mask)
            traj.logprobs, traj.versions = list(conv.logprobs), list(conv.versions)
            traj.turns, traj.images = conv.turns, list(conv.patched)
            manager.finished(ep, traj)

    # -- one turn -------------------------------------------------------------------------------
    async def _turn(self, manager: Any, ep: Any, conv: Conversation, body: Mapping[str, Any],
                    traj: Trajectory) -> tuple[Any, Any]:
        """Checks `body`, runs its turn; (pending, reply), or raises ChatError (nothing
        appended)."""
        p = conv.request(body, max_action_tokens=self.max_action_tokens)
        if conv.turns >= self.cfg.max_turns:
            raise ChatError(400, f"task {ep.task.task_id!r} reached env.max_turns="
                                 f"{self.cfg.max_turns} turns", code="turn_limit")
        t = body.get("temperature")
        if t is not None and t != self.temperature and not self._warned_temperature:
            self._warned_temperature = True
            log.warning("agent requests ask for temperature=%s; tiderl samples at the run's "
                        "rollout.temperature=%s (the trainer corrects for that policy)", t,
                        self.temperature)
        result = await manager.agent_turn(ep, p.new_ids, len(conv.tokens) + len(p.new_ids),
                                          max_action_tokens=p.max_tokens,
                                          images=p.images or None)
        traj.prompt_tokens += result.prompt_tokens
        traj.cached_tokens += result.cached_tokens
        if result.stop_reason == StopReason.CONTEXT_LIMIT and not result.action_tokens:
            raise ChatError(400, f"the task's context ({len(conv.tokens) + len(p.new_ids)} "
                                 "tokens with this request) leaves no room for a reply within "
                                 "rollout.max_context", code="context_length_exceeded")
        reply = conv.reply(p, result.action_tokens, result.logprobs, result.versions,
                           length_stop=result.stop_reason in (StopReason.MAX_ACTION_TOKENS,
                                                              StopReason.CONTEXT_LIMIT))
        if result.stop_reason == StopReason.CONTEXT_LIMIT:
            traj.end_reason = EndReason.context_limit
        return p, reply

    # -- single-turn ----------------------------------------------------------------------------
    async def _single(self, manager: Any, ep: Any, conv: Conversation, traj: Trajectory) -> None:
        spec = ep.spec
        msgs = list(spec["messages"]) if "messages" in spec else [
            {"role": "user", "content": spec["prompt"]}]
        if self.system and msgs[0].get("role") != "system":
            msgs.insert(0, {"role": "system", "content": self.system})
        try:
            _, reply = await self._turn(manager, ep, conv, {"messages": msgs,
                                                             "tools": spec.get("tools")}, traj)
        except ChatError as e:
            traj.end_reason = (EndReason.context_limit if e.code == "context_length_exceeded"
                               else EndReason.env_error)
            traj.error = f"task {ep.task.task_id}: {e.message}"
            return
        if traj.end_reason != EndReason.context_limit:
            traj.end_reason = EndReason.done
        content = reply.message.get("content") or ""
        await self._score(ep.spec, conv, traj, content, done=reply.finish_reason != "length")

    async def _score(self, spec: Mapping[str, Any], conv: Conversation, traj: Trajectory,
                     completion_text: str, *, done: bool, info: Mapping | None = None) -> None:
        if self.reward is None:
            traj.end_reason = EndReason.reward_error
            traj.error = (f"task {traj.task_id}: no reward (the agent neither returned one nor "
                          "POSTed .../reward, and env.reward is not set)")
            return
        s = await self.reward(spec, Episode(messages=conv.transcript_messages,
                                            completion=completion_text, turns=conv.turns,
                                            done=done, info=dict(info or {})))
        if s.error:
            traj.end_reason, traj.error = s.reason or EndReason.reward_error, s.error
        else:
            traj.reward, traj.info = s.reward, {**traj.info, **s.info}

    # -- agent ----------------------------------------------------------------------------------
    def _start_agent(self, spec: dict[str, Any], base_url: str) -> asyncio.Future:
        if self.agent_async:
            return asyncio.ensure_future(self.agent(spec, base_url, self.api_key))
        assert self._pool is not None
        return asyncio.wrap_future(self._pool.submit(self.agent, spec, base_url, self.api_key))

    async def _agent(self, manager: Any, ep: Any, conv: Conversation, traj: Trajectory) -> None:
        assert self.endpoint is not None
        tid = ep.task.task_id
        session = self.endpoint.open(tid)
        agent = self._start_agent(dict(ep.spec), self.endpoint.base_url(tid))
        get: asyncio.Future | None = None
        try:
            while True:
                get = asyncio.ensure_future(session.queue.get())
                done, _ = await asyncio.wait({get, agent},
                                             timeout=self.cfg.endpoint.idle_timeout_s,
                                             return_when=asyncio.FIRST_COMPLETED)
                if get not in done:
                    get.cancel()
                else:
                    body, fut = get.result()
                    await self._serve(manager, ep, conv, traj, body, fut)
                    continue
                if agent in done:
                    break
                traj.end_reason = EndReason.timeout
                traj.error = (f"task {tid}: the agent sent nothing for env.endpoint."
                              f"idle_timeout_s={self.cfg.endpoint.idle_timeout_s:g}s")
                agent.cancel()
                return
        except asyncio.CancelledError:
            agent.cancel()
            raise
        finally:
            if get is not None and not get.done():
                get.cancel()
            self.endpoint.close(tid, "its episode ended")
        try:
            returned = agent.result()
        except Exception as e:  # noqa: BLE001 - the user's agent failing is this task's failure
            traj.end_reason = EndReason.env_error
            traj.error = f"task {tid}: agent {self.cfg.agent} raised {type(e).__name__}: {e}"
            log.warning("%s", traj.error)
            return
        if conv.turns == 0:
            traj.end_reason = EndReason.env_error
            traj.error = (f"task {tid}: agent {self.cfg.agent} returned without a chat request "
                          "to its base_url")
            return
        if traj.end_reason == EndReason.cancelled:
            traj.end_reason = EndReason.done
        last = next((m for m in reversed(conv.messages) if m["role"] == "assistant"), {})
        await self._reward_of(ep.spec, conv, traj, session.reward, returned,
                              last.get("content") or "")

    async def _serve(self, manager: Any, ep: Any, conv: Conversation, traj: Trajectory,
                     body: dict[str, Any], fut: asyncio.Future) -> None:
        try:
            if traj.end_reason == EndReason.context_limit:  # the agent may still finish
                raise ChatError(400, f"task {ep.task.task_id!r} takes no more turns: its context "
                                     "reached rollout.max_context",
                                code="context_length_exceeded")
            p, reply = await self._turn(manager, ep, conv, body, traj)
        except ChatError as e:
            if e.code == "context_length_exceeded":
                traj.end_reason = EndReason.context_limit
            if e.code == "turn_limit":
                traj.end_reason = EndReason.turn_limit
            if not fut.done():
                fut.set_exception(e)
            return
        if not fut.done():
            fut.set_result(completion(reply, model=self.cfg.endpoint.model_name, conv=conv,
                                      pending=p, task_id=ep.task.task_id))

    async def _reward_of(self, spec: Mapping[str, Any], conv: Conversation, traj: Trajectory,
                         posted: tuple[float, dict] | None, returned: Any, text: str) -> None:
        if posted is not None:
            traj.reward, traj.info = posted[0], dict(posted[1])
            return
        value, info = returned, {}
        if isinstance(returned, Mapping):
            value = returned.get("reward")
            info = {str(k): v for k, v in returned.items() if k != "reward"}
        if value is not None:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(
                    value):
                traj.end_reason = EndReason.bad_reward
                traj.error = (f"task {traj.task_id}: agent {self.cfg.agent} returned "
                              f"{returned!r}; return a finite number, {{'reward': ...}} or None")
                return
            traj.reward, traj.info = float(value), info
            return
        await self._score(spec, conv, traj, text, done=traj.end_reason == EndReason.done,
                          info=info)


@contextlib.asynccontextmanager
async def episode_backend(cfg: EnvConfig, template: Any, *, max_action_tokens: int,
                          temperature: float, system: str | None = None
                          ) -> AsyncIterator[tuple[Any, EpisodeRunner | None]]:
    """(env client or None, episode runner or None) for the run's kind of task: an env server
    (in-process or env.url, scored by env.reward when set), single-turn tasks, or agents."""
    from tiderl.envs.client import EnvClient
    from tiderl.envs.server import endpoint

    reward = RewardFn(cfg.reward, timeout_s=cfg.reward_timeout_s) if cfg.reward else None
    try:
        if cfg.kind == "env":
            async with endpoint(cfg) as url, EnvClient(url, cfg) as env:
                yield (env if reward is None else RewardedEnv(env, reward)), None
            return
        renderer = ChatRenderer(template)
        if cfg.kind == "single_turn":
            runner = EpisodeRunner(cfg, renderer, max_action_tokens=max_action_tokens,
                                   temperature=temperature, reward=reward, system=system)
            yield None, runner
            return
        try:
            renderer.check()
        except ValueError as e:
            from tiderl.configlib import ConfigError

            raise ConfigError(f"env.agent: the chat template of model.tokenizer: {e}") from e
        ep = AgentEndpoint(cfg.endpoint)
        runner = EpisodeRunner(cfg, renderer, max_action_tokens=max_action_tokens,
                               temperature=temperature, reward=reward, endpoint=ep)
        try:
            async with ep.serve():
                yield None, runner
        finally:
            runner.close()
    finally:
        if reward is not None:
            reward.close()
