"""Bring your own environment and reward: adapters named `package.module:Class` (in a job and
in `python -m tiderl.envs serve --adapter`), the job's env.options reaching an external server
through /start, reward functions run safely, and a wrong env.url failing launch in seconds with
one line."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiderl.configlib import ConfigError
from tiderl.envs.adapters.default import GuessNumber
from tiderl.envs.client import EnvClient
from tiderl.envs.config import EndpointConfig, EnvConfig
from tiderl.envs.protocol import EndReason
from tiderl.envs.rewards import Episode, RewardedEnv, RewardFn
from tiderl.envs.server import EnvServer
from tiderl.envs.suites import adapter_class

ROOT = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
CALC = "examples.calculator.adapter:Calculator"


def test_adapters_by_import_path_and_their_errors():
    from examples.calculator.adapter import Calculator

    assert adapter_class(CALC) is Calculator and adapter_class("") is GuessNumber
    for spec, match in [("examples.calculator.nope:X", "cannot import 'examples.calculator.nope'"),
                        ("examples.calculator.adapter:Nope", "has no 'Nope'"),
                        ("examples.calculator.adapter:calculate", "not a subclass of")]:
        with pytest.raises(ConfigError, match=match) as e:
            adapter_class(spec)
        assert "env.suite" in str(e.value)
    for kw, key in [({"suite": "not a spec"}, "env.suite"), ({"reward": "noattr"}, "env.reward"),
                    ({"agent": "m:f", "suite": CALC}, "env.agent"), ({"epochs": -1}, "env.epochs"),
                    ({"tasks": "t.jsonl"}, "needs a way to play"),
                    ({"eval_tasks": "e.jsonl"}, "env.eval_tasks")]:
        with pytest.raises(ConfigError, match=key):
            EnvConfig(**kw)
    with pytest.raises(ConfigError, match="env.endpoint.token"):
        EndpointConfig(host="0.0.0.0")


def test_kind_of_task():
    assert EnvConfig().kind == "env" and EnvConfig().suite_name == "default"
    assert EnvConfig(tasks="t.jsonl", reward="m:f").kind == "single_turn"
    assert EnvConfig(tasks="t.jsonl", reward="m:f", suite=CALC).kind == "env"
    assert EnvConfig(tasks="t.jsonl", agent="m:f").kind == "agent"


def test_serve_a_user_adapter_from_the_command_line():
    p = subprocess.Popen([sys.executable, "-m", "tiderl.envs", "serve", "--adapter", CALC,
                          "--port", "0"], env=ENV, stdout=subprocess.PIPE, text=True)
    try:
        url = p.stdout.readline().split("url=")[1].strip()

        async def play():
            async with EnvClient(url, EnvConfig()) as env:
                s = await env.start({"task_id": "t", "question": "What is 6 * 7?", "answer": 42})
                calc = await env.step(s.session, "calc 6*7")
                done = await env.step(s.session, "answer 42")
                end = await env.end(s.session)
                health = await env.health()
                bad = await env.start({"task_id": "u"})  # no question: the task's fault
            return s, calc, done, end, health, bad

        s, calc, done, end, health, bad = asyncio.run(play())
        assert s.observation.startswith("What is 6 * 7?")
        assert calc.observation == "= 42" and done.done and done.reward == 1.0
        assert end.reward == 1.0 and end.info == {"answered": True, "calc_calls": 1}
        assert health.body["suite"] == CALC
        assert bad.reason == EndReason.env_error and "HTTP 422" in bad.error
    finally:
        p.terminate()
        p.wait(timeout=30)
    r = subprocess.run([sys.executable, "-m", "tiderl.envs", "serve", "--adapter",
                        "examples.calculator.adapter:Nope"], env=ENV, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "has no 'Nope'" in r.stderr


def test_job_options_reach_an_external_server():
    """The server runs without options; the job's env.options travel with each /start."""
    async def go():
        server = EnvServer(GuessNumber, EnvConfig())
        async with server.serve() as url:
            async with EnvClient(url, EnvConfig(options=("n=3",))) as env:
                s = await env.start({"task_id": "t", "seed": 1})
            async with EnvClient(url, EnvConfig(options=("hint=nope",))) as env:
                bad = await env.start({"task_id": "u", "seed": 1})
            async with EnvClient(url, EnvConfig()) as env:
                plain = await env.start({"task_id": "v", "seed": 1})
        return s, bad, plain

    s, bad, plain = asyncio.run(go())
    assert s.observation == "guess 1-3" and plain.observation == "guess 1-8"
    assert not bad.ok and "HTTP 422" in bad.error and "hint" in bad.error


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_wrong_env_url_fails_launch_in_seconds_with_one_line():
    url = f"http://127.0.0.1:{_free_port()}"
    # A launch that retried for minutes would hit this subprocess timeout; the speed itself
    # is not asserted (shared machines).
    r = subprocess.run([sys.executable, "-m", "tiderl.launch", f"env.url={url}",
                        "run_dir=/nonexistent/never"], env=ENV, capture_output=True, text=True,
                       timeout=60, cwd=ROOT)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith(f"tiderl.launch: error: config key 'env.url'='{url}'")
    assert "/health" in lines[0] and "python -m tiderl.envs serve" in lines[0]


