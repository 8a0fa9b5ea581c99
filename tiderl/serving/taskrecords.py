"""What the schedulers keep of a task and what they decide about it. No JAX.

`Task` is one trajectory as the scheduler sees it (its state, rank, size and phase); `Admit`,
`Pause` and `Resume` are the decisions a scheduling round returns. Shared by the task table
(`tasktable.py`, which re-exports them), CTB, the request-level baseline, the release valve and
preemption.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

State = Literal["new", "active", "paused", "done"]


@dataclasses.dataclass
class Task:
    """What the scheduler knows of one task (one trajectory)."""

    task_id: str
    group_id: str
    prompt_tokens: int
    is_eval: bool = False
    task_type: str = ""
    tokens: int = 0
    """Current context length (prompt + turns so far)."""
    state: State = "new"
    rank: int | None = None
    """Where the task is active, or (paused) where its KV may still be resident."""
    executing: bool = False
    """In a prefill/decode now (vs waiting on its environment)."""
    measured: bool = False
    """Its context length has been reported (`update_usage`); until then usage uses the probe."""
    turns: int = 0
    """Turns started (`update_usage` calls)."""
    ready: bool = False
    """Its environment answered: it wants the engine for its next turn (cleared when the turn
    starts executing)."""
    since: float = 0.0
    """When it entered its current phase (executing, ready or waiting on its environment)."""
    answered: float = 0.0
    """When its environment last answered (its turn's time outside the environment, waiting
    for room and the engine included, runs from here to the turn's end)."""
    parked: bool = False
    """Paused by the release valve while it waits on its environment: it holds no budget and
    is not resumed until its environment answers (CTB's `park_below_busy`)."""

    def __post_init__(self):
        self.tokens = max(self.tokens, self.prompt_tokens)


@dataclasses.dataclass(frozen=True)
class Admit:
    task_id: str
    rank: int


@dataclasses.dataclass(frozen=True)
class Pause:
    task_id: str
    rank: int
    parked: bool = False
    """Released while it waits on its environment (CTB's release valve), not over budget."""


@dataclasses.dataclass(frozen=True)
class Resume:
    task_id: str
    rank: int
    migrated: bool
    """True when the task resumes on a rank other than the one that held its KV."""


Decision = Admit | Pause | Resume


LIVE_STATES = ("active", "paused")
