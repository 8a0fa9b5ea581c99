"""TextWorld games generated and compiled locally from seeds (the engine under ALFWorld). No JAX.

A task names a seed and the world's shape (rooms, objects, quest length); the game is generated
and compiled once into a cache folder (~2-3 s) and reused by every session of that seed, so a
GRPO group of 8 compiles once. Reward: the in-game score normalised by the maximum score, so
playing the walkthrough ends with reward 1.0.
"""

from __future__ import annotations

import os
import re
import tempfile
import threading
from collections.abc import Mapping
from typing import Any

from tiderl.envs.adapters.base import Adapter, Step, int_option

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
# The ASCII-art TextWorld banner printed before the first room: lines of only these characters.
_BANNER_LINE = re.compile(r"^[\s$|\\/_<>]*$")


def default_cache_dir() -> str:
    return os.path.join(tempfile.gettempdir(), "tiderl-textworld")


def game_shape(task: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, int]:
    """(seed, rooms, objects, quest_length) of a task, task fields over suite options."""
    merged = {**options, **task}
    return {
        "seed": int_option(merged, "seed", 0, lo=0, hi=(1 << 31) - 1),
        "rooms": int_option(merged, "rooms", 3, lo=1, hi=64),
        "objects": int_option(merged, "objects", 4, lo=0, hi=128),
        "quest_length": int_option(merged, "quest_length", 3, lo=1, hi=32),
    }


def compile_game(shape: Mapping[str, int], cache_dir: str) -> str:
    """Path of the compiled .z8 game for `shape`, generating it on first use."""
    import textworld

    name = "tw-s{seed}-r{rooms}-o{objects}-q{quest_length}".format(**shape)
    path = os.path.join(cache_dir, name + ".z8")
    with _LOCKS_GUARD:
        lock = _LOCKS.setdefault(path, threading.Lock())
    with lock:
        if not os.path.exists(path):
            os.makedirs(cache_dir, exist_ok=True)
            opts = textworld.GameOptions()
            opts.seeds = shape["seed"]
            opts.nb_rooms = shape["rooms"]
            opts.nb_objects = shape["objects"]
            opts.quest_length = shape["quest_length"]
            opts.path = path
            opts.file_ext = ".z8"
            textworld.make(opts)
    return path


def walkthrough(game_file: str) -> list[str]:
    """The generated game's winning command sequence (tests and baselines; not shown to agents)."""
    import textworld

    return list(textworld.Game.load(game_file.removesuffix(".z8") + ".json").walkthrough)


def _clean(text: str) -> str:
    lines = text.splitlines()
    if any("$$" in line for line in lines):  # first observation: drop the banner
        lines = [line for line in lines if not _BANNER_LINE.match(line) or not line.strip()]
    text = "\n".join(line.rstrip() for line in lines)
    text = text.replace("Would you like to RESTART, RESTORE a saved game, QUIT or UNDO the last "
                        "command?", "")
    text = re.sub(r"\n{3,}", "\n\n", text).strip()
    return text.removesuffix(">").strip()


class TextWorldGame(Adapter):
    """One TextWorld episode; task fields: seed, rooms, objects, quest_length."""

    blocking = True  # generating and compiling a game takes seconds: run in a worker thread
    max_workers = 1  # TextWorld/jericho sessions are not thread-safe

    def __init__(self, options: Mapping[str, str] | None = None):
        super().__init__(options)
        self.cache_dir = self.options.get("cache_dir") or default_cache_dir()
        self.admissible = self.options.get("admissible", "false").lower() in ("1", "true")
        self.env: Any = None
        self.state: Any = None
        self.game_file = ""

    @classmethod
    def task_fields(cls, seed: int, options: Mapping[str, str]) -> dict[str, Any]:
        shape = game_shape({"seed": seed % (1 << 31)}, options)
        return dict(shape)

    def reset(self, task: Mapping[str, Any]) -> str:
        import textworld

        shape = game_shape(task, {k: v for k, v in self.options.items()
                                  if k in ("rooms", "objects", "quest_length")})
        self.game_file = compile_game(shape, self.cache_dir)
        infos = textworld.EnvInfos(max_score=True, score=True, won=True, lost=True,
                                   moves=True, admissible_commands=self.admissible)
        self.env = textworld.start(self.game_file, request_infos=infos)
        self.state = self.env.reset()
        return self._observe(self.state)

    def _observe(self, state: Any) -> str:
        text = _clean(state.feedback)
        if self.admissible and state.admissible_commands:
            text += "\nValid actions: " + ", ".join(state.admissible_commands)
        return text

    def step(self, action: str) -> Step:
        if self.env is None:
            raise RuntimeError("step before reset")
        before = self.state.score
        # The game interpreter takes printable ASCII only: a NUL byte kills it, and control
        # bytes or backslashes act as interpreter hot keys. An untrained policy emits all three.
        command = "".join(c for c in action if " " <= c <= "~" and c != "\\").strip()
        self.state, _, done = self.env.step(command)
        reward = float(self.state.score - before) / max(1, self.state.max_score)
        return Step(self._observe(self.state), bool(done), reward)

    def close(self) -> tuple[float, dict[str, Any]]:
        if self.env is None:
            return 0.0, {}
        score, max_score = self.state.score, self.state.max_score
        info = {"score": score, "max_score": max_score, "won": bool(self.state.won),
                "lost": bool(self.state.lost), "moves": self.state.moves,
                "game": os.path.basename(self.game_file)}
        self.env.close()
        self.env = None
        return float(score) / max(1, max_score), info
