"""TextWorld games generated and compiled locally from seeds (the engine under ALFWorld). No JAX.

A task names a seed and the world's shape (rooms, objects, quest length); the game is generated
and compiled once into a cache folder (~2-3 s) and reused by every session of that seed, so a
GRPO group of 8 compiles once. The cache is `textworld/` in the env server's own state folder
(`EnvServer(state_dir=...)`, `python -m tiderl.envs serve --state-dir`; by default a private
temporary folder), never a path a client names. It is bounded: after each compile, games not
used for `cache_max_age_h` hours (suite option, default 168) go, then the least recently used
ones until the folder holds at most `cache_max_mb` MB (default 1024). Both are server-side
options; clients may set only rooms, objects, quest_length, admissible, format and format_bonus.
`format=chat` (with `admissible=true`) is the game for a pretrained chat model, as the default
task's chat form is: the valid actions are a numbered list, and a reply is read leniently — the
valid action it names earliest ("I will go south." plays `go south`), else the action whose
number is the reply's first integer ("2) examine key"), else the reply as written. A small
instruct model copies a numbered choice far more often than a command (SmolLM2-135M: 12 of 32
replies vs 0-4 of 32). `format_bonus=B` (chat form; default 0) pays a failed episode
B × (turns whose reply was a valid action / turns), so reading the list earns reward before a
win does; a win pays what it pays, and evaluation counts wins.
Reward: the in-game score normalised by the maximum score, so playing the walkthrough ends
with reward 1.0.
"""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
import threading
import time
from collections.abc import Mapping
from typing import Any

from tiderl.envs.adapters.base import Adapter, Step, int_option

_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()
# The ASCII-art TextWorld banner printed before the first room: lines of only these characters.
_BANNER_LINE = re.compile(r"^[\s$|\\/_<>]*$")
_GAME = re.compile(r"^(tw-s\d+-r\d+-o\d+-q\d+)\.")
_PRIVATE: list[str] = []  # the process's own cache folder for adapters outside a server


def cache_dir_of(state_dir: str) -> str:
    """Where games compile for a server whose state folder is `state_dir` ('' outside a server:
    a private temporary folder of this process, made once)."""
    if state_dir:
        return os.path.join(state_dir, "textworld")
    with _LOCKS_GUARD:
        if not _PRIVATE:
            _PRIVATE.append(tempfile.mkdtemp(prefix="tiderl-textworld-"))
    return _PRIVATE[0]


def _lock(key: str) -> threading.Lock:
    with _LOCKS_GUARD:
        return _LOCKS.setdefault(key, threading.Lock())


def prune_cache(cache_dir: str, *, max_bytes: int, max_age_s: float, keep: str = "") -> int:
    """Removes games (all files of one game together) last used more than `max_age_s` ago,
    then the least recently used until the folder holds at most `max_bytes`; never `keep` (a
    game's path). Returns the games removed. A game's use time is its .z8's mtime (a cache hit
    touches it)."""
    games: dict[str, list[os.DirEntry]] = {}
    try:
        with os.scandir(cache_dir) as it:
            for entry in it:
                m = _GAME.match(entry.name)
                if m and entry.is_file(follow_symlinks=False):
                    games.setdefault(m.group(1), []).append(entry)
    except FileNotFoundError:
        return 0
    kept = os.path.basename(keep).removesuffix(".z8")
    now = time.time()
    rows = []
    for name, entries in games.items():
        stats = [e.stat(follow_symlinks=False) for e in entries]
        used = max((st.st_mtime for e, st in zip(entries, stats, strict=True)
                    if e.name.endswith(".z8")), default=min(st.st_mtime for st in stats))
        rows.append((used, sum(st.st_size for st in stats), name, entries))
    rows.sort()  # least recently used first
    total = sum(r[1] for r in rows)
    removed = 0
    for used, size, name, entries in rows:
        if name == kept:
            continue
        if now - used <= max_age_s and total <= max_bytes:
            continue
        with _lock(os.path.join(cache_dir, name + ".z8")):
            for e in entries:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(e.path)
        total -= size
        removed += 1
    return removed


def game_shape(task: Mapping[str, Any], options: Mapping[str, Any]) -> dict[str, int]:
    """(seed, rooms, objects, quest_length) of a task, task fields over suite options."""
    merged = {**options, **task}
    return {
        "seed": int_option(merged, "seed", 0, lo=0, hi=(1 << 31) - 1),
        "rooms": int_option(merged, "rooms", 3, lo=1, hi=64),
        "objects": int_option(merged, "objects", 4, lo=0, hi=128),
        "quest_length": int_option(merged, "quest_length", 3, lo=1, hi=32),
    }


def compile_game(shape: Mapping[str, int], cache_dir: str, *, max_bytes: int = 1 << 30,
                 max_age_s: float = 7 * 86400.0) -> str:
    """Path of the compiled .z8 game for `shape` in `cache_dir`, generating it on first use
    (then the cache is pruned to `max_bytes` and `max_age_s`, see `prune_cache`)."""
    import textworld

    name = "tw-s{seed}-r{rooms}-o{objects}-q{quest_length}".format(**shape)
    path = os.path.join(cache_dir, name + ".z8")
    with _lock(path):
        if os.path.exists(path):
            with contextlib.suppress(OSError):
                os.utime(path)  # used now: pruning goes by last use
            return path
        os.makedirs(cache_dir, mode=0o700, exist_ok=True)
        opts = textworld.GameOptions()
        opts.seeds = shape["seed"]
        opts.nb_rooms = shape["rooms"]
        opts.nb_objects = shape["objects"]
        opts.quest_length = shape["quest_length"]
        opts.path = path
        opts.file_ext = ".z8"
        textworld.make(opts)
    prune_cache(cache_dir, max_bytes=max_bytes, max_age_s=max_age_s, keep=path)
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


