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
waits before each /start's reset, to mimic a VM boot, holding no worker thread; default 0),
and, for a policy trained from scratch with the byte tokenizer (none changes a default task):

    grid=CxR        icons sit in the cells of a C x R grid (cells numbered 1.. row by row from
                    the top left), each centred in a cell of its own drawn per seed, sizes
                    varying; cells must be at least 64x42 pixels
    actions=cell    (with a grid of <= 9 cells) a reply's first digit is the action: 1..N
                    clicks the centre of that cell (always on the icon there, if any), 0 clicks
                    the open window's close box; no digit, or one above N, is an invalid turn.
                    click(x, y) and type("text") still count when the reply has them. Tasks
                    then have open and close steps only (a digit cannot type).
    slack=S         a turn budget of oracle_turns + S instead of 2 * oracle_turns + 2
    format_bonus=F  (0 <= F < 1) a failed episode pays F x (valid turns / turns played), as the
                    default suite does, plus the partial reward (capped at 0.99); a success
                    pays 1.0, and only a success counts
    colors=app      each app always drawn in its own colour (default random per desk)
    prompt=task     the first observation's text is the task line alone ("Task: open Notes."),
                    without the screen size, the turn budget and the reply format (default
                    full): a from-scratch policy reads no English, and every text token shares
                    its answer's attention with the screenshot's

A window is modal and, on a 320x200 screen, 312 px wide: it covers nearly every cell, and a
cell reply then clicks whatever of the window is under that cell's centre (over 300 seeds,
5% (2x2) and 8% (3x3) of cell centres close it; the rest do nothing or focus a field), so a
wrong icon costs the rest of a short budget unless the reply is 0.
Random baselines of 1-turn tasks (`benchmarks/gui_random.py`): see docs/how-to/your-env.md.
"""

from __future__ import annotations

import copy
import random
import re
from collections.abc import Mapping, Sequence
from typing import Any

from tiderl.envs.adapters.base import Adapter, Observation, Step, TaskError, int_option
from tiderl.envs.adapters.gui_desk import MIN_CELL, Desk, Event, center
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
FORMAT_CELL = ("Reply with one digit: 1-{n} clicks the centre of that cell of the {cols}x{rows} "
               "grid (numbered row by row from the top left), 0 closes the open window.")
_DIGIT = re.compile(r"[0-9]")


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


def make_goals(desk: Desk, rng: random.Random, turns: int,
               typing: bool = True) -> tuple[list[Goal], int]:
    """Steps whose oracle solution takes exactly `turns` turns (and that number); open and
    close steps only when not `typing`."""
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
            if typing:
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


def oracle_cell(desk: Desk, goal: Goal) -> str:
    """The oracle's next reply under cell actions (open and close steps only): 0 while a window
    is open (the next step closes it or needs the desk free), else the target's cell."""
    if goal[0] == "fill":
        raise ValueError("cell actions cannot type: tasks under actions=cell have no fill steps")
    return "0" if desk.window is not None else str(desk.icon(goal[1]).cell)


def first_digit(text: str) -> int | None:
    """The value of the first decimal digit in `text` (a cell reply), None for none."""
    found = _DIGIT.search(text)
    return None if found is None else int(found.group())


def format_action(action: tuple[str, Any]) -> str:
    kind, arg = action
    return f"click({arg[0]}, {arg[1]})" if kind == "click" else f'type("{arg}")'


