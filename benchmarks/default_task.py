"""Default task: exact random, best open-loop and optimal success rates, and a protocol check.

    python benchmarks/default_task.py [--n 8] [--guesses 3]

Every rate is exact (fractions), computed by playing the real adapter (tiderl.envs.adapters.
default.GuessNumber), not by a formula:
  random          uniform over the valid guesses 1..n each turn: all n^k action sequences x
                  all n targets, each played through the adapter;
  open_loop_best  the best policy that ignores observations: every such policy is a mixture of
                  fixed action sequences, so the best is the best of the n^k sequences;
  optimal         the best closed-loop policy: exhaustive search over the game tree (the belief
                  is the set of targets consistent with the feedback), then that policy is
                  played through the adapter for every target to confirm the value.
Also printed: a uniform-over-vocabulary single-token policy (what an untrained byte model
does), a table over other (n, guesses), and the three policies run through the real HTTP
server (Monte Carlo, medians over repeats) as a check that the protocol path agrees.
The last line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import itertools
import json
import random
import statistics
import sys
import time
from fractions import Fraction

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from tiderl.envs.adapters.default import HIGHER, LOWER, GuessNumber  # noqa: E402
from tiderl.envs.client import EnvClient  # noqa: E402
from tiderl.envs.config import EnvConfig  # noqa: E402
from tiderl.envs.server import EnvServer  # noqa: E402

BYTE_VOCAB = 272  # tiderl.models.tokenizer.ByteTokenizer.vocab_size


def play(n: int, guesses: int, target: int, policy) -> bool:
    """One episode through the adapter; `policy(history)` -> action, history of (a, obs)."""
    env = GuessNumber({"n": str(n), "guesses": str(guesses)})
    env.reset({"seed": 0, "target": target})
    history: list[tuple[str, str]] = []
    while True:
        action = policy(history)
        step = env.step(action)
        history.append((action, step.observation))
        if step.done:
            return env.close()[0] == 1.0


def random_rate(n: int, k: int) -> Fraction:
    wins = 0
    for target in range(1, n + 1):
        for seq in itertools.product(range(1, n + 1), repeat=k):
            wins += play(n, k, target, lambda h, seq=seq: str(seq[len(h)]))
    return Fraction(wins, n * n**k)


def open_loop_rate(n: int, k: int) -> tuple[Fraction, tuple[int, ...]]:
    best, best_seq = Fraction(-1), ()
    for seq in itertools.product(range(1, n + 1), repeat=k):
        wins = sum(play(n, k, t, lambda h, seq=seq: str(seq[len(h)])) for t in range(1, n + 1))
        if Fraction(wins, n) > best:
            best, best_seq = Fraction(wins, n), seq
    return best, best_seq


def optimal_policy(n: int, k: int):
    """(value, policy) of the best closed-loop policy, by exhaustive game-tree search."""

    @functools.cache
    def value(cands: frozenset[int], left: int) -> tuple[Fraction, int]:
        if left == 0 or not cands:
            return Fraction(0), 1
        best = (Fraction(-1), 1)
        for g in range(1, n + 1):
            v = Fraction(int(g in cands), len(cands))
            if left > 1:
                for part in ({c for c in cands if c > g}, {c for c in cands if c < g}):
                    if part:
                        v += Fraction(len(part), len(cands)) * value(frozenset(part),
                                                                     left - 1)[0]
            best = max(best, (v, g), key=lambda x: x[0])
        return best

    def policy(history):
        cands = set(range(1, n + 1))
        for action, obs in history:
            g = int(action)
            cands = {c for c in cands if (c > g if obs == HIGHER else c < g if obs == LOWER
                                          else c != g)}
        return str(value(frozenset(cands), k - len(history))[1])

    return value(frozenset(range(1, n + 1)), k)[0], policy


def measure(n: int, k: int) -> dict[str, Fraction]:
    opt, policy = optimal_policy(n, k)
    played = Fraction(sum(play(n, k, t, policy) for t in range(1, n + 1)), n)
    assert played == opt, (played, opt)
    vocab = 1 - Fraction(BYTE_VOCAB - 1, BYTE_VOCAB) ** k
    return {"random": random_rate(n, k), "open_loop_best": open_loop_rate(n, k)[0],
            "optimal": opt, "random_vocab": vocab}


async def through_protocol(n: int, k: int, episodes: int, repeats: int) -> dict[str, list]:
    """Success rates and episodes/s of the three policies over real HTTP, per repeat."""
    _, opt_policy = optimal_policy(n, k)
    _, seq = open_loop_rate(n, k)
    cfg = EnvConfig(concurrency=256, options=(f"n={n}", f"guesses={k}"))
    out: dict[str, list] = {"random": [], "open_loop_best": [], "optimal": [], "eps_per_s": []}
    async with EnvServer(GuessNumber, cfg).serve() as url, EnvClient(url, cfg) as env:
        async def episode(policy, seed):
            s = await env.start({"task_id": f"b{seed}", "seed": seed})
            history: list[tuple[str, str]] = []
            while True:
                action = policy(history, seed)
                r = await env.step(s.session, action)
                assert r.ok, r.error
                history.append((action, r.observation))
                if r.done:
                    return (await env.end(s.session)).reward

        policies = {
            "random": lambda h, seed: str(random.Random(seed * 64 + len(h)).randint(1, n)),
            "open_loop_best": lambda h, seed: str(seq[len(h)]),
            "optimal": lambda h, seed: opt_policy(h),
        }
        for r in range(repeats):
            t0 = time.perf_counter()
            for name, policy in policies.items():
                seeds = range(r * episodes, (r + 1) * episodes)
                rewards = await asyncio.gather(*(episode(policy, s) for s in seeds))
                out[name].append(sum(rewards) / episodes)
            out["eps_per_s"].append(3 * episodes / (time.perf_counter() - t0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--guesses", type=int, default=3)
    p.add_argument("--episodes", type=int, default=512)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    n, k = args.n, args.guesses

    head = measure(n, k)
    print(f"default task: guess 1..{n} in {k} guesses (exact, every episode played)")
    for key in ("random", "open_loop_best", "optimal", "random_vocab"):
        print(f"  {key:15s} {str(head[key]):>9s} = {float(head[key]):.4f}")
    ratio = head["open_loop_best"] / head["optimal"]
    print(f"  open_loop_best / optimal = {float(ratio):.3f} (must be <= 0.5); "
          f"optimal / random = {float(head['optimal'] / head['random']):.2f}x")

    print("\nother shapes: n guesses  random  open_loop  optimal  open/opt")
    for nn, kk in [(4, 2), (6, 2), (8, 2), (8, 4), (9, 3)]:
        m = measure(nn, kk)
        r = m["open_loop_best"] / m["optimal"]
        print(f"  {nn:2d} {kk:2d}      {float(m['random']):.3f}   {float(m['open_loop_best']):.3f}"
              f"      {float(m['optimal']):.3f}    {float(r):.3f}{'' if r <= 0.5 else '  (> 0.5)'}")

    mc = asyncio.run(through_protocol(n, k, args.episodes, args.repeats))
    print(f"\nthrough HTTP ({args.episodes} episodes x {args.repeats} repeats, median):")
    for key in ("random", "open_loop_best", "optimal"):
        print(f"  {key:15s} {statistics.median(mc[key]):.4f}   exact {float(head[key]):.4f}")
    eps = statistics.median(mc["eps_per_s"])
    print(f"  server+client throughput: {eps:.0f} episodes/s (256 concurrent, 1 process)")

    print(json.dumps({
        "n": n, "guesses": k,
        "random": round(float(head["random"]), 6),
        "open_loop_best": round(float(head["open_loop_best"]), 6),
        "optimal": round(float(head["optimal"]), 6),
        "random_vocab": round(float(head["random_vocab"]), 6),
        "open_loop_over_optimal": round(float(ratio), 6),
        "http_random": round(statistics.median(mc["random"]), 4),
        "http_open_loop_best": round(statistics.median(mc["open_loop_best"]), 4),
        "http_optimal": round(statistics.median(mc["optimal"]), 4),
        "http_episodes_per_s": round(eps, 1),
    }))


if __name__ == "__main__":
    main()
