"""The gui suite (tiderl/envs/adapters/gui.py): deterministic by seed, solved by the scripted
oracle on every task (1 to 50 turns), its clicks land on what the screenshot shows, a random
clicker's success rate measured, bad actions handled, options checked, served over the real
protocol, and a text-only rollout reads its screenshots as placeholder lines."""

from __future__ import annotations

import asyncio
import random
import re
import time

import pytest

from tiderl.configlib import ConfigError
from tiderl.envs.adapters.base import TaskError
from tiderl.envs.adapters.gui import GuiDesktop, parse_action, random_action
from tiderl.envs.client import EnvClient
from tiderl.envs.config import EnvConfig
from tiderl.envs.server import EnvServer
from tiderl.envs.suites import adapter_class

SMALL = {"width": "320", "height": "200"}


def play(adapter: GuiDesktop, seed: int, policy, **task) -> tuple[float, dict, list]:
    obs = adapter.reset({"seed": seed, **task})
    shots = [obs.images[0]]
    while True:
        step = adapter.step(policy())
        shots.append(step.images[0])
        if step.done:
            break
    reward, info = adapter.close()
    return reward, info, shots


def test_the_same_seed_gives_the_same_task_screens_and_replies():
    def run(seed):
        a = GuiDesktop(SMALL)
        obs = a.reset({"seed": seed})
        out = [(obs.text, obs.images[0].data)]
        for act in (a.oracle_action(), "click(5, 5)", 'type("x")', a.oracle_action()):
            st = a.step(act)
            out.append((st.observation, st.images[0].data))
            if st.done:
                break
        return out

    assert run(3) == run(3)
    assert run(3)[0] != run(4)[0]
    texts = {GuiDesktop().reset({"seed": s}).text for s in range(20)}
    assert len(texts) == 20  # every seed its own task


def test_the_oracle_solves_every_task_in_exactly_its_turns_from_1_to_50():
    a = GuiDesktop({**SMALL, "min_turns": "1", "max_turns": "50"})
    lengths = []
    for seed in range(40):
        reward, info, _ = play(a, seed, a.oracle_action)
        assert reward == 1.0 and info["success"], (seed, info)
        assert info["turns"] == info["oracle_turns"] and info["invalid"] == 0
        lengths.append(info["oracle_turns"])
    for turns in (1, 2, 3, 50):  # a task's own length, exactly
        reward, info, _ = play(a, 99, a.oracle_action, turns=turns)
        assert reward == 1.0 and info["turns"] == turns == info["oracle_turns"]
    assert min(lengths) <= 5 and max(lengths) >= 40, lengths


def test_oracle_clicks_land_on_what_the_screenshot_shows():
    """Hit-testing and rendering agree: each oracle click's pixel is not the desktop's
    background, and a window's OK button is drawn where a click submits."""
    a = GuiDesktop()
    for seed in range(6):
        obs = a.reset({"seed": seed, "turns": 12})
        shot = obs.images[0].pil().convert("RGB")
        background = a.desk.background
        while True:
            act = a.oracle_action()
            kind, arg = parse_action(act)
            if kind == "click":
                assert shot.getpixel(arg) != background, (seed, act)
            step = a.step(act)
            shot = step.images[0].pil().convert("RGB")
            if step.done:
                break
        assert a.close()[0] == 1.0


def test_a_random_clicker_rarely_succeeds():
    """The random baseline a vision policy must beat (default options: tasks of 1..8 turns,
    budget 2 * turns + 2). Uniform clicks cannot type, so only open/close tasks can fall to
    it; with the instruction's words typed one time in four it does a little better."""
    rates = {}
    for name, words in (("clicks", False), ("clicks+words", True)):
        a = GuiDesktop(SMALL)
        wins = 0
        for seed in range(60):
            rng = random.Random(seed)
            a.reset({"seed": seed})
            vocab = [w for g in a.goals for _, w in g[2]] if words else []
            reward, _, _ = play(a, seed, lambda: random_action(rng, a.width, a.height, vocab))
            wins += reward == 1.0
        rates[name] = wins / 60
    print("gui random success rates over 60 tasks:", rates)
    assert rates["clicks"] < 0.35 and rates["clicks+words"] < 0.45


