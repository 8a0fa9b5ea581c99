"""Env failures that must stay values, over real aiohttp servers on 127.0.0.1: rewards that are
not finite numbers (bad_reward), actions over the server's limit (action_too_long, and the
config check tying env.max_action_chars to rollout.max_action_tokens), per-session options
checked against the adapter's allow-list (TextWorld's games in the server's own folder), and
/pause serialised with the session's steps and safe from the reaper."""

from __future__ import annotations

import asyncio
import contextlib
import os
import stat
import threading
import time

import aiohttp
import numpy as np
import pytest
from aiohttp import web

from tiderl.configlib import ConfigError
from tiderl.envs.adapters.base import Adapter, Step
from tiderl.envs.adapters.default import GuessNumber
from tiderl.envs.client import EnvClient
from tiderl.envs.config import EnvConfig
from tiderl.envs.protocol import EndReason
from tiderl.envs.rewards import Episode, RewardedEnv, RewardFn
from tiderl.envs.server import EnvServer
from tiderl.serving.trajectory import Trajectory

CFG = EnvConfig(retries=0, request_timeout_s=5, call_deadline_s=10)


@contextlib.asynccontextmanager
async def serving(adapter=GuessNumber, *, cfg: EnvConfig = CFG, **server_kw):
    server = EnvServer(adapter, cfg, **server_kw)
    async with server.serve() as url, EnvClient(url, cfg) as env:
        yield server, url, env


@contextlib.asynccontextmanager
async def raw_app(end_body: bytes, step_body: bytes):
    """An env server of someone else's, answering fixed JSON bytes (NaN literals included)."""
    async def start(request):
        return web.json_response({"session": "s", "observation": "go"})

    async def step(request):
        return web.Response(body=step_body, content_type="application/json")

    async def end(request):
        return web.Response(body=end_body, content_type="application/json")

    app = web.Application()
    app.add_routes([web.post("/start", start), web.post("/observation", step),
                    web.post("/end", end)])
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = site._server.sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        await runner.cleanup()


class BadRewards(Adapter):
    """Its /end reward (and the first step's, for 'step_nan') is whatever the task names."""

    VALUES = {"nan": float("nan"), "inf": float("inf"), "none": None, "string": "high",
              "numpy": np.float32(0.5), "fine": 1.0}

    def reset(self, task):
        self.kind = task.get("kind", "fine")
        return "go"

    def step(self, action):
        if self.kind == "step_nan":
            return Step("again", False, float("nan"))
        return Step("done", True, 0.0)

    def close(self):
        return self.VALUES.get(self.kind, 0.0), {}


# -- 1. rewards -----------------------------------------------------------------------------


def test_rewards_that_are_not_finite_numbers_end_the_task_bad_reward():
    async def play(kind):
        async with serving(BadRewards) as (_, _, env):
            s = await env.start({"task_id": kind, "kind": kind})
            step = await env.step(s.session, "x")
            end = await env.end(s.session)
            return step, end

    for kind in ("nan", "inf", "none", "string"):
        step, end = asyncio.run(play(kind))
        assert step.ok and step.done
        assert end.reason == EndReason.bad_reward and "reward" in end.error, (kind, end)
    step, end = asyncio.run(play("step_nan"))
    assert step.reason == EndReason.bad_reward and "nan" in step.error
    for kind, want in (("numpy", 0.5), ("fine", 1.0)):
        _, end = asyncio.run(play(kind))
        assert end.ok and end.reward == want


@pytest.mark.parametrize("end_body", [
    b'{"reward": NaN, "info": {}}', b'{"reward": Infinity}', b'{"reward": null}',
    b'{"reward": "high"}', b'{"info": {}}', b'{"reward": true}'])
def test_an_external_servers_bad_end_reward_is_bad_reward(end_body):
    async def go():
        async with raw_app(end_body, b'{"observation": "o", "done": true, "reward": NaN}') as url:
            async with EnvClient(url, CFG) as env:
                s = await env.start({"task_id": "t"})
                return await env.step(s.session, "x"), await env.end(s.session)

    step, end = asyncio.run(go())
    assert step.reason == EndReason.bad_reward
    assert end.reason == EndReason.bad_reward and end.error.startswith("/end: ")


