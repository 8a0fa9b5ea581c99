"""The gui suite (tiderl/envs/adapters/gui.py): deterministic by seed, solved by the scripted
oracle on every task (1 to 50 turns), its clicks land on what the screenshot shows, a random
clicker's success rate measured, bad actions handled, options checked, served over the real
protocol, and a text-only rollout reads its screenshots as placeholder lines."""

from __future__ import annotations

import asyncio
import random
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


async def text_rollout(max_context: int, group_size: int = 3):
    """A group of gui tasks played by the episode runner with a text policy (a host-side
    engine sampling digits) against a real server."""
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
    cfg = EnvConfig(suite="gui", options=("width=320", "height=200", "max_turns=2"), retries=0)
    engine = SimEngine(max_action_tokens=4, max_context=max_context,
                       actions=DigitActions(0, length=4), stop_tokens=tuple(tmpl.stop_ids))
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