class GuiDesktop(Adapter):
    """A task on a rendered desktop; see the module docstring."""

    blocking = True  # rendering and PNG encoding (~10 ms a screen) run in worker threads
    client_options = frozenset({"width", "height", "icons", "min_turns", "max_turns", "partial",
                                "grid", "actions", "format_bonus", "slack", "colors",
                                "prompt"})

    def __init__(self, options: Mapping[str, str] | None = None):
        super().__init__(options)
        o, w = self.options, "suite option"
        self.width = int_option(o, "width", 640, lo=320, hi=1920, where=w)
        self.height = int_option(o, "height", 400, lo=200, hi=1080, where=w)
        self.icons = int_option(o, "icons", 6, lo=1, hi=12, where=w)
        self.min_turns = int_option(o, "min_turns", 1, lo=1, hi=50, where=w)
        self.max_turns = int_option(o, "max_turns", 8, lo=self.min_turns, hi=50, where=w)
        self.partial = int_option(o, "partial", 0, lo=0, hi=1, where=w)
        # slack=S: a budget of oracle_turns + S turns (default: 2 * oracle_turns + 2)
        self.slack = int_option(o, "slack", 0, lo=0, hi=100, where=w) if "slack" in o else None
        self.grid = _grid_option(o, self.width, self.height, self.icons)
        self.actions = o.get("actions", "click")
        if self.actions not in ("click", "cell"):
            raise TaskError(f"suite option actions={self.actions!r} must be 'click' or 'cell'")
        self.cells = self.grid[0] * self.grid[1] if self.grid else 0
        if self.actions == "cell" and not 1 <= self.cells <= 9:
            raise TaskError("suite option actions=cell names a cell by one digit: it needs a grid "
                            "of at most 9 cells; set grid=2x2 or grid=3x3 too")
        self.app_colors = o.get("colors", "random")
        if self.app_colors not in ("random", "app"):
            raise TaskError(f"suite option colors={self.app_colors!r} must be 'random' or 'app'")
        self.format_bonus = _float_option(o, "format_bonus", 0.0, 1.0)
        self.prompt = o.get("prompt", "full")
        if self.prompt not in ("full", "task"):
            raise TaskError(f"suite option prompt={self.prompt!r} must be 'full' or 'task'")
        self.start_latency_s = _float_option(o, "start_latency_s", 0.0, 600.0, closed=True,
                                             unit=" of seconds")
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
            self.desk = Desk(seed, self.width, self.height, self.icons, self.grid,
                             self.app_colors == "app")
        except ValueError as e:
            raise TaskError(str(e)) from None
        self.goals, self.oracle_turns = make_goals(self.desk, rng, turns,
                                                   typing=self.actions == "click")
        self.done_goals, self.turn, self.invalid = 0, 0, 0
        self.budget = (2 * self.oracle_turns + 2 if self.slack is None
                       else self.oracle_turns + self.slack)
        fmt = (FORMAT if self.actions == "click" else
               FORMAT_CELL.format(n=self.cells, cols=self.grid[0], rows=self.grid[1]))
        text = f"Task: {'; then '.join(describe(g) for g in self.goals)}."
        if self.prompt == "full":
            text += (f"\nScreen {self.width}x{self.height}, {self.budget} "
                     f"turn{'s' if self.budget != 1 else ''}. {fmt}")
        return Observation(text, [png(self.desk.render())])

    def step(self, action: str) -> Step:
        desk = self.desk
        if desk is None or self.done_goals == len(self.goals) or self.turn >= self.budget:
            raise RuntimeError("step after the episode ended (a bug in the caller or server)")
        self.turn += 1
        event = self._act(desk, action)
        if isinstance(event, str):  # an invalid action: what was wrong
            self.invalid += 1
            said = f"invalid action: {event}"
        else:
            said = _said(event)
            if satisfied(self.goals[self.done_goals], event, desk):
                self.done_goals += 1
        solved = self.done_goals == len(self.goals)
        done = solved or self.turn >= self.budget
        text = f"{said}. Turn {self.turn} of {self.budget}." + (" Task done." if solved else "")
        return Step(text, done, self._reward() if done else None, [png(desk.render())])

    def _act(self, desk: Desk, action: str) -> Event | str:
        """Plays `action` on the desk: its event, or why it is invalid (nothing changed)."""
        parsed = parse_action(action)
        if parsed is None and self.actions == "cell":
            cell = first_digit(action)
            if cell is None:
                return f"no digit found (0-{self.cells})"
            if cell > self.cells:
                return f"cell {cell} is not on the grid (1-{self.cells}, or 0)"
            return desk.close_window() if cell == 0 else desk.click_cell(cell)
        if parsed is None:
            return 'no click(x, y) or type("text") found'
        kind, arg = parsed
        if kind == "click" and not (0 <= arg[0] < self.width and 0 <= arg[1] < self.height):
            return f"click{arg} is off the {self.width}x{self.height} screen"
        if kind == "type" and (len(arg) > MAX_TEXT or not arg.isprintable()):
            return f"type text must be 1..{MAX_TEXT} printable characters"
        return desk.click(*arg) if kind == "click" else desk.type(arg)

    def _reward(self) -> float:
        """1 when solved; else the fraction of steps done (partial=1) plus format_bonus x the
        fraction of turns with a valid action, kept below a win's 1.0."""
        if self.done_goals == len(self.goals):
            return 1.0
        reward = self.done_goals / len(self.goals) if self.partial else 0.0
        if self.format_bonus and self.turn:
            reward = min(0.99, reward + self.format_bonus * (self.turn - self.invalid) / self.turn)
        return reward

    def close(self) -> tuple[float, dict[str, Any]]:
        return self._reward(), {"success": self.done_goals == len(self.goals),
                                "steps_done": self.done_goals, "steps": len(self.goals),
                                "oracle_turns": self.oracle_turns, "turns": self.turn,
                                "invalid": self.invalid}

    # -- scripted players (tests, baselines) ----------------------------------------------------
    def oracle_action(self) -> str:
        """The oracle's next action (it reads the desk's state): a digit under actions=cell."""
        assert self.desk is not None
        goal = self.goals[self.done_goals]
        if self.actions == "cell":
            return oracle_cell(self.desk, goal)
        return format_action(oracle_step(self.desk, goal))


def _grid_option(o: Mapping[str, str], width: int, height: int,
                 icons: int) -> tuple[int, int] | None:
    """The grid=COLSxROWS suite option, checked against the screen and the icons; None unset."""
    raw = o.get("grid")
    if raw is None:
        return None
    m = re.fullmatch(r"\s*(\d{1,2})\s*x\s*(\d{1,2})\s*", str(raw), re.IGNORECASE)
    if m is None or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise TaskError(f"suite option grid={raw!r} must be COLSxROWS, e.g. grid=3x3")
    cols, rows = int(m.group(1)), int(m.group(2))
    if icons > cols * rows:
        raise TaskError(f"suite option icons={icons} does not fit grid={cols}x{rows} "
                        f"({cols * rows} cells): use icons<={cols * rows} or a larger grid")
    cw, ch = width // cols, height // rows
    if cw < MIN_CELL[0] or ch < MIN_CELL[1]:
        raise TaskError(f"suite option grid={cols}x{rows} makes {cw}x{ch}-pixel cells on a "
                        f"{width}x{height} screen, under {MIN_CELL[0]}x{MIN_CELL[1]}: use fewer "
                        "columns or rows, or a larger width/height")
    return cols, rows


def _float_option(o: Mapping[str, str], name: str, default: float, hi: float,
                  closed: bool = False, unit: str = "") -> float:
    """A number option in [0, hi) ([0, hi] when `closed`), with a one-line error."""
    raw = o.get(name, default)
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise TaskError(f"suite option {name}={raw!r} must be a number{unit}") from None
    if not (0 <= value <= hi if closed else 0 <= value < hi):
        raise TaskError(f"suite option {name}={value} is out of range 0..{hi:g}"
                        + ("" if closed else " (1 excluded)"))
    return value


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