def _number(options: Mapping[str, Any], name: str, default: float) -> float:
    try:
        value = float(options.get(name, default))
    except (TypeError, ValueError):
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise ValueError(f"suite option {name}={options.get(name)!r} must be a positive number")
    return value


def named_command(reply: str, commands: Any) -> str | None:
    """The command of `commands` named earliest in `reply` (case-insensitive, on word
    boundaries; at one position the longest), or None."""
    best: tuple[int, int, str] | None = None
    for cmd in commands:
        m = re.search(r"(?<![\w])" + re.escape(cmd.lower()) + r"(?![\w])", reply.lower())
        if m and (best is None or (m.start(), -len(cmd)) < best[:2]):
            best = (m.start(), -len(cmd), cmd)
    return best[2] if best else None


def chosen_command(reply: str, commands: Any) -> str | None:
    """What a chat-form reply plays: the command it names earliest, else the command numbered
    by its first integer (1-based), else None."""
    commands = list(commands)
    named = named_command(reply, commands)
    if named is not None:
        return named
    number = re.search(r"\d+", reply)
    if number and 1 <= int(number.group()) <= len(commands):
        return commands[int(number.group()) - 1]
    return None


class TextWorldGame(Adapter):
    """One TextWorld episode; task fields: seed, rooms, objects, quest_length."""

    blocking = True  # generating and compiling a game takes seconds: run in a worker thread
    max_workers = 1  # TextWorld/jericho sessions are not thread-safe
    client_options = frozenset({"rooms", "objects", "quest_length", "admissible", "format",
                                "format_bonus"})

    def __init__(self, options: Mapping[str, str] | None = None):
        super().__init__(options)
        if "cache_dir" in self.options:
            raise ValueError("suite option cache_dir is not an option: games compile into the "
                             "env server's own state folder (python -m tiderl.envs serve "
                             "--state-dir DIR, or EnvServer(state_dir=DIR))")
        mb = _number(self.options, "cache_max_mb", 1024.0)
        hours = _number(self.options, "cache_max_age_h", 168.0)
        self.cache_max_bytes, self.cache_max_age_s = int(mb * (1 << 20)), hours * 3600.0
        self.admissible = self.options.get("admissible", "false").lower() in ("1", "true")
        self.format = self.options.get("format", "text")
        if self.format not in ("text", "chat"):
            raise ValueError(f"suite option format={self.format!r} must be 'text' or 'chat'")
        if self.format == "chat" and not self.admissible:
            raise ValueError("suite option format=chat reads replies against the valid actions: "
                             "set admissible=true too")
        bonus = self.options.get("format_bonus", "0")
        try:
            self.format_bonus = float(bonus)
        except ValueError:
            self.format_bonus = -1.0
        if not 0.0 <= self.format_bonus < 1.0:
            raise ValueError(f"suite option format_bonus={bonus} must be a number in [0, 1)")
        if self.format_bonus and self.format != "chat":
            raise ValueError("suite option format_bonus pays replies that are valid actions, "
                             "which the chat form reads: set format=chat too")
        self.turns = self.valid_turns = 0
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
        self.game_file = compile_game(shape, cache_dir_of(self.state_dir),
                                      max_bytes=self.cache_max_bytes,
                                      max_age_s=self.cache_max_age_s)
        infos = textworld.EnvInfos(max_score=True, score=True, won=True, lost=True,
                                   moves=True, admissible_commands=self.admissible)
        self.env = textworld.start(self.game_file, request_infos=infos)
        self.state = self.env.reset()
        self.turns = self.valid_turns = 0
        return self._observe(self.state)

    def _observe(self, state: Any) -> str:
        text = _clean(state.feedback)
        if self.admissible and state.admissible_commands:
            if self.format == "chat":
                text += "\nValid actions:\n" + "\n".join(
                    f"{i}. {c}" for i, c in enumerate(state.admissible_commands, 1))
            else:
                text += "\nValid actions: " + ", ".join(state.admissible_commands)
        return text

    def step(self, action: str) -> Step:
        if self.env is None:
            raise RuntimeError("step before reset")
        before = self.state.score
        # The game interpreter takes printable ASCII only: a NUL byte kills it, and control
        # bytes or backslashes act as interpreter hot keys. An untrained policy emits all three.
        command = "".join(c for c in action if " " <= c <= "~" and c != "\\").strip()
        if self.format == "chat":
            chosen = chosen_command(command, self.state.admissible_commands or ())
            self.turns += 1
            self.valid_turns += chosen is not None
            command = chosen or command
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
        reward = float(score) / max(1, max_score)
        if self.format_bonus and not self.state.won and self.turns:
            info["valid_turns"] = self.valid_turns
            # Below a win's 1.0 always: evaluation counts rewards of 1.0 as wins.
            reward = min(0.99, reward + self.format_bonus * self.valid_turns / self.turns)
        return reward, info
