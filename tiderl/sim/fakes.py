"""Cost-model stand-ins for the engine, the trainer and the environments, on the event loop's
clock. No JAX: with these, the real control plane (controller, CTB, ranks, buffer) runs on a
virtual-time loop (looptime), which is the seam the cluster-scale simulator builds on.

- `SimEngine` implements the engine contract on host data only: prefill/decode cost time in
  the rank's worker thread is not modelled; instead every call records a cost the rank's
  owner can charge. Tokens are drawn from a seeded RNG keyed like the real sampler, so a
  trajectory does not depend on batching.
- `SimTrainer` implements the trainer-backend contract; a step costs `per_mb_s` of loop time
  per micro-batch.
- `SimGuessEnv` is the default task (guess 1..n) behind the env-client interface, with a fixed
  per-step latency in loop time.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random
from typing import Any

from tiderl.envs.adapters.default import GuessNumber
from tiderl.envs.protocol import EndResult, OpResult, StartResult, StepResult
from tiderl.serving.pages import EngineCounters, Prefix, ResultTokens, StopReason

DIGITS = [ord(str(d)) for d in range(1, 10)]


class SimEngine:
    """The engine contract without a model: samples digit tokens, tracks residency exactly."""

    def __init__(self, *, seed: int = 0, max_action_tokens: int = 1, max_context: int = 512,
                 stop_tokens: tuple[int, ...] = ()):
        self.seed, self.version = seed, 0
        self.max_action_tokens, self.max_context = max_action_tokens, max_context
        self.stop_tokens = stop_tokens
        self.counters = EngineCounters()
        self.slots: dict[int, Prefix] = {}
        self._next_slot = 0

    def init_decode_state(self) -> dict:
        return {}

    def update_weights(self, params: Any, *, version: int | None = None) -> None:
        self.version = self.version + 1 if version is None else version
        for p in self.slots.values():
            if p.version != self.version:
                p.kv_length = 0

    def _sample(self, p: Prefix) -> None:
        rng = random.Random(hash((self.seed, p.task_id, len(p.tokens))))
        tok = rng.choice(DIGITS)
        p.tokens.append(tok)
        p.logprobs.append(-2.2)
        p.versions.append(self.version)
        if len(p.action_tokens) >= p.max_action_tokens:
            p.stop_reason = StopReason.MAX_ACTION_TOKENS

    def prefill(self, params, existing_prefix: Prefix | None, tokens, true_length: int, *,
                task_id: int | None = None, **_: Any) -> Prefix:
        p = existing_prefix or Prefix(task_id=int(task_id or 0),
                                      max_action_tokens=self.max_action_tokens)
        new = list(tokens)[:true_length]
        if len(p.tokens) + len(new) + 1 > self.max_context:
            p.stop_reason = StopReason.CONTEXT_LIMIT
            return p
        if p.slot is None:
            p.slot, self._next_slot = self._next_slot, self._next_slot + 1
            self.slots[p.slot] = p
        resident = p.kv_length if p.version == self.version else 0
        p.tokens.extend(new)
        end = len(p.tokens)
        self.counters.prompt_tokens_queried += end
        self.counters.prompt_tokens_served += resident
        self.counters.computed_new += end - resident
        self.counters.prefill_calls += 1
        p.prefill_cached, p.prefill_computed = resident, end - resident
        if new:
            p.action_start, p.logprobs, p.versions = end, [], []
            p.stop_reason = StopReason.NONE
        p.kv_length, p.version = end, self.version
        self._sample(p)
        p.decoding = False
        return p

    def insert(self, prefix: Prefix, state: dict, slot: int | None = None) -> dict:
        prefix.decoding = not prefix.done
        return state

    def generate(self, params, state: dict) -> tuple[dict, ResultTokens]:
        active = [p for p in self.slots.values() if p.decoding]
        for p in active:
            p.kv_length = len(p.tokens)
            self._sample(p)
            p.decoding = not p.done
        n = len(active)
        import numpy as np

        res = ResultTokens(np.asarray([p.slot for p in active], np.int32),
                           np.asarray([p.tokens[-1] for p in active], np.int32),
                           np.full(n, -2.2, np.float32),
                           np.asarray([len(p.tokens) for p in active], np.int32),
                           np.asarray([int(p.stop_reason) for p in active], np.int32))
        self.counters.decode_steps += 1
        return state, res

    def evict(self, prefix: Prefix | int) -> Prefix:
        p = prefix if isinstance(prefix, Prefix) else self.slots[prefix]
        self.slots.pop(p.slot, None)
        p.slot, p.kv_length, p.decoding = None, 0, False
        return p

    def free(self, prefix: Prefix | int) -> None:
        self.evict(prefix)

    def stats(self) -> dict[str, float]:
        return {"slots_in_use": len(self.slots), "version": self.version}


class SimTrainer:
    """The trainer-backend contract in loop time: `per_mb_s` per submitted micro-batch."""

    def __init__(self, *, per_mb_s: float = 0.5):
        self.per_mb_s = per_mb_s
        self.version = 0
        self.submitted: list[Any] = []
        self.steps: list[dict] = []

    def submit(self, mb: Any) -> None:
        self.submitted.append(mb)

    async def finish_step_async(self) -> dict:
        n = len(self.submitted)
        await asyncio.sleep(self.per_mb_s * n)
        tokens = sum(int(mb.loss_mask_bt.sum()) for mb in self.submitted)
        self.submitted = []
        self.version += 1
        m = {"loss": 0.0, "grad_norm": 0.0, "microbatches": n, "action_tokens": tokens,
             "time_wait": 0.0, "version": self.version}
        self.steps.append(m)
        return m

    async def export_weights_async(self) -> int:
        return self.version


@dataclasses.dataclass
class _Session:
    game: GuessNumber
    turns: int = 0


class SimGuessEnv:
    """The default task behind the env-client interface, `step_s` of loop time per step."""

    def __init__(self, *, step_s: float = 1.0, options: dict[str, str] | None = None):
        self.step_s = step_s
        self.options = options or {}
        self.sessions: dict[str, _Session] = {}
        self.paused: set[str] = set()
        self.pauses = 0
        self._n = 0

    async def start(self, task: dict) -> StartResult:
        self._n += 1
        sid = f"s{self._n}"
        game = GuessNumber(self.options)
        obs = game.reset(task)
        self.sessions[sid] = _Session(game)
        return StartResult(session=sid, observation=obs)

    async def step(self, session: str, action: str) -> StepResult:
        await asyncio.sleep(self.step_s)
        s = self.sessions[session]
        s.turns += 1
        st = s.game.step(action)
        return StepResult(observation=st.observation, done=st.done, reward=st.reward,
                          turn=s.turns)

    async def end(self, session: str) -> EndResult:
        s = self.sessions.pop(session)
        reward, info = s.game.close()
        return EndResult(reward=reward, info=info)

    async def pause(self, session: str) -> OpResult:
        self.paused.add(session)
        self.pauses += 1
        return OpResult()

    async def resume(self, session: str) -> OpResult:
        self.paused.discard(session)
        return OpResult()
