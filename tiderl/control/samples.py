"""Sample trajectories of each evaluation, decoded with the run's tokenizer. No JAX.

`<run_dir>/samples/step_K.jsonl` holds one JSON object per trajectory: its ids, reward, end
reason, turns, the env's end info, `observations` and `actions` (the token runs the policy
saw and sampled, decoded without special tokens — an action made only of special tokens
keeps them — observation i came before action i; the first observation includes the system
turn and the task's prompt) and `text` (the whole
token sequence decoded with its special tokens, exactly what the model saw).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

Decode = Callable[..., str]
"""`decode(ids, skip_special=bool) -> str`, as both tiderl tokenizers have it."""


def runs(mask: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, mask value) of each maximal run of equal loss-mask values."""
    out: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((start, i, int(mask[start])))
            start = i
    return out


def decode_trajectory(traj: Any, decode: Decode) -> dict[str, Any]:
    """One finished `Trajectory` as plain text fields (see the module docstring)."""
    tokens = list(traj.tokens)
    observations: list[str] = []
    actions: list[str] = []
    for start, end, is_action in runs(list(traj.loss_mask)):
        text = decode(tokens[start:end], skip_special=True).strip()
        if is_action:
            # An action of special tokens only (an untrained policy's, often): show them.
            text = text or decode(tokens[start:end], skip_special=False)
            if len(observations) == len(actions):  # two actions in a row: an empty observation
                observations.append("")
            actions.append(text)
        else:
            observations.append(text)
    return {
        "task_id": traj.task_id, "group_id": traj.group_id, "reward": float(traj.reward),
        "end_reason": str(traj.end_reason), "turns": int(traj.turns), "error": traj.error,
        "info": dict(traj.info), "observations": observations, "actions": actions,
        "response_tokens": int(sum(traj.loss_mask)), "tokens": len(tokens),
        "text": decode(tokens, skip_special=False),
    }


def one_line(sample: dict[str, Any], limit: int = 400) -> str:
    """A decoded trajectory on one console line: `obs » action │ obs » action …`."""
    parts = []
    for i, obs in enumerate(sample["observations"]):
        act = sample["actions"][i] if i < len(sample["actions"]) else None
        parts.append(_flat(obs) + (f" » {_flat(act)!r}" if act is not None else ""))
    line = " │ ".join(parts)
    head = (f"{sample['task_id']} reward {sample['reward']:.2f} ({sample['end_reason']}, "
            f"{sample['turns']} turns): ")
    body = line if len(line) <= limit else line[:limit] + " …"
    return head + body


def _flat(text: str) -> str:
    return " ".join(text.split())


class SampleWriter:
    """Writes the first `n` trajectories of each evaluation to `samples/step_K.jsonl`."""

    def __init__(self, run_dir: str | Path, decode: Decode, n: int):
        self.dir = Path(run_dir) / "samples"
        self.decode = decode
        self.n = n

    def write(self, step: int, trajs: Sequence[Any]) -> tuple[Path, list[dict[str, Any]]]:
        samples = [decode_trajectory(t, self.decode) for t in list(trajs)[: self.n]]
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"step_{step}.jsonl"
        path.write_text("".join(json.dumps(s) + "\n" for s in samples))
        return path, samples