def test_reward_functions_sync_async_and_their_failures():
    ep = Episode(messages=[{"role": "user", "content": "q"}], completion="answer 5", turns=1,
                 done=True)
    task = {"task_id": "t", "answer": 5}

    async def score(spec, **kw):
        fn = RewardFn(spec, **kw)
        try:
            return await fn(task, ep)
        finally:
            fn.close()

    s = asyncio.run(score("examples.calculator.reward:score"))
    assert (s.reward, s.info, s.error) == (1.0, {"correct": True}, "")
    for name, match in [("raising", "raised KeyError: 'missing'"), ("wrong", "returned 'high'"),
                        ("nan", "must be finite"), ("nodict", "without 'reward'")]:
        s = asyncio.run(score(f"test_envs_byo:{name}"))
        assert s.error and match in s.error and "test_envs_byo:" in s.error
    assert asyncio.run(score("test_envs_byo:async_score")).reward == 0.5
    s = asyncio.run(score("test_envs_byo:slow", timeout_s=0.2))
    assert "env.reward_timeout_s=0.2" in s.error


def raising(task, transcript):
    return task["missing"]


def wrong(task, transcript):
    return "high"


def nan(task, transcript):
    return float("nan")


def nodict(task, transcript):
    return {"score": 1}


async def async_score(task, transcript):
    await asyncio.sleep(0)
    return {"reward": 0.5}


def slow(task, transcript):
    time.sleep(1.0)
    return 1.0


def test_reward_function_scores_env_episodes_and_its_failure_fails_the_task():
    """RewardedEnv over a real server: the reward function sees the conversation and the env's
    own reward/info; when it raises, /end reports reward_error (the episode runner then fails
    only that task)."""
    from examples.calculator.adapter import Calculator

    seen = []

    async def go(spec):
        reward = RewardFn(spec)
        server = EnvServer(Calculator, EnvConfig(suite=CALC))
        async with server.serve() as url, EnvClient(url, EnvConfig()) as client:
            env = RewardedEnv(client, reward)
            s = await env.start({"task_id": "t", "question": "What is 2 + 2?", "answer": 4})
            await env.step(s.session, "calc 2+2")
            await env.step(s.session, "answer 4")
            end = await env.end(s.session)
        reward.close()
        return end

    global SEEN
    SEEN = seen
    end = asyncio.run(go("test_envs_byo:recording"))
    assert end.ok and end.reward == 2.0 and end.info["answered"] is True
    (ep,) = seen
    assert [m["role"] for m in ep.messages] == ["user", "assistant", "user", "assistant"]
    assert ep.messages[2]["content"] == "= 4" and ep.completion == "answer 4"
    assert ep.env_reward == 1.0 and ep.done and ep.turns == 2
    end = asyncio.run(go("test_envs_byo:raising"))
    assert end.reason == EndReason.reward_error and "raised KeyError" in end.error


SEEN: list = []


def recording(task, transcript):
    SEEN.append(transcript)
    return 2.0 * transcript.env_reward
