"""The agent endpoint on real aiohttp servers and the real openai client, driven through the
real rollout manager and CTB scheduler (a scripted host-side engine stands in for the model, so
the model's output is known): an unmodified agent loop with a tool call, token-in/token-out
trajectories, rewards from each source, and every kind of bad input answered with a clear 4xx
or the documented fallback while the run goes on."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
from test_envs_chat_templates import qwen25

from tiderl.agents.runner import episode_backend
from tiderl.envs.config import EnvConfig
from tiderl.envs.protocol import EndReason
from tiderl.envs.templates import template_for
from tiderl.models.tokenizer import HFTokenizer
from tiderl.serving.ctb import CTBConfig, make_scheduler
from tiderl.serving.pages import StopReason
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager
from tiderl.sim.fakes import SimEngine
from tiderl.sim.virtual_engine import DigitActions

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")

TOOL_CALL = '<tool_call>\n{"name": "calc", "arguments": {"expression": "2 + 3"}}\n</tool_call>'
ANSWER = "The answer is 5."


class ScriptedEngine(SimEngine):
    """The engine contract on the host, sampling a fixed script: action k of a task is
    `script[k]` (token ids ending with the stop id), with made-up logprobs."""

    def __init__(self, script: list[list[int]], delay_s: float = 0.0, **kw):
        # Actions as long as the engine allows: the script's stop token ends each one.
        super().__init__(max_action_tokens=256, max_context=4096,
                         actions=DigitActions(0, length=256), **kw)
        self.script, self.turn_of, self.delay_s = script, {}, delay_s

    def _sample(self, p, n: int = 1):
        # Device time the rank charges on its loop (a simulated engine's cost), per token.
        self._charge(self.delay_s * n)
        for _ in range(n):
            # Action k of a task starts at its k-th distinct action start (a re-prefill after
            # a pause or an eviction continues the same action).
            starts = self.turn_of.setdefault(p.task_id, {})
            turn = starts.setdefault(p.action_start, len(starts))
            ids = self.script[min(turn, len(self.script) - 1)]
            i = len(p.action_tokens)
            tok = ids[i] if i < len(ids) else ids[-1]
            p.tokens.append(tok)
            p.logprobs.append(-0.5 - 0.01 * i)
            p.versions.append(self.version)
            if tok in self.stop_tokens:
                p.stop_reason = StopReason.STOP_TOKEN
            elif len(p.action_tokens) >= p.max_action_tokens:
                p.stop_reason = StopReason.MAX_ACTION_TOKENS
            if p.stop_reason != StopReason.NONE:
                break


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen")
    hf = qwen25(folder)
    return HFTokenizer(folder), hf


@contextlib.asynccontextmanager
async def harness(tok, agent, script_texts, delay_s=0.0, ranks=1, capacity=1 << 16, **env):
    ours, _ = tok
    template = template_for(ours)
    stop = template.stop[0]
    script = [ours.encode(t) + [stop] for t in script_texts]
    cfg = EnvConfig(agent=f"test_agents_endpoint:{agent}", max_turns=4, **env)
    engines = [ScriptedEngine(script, delay_s, stop_tokens=tuple(template.stop_ids))
               for _ in range(ranks)]
    for e in engines[1:]:  # a task that moves to another rank keeps its place in the script
        e.turn_of = engines[0].turn_of
    rank_objs = [RolloutRank(i, engines[i]) for i in range(ranks)]
    for r in rank_objs:
        await r.start()
    sched = make_scheduler("ctb", CTBConfig(), [capacity] * ranks, max_context=4096,
                           max_tasks_per_rank=64)
    try:
        async with episode_backend(cfg, template, max_action_tokens=128,
                                   temperature=1.0) as (_, runner):
            yield RolloutManager(rank_objs, sched, None, template, max_turns=4,
                                 runner=runner), runner
    finally:
        for r in rank_objs:
            await r.close()


def group(n=1, question="What is 2 + 3?", answer=5, gid="train/e0/q0"):
    return {"group_id": gid, "tasks": [
        {"id": "q0", "question": question, "answer": answer, "task_id": f"{gid}/m{m}",
         "group_id": gid, "member": m, "split": "train", "suite": "agent"} for m in range(n)]}


# -- agents the runner calls (named by env.agent) ------------------------------------------------
def calculator(task, base_url, api_key):
    from examples.calculator.agent import solve

    return solve(task, base_url, api_key)


def slow_tools(task, base_url, api_key):
    """The calculator agent whose tool takes a while: its task waits between its turns."""
    import examples.calculator.agent as agent

    real = agent.calculate

    def calculate(expression):
        time.sleep(0.3)
        return real(expression)

    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    messages = [{"role": "user", "content": task["question"]}]
    for _ in range(3):
        msg = client.chat.completions.create(model="x", messages=messages,
                                             tools=agent.TOOLS).choices[0].message
        messages.append(msg)
        if not msg.tool_calls:
            return None
        for c in msg.tool_calls:
            result = calculate(json.loads(c.function.arguments)["expression"])
            messages.append({"role": "tool", "tool_call_id": c.id, "content": f"{result:g}"})
    return None


RECORDED: dict = {}


def recording(task, base_url, api_key):
    """The calculator agent, keeping the raw replies (logprobs and token ids) it got."""
    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    from examples.calculator.agent import TOOLS

    messages = [{"role": "user", "content": task["question"]}]
    replies = []
    for _ in range(2):
        r = client.chat.completions.create(model="x", messages=messages, tools=TOOLS,
                                           logprobs=True,
                                           extra_body={"return_token_ids": True})
        replies.append(r.model_dump())
        msg = r.choices[0].message
        messages.append(msg)
        for c in msg.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": c.id, "content": "5"})
        if not msg.tool_calls:
            break
    RECORDED[task["task_id"]] = (replies, messages)
    return 1.0 if "5" in (msg.content or "") else 0.0


GATE: dict = {}


async def gated(task, base_url, api_key):
    """Hands its task and base URL to the test and waits until the test says how it ends."""
    GATE["url"], GATE["task"], GATE["api_key"] = base_url, task, api_key
    GATE["ready"].set()
    await GATE["release"].wait()
    return GATE.get("returns")


def raising(task, base_url, api_key):
    openai.OpenAI(base_url=base_url, api_key=api_key).chat.completions.create(
        model="x", messages=[{"role": "user", "content": "hi"}])
    raise RuntimeError("the agent broke")


# -- tests -------------------------------------------------------------------------------------
def test_unmodified_openai_agent_with_a_tool_call(tok):
    """examples/calculator/agent.py as written: the scripted model calls the tool, the agent
    runs it and sends the result back, the model answers; the trajectory is the tokens the
    engine saw and produced, and env.reward scores the conversation."""
    ours, hf = tok

    async def go():
        async with harness(tok, "calculator", [TOOL_CALL, ANSWER],
                           reward="examples.calculator.reward:score") as (mgr, _):
            return await mgr.run_group(group(n=4))

    trajs = asyncio.run(go())
    assert [t.end_reason for t in trajs] == [EndReason.done] * 4, [t.error for t in trajs]
    t = trajs[0]
    assert t.reward == 1.0 and t.turns == 2 and t.info == {"correct": True}
    # The context equals transformers' rendering of the finished conversation (the tool call
    # was sampled exactly as the template writes one), and the loss mask covers the two actions.
    from examples.calculator.agent import TOOLS

    messages = [{"role": "system", "content": "Use the calc tool, then answer."},
                {"role": "user", "content": "What is 2 + 3?"},
                {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                 "function": {"name": "calc", "arguments": {"expression": "2 + 3"}}}]},
                {"role": "tool", "content": "5"}, {"role": "assistant", "content": ANSWER}]
    want = hf.apply_chat_template(messages, tools=TOOLS, tokenize=True)
    want = list(want if isinstance(want, list) else want["input_ids"])
    # ... up to the last sampled token: the template's "\n" after the final <|im_end|> was
    # never fed to the model.
    assert t.tokens == want[:-1] and hf.decode(want[-1:]) == "\n"
    actions = [t.tokens[i] for i, m in enumerate(t.loss_mask) if m]
    assert actions == ours.encode(TOOL_CALL) + [hf.convert_tokens_to_ids("<|im_end|>")] + \
        ours.encode(ANSWER) + [hf.convert_tokens_to_ids("<|im_end|>")]
    assert len(t.logprobs) == len(t.versions) == len(t.tokens)
    assert all(v == 0 for v, m in zip(t.versions, t.loss_mask, strict=True) if m)


def test_ctb_parks_agent_tasks_between_their_turns_on_a_tight_pool(tok):
    """Two ranks whose KV budget holds about two of these tasks each, 12 agent sessions: CTB
    admits what fits, pauses tasks while their agents run tools and resumes them; every
    session completes with its full trajectory."""
    async def go():
        async with harness(tok, "slow_tools", [TOOL_CALL, ANSWER], delay_s=0.002, ranks=2,
                           capacity=1600, reward="examples.calculator.reward:score") as (mgr, _):
            trajs = await asyncio.gather(*(mgr.run_group(group(n=4, gid=f"train/e0/q{g}"))
                                           for g in range(3)))
            return [t for ts in trajs for t in ts], mgr.stats()

    trajs, stats = asyncio.run(go())
    assert len(trajs) == 12 and all(t.ok and t.reward == 1.0 and t.turns == 2 for t in trajs)
    d = stats["decisions"]
    assert d["admit"] == 12 and d["pause"] > 0 and d["resume"] > 0, d
    assert len({tuple(t.tokens) for t in trajs}) == 1  # same script, same trajectory anywhere


def test_replies_carry_logprobs_and_the_engines_token_ids(tok):
    ours, _ = tok
    RECORDED.clear()

    async def go():
        async with harness(tok, "recording", [TOOL_CALL, ANSWER]) as (mgr, _):
            return await mgr.run_group(group(n=2))

    trajs = asyncio.run(go())
    for t in trajs:
        assert t.ok and t.reward == 1.0  # the agent's return value
        replies, _ = RECORDED[t.task_id]
        first, second = replies
        c = first["choices"][0]
        assert c["finish_reason"] == "tool_calls" and c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert call["function"] == {"name": "calc", "arguments": '{"expression": "2 + 3"}'}
        assert second["choices"][0]["message"]["content"] == ANSWER
        ids = [i for r in replies for i in r["choices"][0]["token_ids"]]
        lps = [x["logprob"] for r in replies for x in r["choices"][0]["logprobs"]["content"]]
        assert ids == [tk for tk, m in zip(t.tokens, t.loss_mask, strict=True) if m]
        assert lps == [lp for lp, m in zip(t.logprobs, t.loss_mask, strict=True) if m]
        assert first["prompt_token_ids"] == t.tokens[:len(first["prompt_token_ids"])]
        assert second["prompt_token_ids"] == t.tokens[:len(second["prompt_token_ids"])]


def test_a_badly_formatted_tool_call_falls_back_to_content(tok):
    """Documented fallback: a <tool_call> block that is not valid JSON comes back as plain
    content (finish_reason 'stop', no tool_calls); the trajectory keeps the tokens."""
    bad = '<tool_call>\n{"name": "calc", "arguments": {expression: 2+3}\n</tool_call>'
    RECORDED.clear()

    async def go():
        async with harness(tok, "recording", [bad]) as (mgr, _):
            return await mgr.run_group(group())

    (t,) = asyncio.run(go())
    replies, _ = RECORDED[t.task_id]
    (r,) = replies  # no tool call: the agent's loop ends after one turn
    c = r["choices"][0]
    assert c["finish_reason"] == "stop" and c["message"]["tool_calls"] is None
    assert c["message"]["content"] == bad and r["tiderl"]["malformed_tool_call"] is True
    assert t.ok and t.turns == 1


def _post(url, body, *, raw=None, method="POST"):
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data if method == "POST" else None, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


async def _with_gate(tok, script, check, *, returns=None, after=None, delay_s=0.0, **env):
    """Runs one gated agent task; `check(base_url)` runs in a thread while the task is open,
    `after(base_url)` once it ended (the endpoint still serving: its run goes on)."""
    GATE.clear()
    GATE.update(ready=asyncio.Event(), release=asyncio.Event(), returns=returns)
    async with harness(tok, "gated", script, delay_s, **env) as (mgr, runner):
        run = asyncio.ensure_future(mgr.run_group(group()))
        await GATE["ready"].wait()
        result = await asyncio.to_thread(check, GATE["url"])
        GATE["release"].set()
        (t,) = await run
        late = None if after is None else await asyncio.to_thread(after, GATE["url"])
        return result, t, runner, late


def test_bad_requests_get_a_clear_4xx_and_the_task_goes_on(tok):
    user = {"role": "user", "content": "What is 2 + 3?"}

    def check(base):
        out = {}
        chat = base + "/chat/completions"
        out["malformed"] = _post(chat, None, raw=b"{not json")
        out["not_object"] = _post(chat, [1, 2])
        out["no_messages"] = _post(chat, {"model": "x"})
        out["bad_role"] = _post(chat, {"messages": [{"role": "robot", "content": "x"}]})
        out["n"] = _post(chat, {"messages": [user], "n": 3})
        out["top_p"] = _post(chat, {"messages": [user], "top_p": 0.5})
        out["unknown_task"] = _post(base.replace("q0%2Fm0", "nope") + "/chat/completions",
                                    {"messages": [user]})
        out["no_route"] = _post(base.rsplit("/tasks/", 1)[0] + "/v1/chat/completions",
                                {"messages": [user]})
        out["ok1"] = _post(chat, {"messages": [user]})
        reply = out["ok1"][1]["choices"][0]["message"]
        out["retry"] = _post(chat, {"messages": [user]})  # the same request again: replayed
        edited = {**reply, "content": reply["content"] + " (edited)"}
        out["mismatch"] = _post(chat, {"messages": [user, edited,
                                                    {"role": "user", "content": "and?"}]})
        out["short"] = _post(chat, {"messages": [user]})  # an old history, not the retry
        out["ok2"] = _post(chat, {"messages": [user, reply, {"role": "user", "content": "and?"}]})
        out["bad_reward"] = _post(base.rsplit("/v1", 1)[0] + "/reward", {"reward": "high"})
        out["reward"] = _post(base.rsplit("/v1", 1)[0] + "/reward", {"reward": 0.25})
        out["reward_again"] = _post(base.rsplit("/v1", 1)[0] + "/reward", {"reward": 1.0})
        return out

    out, t, runner, _ = asyncio.run(_with_gate(tok, ["four", "five"], check))
    codes = {k: v[0] for k, v in out.items()}
    assert codes == {"malformed": 400, "not_object": 400, "no_messages": 400, "bad_role": 400,
                     "n": 400, "top_p": 400, "unknown_task": 404, "no_route": 404, "ok1": 200,
                     "retry": 200, "mismatch": 400, "short": 200, "ok2": 200,
                     "bad_reward": 400, "reward": 200, "reward_again": 409}
    err = {k: v[1]["error"] for k, v in out.items() if v[0] != 200}
    assert "malformed JSON" in err["malformed"]["message"]
    assert err["mismatch"]["code"] == "history_mismatch"
    assert "messages[1] does not extend the task's resident history" in err["mismatch"]["message"]
    assert "unknown task 'train/e0/nope'" in err["unknown_task"]["message"]
    assert out["retry"][1] == out["ok1"][1]  # one turn, not two
    assert "n=3" in err["n"]["message"] and err["top_p"]["param"] == "top_p"
    # 'short' was the first request again: replayed too (idempotent), nothing appended.
    assert out["short"][1] == out["ok1"][1]
    # The task went on: two real turns, the reward the agent posted.
    assert t.ok and t.turns == 2 and t.reward == 0.25
    assert runner.endpoint.requests[400] >= 7


def test_a_request_while_one_is_in_flight_is_409_and_ended_tasks_are_410(tok):
    user = {"role": "user", "content": "hi"}

    def check(base):
        chat = base + "/chat/completions"
        codes = []
        first = threading.Thread(target=lambda: codes.append(("a", _post(
            chat, {"messages": [user]})[0])))
        first.start()
        time.sleep(0.3)  # the first turn takes ~1 s (20 tokens, 50 ms each)
        status, body = _post(chat, {"messages": [user, {"role": "assistant", "content": "x"},
                                                 user]})
        codes.append(("b", status, body["error"]["code"]))
        first.join()
        return codes

    codes, t, _, late = asyncio.run(_with_gate(
        tok, ["one two three four five six seven eight nine ten"], check, returns=0.5,
        delay_s=0.05,
        after=lambda base: _post(base + "/chat/completions", {"messages": [user]})))
    assert ("a", 200) in codes and ("b", 409, "request_in_flight") in codes
    assert t.ok and t.reward == 0.5  # the agent's return value
    assert late[0] == 410 and late[1]["error"]["code"] == "task_ended"


def test_agent_failures_and_missing_rewards_fail_only_their_task(tok):
    async def go():
        async with harness(tok, "raising", ["x"]) as (mgr, _):
            return await mgr.run_group(group(n=2))

    trajs = asyncio.run(go())
    assert {t.end_reason for t in trajs} == {EndReason.env_error}
    assert all("raised RuntimeError: the agent broke" in t.error for t in trajs)
    # No reward from anywhere: the task fails with a message naming the three sources.
    _, t, _, _ = asyncio.run(_with_gate(tok, ["x"], lambda base: _post(
        base + "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})))
    assert t.end_reason == EndReason.reward_error and "POSTed .../reward" in t.error
    # A reward function that raises: reward_error with its message.
    _, t, _, _ = asyncio.run(_with_gate(tok, ["x"], lambda base: _post(
        base + "/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
        reward="test_agents_endpoint:broken_reward"))
    assert t.end_reason == EndReason.reward_error
    assert "raised ZeroDivisionError" in t.error


def broken_reward(task, transcript):
    return 1 / 0


def test_single_turn_rows_run_without_an_env_server(tok, tmp_path):
    """env.tasks + env.reward and no env.suite/env.agent: each row's `prompt` (or `messages`)
    is rendered with the chat template, one action is sampled, the reward function scores it."""
    ours, hf = tok
    template = template_for(ours)
    stop = template.stop[0]
    cfg = EnvConfig(tasks=str(tmp_path / "unused.jsonl"), reward="examples.calculator.reward:score")
    assert cfg.kind == "single_turn"

    async def go():
        rank = RolloutRank(0, ScriptedEngine([ours.encode("It is 5.") + [stop]],
                                             stop_tokens=tuple(template.stop_ids)))
        await rank.start()
        sched = make_scheduler("ctb", CTBConfig(), [1 << 16], max_context=4096,
                               max_tasks_per_rank=64)
        try:
            async with episode_backend(cfg, template, max_action_tokens=16,
                                       temperature=1.0) as (env, runner):
                assert env is None
                mgr = RolloutManager([rank], sched, None, template, max_turns=1, runner=runner)
                base = {"group_id": "g", "split": "train", "suite": "single_turn"}
                prompt = [{**base, "task_id": f"g/m{m}", "member": m, "answer": 5,
                           "prompt": "What is 2 + 3?"} for m in range(2)]
                chat = [{**base, "task_id": "h/m0", "group_id": "h", "member": 0, "answer": 4,
                         "messages": [{"role": "system", "content": "Be brief."},
                                      {"role": "user", "content": "What is 2 + 2?"}]}]
                return (await mgr.run_group({"group_id": "g", "tasks": prompt}),
                        await mgr.run_group({"group_id": "h", "tasks": chat}))
        finally:
            await rank.close()

    prompt, chat = asyncio.run(go())
    for t in prompt:
        assert t.ok and t.end_reason == EndReason.done and t.reward == 1.0 and t.turns == 1
    (c,) = chat
    assert c.ok and c.reward == 0.1  # a number, the wrong one
    want = hf.apply_chat_template([{"role": "system", "content": "Be brief."},
                                   {"role": "user", "content": "What is 2 + 2?"}],
                                  tokenize=True, add_generation_prompt=True)
    want = list(want if isinstance(want, list) else want["input_ids"])
    assert c.tokens == want + ours.encode("It is 5.") + [stop]
    assert c.loss_mask == [0] * len(want) + [1] * (len(c.tokens) - len(want))
