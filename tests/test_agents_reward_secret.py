"""The reward route takes a reward only from the task's own agent: each task's base URL carries
a per-task secret (the bearer token is shared by every task, and task ids are predictable), so
a post without it is 401, with another secret 403, and a second reward or one after the task
ended is 409. The secret reaches the agent function and nothing the model sees. Real aiohttp
endpoint, real rollout manager and scheduler, a scripted engine (see test_agents_endpoint)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from test_agents_endpoint import GATE, _with_gate
from test_envs_chat_templates import qwen25

from tiderl.agents.endpoint import AgentEndpoint
from tiderl.envs.config import EndpointConfig
from tiderl.models.tokenizer import HFTokenizer

pytest.importorskip("openai")
pytest.importorskip("transformers")

USER = {"role": "user", "content": "What is 2 + 3?"}


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen")
    hf = qwen25(folder)
    return HFTokenizer(folder), hf


def _call(url, body=None, *, token="", method="POST"):
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = json.dumps(body).encode() if method == "POST" else None
    req = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _split(base):
    """(root/tasks/{task_id}, secret) of a task's base URL .../tasks/{task_id}/{secret}/v1."""
    head, secret, v1 = base.rsplit("/", 2)
    assert v1 == "v1" and "/tasks/" in head, base
    return head, secret


def test_a_reward_needs_the_tasks_secret_and_is_taken_once(tok):
    """The shared bearer token alone does not post a reward: no secret 401, a wrong one 403
    (nor a chat turn); the agent's own URL posts it once; after that, and after the task
    ended, 409."""
    token = "the-shared-token"

    def check(base):
        # What anyone holding the shared token can guess: the root and the task's id.
        head = base.split("/tasks/")[0] + "/tasks/train%2Fe0%2Fq0%2Fm0"
        secret = base.removeprefix(head + "/").removesuffix("v1").rstrip("/")
        wrong = secret[:-1] + ("A" if secret[-1:] != "A" else "B")
        out = {"no_secret": _call(head + "/reward", {"reward": 1.0}, token=token),
               "wrong_secret": _call(f"{head}/{wrong}/reward", {"reward": 1.0}, token=token),
               "chat_no_secret": _call(head + "/v1/chat/completions", {"messages": [USER]},
                                       token=token),
               "chat_wrong": _call(f"{head}/{wrong}/v1/chat/completions",
                                   {"messages": [USER]}, token=token),
               "models_no_secret": _call(head + "/v1/models", token=token, method="GET"),
               "no_token": _call(base.removesuffix("/v1") + "/reward", {"reward": 1.0}),
               "chat": _call(base + "/chat/completions", {"messages": [USER]}, token=token),
               "models": _call(base + "/models", token=token, method="GET"),
               "reward": _call(base.removesuffix("/v1") + "/reward", {"reward": 0.75},
                               token=token),
               "again": _call(base.removesuffix("/v1") + "/reward", {"reward": 1.0},
                              token=token)}
        return out

    def after(base):
        head = base.split("/tasks/")[0] + "/tasks/train%2Fe0%2Fq0%2Fm0"
        return {"late": _call(base.removesuffix("/v1") + "/reward", {"reward": 1.0},
                              token=token),
                "late_wrong": _call(f"{head}/nope/reward", {"reward": 1.0}, token=token),
                "late_chat": _call(base + "/chat/completions", {"messages": [USER]},
                                   token=token)}

    out, t, runner, late = asyncio.run(_with_gate(
        tok, ["five"], check, after=after, endpoint=EndpointConfig(token=token)))
    codes = {k: v[0] for k, v in {**out, **late}.items()}
    assert codes == {"no_secret": 401, "wrong_secret": 403, "chat_no_secret": 401,
                     "chat_wrong": 403, "models_no_secret": 401, "no_token": 401, "chat": 200,
                     "models": 200, "reward": 200, "again": 409, "late": 409,
                     "late_wrong": 403, "late_chat": 410}
    assert len(_split(GATE["url"])[1]) >= 32
    err = {k: v[1]["error"] for k, v in {**out, **late}.items() if v[0] != 200}
    assert err["no_secret"]["code"] == "missing_task_secret"
    assert err["no_secret"]["type"] == "authentication_error"
    assert err["wrong_secret"]["code"] == "wrong_task_secret"
    assert err["again"]["code"] == "reward_posted" and err["late"]["code"] == "task_ended"
    # No error echoes the secret.
    _, secret = _split(GATE["url"])
    assert all(secret not in json.dumps(e) for e in err.values())
    # Only the agent's post counted: one turn, its reward.
    assert t.ok and t.turns == 1 and t.reward == 0.75
    assert runner.endpoint.requests[401] == 4 and runner.endpoint.requests[403] == 3


def test_the_secret_reaches_the_agent_and_nothing_the_model_sees(tok):
    """The secret is in the agent's base URL only: not in its task, its api_key, the prompt
    the model is given, the reply, or the trajectory the trainer gets."""
    ours, _ = tok

    def check(base):
        reply = _call(base + "/chat/completions", {"messages": [USER],
                                                   "return_token_ids": True})
        return reply, _call(base.removesuffix("/v1") + "/reward", {"reward": 0.5})

    (reply, posted), t, _, _ = asyncio.run(_with_gate(tok, ["five"], check))
    _, secret = _split(GATE["url"])
    assert reply[0] == 200 and posted[0] == 200 and t.ok and t.reward == 0.5
    assert secret not in json.dumps(GATE["task"]) and secret not in GATE["api_key"]
    assert secret not in json.dumps(reply[1])
    assert secret not in ours.decode(reply[1]["prompt_token_ids"])
    assert secret not in ours.decode(t.tokens) and secret not in json.dumps(t.info)


def test_a_reopened_task_gets_a_new_secret_and_the_old_one_is_refused():
    """Secrets are per task opening: two tasks never share one, and a task id opened again
    (a retried group) does not take the old opening's secret."""

    async def go():
        ep = AgentEndpoint(EndpointConfig())
        async with ep.serve():
            a, b = ep.open("train/e0/q0/m0"), ep.open("train/e0/q0/m1")
            url_a, url_b = ep.base_url(a.task_id), ep.base_url(b.task_id)
            ep.close(a.task_id, "its episode ended")
            again = ep.open(a.task_id)
            url_again = ep.base_url(again.task_id)
            # Task b's secret on task a's id, and a's first secret on its second opening.
            head_a, _ = _split(url_a)
            crossed = f"{head_a}/{_split(url_b)[1]}/reward"
            codes = await asyncio.to_thread(lambda: [
                _call(crossed, {"reward": 1.0})[0],
                _call(url_a.removesuffix("/v1") + "/reward", {"reward": 1.0})[0],
                _call(url_again.removesuffix("/v1") + "/reward", {"reward": 0.5})[0]])
            return {a.secret, b.secret, again.secret}, codes, again.reward

    secrets, codes, reward = asyncio.run(go())
    assert len(secrets) == 3 and codes == [403, 403, 200] and reward == (0.5, {})
