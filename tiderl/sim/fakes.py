"""Cost-model stand-ins for the engine, the trainer and the environments, on the event loop's
clock. No JAX: with these, the real control plane (controller, CTB, ranks, buffer) runs on a
virtual-time loop (looptime), which is the seam the cluster-scale simulator builds on.

- `SimEngine` (from `tiderl.sim.virtual_engine`) implements the engine contract on host data only; with
  no cost model its calls cost no time. Tokens are drawn keyed by (task, position), so a
  trajectory does not depend on batching.
- `FlatTrainer` here is the flat stand-in: a step costs `per_mb_s` of loop time per micro-batch
  (the cost-model trainer is `tiderl.sim.trainer.SimTrainer`).
- `SimGuessEnv` is the default task (guess 1..n) behind the env-client interface, with a fixed
  per-step latency in loop time.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from tiderl.envs.adapters.default import GuessNumber
from tiderl.envs.protocol import EndResult, OpResult, StartResult, StepResult
from tiderl.sim.virtual_engine import SimEngine

__all__ = ["SimEngine", "SimGuessEnv", "FlatTrainer"]


class FlatTrainer:
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
class _GuessSession:
    game: GuessNumber
    turns: int = 0


class SimGuessEnv:
    """The default task behind the env-client interface, `step_s` of loop time per step."""

    def __init__(self, *, step_s: float = 1.0, options: dict[str, str] | None = None):
        self.step_s = step_s
        self.options = options or {}
        self.sessions: dict[str, _GuessSession] = {}
        self.paused: set[str] = set()
        self.pauses = 0
        self._n = 0

    async def start(self, task: dict) -> StartResult:
        self._n += 1
        sid = f"s{self._n}"
        game = GuessNumber(self.options)
        obs = game.reset(task)
        self.sessions[sid] = _GuessSession(game)
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
