"""The calculator task's reward function: `env.reward=examples.calculator.reward:score`.

1 for the right number in the final answer; otherwise 0.1 when the answer holds a number at all
(a policy trained from scratch learns the format first)."""

from __future__ import annotations

import re
from typing import Any

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def score(task: dict[str, Any], transcript: Any) -> dict[str, Any]:
    numbers = _NUMBER.findall(transcript.completion)
    correct = bool(numbers) and float(numbers[-1]) == float(task["answer"])
    reward = 1.0 if correct else 0.1 if numbers else 0.0
    return {"reward": reward, "correct": correct}
