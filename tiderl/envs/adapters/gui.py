"""The gui suite (`env.suite=gui`): operate a rendered desktop by clicks and typing. No JAX.

Each task is a seeded desktop (`gui_desk.Desk`: app icons of varying sizes at varying
positions; windows with text fields, OK and Cancel that open at a new place each time) and a
chain of steps, e.g. "open Notes; then in Settings type "alice" into Name and press OK; then
close Mail". Observations are a PNG screenshot plus a short text (the task on the first turn,
then what the last action did and the turn count). Actions, one per turn:

    click(x, y)        a left click at pixel (x, y), origin top left
    type("text")       replaces the focused text field's text (click the field first)

Parsing is lenient: case, spaces, `x=`/`y=`/`text=` keywords, single or double quotes, and text
around the action are all accepted; the last action in the reply counts, so a model may
reason first. A reply with no action, or a click off the screen, is an invalid turn: it
changes nothing, uses a turn, and the observation says what was expected.

A task is solved when its steps happen in order (a step done out of order is not counted, and
does no harm); the episode ends when it is solved (reward 1) or after its turn budget,
`2 * oracle_turns + 2` (reward 0; `partial=1` pays the fraction of steps done instead). The
oracle (`oracle_action`, reading the desk's state) solves every task in exactly `oracle_turns`
turns, drawn per task from `min_turns..max_turns`.

Suite options: width, height (screen pixels, default 640x400), icons (default 6), min_turns and
max_turns (default 1 and 8; up to 50), partial (0/1), start_latency_s (seconds the server
waits before each /start's reset, to mimic a VM boot, holding no worker thread; default 0).
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tiderl.envs.adapters.base import Adapter, Observation, Step, TaskError, int_option
from tiderl.envs.adapters.gui_desk import Desk, Event, center
from tiderl.envs.images import png

WORDS = ("alice", "bob", "carol", "delta", "amber", "river", "stone", "maple", "ocean", "tiger",
         "lemon", "cedar", "pixel", "orbit", "frost", "coral")
FORMAT = 'Reply with one action: click(x, y) or type("text").'
_NUM = r"(-?\d+(?:\.\d+)?)"
_ACTION = re.compile(
    rf"click\s*\(\s*(?:x\s*=\s*)?{_NUM}\s*,\s*(?:y\s*=\s*)?{_NUM}\s*\)"
    r"|type\s*\(\s*(?:text\s*=\s*)?(?:\"([^\"]*)\"|'([^']*)'|([^)\"']*?))\s*\)",
    re.IGNORECASE)
MAX_TEXT = 64


def parse_action(text: str) -> tuple[str, Any] | None:
    """('click', (x, y)) or ('type', text) for the last action in `text`; None for none."""
    matches = list(_ACTION.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    if m.group(1) is not None:
        return "click", (round(float(m.group(1))), round(float(m.group(2))))
    typed = next(g for g in (m.group(3), m.group(4), m.group(5)) if g is not None)
    return "type", typed.strip() if m.group(5) is not None else typed


# -- tasks ---------------------------------------------------------------------------------------
Goal = tuple[str, str, tuple[tuple[str, str], ...]]
"""One step of a task: ('open' | 'close' | 'fill', app, field values to submit)."""


def describe(goal: Goal) -> str:
    kind, app, values = goal
    if kind == "open":
        return f"open {app}"
    if kind == "close":
        return f"close {app}"
    typed = " and ".join(f'type "{v}" into {f}' for f, v in values)
    return f"in {app} {typed} and press OK"


def satisfied(goal: Goal, event: Event, desk: Desk) -> bool:
    kind, app, values = goal
    if kind == "open":
        return desk.window is not None and desk.window.app == app
    if kind == "close":
        return event.kind == "closed" and event.app == app
    return event.kind == "submitted" and event.app == app and all(
        dict(event.values).get(f) == v for f, v in values)


def make_goals(desk: Desk, rng: random.Random, turns: int) -> tuple[list[Goal], int]:
    """Steps whose oracle solution takes exactly `turns` turns (and that number)."""
    goals: list[Goal] = []
    sim = copy.deepcopy(desk)
    used = 0
    while used < turns:
        left = turns - used
        options: list[Goal] = []
        open_app = sim.window.app if sim.window is not None else ""
        if open_app:
            options.append(("close", open_app, ()))
        for icon in sim.icons:
            options.append(("open", icon.app, ()))
            values = tuple((f, rng.choice(WORDS)) for f in icon.fields)
            options.append(("fill", icon.app, values))
        rng.shuffle(options)
        for goal in options:
            if goal[0] == "open" and goal[1] == open_app:
                continue  # already open: no turn to spend
            trial = copy.deepcopy(sim)
            cost = _solve(trial, goal)
            if cost <= left:
                goals.append(goal)
                sim, used = trial, used + cost
                break
        else:  # cannot happen: closing (1) or opening (1) always fits a budget of 1
            raise AssertionError(f"no step fits {left} turns")
    return goals, used


def _solve(desk: Desk, goal: Goal, cap: int = 64) -> int:
    """Plays the oracle on `desk` (mutated) until `goal` is met; its number of turns."""
    for n in range(1, cap + 1):
        kind, arg = oracle_step(desk, goal)
        event = desk.click(*arg) if kind == "click" else desk.type(arg)
        if satisfied(goal, event, desk):
            return n
    raise AssertionError(f"the oracle did not reach {goal} in {cap} turns")


def oracle_step(desk: Desk, goal: Goal) -> tuple[str, Any]:
    """The next action that makes progress on `goal` from the desk's state."""
    kind, app, values = goal
    win = desk.window
    if win is not None and win.app != app:
        return "click", center(win.close)
    if win is None:
        return "click", center(desk.icon(app).square)
    if kind == "close":
        return "click", center(win.close)
    for field, value in values:
        if win.values[field] != value:
            if win.focus != field:
                return "click", center(win.fields[field])
            return "type", value
    return "click", center(win.ok)