def nan_reward(task, transcript):
    return float("nan")


def none_reward(task, transcript):
    return None


def string_reward(task, transcript):
    return "high"


def dict_none_reward(task, transcript):
    return {"reward": None}


def raising_reward(task, transcript):
    raise KeyError("x")


def test_reward_functions_returning_nan_none_or_a_string_fail_bad_reward():
    ep = Episode(messages=[], completion="", turns=1, done=True)

    async def score(name):
        fn = RewardFn(f"test_envs_hardening:{name}")
        try:
            return await fn({"task_id": "t"}, ep)
        finally:
            fn.close()

    for name in ("nan_reward", "none_reward", "string_reward", "dict_none_reward"):
        s = asyncio.run(score(name))
        assert s.error and s.reason == EndReason.bad_reward, (name, s)
    assert asyncio.run(score("raising_reward")).reason == EndReason.reward_error

    async def through_env(name):
        fn = RewardFn(f"test_envs_hardening:{name}")
        async with serving(GuessNumber) as (_, _, client):
            env = RewardedEnv(client, fn)
            s = await env.start({"task_id": "t", "seed": 1, "target": 4})
            await env.step(s.session, "4")
            end = await env.end(s.session)
        fn.close()
        return end

    assert asyncio.run(through_env("nan_reward")).reason == EndReason.bad_reward


def _traj(i, reward, reason=EndReason.done):
    return Trajectory(task_id=f"g/m{i}", group_id="g", is_eval=False, tokens=[1, 2, 3],
                      loss_mask=[0, 1, 1], logprobs=[0.0, -1.0, -1.0], versions=[-1, 0, 0],
                      reward=reward, end_reason=reason, turns=1)


def test_a_nan_reward_in_a_group_fails_that_task_and_the_group_trains_or_is_dropped():
    from tiderl.control.buffer import ReadinessBuffer

    buf = ReadinessBuffer(groups_per_microbatch=1, max_staleness=4, min_ok_per_group=2)
    g = buf.add_group([_traj(0, float("nan")), _traj(1, 1.0), _traj(2, 0.0),
                       _traj(3, float("inf"))], now=0.0)
    assert g is not None and len(g.seqs) == 2
    assert all(np.isfinite(s.advantage) for s in g.seqs)
    assert buf.failed_tasks["bad_reward"] == 2
    # Too few verdicts left: dropped and counted, nothing raised.
    assert buf.add_group([_traj(0, float("nan")), _traj(1, 1.0)], now=1.0) is None
    assert buf.dropped["failed_tasks"] == 1 and buf.failed_tasks["bad_reward"] == 3


# -- 2. long actions ------------------------------------------------------------------------


def test_an_action_over_the_servers_limit_ends_action_too_long_and_the_episode_ends_normally():
    async def go():
        async with serving(cfg=EnvConfig(retries=0, max_action_chars=2)) as (server, _, env):
            s = await env.start({"task_id": "t", "seed": 1, "target": 4})
            long = await env.step(s.session, "123")
            end = await env.end(s.session)  # the session is intact: a verdict, a reward
            return long, end, server.live_sessions

    long, end, live = asyncio.run(go())
    assert long.done and long.reason == EndReason.action_too_long and "413" in long.error
    assert end.ok and live == 0
    t = _traj(0, end.reward, EndReason.action_too_long)
    assert t.ok  # trainable, not dropped


def test_config_ties_max_action_chars_to_max_action_tokens(tmp_path):
    from tokenizers import Tokenizer, models

    from tiderl.config import load_config
    from tiderl.models.tokenizer import max_token_chars

    with pytest.raises(ConfigError) as e:
        load_config(None, ["env.max_action_chars=2", "rollout.max_action_tokens=3"])
    msg = str(e.value)
    assert "\n" not in msg and "env.max_action_chars" in msg
    assert "rollout.max_action_tokens=3" in msg and "env.max_action_chars=3" in msg
    # Unset (0): derived, at least 4096; the embedded default stays 4096.
    assert load_config(None, []).env.max_action_chars == 4096
    big = load_config(None, ["rollout.max_action_tokens=5000", "rollout.max_context=8192",
                             "model.max_seq_len=8192", "trainer.row_len=8192",
                             "rollout.num_pages=1024"])
    assert big.env.max_action_chars == 5000
    # An external server's limit is its own: the client's ends over-long actions instead.
    assert load_config(None, ["env.max_action_chars=2", "rollout.max_action_tokens=3",
                              "env.url=http://127.0.0.1:9"]).env.max_action_chars == 2
    # A tokenizer.json: its longest token (+1 for a decoder's space) bounds a token's text.
    t = Tokenizer(models.WordLevel({"<unk>": 0, "a": 1, "hello_world": 2}, unk_token="<unk>"))
    t.save(str(tmp_path / "tokenizer.json"))
    assert max_token_chars(str(tmp_path)) == len("hello_world") + 1
    assert max_token_chars("byte") == 1