def test_actions_are_parsed_leniently():
    cases = {
        "click(12, 40)": ("click", (12, 40)),
        "CLICK( 12 , 40 )": ("click", (12, 40)),
        "click(x=12, y=40)": ("click", (12, 40)),
        "I see the icon at the top. click(12.6, 40.2)": ("click", (13, 40)),
        "click(1, 2) no wait click(3, 4)": ("click", (3, 4)),
        'type("alice")': ("type", "alice"),
        "type('alice smith')": ("type", "alice smith"),
        'Type(text="bob")': ("type", "bob"),
        "type(bob )": ("type", "bob"),
        'type("")': ("type", ""),
    }
    for text, want in cases.items():
        assert parse_action(text) == want, text
    for text in ("", "click", "click(1)", "tap(1, 2)", "clicks at 4, 5", "type"):
        assert parse_action(text) is None, text


def test_bad_actions_use_a_turn_change_nothing_and_say_why():
    a = GuiDesktop(SMALL)
    obs = a.reset({"seed": 1, "turns": 4})
    before = obs.images[0].data
    bad = {"": "no click(x, y)", "press the button": "no click(x, y)",
           "click(400, 10)": "off the 320x200 screen", "click(-1, 10)": "off the 320x200",
           f'type("{"a" * 65}")': "1..64 printable", 'type("a\tb")': "1..64 printable"}
    for turn, (action, words) in enumerate(bad.items(), 1):
        step = a.step(action)
        assert words in step.observation and f"Turn {turn} of 10" in step.observation
        assert step.images[0].data == before and not step.done
    step = a.step('type("x")')  # valid, but nothing has focus
    assert "no text field has focus" in step.observation
    assert "opened" in a.step(a.oracle_action()).observation  # turn 8: the desk still works
    assert not a.step("wait").done
    step = a.step("wait")
    assert step.done and step.reward == 0.0  # the budget (2*4+2) is spent, unsolved
    reward, info = a.close()
    assert reward == 0.0 and info["invalid"] == 8 and info["turns"] == 10
    with pytest.raises(RuntimeError, match="after the episode ended"):
        a.step("click(1, 1)")


def test_partial_pays_the_fraction_of_steps_done():
    a = GuiDesktop({**SMALL, "partial": "1"})
    a.reset({"seed": 5, "turns": 6})
    n = len(a.goals)
    assert n >= 2
    first = a.goals[0]
    while a.done_goals == 0:  # do the first step with the oracle, then waste the budget
        a.step(a.oracle_action())
    while a.turn < a.budget:
        a.step("nothing")
    reward, info = a.close()
    assert info["steps_done"] == 1 and reward == pytest.approx(1 / n), (first, info)


def test_options_are_checked_and_the_suite_is_registered():
    assert adapter_class("gui") is GuiDesktop
    assert EnvConfig(suite="gui").suite_name == "gui"
    with pytest.raises(ConfigError, match="not a known suite"):
        EnvConfig(suite="guii")
    for bad, words in ((("width", "10"), "out of range 320..1920"),
                       (("max_turns", "51"), "out of range 1..50"),
                       (("start_latency_s", "soon"), "must be a number of seconds"),
                       (("icons", "x"), "must be an integer")):
        with pytest.raises(TaskError, match=words):
            GuiDesktop(dict([bad]))
        with pytest.raises(ConfigError, match="env.options"):  # a server refuses to start
            EnvServer(GuiDesktop, EnvConfig(suite="gui", options=(f"{bad[0]}={bad[1]}",)))
    with pytest.raises(TaskError, match="turns"):
        GuiDesktop().reset({"seed": 1, "turns": 0})


@pytest.mark.asyncio
async def test_served_over_the_protocol_with_a_start_latency():
    cfg = EnvConfig(suite="gui", options=("width=320", "height=200", "start_latency_s=0.3"),
                    retries=0)
    async with EnvServer(GuiDesktop, cfg).serve() as url, EnvClient(url, cfg) as env:
        t0 = time.perf_counter()
        starts = await asyncio.gather(*(env.start({"task_id": f"t{i}", "seed": i})
                                        for i in range(3)))
        took = time.perf_counter() - t0
        assert all(s.ok for s in starts) and took >= 0.3
        # A local adapter with the same seed plays the oracle; the server must agree.
        for i, s in enumerate(starts):
            local = GuiDesktop(SMALL)
            local_obs = local.reset({"seed": i})
            assert s.observation == local_obs.text and s.images[0].data == local_obs.images[0].data
            assert (s.images[0].width, s.images[0].height) == (320, 200)
            while True:
                act = local.oracle_action()
                mine = local.step(act)
                r = await env.step(s.session, act)
                assert r.ok and r.observation == mine.observation
                assert r.images[0].data == mine.images[0].data
                if r.done:
                    break
            end = await env.end(s.session)
            assert end.ok and end.reward == 1.0 and end.info["success"]


