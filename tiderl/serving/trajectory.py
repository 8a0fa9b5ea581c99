"""What rollout hands the trainer: one finished task token in / token out (`Trajectory`), and
the end reasons that carry a verdict (`VERDICTS`). No JAX.

`RolloutManager` (serving/rollout.py) and the agent runner (agents/runner.py) fill them in; the
readiness buffer (control/buffer.py) turns finished groups of them into trainable sequences.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from tiderl.envs.protocol import EndReason

VERDICTS = frozenset({EndReason.done, EndReason.turn_limit, EndReason.context_limit,
                      EndReason.action_too_long})
"""End reasons of a trainable trajectory (the others carry no verdict)."""


@dataclasses.dataclass
class Trajectory:
    """One finished task, token in / token out: exactly the ids the engine saw and produced."""

    task_id: str
    group_id: str
    is_eval: bool
    tokens: list[int]
    loss_mask: list[int]
    """1 on action tokens (what the policy sampled), 0 on prompt/observation/template tokens."""
    logprobs: list[float]
    """Behaviour logprob of each token (0 where loss_mask is 0)."""
    versions: list[int]
    """Weight version that sampled each token (-1 where loss_mask is 0)."""
    reward: float
    end_reason: EndReason
    turns: int
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str = ""
    info: dict[str, Any] = dataclasses.field(default_factory=dict)
    finished_at: float = 0.0
    images: list[Any] = dataclasses.field(default_factory=list)
    """A vision-language policy's images, in the order of their placeholder runs in `tokens`
    (each `(patch rows, grid_thw)`, as the engine took them)."""
    segments: list[Any] = dataclasses.field(default_factory=list)
    """Parts cut off earlier by the sliding image window (train/image_window.py `Segment`s, in
    order); each trains as a sequence of its own with the trajectory's advantage. The fields
    above hold the last part (the context the task ended in)."""

    @property
    def ok(self) -> bool:
        """Trainable: the episode ran to a verdict (done, a turn, context or action-length
        limit) with a finite reward."""
        return self.end_reason in VERDICTS and math.isfinite(self.reward)

    @property
    def min_version(self) -> int:
        """The oldest weight version that sampled a token of it (its cut segments too)."""
        # Over the distinct versions (a handful) rather than every token (thousands).
        seen = set(self.versions).union(*(s.versions for s in self.segments))
        return min((v for v in seen if v >= 0), default=-1)

    @property
    def action_token_count(self) -> int:
        """Sampled tokens, its cut segments' included."""
        return sum(self.loss_mask) + sum(sum(s.loss_mask) for s in self.segments)
