"""Simulated agent environments behind the env-client interface, on the loop's clock. No JAX.

`SimAgentEnv` plays each task's `TaskPlan` (tiderl.sim.workloads): `/start` returns a prompt of
the planned length, each `/observation` waits the planned latency and returns an observation of
the planned length until the planned rounds are played, `/end` gives reward 1 to successful
tasks. Observation text is one byte per token under the byte tokenizer, so context lengths are
exactly the plan's (plus the turn template's few role tokens). A GUI workload's screenshot
(`Workload.image_tokens`) is a run of `IMAGE` characters: after the prompt's text (so the
prompt's text is the head the sliding window keeps), before each observation's text (where the
vision-language policy's placeholders go).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from tiderl.envs.protocol import EndReason, EndResult, OpResult, StartResult, StepResult
from tiderl.sim.workloads import Sampler, TaskPlan

IMAGE = "i"
"""A screenshot's image tokens, one character per token under the byte tokenizer."""


@dataclasses.dataclass
class _SimSession:
    task_id: str
    plan: TaskPlan
    turns: int = 0
    image_tokens: int = 0


class SimAgentEnv:
    """Workload-driven sessions; `step_of()` gives the training step (the drift's clock)."""

    def __init__(self, sampler: Sampler, *, step_of: Callable[[], int] = lambda: 0):
        self.sampler, self.step_of = sampler, step_of
        self.sessions: dict[str, _SimSession] = {}
        self.pauses = 0
        self.resumes = 0
        self.started = 0
        self.env_s = 0.0
        """Seconds of environment time served (all sessions)."""

    async def start(self, task: dict) -> StartResult:
        suite = task.get("suite", "")
        if suite not in self.sampler.workloads:
            return StartResult(reason=EndReason.env_error,
                               error=f"task suite {suite!r} is not a workload of this sim")
        plan = self.sampler.plan(suite, task["task_id"], self.step_of())
        self.started += 1
        sid = f"s{self.started}"
        self.sessions[sid] = _SimSession(task["task_id"], plan,
                                         image_tokens=self.sampler.workloads[suite].image_tokens)
        if plan.start_s:
            self.env_s += plan.start_s
            await asyncio.sleep(plan.start_s)
        w = self.sampler.workloads[suite]
        return StartResult(session=sid, observation="p" * w.prompt_tokens
                           + IMAGE * w.image_tokens)

    async def step(self, session: str, action: str) -> StepResult:
        s = self.sessions.get(session)
        if s is None:
            return StepResult(done=True, reason=EndReason.env_error, error="unknown session")
        lat = s.plan.latency_s[min(s.turns, len(s.plan.latency_s) - 1)]
        self.env_s += lat
        await asyncio.sleep(lat)
        s.turns += 1
        if s.turns >= s.plan.rounds:
            return StepResult(done=True, reward=float(s.plan.success), turn=s.turns)
        return StepResult(observation=IMAGE * s.image_tokens
                          + "o" * s.plan.obs_tokens[s.turns - 1], turn=s.turns)

    async def end(self, session: str) -> EndResult:
        s = self.sessions.pop(session, None)
        if s is None:
            return EndResult(reason=EndReason.env_error, error="unknown session")
        self.sampler.forget(s.task_id)
        return EndResult(reward=float(s.plan.success), info={"turns": s.turns})

    async def pause(self, session: str) -> OpResult:
        self.pauses += 1
        return OpResult()

    async def resume(self, session: str) -> OpResult:
        self.resumes += 1
        return OpResult()