async def text_rollout(max_context: int, group_size: int = 3,
                       options: tuple[str, ...] = ("width=320", "height=200", "max_turns=2"),
                       length: int = 4):
    """A group of gui tasks played by the episode runner with a text policy (a host-side
    engine sampling `length` digits a turn) against a real server."""
    from tiderl.envs.tasks import TaskSource
    from tiderl.envs.templates import template_for
    from tiderl.models.tokenizer import ByteTokenizer
    from tiderl.serving.ctb import CTBConfig, make_scheduler
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager
    from tiderl.sim.fakes import SimEngine
    from tiderl.sim.virtual_engine import DigitActions

    tok = ByteTokenizer()
    tmpl = template_for(tok, "byte")
    cfg = EnvConfig(suite="gui", options=options, retries=0)
    engine = SimEngine(max_action_tokens=length, max_context=max_context,
                       actions=DigitActions(0, length=length), stop_tokens=tuple(tmpl.stop_ids))
    rank = RolloutRank(0, engine)
    await rank.start()
    sched = make_scheduler("ctb", CTBConfig(), [1 << 16], max_context=max_context)
    try:
        async with EnvServer(GuiDesktop, cfg).serve() as url, EnvClient(url, cfg) as env:
            mgr = RolloutManager([rank], sched, env, tmpl, max_turns=8)
            return tok, await mgr.run_group(TaskSource("gui", "train", groups=1,
                                                        group_size=group_size).element(0))
    finally:
        await rank.close()


@pytest.mark.asyncio
async def test_a_text_only_rollout_reads_screenshots_as_placeholders():
    """The episode runner with a text policy on the gui suite: no crash, each observation's
    screenshot a placeholder line in the trajectory, every task ending with a verdict."""
    from tiderl.envs.protocol import EndReason

    tok, trajs = await text_rollout(4096)
    for t in trajs:
        assert t.end_reason == EndReason.done, (t.end_reason, t.error)
        text = tok.decode(t.tokens)
        # the first observation and each one after an action but the last (done)
        assert text.count("[image 1: image/png 320x200]") == t.turns, text
        assert "Task: " in text and t.reward == 0.0


@pytest.mark.asyncio
async def test_an_observation_that_does_not_fit_the_context_is_not_kept():
    """A trajectory holds only the tokens the engine took, so it never outgrows
    rollout.max_context (and trainer.row_len): an observation refused at the context limit
    is dropped, the task ends context_limit; a first observation that does not fit leaves an
    empty trajectory, as a refused first request does at the agent endpoint."""
    from tiderl.envs.protocol import EndReason

    _, trajs = await text_rollout(100, group_size=2)  # the task text alone is ~180 tokens
    assert [(t.end_reason, t.tokens) for t in trajs] == [(EndReason.context_limit, [])] * 2
    _, trajs = await text_rollout(300, group_size=2)  # two turns fit, the third does not
    for t in trajs:
        assert t.end_reason == EndReason.context_limit and t.turns >= 2
        assert 0 < len(t.tokens) <= 300
        assert len(t.tokens) == len(t.loss_mask) == len(t.logprobs) == len(t.versions)
        assert t.loss_mask[-1] == 1  # it ends with the last action the engine sampled


# -- the grid layout and cell actions (a byte policy's form) -------------------------------------
CELL = {**SMALL, "grid": "3x3", "icons": "4", "actions": "cell", "min_turns": "1",
        "max_turns": "1"}


def test_defaults_are_unchanged():
    """No grid option: the free layout of before (icon boxes and budgets recorded from the
    suite before the grid options existed)."""
    a = GuiDesktop()
    a.reset({"seed": 0})
    assert [(i.app, i.box) for i in a.desk.icons] == [
        ("Maps", (101, 320, 161, 369)), ("Settings", (105, 41, 165, 101)),
        ("Music", (366, 226, 426, 273)), ("Calendar", (457, 270, 517, 341)),
        ("Clock", (99, 208, 159, 249)), ("Files", (345, 128, 405, 200))]
    assert a.budget == 16 and all(i.cell == 0 for i in a.desk.icons) and a.desk.cells == []
    a.reset({"seed": 2})
    assert [i.box for i in a.desk.icons][:2] == [(525, 194, 585, 260), (32, 190, 92, 233)]
    assert a.budget == 6 and a.format_bonus == 0.0 and a.slack is None