# -- 3. per-session options -----------------------------------------------------------------


async def _start(http, url, options):
    async with http.post(url + "/start", json={"task": {"task_id": "t", "seed": 1},
                                               "options": options}) as resp:
        return resp.status, await resp.json()


def test_client_options_outside_the_adapters_allow_list_are_refused():
    async def go():
        server = EnvServer(GuessNumber, EnvConfig(options=("hint=range", "guesses=3")))
        async with server.serve() as url, aiohttp.ClientSession() as http:
            out = [await _start(http, url, o) for o in (
                {"cache_dir": "/etc"}, {"n": "3"}, {"hint": "range"}, {"workers": "64"})]
            return out, server.live_sessions

    (bad, ok, same, bad2), live = asyncio.run(go())
    assert bad[0] == 400 and "'cache_dir'" in bad[1]["error"]
    assert "clients may set: bonus, format, format_bonus, guesses, hint, n, target, targets" in (
        bad[1]["error"])
    assert bad2[0] == 400 and "'workers'" in bad2[1]["error"]
    assert ok[0] == 200 and ok[1]["observation"] == "guess 1-3"
    assert same[0] == 200  # the server's own value: no override
    assert live == 2  # the refused ones opened no session


def test_a_user_adapter_lets_clients_set_nothing_unless_it_lists_it():
    class Mine(BadRewards):
        pass

    class Listed(BadRewards):
        client_options = frozenset({"level"})

    async def go(cls):
        async with EnvServer(cls, CFG).serve() as url, aiohttp.ClientSession() as http:
            return await _start(http, url, {"level": "2"})

    status, body = asyncio.run(go(Mine))
    assert status == 400 and "clients may set: none" in body["error"]
    assert asyncio.run(go(Listed))[0] == 200


def test_textworld_games_compile_in_the_servers_private_folder():
    pytest.importorskip("textworld")
    from tiderl.envs.adapters.textworld import TextWorldGame

    task = {"task_id": "tw", "seed": 3, "rooms": 1, "objects": 0, "quest_length": 1}

    async def go():
        server = EnvServer(TextWorldGame, EnvConfig(suite="textworld", retries=0))
        # Compiling a game takes ~2 s on an idle core and several times that on a loaded CI
        # machine: this client waits for it (CFG's 5 s reply limit is for the toy suites).
        slow = EnvConfig(retries=0, request_timeout_s=120, call_deadline_s=240)
        async with server.serve() as url, EnvClient(url, slow) as env, \
                aiohttp.ClientSession() as http:
            status, body = await _start(http, url, {"cache_dir": "/tmp/elsewhere"})
            s = await env.start(task)
            games = sorted(os.listdir(os.path.join(server.state_dir, "textworld")))
            mode = stat.S_IMODE(os.stat(server.state_dir).st_mode)
            await env.end(s.session)
        return server.state_dir, status, body, s, games, mode

    state, status, body, s, games, mode = asyncio.run(go())
    assert status == 400 and "'cache_dir'" in body["error"] and "quest_length" in body["error"]
    assert s.ok, s.error
    assert "tw-s3-r1-o0-q1.z8" in games and mode == 0o700
    assert not os.path.exists(state)  # the private folder goes with the server
    # A server-side cache_dir option is refused at startup: the folder is the server's.
    with pytest.raises(ConfigError, match="--state-dir"):
        EnvServer(TextWorldGame, EnvConfig(suite="textworld", options=("cache_dir=/tmp/x",)))


