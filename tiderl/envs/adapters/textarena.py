"""TextArena single-player games that run offline (GuessTheNumber, TowerOfHanoi, ...). No JAX.

Only games checked to run with no network and no API key are allowed: Wordle, WordLadder and
Hangman fetch NLTK corpora at reset and TwentyQuestions calls a hosted LLM, so they are out.
Games use their '-raw' registrations (no LLM prompt wrappers); the adapter renders the game's
messages to the player as text, skipping the echo of the player's own action. TextArena reads
moves in square brackets; a bare action like `5` is sent as `[5]`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tiderl.envs.adapters.base import Adapter, Step, TaskError, int_option

OFFLINE_GAMES = (
    "GuessTheNumber-v0", "TowerOfHanoi-v0", "Mastermind-v0", "Minesweeper-v0-small",
    "FrozenLake-v0", "LightsOut-v0", "FifteenPuzzle-v0", "Countdown-v0", "Cryptarithm-v0",
    "Sudoku-v0-very-easy", "Crosswords-v0",
)


class TextArenaGame(Adapter):
    """One single-player TextArena episode; task fields: game, seed."""

    client_options = frozenset({"game"})

    def __init__(self, options: Mapping[str, str] | None = None):
        super().__init__(options)
        self.game = self.options.get("game", "GuessTheNumber-v0")
        self._check(self.game, "suite option 'game'")
        self.env: Any = None
        self.done = False
        self.turns = 0

    @staticmethod
    def _check(game: str, where: str) -> None:
        if game not in OFFLINE_GAMES:
            raise TaskError(f"{where}={game!r} is not an offline single-player game; use one "
                            f"of {', '.join(OFFLINE_GAMES)}")

    @classmethod
    def task_fields(cls, seed: int, options: Mapping[str, str]) -> dict[str, Any]:
        return {"seed": seed % (1 << 31), "game": options.get("game", "GuessTheNumber-v0")}

    def reset(self, task: Mapping[str, Any]) -> str:
        import textarena

        self.game = str(task.get("game", self.game))
        self._check(self.game, "task field 'game'")
        seed = int_option(task, "seed", 0, lo=0, hi=(1 << 31) - 1)
        self.env = textarena.make(self.game + "-raw")
        self.env.reset(num_players=1, seed=seed)
        return self._observe()

    def _observe(self) -> str:
        from textarena.core import ObservationType

        _, messages = self.env.get_observation()
        return "\n".join(str(text) for sender, text, kind in messages
                         if kind != ObservationType.PLAYER_ACTION).strip()

    def step(self, action: str) -> Step:
        if self.env is None or self.done:
            raise RuntimeError("step before reset or after the episode ended")
        move = action.strip()
        if "[" not in move:
            move = f"[{move}]"
        self.turns += 1
        done, _ = self.env.step(move)
        self.done = bool(done)
        reward = self._reward() if self.done else 0.0
        return Step(self._observe(), self.done, reward)

    def _reward(self) -> float:
        rewards = getattr(self.env.state, "rewards", None)
        return float(rewards.get(0, 0.0)) if rewards else 0.0

    def close(self) -> tuple[float, dict[str, Any]]:
        if self.env is None:
            return 0.0, {}
        rewards, game_info = self.env.close()
        info = dict((game_info or {}).get(0, {}))
        info.update({"game": self.game, "finished": self.done, "turns": self.turns})
        reward = float(rewards.get(0, 0.0)) if rewards else 0.0
        self.env = None
        return reward, info