class SimSuiteEnv:
    """A built-in suite's adapter (e.g. the default task) behind the env-client interface, with
    the server's injected latency (`tiderl.envs.latency`, same seeds: the same delays per task
    and turn as the real server) and its turn cap, plus `overhead_s` of host work per call (the
    event loop's CPU time the real client and server spend on it, from the profile's
    `env_call`, measured by `tiderl.sim.hostcost`). With `server_s`, the server runs in a
    process of its own: `overhead_s` is the client's share alone (`env_client`) and each call
    also takes `server_s` of the server's one thread (`env_server`), one call at a time in the
    order they arrive: a queue that runs at its own pace, not the job's event loop's (its
    process has a core of its own), its work in flight on the shared host meanwhile.

    `trace` ({(task id, turn): action text}, recorded from a real run) replays the real
    policy's actions: the simulated engine only decides how many tokens an action has, so
    with a trace the simulated episodes play exactly the real ones (same turns, rewards and
    dropped groups); tasks the trace lacks play the engine's own actions."""

    def __init__(self, cfg: Any, *, overhead_s: float = 0.0, server_s: float = 0.0,
                 trace: dict[tuple[str, int], str] | None = None, host: Any = None):
        from tiderl.envs.latency import LatencyModel
        from tiderl.envs.suites import adapter_class

        self.cfg, self.overhead_s, self.server_s, self.host = cfg, overhead_s, server_s, host
        self._make = adapter_class(cfg.suite_name)
        self._options = cfg.option_dict()
        self._latency = LatencyModel(cfg.latency)
        self.trace = trace or {}
        self.replayed = 0
        self.sessions: dict[str, list] = {}
        self.pauses = 0
        self._n = 0
        self._loop = asyncio.Lock()  # the event loop the real job serves the suite on
        self._server_free = 0.0
        """When the served env's thread (with `server_s`) is next free, on the loop's clock."""

    async def _overhead(self) -> None:
        """The call's host work (`overhead_s`): on a `VirtualLoop`, held on the loop (the real
        client and server run on the job's event loop, so nothing else on it runs meanwhile)
        and on the shared host; on another loop, a wait behind the calls before it."""
        if not self.overhead_s:
            return
        h = self.host
        hold = getattr(asyncio.get_running_loop(), "hold", None)
        if hold is not None:
            hold(self.overhead_s, h)
            await asyncio.sleep(0)  # resumes once the held time has passed
            return
        async with self._loop:
            await asyncio.sleep(h.fixed(self.overhead_s) if h is not None else self.overhead_s)

    async def _call(self) -> None:
        """A call's host work: the client's (and an in-process server's) on the job's loop,
        then a served env's on its own thread. The server's queue is kept on the clock, not
        in coroutines taking turns: the job's loop, held by other work, delays when the
        caller takes the answer, not when the server serves the next call."""
        await self._overhead()
        if not self.server_s:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        start = max(now, self._server_free)
        end = self._server_free = start + self.server_s
        if start > now:
            await asyncio.sleep(start - now)
        if self.host is not None:  # late when the loop was held: the part left registers
            self.host.beside(end - loop.time())
        await asyncio.sleep(max(0.0, end - loop.time()))

    async def start(self, task: dict) -> StartResult:
        await self._call()
        adapter = self._make(self._options)
        tid = str(task.get("task_id"))
        delay = self._latency.sample(tid, 0)
        if delay:
            await asyncio.sleep(delay)
        obs = adapter.reset(task)
        self._n += 1
        sid = f"s{self._n}"
        self.sessions[sid] = [adapter, tid, 0]
        return StartResult(session=sid, observation=str(obs))

    async def step(self, session: str, action: str) -> StepResult:
        await self._call()
        s = self.sessions[session]
        adapter, tid, turn = s
        delay = self._latency.sample(tid, turn + 1)
        if delay:
            await asyncio.sleep(delay)
        recorded = self.trace.get((tid, turn))
        if recorded is not None:
            action = recorded
            self.replayed += 1
        st = adapter.step(action)
        s[2] = turn = turn + 1
        done = bool(st.done) or turn >= self.cfg.max_turns
        return StepResult(observation=str(st.observation), done=done,
                          reward=None if st.reward is None else float(st.reward), turn=turn,
                          truncated="turn_limit" if done and not st.done else "")

    async def end(self, session: str) -> EndResult:
        await self._call()
        adapter = self.sessions.pop(session)[0]
        reward, info = adapter.close()
        return EndResult(reward=float(reward), info=info)

    async def pause(self, session: str) -> OpResult:
        await self._call()
        self.pauses += 1
        return OpResult()

    async def resume(self, session: str) -> OpResult:
        await self._call()
        return OpResult()