@pytest.mark.parametrize("grid,icons", [("2x2", 4), ("3x3", 2), ("3x3", 9), ("3x2", 5)])
def test_the_grid_centres_each_icon_in_a_cell_of_its_own(grid, icons):
    a = GuiDesktop({**SMALL, "grid": grid, "icons": str(icons)})
    cols, rows = map(int, grid.split("x"))
    sides, first_cells = set(), set()
    for seed in range(30):
        a.reset({"seed": seed})
        desk = a.desk
        assert len(desk.cells) == cols * rows
        cells = [i.cell for i in desk.icons]
        assert len(set(cells)) == icons and all(1 <= c <= cols * rows for c in cells)
        shot = desk.render()
        for icon in desk.icons:
            cell = desk.cells[icon.cell - 1]
            x0, y0, x1, y1 = icon.box
            assert cell[0] <= x0 and x1 <= cell[2] and cell[1] <= y0 and y1 <= cell[3]
            cx, cy = (cell[0] + cell[2]) // 2, (cell[1] + cell[3]) // 2
            assert abs((x0 + x1) / 2 - cx) <= 1 and abs((y0 + y1) / 2 - cy) <= 1
            sq = icon.square
            assert sq[0] <= cx < sq[2] and sq[1] <= cy < sq[3]  # the centre is on the square
            assert shot.getpixel((cx, cy)) != desk.background  # the icon (or its letter)
            sides.add(sq[2] - sq[0])
        first_cells.add(desk.icons[0].cell)
    assert len(sides) >= 5  # sizes vary
    assert len(first_cells) >= min(4, cols * rows)  # where an app sits is drawn per seed


def test_the_oracle_solves_every_grid_task_windows_included():
    a = GuiDesktop({**SMALL, "grid": "3x3", "icons": "6", "min_turns": "1", "max_turns": "16"})
    kinds = set()
    for seed in range(20):
        reward, info, _ = play(a, seed, a.oracle_action)
        assert reward == 1.0 and info["turns"] == info["oracle_turns"], (seed, info)
        kinds |= {g[0] for g in a.goals}
    assert kinds == {"open", "close", "fill"}


def test_a_cell_reply_clicks_the_cells_centre_and_opens_the_icon_there():
    a = GuiDesktop({**CELL, "max_turns": "6", "slack": "4"})
    obs = a.reset({"seed": 7})
    assert "1-9 clicks the centre of that cell of the 3x3 grid" in obs.text
    assert "0 closes the open window" in obs.text
    for icon in a.desk.icons:
        step = a.step(f"{icon.cell}")
        assert step.observation.startswith(f"opened {icon.app}.")
        assert a.desk.window is not None and a.desk.window.app == icon.app
        assert a.step("0").observation.startswith(f"closed {icon.app}.")  # 0 closes it
        a.reset({"seed": 7})
    empty = next(c for c in range(1, 10) if c not in {i.cell for i in a.desk.icons})
    assert a.step(f"cell {empty}").observation.startswith("nothing happened (no icon there)")
    assert a.step("0").observation.startswith("nothing happened (no window is open)")
    # The first digit counts; click(x, y) still works under actions=cell.
    icon = a.desk.icons[1]
    assert a.step(f"{icon.cell}{a.desk.icons[0].cell}").observation.startswith(
        f"opened {icon.app}")
    a.reset({"seed": 7})
    x, y = (icon.square[0] + icon.square[2]) // 2, (icon.square[1] + icon.square[3]) // 2
    assert a.step(f"click({x}, {y})").observation.startswith(f"opened {icon.app}")
    assert a.invalid == 0


def test_the_cell_oracle_solves_open_and_close_tasks_in_exactly_their_turns():
    a = GuiDesktop({**CELL, "min_turns": "1", "max_turns": "12"})
    for seed in range(25):
        reward, info, _ = play(a, seed, a.oracle_action)
        assert reward == 1.0 and info["turns"] == info["oracle_turns"], (seed, info)
        assert {g[0] for g in a.goals} <= {"open", "close"}  # a digit cannot type
        assert a.budget == 2 * info["oracle_turns"] + 2
    obs = a.reset({"seed": 3, "turns": 1})
    assert obs.text.startswith(f"Task: open {a.goals[0][1]}.")
    assert a.oracle_action() == str(a.desk.icon(a.goals[0][1]).cell)


