"""Gymnasium toy-text games (FrozenLake, Taxi, CliffWalking, Blackjack) rendered as text. No JAX.

Observations are small text renderings of the state; actions are the game's action names
("left", "pickup", "hit", ...) or their integer ids. The episode reward is the sum of
gymnasium's own step rewards, so a fixed action sequence scores exactly what it scores in
gymnasium. An unparseable action does not touch the environment: it costs a turn and answers
with the list of valid actions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiderl.envs.adapters.base import Adapter, Step, TaskError, int_option

ACTIONS: dict[str, tuple[str, ...]] = {
    "FrozenLake-v1": ("left", "down", "right", "up"),
    "FrozenLake8x8-v1": ("left", "down", "right", "up"),
    "Taxi-v4": ("south", "north", "east", "west", "pickup", "dropoff"),
    "CliffWalking-v1": ("up", "right", "down", "left"),
    "Blackjack-v1": ("stick", "hit"),
}
_TAXI_PLACES = ("R", "G", "Y", "B")


def _bool(raw: Any, name: str) -> bool:
    if isinstance(raw, bool):
        return raw
    if str(raw).lower() in ("1", "true", "yes"):
        return True
    if str(raw).lower() in ("0", "false", "no"):
        return False
    raise TaskError(f"task field '{name}' must be a boolean, got {raw!r}")


class GymText(Adapter):
    """One gymnasium toy-text episode; task fields: game, seed, and optional is_slippery,
    max_steps."""

    client_options = frozenset({"game", "is_slippery", "max_steps"})

    def __init__(self, options: Mapping[str, str] | None = None):
        super().__init__(options)
        self.game = self.options.get("game", "FrozenLake-v1")
        if self.game not in ACTIONS:
            raise TaskError(f"game {self.game!r} is not supported; use one of "
                            f"{', '.join(ACTIONS)}")
        self.env: Any = None
        self.total = 0.0
        self.steps = 0
        self.done = False
        self.last_obs: Any = None

    @classmethod
    def task_fields(cls, seed: int, options: Mapping[str, str]) -> dict[str, Any]:
        fields: dict[str, Any] = {"seed": seed, "game": options.get("game", "FrozenLake-v1")}
        for key in ("is_slippery", "max_steps"):
            if key in options:
                fields[key] = options[key]
        return fields

    def reset(self, task: Mapping[str, Any]) -> str:
        import gymnasium as gym

        self.game = str(task.get("game", self.game))
        if self.game not in ACTIONS:
            raise TaskError(f"task field 'game'={self.game!r} is not supported; use one of "
                            f"{', '.join(ACTIONS)}")
        kwargs: dict[str, Any] = {}
        if self.game.startswith("FrozenLake"):
            kwargs["is_slippery"] = _bool(task.get("is_slippery", True), "is_slippery")
        if "max_steps" in task:
            kwargs["max_episode_steps"] = int_option(task, "max_steps", 100)
        seed = int_option(task, "seed", 0, lo=0, hi=(1 << 32) - 1)
        self.env = gym.make(self.game, **kwargs)
        obs, _ = self.env.reset(seed=seed)
        self.last_obs = obs
        return f"{self._intro()}\n{self._render(obs)}"

    def _intro(self) -> str:
        names = ", ".join(ACTIONS[self.game])
        legend = {
            "FrozenLake": "Reach G over frozen F without falling in a hole H. P is you.",
            "Taxi": "Pick up the passenger and drop them at the destination.",
            "CliffWalking": "Walk from x to T without stepping on the cliff C.",
            "Blackjack": "Get closer to 21 than the dealer without going over.",
        }[self.game.split("-")[0].removesuffix("8x8")]
        return f"{self.game}. {legend} Actions: {names}."

    def _render(self, obs: Any) -> str:
        env = self.env.unwrapped
        if self.game.startswith("FrozenLake"):
            rows = [[c.decode() for c in row] for row in env.desc]
            r, c = divmod(int(obs), env.ncol)
            rows[r][c] = "P"
            return "\n".join("".join(row) for row in rows)
        if self.game.startswith("CliffWalking"):
            nrow, ncol = env.shape
            rows = [["o"] * ncol for _ in range(nrow)]
            for c in range(1, ncol - 1):
                rows[nrow - 1][c] = "C"
            rows[nrow - 1][ncol - 1] = "T"
            r, c = divmod(int(obs), ncol)
            rows[r][c] = "x"
            return "\n".join(" ".join(row) for row in rows)
        if self.game.startswith("Taxi"):
            row, col, passenger, dest = env.decode(int(obs))
            where = "in the taxi" if passenger == 4 else f"at {_TAXI_PLACES[passenger]}"
            grid = [[c.decode() for c in line] for line in env.desc]
            grid[1 + row][2 * col + 1] = "T"
            return ("\n".join("".join(line) for line in grid)
                    + f"\ntaxi at row {row} col {col}; passenger {where}; destination "
                      f"{_TAXI_PLACES[dest]}")
        player, dealer, usable = obs
        return (f"your sum {int(player)}, dealer shows {int(dealer)}, usable ace "
                f"{'yes' if usable else 'no'}")

    def parse(self, action: str) -> int | None:
        """The action id of `action` (a name or an integer id), or None."""
        text = action.strip().lower()
        names = ACTIONS[self.game]
        if text in names:
            return names.index(text)
        if text.isdigit() and int(text) < len(names):
            return int(text)
        return None

    def step(self, action: str) -> Step:
        if self.env is None or self.done:
            raise RuntimeError("step before reset or after the episode ended")
        self.steps += 1
        a = self.parse(action)
        if a is None:
            return Step(f"invalid action {action[:32]!r}; use one of "
                        f"{', '.join(ACTIONS[self.game])}", False, 0.0)
        obs, reward, terminated, truncated, _ = self.env.step(a)
        self.last_obs = obs
        self.total += float(reward)
        self.done = bool(terminated or truncated)
        return Step(self._render(obs), self.done, float(reward))

    def close(self) -> tuple[float, dict[str, Any]]:
        if self.env is not None:
            self.env.close()
        return self.total, {"game": self.game, "steps": self.steps, "done": self.done}