def format_action(action: tuple[str, Any]) -> str:
    kind, arg = action
    return f"click({arg[0]}, {arg[1]})" if kind == "click" else f'type("{arg}")'


class GuiDesktop(Adapter):
    """A task on a rendered desktop; see the module docstring."""

    blocking = True  # rendering and PNG encoding (~10 ms a screen) run in worker threads
    client_options = frozenset({"width", "height", "icons", "min_turns", "max_turns", "partial"})

    def __init__(self, options: Mapping[str, str] | None = None):
        super().__init__(options)
        o, w = self.options, "suite option"
        self.width = int_option(o, "width", 640, lo=320, hi=1920, where=w)
        self.height = int_option(o, "height", 400, lo=200, hi=1080, where=w)
        self.icons = int_option(o, "icons", 6, lo=1, hi=12, where=w)
        self.min_turns = int_option(o, "min_turns", 1, lo=1, hi=50, where=w)
        self.max_turns = int_option(o, "max_turns", 8, lo=self.min_turns, hi=50, where=w)
        self.partial = int_option(o, "partial", 0, lo=0, hi=1, where=w)
        try:
            self.start_latency_s = float(o.get("start_latency_s", "0"))
        except ValueError:
            raise TaskError(f"suite option start_latency_s={o['start_latency_s']!r} must be a "
                            "number of seconds") from None
        if not 0 <= self.start_latency_s <= 600:
            raise TaskError(f"suite option start_latency_s={self.start_latency_s} is out of "
                            "range 0..600")
        self.start_delay_s = self.start_latency_s  # the server waits it out before reset
        self.desk: Desk | None = None
        self.goals: list[Goal] = []
        self.done_goals = 0
        self.turn = 0
        self.budget = 0
        self.oracle_turns = 0
        self.invalid = 0

    @classmethod
    def task_fields(cls, seed: int, options: Mapping[str, str]) -> dict[str, Any]:
        return {"seed": seed}

    def reset(self, task: Mapping[str, Any]) -> Observation:
        seed = int_option(task, "seed", 0, lo=0, hi=(1 << 63) - 1)
        rng = random.Random(seed * 1_000_003 + 17)
        turns = int_option(task, "turns", rng.randint(self.min_turns, self.max_turns), lo=1,
                           hi=50)
        try:
            self.desk = Desk(seed, self.width, self.height, self.icons)
        except ValueError as e:
            raise TaskError(str(e)) from None
        self.goals, self.oracle_turns = make_goals(self.desk, rng, turns)
        self.done_goals, self.turn, self.invalid = 0, 0, 0
        self.budget = 2 * self.oracle_turns + 2
        text = (f"Task: {'; then '.join(describe(g) for g in self.goals)}.\n"
                f"Screen {self.width}x{self.height}, {self.budget} turns. {FORMAT}")
        return Observation(text, [png(self.desk.render())])

    def step(self, action: str) -> Step:
        desk = self.desk
        if desk is None or self.done_goals == len(self.goals) or self.turn >= self.budget:
            raise RuntimeError("step after the episode ended (a bug in the caller or server)")
        self.turn += 1
        parsed = parse_action(action)
        if parsed is None:
            self.invalid += 1
            said = 'invalid action: no click(x, y) or type("text") found'
        elif parsed[0] == "click" and not (0 <= parsed[1][0] < self.width
                                           and 0 <= parsed[1][1] < self.height):
            self.invalid += 1
            said = (f"invalid action: click{parsed[1]} is off the {self.width}x{self.height} "
                    "screen")
        elif parsed[0] == "type" and (len(parsed[1]) > MAX_TEXT or not parsed[1].isprintable()):
            self.invalid += 1
            said = f"invalid action: type text must be 1..{MAX_TEXT} printable characters"
        else:
            event = desk.click(*parsed[1]) if parsed[0] == "click" else desk.type(parsed[1])
            said = _said(event)
            if satisfied(self.goals[self.done_goals], event, desk):
                self.done_goals += 1
        solved = self.done_goals == len(self.goals)
        done = solved or self.turn >= self.budget
        text = f"{said}. Turn {self.turn} of {self.budget}." + (" Task done." if solved else "")
        return Step(text, done, self._reward() if done else None, [png(desk.render())])

    def _reward(self) -> float:
        if self.done_goals == len(self.goals):
            return 1.0
        return self.done_goals / len(self.goals) if self.partial else 0.0

    def close(self) -> tuple[float, dict[str, Any]]:
        return self._reward(), {"success": self.done_goals == len(self.goals),
                                "steps_done": self.done_goals, "steps": len(self.goals),
                                "oracle_turns": self.oracle_turns, "turns": self.turn,
                                "invalid": self.invalid}

    # -- scripted players (tests, baselines) ----------------------------------------------------
    def oracle_action(self) -> str:
        """The oracle's next action (it reads the desk's state)."""
        assert self.desk is not None
        return format_action(oracle_step(self.desk, self.goals[self.done_goals]))


def random_action(rng: random.Random, width: int, height: int,
                  words: Sequence[str] = ()) -> str:
    """A random clicker: a uniform click on the screen, or (when `words` are given, one time in
    four) typing one of them."""
    if words and rng.random() < 0.25:
        return f'type("{rng.choice(words)}")'
    return f"click({rng.randrange(width)}, {rng.randrange(height)})"


def _said(event: Event) -> str:
    if event.kind == "opened":
        return f"opened {event.app}"
    if event.kind == "closed":
        return f"closed {event.app}"
    if event.kind == "submitted":
        return f"pressed OK in {event.app}"
    if event.kind == "focused":
        return f"{event.detail} field focused"
    if event.kind == "typed":
        return f"typed into {event.detail}"
    return f"nothing happened ({event.detail})"