def test_invalid_cell_replies_use_a_turn_and_change_nothing():
    a = GuiDesktop({**CELL, "grid": "2x2", "slack": "6"})
    obs = a.reset({"seed": 4})
    before = obs.images[0].data
    bad = {"": "no digit found (0-4)", "abc": "no digit found", "seven": "no digit found",
           "7": "cell 7 is not on the grid (1-4, or 0)", " 5 then 1": "cell 5 is not on"}
    for turn, (action, words) in enumerate(bad.items(), 1):
        step = a.step(action)
        assert step.observation.startswith("invalid action: ") and words in step.observation
        assert f"Turn {turn} of 7" in step.observation
        assert step.images[0].data == before and not step.done
    assert a.step(a.oracle_action()).done
    reward, info = a.close()
    assert reward == 1.0 and info["invalid"] == 5 and info["turns"] == 6


def test_format_bonus_pays_a_failed_episode_its_share_of_valid_turns():
    """As the default suite: a failed episode earns format_bonus x valid turns / turns played
    (its whole budget); a win pays 1.0; only a win counts as a success."""
    a = GuiDesktop({**CELL, "slack": "3", "format_bonus": "0.5"})
    a.reset({"seed": 1})
    empty = next(c for c in range(1, 10) if c not in {i.cell for i in a.desk.icons})
    steps = [a.step(r) for r in ("x", str(empty), "?", str(empty))]  # 2 of 4 valid
    assert [s.done for s in steps] == [False, False, False, True]
    assert steps[-1].reward == pytest.approx(0.5 * 2 / 4)
    reward, info = a.close()
    assert reward == pytest.approx(0.25) and not info["success"]
    a.reset({"seed": 1})
    for _ in range(4):
        step = a.step("no digit")
    assert step.done and step.reward == 0.0
    a.reset({"seed": 1})
    assert a.step(a.oracle_action()).reward == 1.0
    # With partial=1 the two add up, kept below a win's 1.0.
    p = GuiDesktop({**SMALL, "partial": "1", "format_bonus": "0.9", "slack": "0"})
    p.reset({"seed": 5, "turns": 6})
    while p.done_goals < len(p.goals) - 1:
        p.step(p.oracle_action())
    while p.turn < p.budget:
        p.step("click(0, 199)")  # valid, does nothing
    assert p.close()[0] == 0.99


def test_slack_sets_the_turn_budget():
    for slack, said, budget in (("0", "1 turn.", 1), ("2", "3 turns.", 3)):
        a = GuiDesktop({**CELL, "slack": slack})
        assert said in a.reset({"seed": 0}).text and a.budget == budget
    a = GuiDesktop({**SMALL, "slack": "1", "max_turns": "9"})
    a.reset({"seed": 3})
    assert a.budget == a.oracle_turns + 1


def test_prompt_task_keeps_the_task_line_alone_and_the_same_screen():
    full, short = GuiDesktop(CELL), GuiDesktop({**CELL, "prompt": "task"})
    for seed in range(5):
        said, brief = full.reset({"seed": seed}), short.reset({"seed": seed})
        assert brief.text == said.text.split("\n")[0] and brief.text.startswith("Task: open ")
        assert "Reply with one digit" in said.text and "\n" not in brief.text
        assert brief.images[0].data == said.images[0].data
        assert short.oracle_action() == full.oracle_action()
    with pytest.raises(TaskError, match="suite option prompt='short' must be 'full' or 'task'"):
        GuiDesktop({**CELL, "prompt": "short"})


def test_colors_app_gives_each_app_its_colour_and_keeps_the_layout():
    mine, fixed = GuiDesktop(CELL), GuiDesktop({**CELL, "colors": "app"})
    colour = {}
    for seed in range(20):
        mine.reset({"seed": seed})
        fixed.reset({"seed": seed})
        assert [(i.app, i.box) for i in mine.desk.icons] == [
            (i.app, i.box) for i in fixed.desk.icons]
        for icon in fixed.desk.icons:
            assert colour.setdefault(icon.app, icon.color) == icon.color
    assert len(set(colour.values())) == len(colour)