def test_a_server_that_fails_to_start_or_never_serves_leaves_no_private_folder(monkeypatch):
    import gc
    import tempfile

    import tiderl.envs.server as server_mod

    made: list[str] = []
    real = tempfile.mkdtemp

    def mkdtemp(**kw):
        made.append(real(**kw))
        return made[-1]

    monkeypatch.setattr(server_mod.tempfile, "mkdtemp", mkdtemp)

    class Picky(GuessNumber):
        def __init__(self, *a, **k):
            raise ValueError("option 'level' must be 1-3")

    with pytest.raises(ConfigError, match="level"):
        EnvServer(Picky, EnvConfig())
    assert len(made) == 1 and not os.path.exists(made[0])  # gone with the failure
    server = EnvServer(GuessNumber, EnvConfig())
    assert server.state_dir == made[1] and os.path.isdir(made[1])
    del server  # constructed, never served: its folder goes when it is collected
    gc.collect()
    assert not os.path.exists(made[1])


def test_textworld_cache_is_pruned_by_age_and_total_size(tmp_path):
    from tiderl.envs.adapters.textworld import prune_cache

    now = time.time()

    def game(name, age_s, size):
        for ext in (".z8", ".json", ".ni"):
            p = tmp_path / f"{name}{ext}"
            p.write_bytes(b"x" * size)
            os.utime(p, (now - age_s, now - age_s))

    game("tw-s1-r1-o0-q1", 10 * 86400, 100)   # too old
    game("tw-s2-r1-o0-q1", 300, 100)
    game("tw-s3-r1-o0-q1", 200, 100)
    game("tw-s4-r1-o0-q1", 100, 100)
    (tmp_path / "notes.txt").write_text("not a game")
    keep = str(tmp_path / "tw-s2-r1-o0-q1.z8")
    removed = prune_cache(str(tmp_path), max_bytes=700, max_age_s=86400, keep=keep)
    left = sorted(p.name for p in tmp_path.iterdir())
    # s1 is too old; then 900 bytes > 700: the least recently used that is not kept (s3) goes.
    assert removed == 2
    assert left == ["notes.txt", *sorted(f"tw-s{k}-r1-o0-q1{e}" for k in (2, 4)
                                         for e in (".json", ".ni", ".z8"))]


# -- 4. /pause under the session lock -------------------------------------------------------


class Slow(Adapter):
    """Blocking calls in worker threads that record when they ran (overlaps show)."""

    blocking = True
    log: list[tuple[str, float, float]] = []
    lock = threading.Lock()

    def reset(self, task):
        return "go"

    def _timed(self, name, seconds):
        t0 = time.monotonic()
        time.sleep(seconds)
        with self.lock:
            Slow.log.append((name, t0, time.monotonic()))

    def step(self, action):
        self._timed("step", 0.4)
        return Step("ok", False, 0.0)

    def pause(self):
        self._timed("pause", 0.5)

    def close(self):
        self._timed("close", 0.0)
        return 0.0, {}


def test_pause_waits_for_a_running_step_and_the_reaper_never_closes_it_midway():
    Slow.log = []
    cfg = EnvConfig(retries=0, max_pause_s=0.1, idle_timeout_s=30.0)

    async def go():
        async with serving(Slow, cfg=cfg) as (server, _, env):
            s = await env.start({"task_id": "t"})
            step = asyncio.create_task(env.step(s.session, "a"))
            await asyncio.sleep(0.1)  # the step is running in its worker thread
            paused = await env.pause(s.session)
            r = await step
            for _ in range(100):  # then, paused past env.max_pause_s, it is reaped
                if not server.live_sessions:
                    break
                await asyncio.sleep(0.05)
            return r, paused, server.live_sessions

    r, paused, live = asyncio.run(go())
    assert r.ok and paused.ok and paused.body["paused"] is True
    assert live == 0
    spans = sorted(Slow.log, key=lambda x: x[1])
    assert [n for n, _, _ in spans] == ["step", "pause", "close"], spans
    for (a, _, a_end), (b, b_start, _) in zip(spans, spans[1:], strict=False):
        assert b_start >= a_end, f"{b} overlapped {a}: {spans}"
