"""Latency injection, EnvConfig validation, the default task's rules, and the serve entry point."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import urllib.request

import pytest

from tiderl.configlib import ConfigError, from_dict
from tiderl.envs.adapters.default import GuessNumber, parse_guess
from tiderl.envs.config import EnvConfig, LatencyConfig
from tiderl.envs.latency import LatencyModel


def test_latency_is_seeded_per_task_and_turn():
    model = LatencyModel(LatencyConfig(dist="lognormal", median_s=0.1, sigma=0.5, seed=3))
    a = [model.sample("task-1", t) for t in range(5)]
    assert a == [model.sample("task-1", t) for t in range(5)]  # same task, same delays
    assert a != [model.sample("task-2", t) for t in range(5)]
    other_seed = LatencyModel(LatencyConfig(dist="lognormal", median_s=0.1, sigma=0.5, seed=4))
    assert a != [other_seed.sample("task-1", t) for t in range(5)]
    assert LatencyModel(LatencyConfig()).sample("task-1", 1) == 0.0


def test_latency_distributions_match_their_parameters():
    # 20k samples: the sample median of a lognormal is within ~2% of exp(mu) (tolerance 5%).
    logn = LatencyModel(LatencyConfig(dist="lognormal", median_s=0.2, sigma=0.8, cap_s=1e9))
    xs = [logn.sample(f"t{i}", 1) for i in range(20000)]
    assert statistics.median(xs) == pytest.approx(0.2, rel=0.05)
    assert statistics.fmean(xs) == pytest.approx(logn.mean(), rel=0.05)
    # Pareto: support starts at scale; P(X > 2*scale) = 2**-alpha (tolerance 0.02 absolute).
    par = LatencyModel(LatencyConfig(dist="pareto", scale_s=0.05, alpha=1.5, cap_s=1e9))
    ys = [par.sample(f"t{i}", 1) for i in range(20000)]
    assert min(ys) >= 0.05
    assert sum(y > 0.1 for y in ys) / len(ys) == pytest.approx(2**-1.5, abs=0.02)
    capped = LatencyModel(LatencyConfig(dist="pareto", scale_s=0.05, alpha=0.5, cap_s=0.5))
    assert max(capped.sample(f"t{i}", 1) for i in range(2000)) == 0.5
    assert math.isinf(capped.mean())


def test_latency_start_factor_applies_to_reset_only():
    base = LatencyConfig(dist="lognormal", median_s=0.1, sigma=0.3)
    slow_start = LatencyModel(LatencyConfig(**{**base.__dict__, "start_factor": 10.0}))
    plain = LatencyModel(base)
    assert slow_start.sample("t", 0) == pytest.approx(10 * plain.sample("t", 0))
    assert slow_start.sample("t", 1) == plain.sample("t", 1)


@pytest.mark.parametrize("data, key", [
    ({"suite": "webshop"}, "env.suite"),
    ({"concurrency": 0}, "env.concurrency"),
    ({"idle_timeout_s": 0}, "env.idle_timeout_s"),
    ({"retries": -1}, "env.retries"),
    ({"call_deadline_s": 1.0, "request_timeout_s": 5.0}, "env.call_deadline_s"),
    ({"options": ["n8"]}, "env.options"),
    ({"latency": {"dist": "weibull"}}, "env.latency.dist"),
    ({"latency": {"dist": "pareto", "alpha": 0}}, "env.latency.alpha"),
])
def test_env_config_errors_name_the_key(data, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        from_dict(EnvConfig, data, prefix="env")


def test_env_config_parses_options():
    cfg = from_dict(EnvConfig, {"suite": "gym", "options": ["game=Taxi-v4", "max_steps=50"]},
                    prefix="env")
    assert cfg.option_dict() == {"game": "Taxi-v4", "max_steps": "50"}


def test_default_task_rules():
    env = GuessNumber()
    assert env.reset({"seed": 0, "target": 6}) == "guess 1-8"
    assert env.step("4").observation == "higher"
    assert env.step(" 9 ").observation == "invalid"  # out of range costs a guess
    last = env.step("7")
    assert (last.observation, last.done, last.reward) == ("lost", True, 0.0)
    assert env.close() == (0.0, {"success": False, "target": 6, "guesses_used": 3,
                                 "valid_guesses": 2, "consistent_guesses": 2})
    assert [parse_guess(a, 8) for a in ["3", "03", "3.0", "", "x", "8", "0"]] == [
        3, 3, None, None, None, 8, None]


def test_default_task_shaping_and_range_hints():
    env = GuessNumber({"format_bonus": "0.3", "hint": "range"})
    env.reset({"seed": 0, "target": 6})
    assert env.step("4").observation == "higher 5-8"
    assert env.step("x").observation == "invalid 5-8"
    last = env.step("8")
    assert (last.observation, last.done) == ("lost", True)
    assert last.reward == pytest.approx(0.3 * 2 / 3)  # two valid guesses of three
    env.reset({"seed": 0, "target": 6})
    assert env.step("7").observation == "lower 1-6"
    assert env.step("5").observation == "higher 6-6"
    assert env.step("6").reward == 1.0 and env.close()[0] == 1.0
    with pytest.raises(ValueError, match="hint"):
        GuessNumber({"hint": "all"})


def test_default_task_consistent_bonus_pays_only_guesses_the_feedback_allows():
    env = GuessNumber({"format_bonus": "0.3", "bonus": "consistent"})
    env.reset({"seed": 0, "target": 6})
    assert env.step("4").observation == "higher"  # 4 was possible: paid
    assert env.step("2").observation == "higher"  # valid, but feedback ruled out 1-4: not paid
    last = env.step("7")  # still possible (5-8): paid
    assert last.reward == pytest.approx(0.3 * 2 / 3)
    assert env.close()[1]["valid_guesses"] == 3 and env.close()[1]["consistent_guesses"] == 2
    env.reset({"seed": 0, "target": 6})
    assert env.step("x").observation == "invalid" and env.step("9").observation == "invalid"
    assert env.step("5").reward == pytest.approx(0.3 * 1 / 3)
    with pytest.raises(ValueError, match="bonus="):
        GuessNumber({"bonus": "all"})


@pytest.mark.entry
def test_serve_entry_point_serves_and_stops():
    proc = subprocess.Popen(
        [sys.executable, "-m", "tiderl.envs", "serve", "--suite", "default", "--port", "0",
         "--token", "t0k", "idle_timeout_s=30"], stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        url = line.strip().split("url=")[1]
        assert url.startswith("http://127.0.0.1:")
        req = urllib.request.Request(url + "/health", headers={"Authorization": "Bearer t0k"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert json.loads(resp.read())["suite"] == "default"
    finally:
        proc.terminate()
        assert proc.wait(10) == 0


def test_serve_entry_point_rejects_bad_config():
    r = subprocess.run([sys.executable, "-m", "tiderl.envs", "serve", "--suite", "nope"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "env.suite" in r.stderr


def test_serve_entry_point_rejects_a_bad_suite_option_in_one_line():
    r = subprocess.run([sys.executable, "-m", "tiderl.envs", "serve", "--option", "hint=bogus"],
                       capture_output=True, text=True, timeout=60)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("tiderl.envs: error:") and "hint='bogus'" in lines[0]
    assert "'none' or 'range'" in lines[0]  # the accepted values


def test_default_task_rates_stated_in_the_readme_hold():
    import importlib.util
    from fractions import Fraction
    from pathlib import Path

    path = Path(__file__).parent.parent / "benchmarks" / "default_task.py"
    spec = importlib.util.spec_from_file_location("default_task_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rates = bench.measure(8, 3)
    assert (rates["random"], rates["open_loop_best"], rates["optimal"]) == (
        Fraction(169, 512), Fraction(3, 8), Fraction(7, 8))
    assert rates["open_loop_best"] <= rates["optimal"] / 2