@pytest.mark.parametrize("bad,words", [
    (("grid", "3-3"), "grid='3-3' must be COLSxROWS, e.g. grid=3x3"),
    (("grid", "0x2"), "must be COLSxROWS"),
    (("grid", "6x2"), "grid=6x2 makes 53x100-pixel cells on a 320x200 screen, under 64x42"),
    (("grid", "2x5"), "under 64x42: use fewer columns or rows, or a larger width/height"),
    (("icons", "5"), "icons=5 does not fit grid=2x2 (4 cells): use icons<=4 or a larger grid"),
    (("actions", "tap"), "actions='tap' must be 'click' or 'cell'"),
    (("grid", None), "actions=cell names a cell by one digit: it needs a grid of at most 9 "
                     "cells; set grid=2x2 or grid=3x3 too"),
    (("grid", "4x3"), "actions=cell names a cell by one digit"),
    (("format_bonus", "1"), "format_bonus=1.0 is out of range 0..1 (1 excluded)"),
    (("format_bonus", "lots"), "format_bonus='lots' must be a number"),
    (("format_bonus", "nan"), "format_bonus=nan is out of range"),
    (("slack", "-1"), "'slack'=-1 is out of range 0..100"),
    (("colors", "blue"), "colors='blue' must be 'random' or 'app'"),
])
def test_grid_and_cell_options_are_checked_in_one_line(bad, words):
    opts = {**SMALL, "grid": "2x2", "icons": "2", "actions": "cell"}
    if bad[1] is None:
        del opts[bad[0]]
    else:
        opts[bad[0]] = bad[1]
    with pytest.raises(TaskError, match=re.escape(words)) as e:
        GuiDesktop(opts)
    assert "\n" not in str(e.value)
    with pytest.raises(ConfigError, match="env.options"):  # a server refuses to start
        EnvServer(GuiDesktop, EnvConfig(suite="gui", options=tuple(
            f"{k}={v}" for k, v in opts.items())))


@pytest.mark.asyncio
async def test_cell_actions_and_format_bonus_served_over_the_protocol():
    opts = {**CELL, "slack": "1", "format_bonus": "0.5"}
    cfg = EnvConfig(suite="gui", options=tuple(f"{k}={v}" for k, v in opts.items()), retries=0)
    async with EnvServer(GuiDesktop, cfg).serve() as url, EnvClient(url, cfg) as env:
        local = GuiDesktop(opts)
        s = await env.start({"task_id": "win", "seed": 11})
        assert s.ok and s.observation == local.reset({"seed": 11}).text
        r = await env.step(s.session, local.oracle_action())
        assert r.ok and r.done and r.observation.startswith("opened ")
        end = await env.end(s.session)
        assert end.reward == 1.0 and end.info["success"]
        s = await env.start({"task_id": "lose", "seed": 11})
        wrong = next(i.cell for i in local.desk.icons if i.app != local.goals[0][1])
        r1 = await env.step(s.session, "none")
        r2 = await env.step(s.session, str(wrong))
        assert "invalid action" in r1.observation and r2.observation.startswith("opened ")
        assert r2.done and r2.reward == pytest.approx(0.5 * 1 / 2)
        end = await env.end(s.session)
        assert end.reward == pytest.approx(0.25) and not end.info["success"]


RECOMMENDED = ("width=320", "height=200", "grid=2x2", "icons=2", "actions=cell", "min_turns=1",
               "max_turns=1", "slack=0", "colors=app", "format_bonus=0.1")


@pytest.mark.asyncio
async def test_a_digit_policy_plays_the_cell_form_through_the_episode_runner():
    """The setting recommended for a from-scratch byte policy, played by the episode runner
    (byte template, an engine sampling one digit a turn) against a real server: one turn a
    task, and each trajectory's reward is what a local adapter pays for the same reply (1 for
    the target's cell, format_bonus for another cell or 0, nothing for a digit off the grid)."""
    from tiderl.envs.protocol import EndReason

    tok, trajs = await text_rollout(1024, group_size=8, options=RECOMMENDED, length=1)
    local = GuiDesktop(dict(o.split("=") for o in RECOMMENDED))
    paid = set()
    for t in trajs:
        assert t.end_reason == EndReason.done and t.turns == 1, (t.end_reason, t.error)
        reply = tok.decode([x for x, m in zip(t.tokens, t.loss_mask, strict=True) if m])
        assert reply.isdigit() and len(reply) == 1, reply
        local.reset({"seed": 0})  # the group's train seed (task_seed 0, group 0)
        want = local.step(reply).reward
        assert t.reward == pytest.approx(want), (reply, t.reward, want)
        paid.add(t.reward)
    assert paid <= {0.0, 0.1, 1.0} and len(paid) >= 2, paid
