"""Agentic workloads as distributions (arXiv 2608.10402, Table 4), drifting over training. No JAX.

A workload says, per task: how many rounds it plays, how long its prompt, observations and
actions are, how long each environment call takes, and whether it succeeds. Table 4 gives the
averages at the start and at the end of training (rounds and total context); everything in
between is a linear drift over `drift_steps` training steps ("as the training goes, the average
turns and the average sequence lengths tend to decrease", Appendix C.1).

What Table 4 does not give is stated here as an assumption and kept in one place: prompt and
action sizes, the spread of rounds (gamma, shape 4: a few tasks take many extra turns after a
wrong action), of observation and action lengths (lognormal), and the environment's latency
(lognormal with a heavy tail, capped; a slower `/start`).

Every draw is a pure function of (seed, task id, what is drawn), so a task plays the same however
the scheduler interleaves it, and the engine (which sees the numeric task id) and the
environment (which sees the task spec) agree on it.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import math
import random
from typing import Any

import numpy as np

from tiderl.configlib import ConfigError
from tiderl.serving.rollout import numeric_id
from tiderl.sim.vision_tower import QWEN3_VL_4B, SCREEN


@dataclasses.dataclass(frozen=True, kw_only=True)
class Workload:
    name: str
    rounds: tuple[float, float]
    """Mean rounds (env steps) per task at the start → end of training (Table 4)."""
    tokens: tuple[float, float]
    """Mean final context per task, start → end (Table 4)."""
    prompt_tokens: int
    action_tokens: int
    """Mean action length (tokens, stop included)."""
    max_turns: int
    max_context: int
    latency_median_s: float
    latency_sigma: float
    latency_cap_s: float = 60.0
    start_median_s: float = 0.0
    success: tuple[float, float] = (0.3, 0.6)
    """Probability a task earns reward 1 at the start → end of training."""
    drift_steps: int = 100
    rounds_shape: float = 4.0
    length_sigma: float = 0.3
    image_tokens: int = 0
    """Image tokens of the screenshot each round brings (one with the prompt, one with each
    observation); 0: a text task. Observations are then image + text, and `tokens` counts
    both."""
    image_window: int = 0
    """The sliding image window (`tiderl.sim.window`): a context holding this many images is
    cut before its next observation and continues from its `image_keep` most recent ones;
    `tokens` is then the mean context a task ends in (after its cuts). 0: no window."""
    image_keep: int = 0

    def __post_init__(self):
        if self.image_window and not 0 < self.image_keep < self.image_window:
            raise ConfigError(f"workload {self.name}: image_keep={self.image_keep} must be "
                              f"in [1, image_window={self.image_window})")
        for r, t in zip(self.rounds, self.tokens, strict=True):
            if self.obs_mean(r, t) <= 0:
                raise ConfigError(f"workload {self.name}: {t} tokens over {r} rounds leave no "
                                  "room for observations after the prompt and actions")

    def progress(self, step: int) -> float:
        return min(1.0, max(0.0, step / max(1, self.drift_steps)))

    def at(self, pair: tuple[float, float], step: int) -> float:
        f = self.progress(step)
        return pair[0] + f * (pair[1] - pair[0])

    def obs_mean(self, rounds: float, tokens: float) -> float:
        """Mean text tokens of an observation that make the mean final context `tokens`."""
        if self.image_tokens:
            # Context = prompt text + k images, k actions and the text of its observations
            # (k - 1 of them, or k once a cut has dropped the prompt's screenshot), k the
            # images of the context the task ends in, averaged over the rounds' spread.
            k, n_obs = final_context_means(self, rounds)
            return (tokens - self.prompt_tokens - k * (self.image_tokens + self.action_tokens)
                    ) / max(1.0, n_obs)
        # Context = prompt + R actions + (R - 1) observations (no observation after the last).
        return (tokens - self.prompt_tokens - rounds * self.action_tokens) / max(1.0, rounds - 1)

    def final_images(self, rounds: int) -> tuple[int, bool]:
        """(images in the context a task of `rounds` rounds ends in, whether it was cut):
        one screenshot with the prompt and one with each of its rounds - 1 observations, the
        window applied before each observation (`tiderl.sim.window`)."""
        k, was_cut = 1, False
        for _ in range(rounds - 1):
            if self.image_window and k >= self.image_window:
                k, was_cut = self.image_keep, True
            k += 1
        return k, was_cut


@functools.lru_cache(maxsize=256)
def _gamma_mean_for(shape: float, cap: int, target: float) -> float:
    """The uncapped gamma mean whose draws, rounded and clipped to [1, cap], average `target`
    (capping at the turn limit would otherwise pull the mean below Table 4's)."""
    rng = random.Random(12345)
    base = np.array([rng.gammavariate(shape, 1.0 / shape) for _ in range(2000)])

    def mean(m: float) -> float:
        # np.rint rounds half to even, as round() does: the same integers, summed exactly.
        return int(np.clip(np.rint(base * m), 1, cap).sum()) / len(base)

    lo, hi = 0.5, 4.0 * cap
    if mean(hi) < target:
        raise ConfigError(f"a mean of {target} rounds is out of reach under a cap of {cap}")
    for _ in range(40):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if mean(mid) < target else (lo, mid)
    return (lo + hi) / 2


@functools.lru_cache(maxsize=1024)
def _final_context_means(w: Workload, target: float) -> tuple[float, float]:
    rng = random.Random(12345)  # the draws `_gamma_mean_for` averages over
    base = np.array([rng.gammavariate(w.rounds_shape, 1.0 / w.rounds_shape)
                     for _ in range(2000)])
    m = _gamma_mean_for(w.rounds_shape, w.max_turns, target)
    ks, obs = [], []
    for n in np.clip(np.rint(base * m), 1, w.max_turns).astype(int).tolist():
        k, was_cut = w.final_images(n)
        ks.append(k)
        obs.append(k if was_cut else k - 1)
    return float(np.mean(ks)), float(np.mean(obs))


def final_context_means(w: Workload, rounds: float) -> tuple[float, float]:
    """(mean images, mean observations) of the context a task ends in, over the spread of
    rounds `Sampler.plan` draws around a mean of `rounds`."""
    return _final_context_means(w, round(rounds * 20) / 20)


SCREENSHOT_TOKENS = QWEN3_VL_4B.image_tokens(*SCREEN)
"""880: a 1280×720 screenshot for Qwen3-VL-4B (`tiderl.sim.vision_tower`)."""

# Table 4 with stated assumptions (prompt, action, latency). Text tasks: ≤ 20 turns, ≤ 8,192
# tokens (Appendix C.1). GUI tasks (Appendix C.2): ≤ 50 turns, a 1280×720 screenshot each round
# (SCREENSHOT_TOKENS image tokens each), the sliding image window, a slower environment start
# ("it also takes longer for multi-modal tasks to start an environment": 30 s median assumed).
# Table 4's image allowance reads as the window: OSWorld 5–9 images = keep 5 of a 10-image
# window (Appendix C.2's numbers for both suites); ScienceBoard 8–15 = keep 8 of 16 (assumed
# from its allowance: C.2's text says 10/5 for both, its Table 4 says 8–15). Table 4's tokens
# are read as the mean context a task ends in, images included; the text of an observation
# (an accessibility tree, say) is what is left of it. The context cap only guards: it is set
# above the window's largest context (assumed; the paper gives none).
WORKLOADS: dict[str, Workload] = {
    "webshop": Workload(name="webshop", rounds=(8, 5), tokens=(3400, 2400), prompt_tokens=600,
                        action_tokens=64, max_turns=20, max_context=8192,
                        latency_median_s=0.8, latency_sigma=1.0, latency_cap_s=30.0,
                        start_median_s=1.0),
    "alfworld": Workload(name="alfworld", rounds=(16, 11), tokens=(7400, 7400),
                         prompt_tokens=1200, action_tokens=48, max_turns=20, max_context=8192,
                         latency_median_s=0.4, latency_sigma=0.8, latency_cap_s=30.0,
                         start_median_s=1.0),
    "osworld": Workload(name="osworld", rounds=(35, 15), tokens=(12000, 12000),
                        prompt_tokens=1500, action_tokens=96, max_turns=50, max_context=32768,
                        latency_median_s=3.0, latency_sigma=0.7, latency_cap_s=60.0,
                        start_median_s=30.0, image_tokens=SCREENSHOT_TOKENS, image_window=10,
                        image_keep=5),
    # ScienceBoard: Table 4's rounds and tokens; prompt, action and latencies as OSWorld's
    # (assumed: the paper gives none for either).
    "scienceboard": Workload(name="scienceboard", rounds=(39, 29), tokens=(24000, 23000),
                             prompt_tokens=1500, action_tokens=96, max_turns=50,
                             max_context=65536, latency_median_s=3.0, latency_sigma=0.7,
                             latency_cap_s=60.0, start_median_s=30.0,
                             image_tokens=SCREENSHOT_TOKENS, image_window=16, image_keep=8),
}


def workload(name: str) -> Workload:
    if name not in WORKLOADS:
        raise ConfigError(f"sim workload {name!r} is unknown; use one of {sorted(WORKLOADS)}")
    return WORKLOADS[name]


def _rng(*key: Any) -> random.Random:
    digest = hashlib.blake2b(repr(key).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


@dataclasses.dataclass(frozen=True)
class TaskPlan:
    rounds: int
    obs_tokens: tuple[int, ...]
    """Observation length after each round but the last."""
    latency_s: tuple[float, ...]
    """Env time of each step (rounds of them)."""
    start_s: float
    success: bool


class Sampler:
    """Draws task plans and action lengths of one workload (or a mix) for one seed."""

    filler = ord("a")
    """Every action token but the stop (the engine's `ActionModel`)."""

    def __init__(self, workloads: dict[str, Workload], seed: int = 0):
        self.workloads, self.seed = workloads, seed
        self._action_mean: dict[int, float] = {}

    def plan(self, suite: str, task_id: str, step: int) -> TaskPlan:
        w = self.workloads[suite]
        rng = _rng(self.seed, "plan", task_id)
        mean_r = w.at(w.rounds, step)
        k = w.rounds_shape
        m = _gamma_mean_for(k, w.max_turns, round(mean_r * 20) / 20)
        rounds = int(min(w.max_turns, max(1, round(rng.gammavariate(k, m / k)))))
        obs_mean = w.obs_mean(mean_r, w.at(w.tokens, step))
        mu = math.log(obs_mean) - w.length_sigma ** 2 / 2
        obs = tuple(max(1, int(rng.lognormvariate(mu, w.length_sigma)))
                    for _ in range(rounds - 1))
        lmu = math.log(w.latency_median_s)
        lat = tuple(min(w.latency_cap_s, rng.lognormvariate(lmu, w.latency_sigma))
                    for _ in range(rounds))
        start = min(w.latency_cap_s, rng.lognormvariate(math.log(w.start_median_s), 0.5)) \
            if w.start_median_s > 0 else 0.0
        ok = rng.random() < w.at(w.success, step)
        self._action_mean[numeric_id(task_id)] = w.action_tokens
        return TaskPlan(rounds, obs, lat, start, ok)

    # -- the engine's ActionModel ---------------------------------------------------------
    def length(self, task_id: int, position: int) -> int:
        mean = self._action_mean.get(task_id)
        if mean is None:  # eval or unknown tasks: the first workload's mean
            mean = next(iter(self.workloads.values())).action_tokens
        sigma = 0.3
        # One hash gives two uniforms; Box-Muller turns them into a normal (a Random per
        # action costs more than the rest of a decode step).
        d = hashlib.blake2b(f"{self.seed}/a/{task_id}/{position}".encode(),
                            digest_size=16).digest()
        u1 = (int.from_bytes(d[:8], "little") + 1) / 2.0 ** 64
        u2 = int.from_bytes(d[8:], "little") / 2.0 ** 64
        z = math.sqrt(-2.0 * math.log(u1)) * math.cos(2.0 * math.pi * u2)
        return max(2, int(math.exp(math.log(mean) - sigma ** 2 / 2 + sigma * z)))

    def token(self, task_id: int, position: int, last: bool) -> int:
        return ord("a")

    def forget(self, task_id: str) -> None:
        self._action_mean.pop(numeric_id(task_id), None)
