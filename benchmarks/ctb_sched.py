"""The cost of one scheduling round as the number of tasks grows (pure Python, no JAX).

    python benchmarks/ctb_sched.py [--sizes 512,1024,2048,4096] [--rounds 20] [--repeats 3]
                                   [--events 16] [--no-vanilla]

The scheduler runs after every rollout event (a turn starts or ends, a task finishes), so its
round is on the rollout's critical path: it must stay in the low milliseconds with thousands of
tasks in flight. Per size N (groups of 8 over four task types, one group in 16 an eval group),
on 8 ranks whose budgets hold about half the tasks:
  1. a previous step has taught the scheduler each type's growth and final context;
  2. all N tasks are submitted (sized) and the cold round admits until the ranks are full
     (timed);
  3. turns are simulated: `--events` events between rounds (a turn starts with
     `update_usage(..., executing=True)` and grows the context, now and then past the budget;
     a turn ends with `set_executing(..., False)`; a task past its last turn finishes; a
     finished group is replaced by a new one, unsized a quarter of the time, so N stays put).
     After an untimed warm-up (`--warmup` events per task), rounds that make decisions
     (pauses, resumes, admissions) are timed until `--rounds` are collected.
Figures: median round time per repeat, then the median over repeats; the slowest round seen;
the growth t(N_max)/t(N_min) (linear scaling would be N_max/N_min, 8x for 512 -> 4096).
The vanilla baseline (request-level batching, cap N/2) runs the same simulation alongside.
The last stdout line is one JSON object with the headline figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time

sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

from tiderl.serving.ctb import (  # noqa: E402
    CTBConfig,
    CTBScheduler,
    Pause,
    Task,
    VanillaScheduler,
)

RANKS = 8
GROUP = 8
MAX_TURNS = 20
# (type, prompt tokens, growth per turn, turns): short math, mid code, long web, many-turn games.
TYPES = [("math", 300, 150, 4), ("code", 800, 300, 6), ("web", 1200, 400, 10),
         ("tw", 500, 100, 20)]
BURST, BURST_X = 0.1, 8.0
"""Share of turns whose observation is BURST_X times the usual growth."""
HELD = 0.75
"""Budgets hold N/2 tasks at HELD x their mean final context (tasks are staggered)."""
CFG = CTBConfig(env_concurrency=1 << 30, vanilla_concurrency=1 << 30, shared_prompts=False)
IDLE = False


class Sim:
    """One scheduler and the episodes it schedules."""

    def __init__(self, kind: str, n: int, seed: int):
        self.rng = random.Random(seed)
        self.next_group = 0
        self.woken: list[str] = []
        self.left: dict[str, int] = {}  # task id -> turns left
        self.grow: dict[str, int] = {}
        self.prompt: dict[str, int] = {}
        final = statistics.fmean(p + g * t + CFG.action_reserve for _, p, g, t in TYPES)
        budget = n / 2 / RANKS * HELD * final
        caps = [int(budget / CFG.budget_fraction) + 1] * RANKS
        if kind == "ctb":
            self.s: CTBScheduler | VanillaScheduler = CTBScheduler(
                CFG, caps, max_context=8192)
        else:
            cfg = CTBConfig(env_concurrency=CFG.env_concurrency, vanilla_concurrency=n // 2)
            self.s = VanillaScheduler(cfg, caps, max_context=8192)
        self.s.horizon_turns = MAX_TURNS
        if IDLE:  # engines with time to spare: CTB's release valve (parking) is on
            self.s.engine_busy = [0.0] * RANKS
        self._previous_step()

    def _previous_step(self) -> None:
        """Plays one group per type to its end: growth and final contexts are known."""
        for name, prompt, _grow, _turns in TYPES:
            self.s.submit([Task(task_id=f"warm-{name}-{i}", group_id=f"warm-{name}",
                                prompt_tokens=prompt, task_type=name) for i in range(2)])
        self.s.schedule()
        for name, prompt, grow, turns in TYPES:
            for i in range(2):
                tid = f"warm-{name}-{i}"
                for k in range(turns):
                    self.s.update_usage(tid, prompt + k * grow)
                self.s.finish(tid)

    def submit_group(self, sized: bool = False) -> None:
        gi = self.next_group
        self.next_group += 1
        name, prompt, grow, turns = self.rng.choice(TYPES)
        unsized = not sized and self.rng.random() < 0.25
        tasks = [Task(task_id=f"g{gi}t{j}", group_id=f"g{gi}",
                      prompt_tokens=0 if unsized else prompt, is_eval=gi % 16 == 5,
                      task_type=name) for j in range(GROUP)]
        self.s.submit(tasks)
        for t in tasks:
            self.left[t.task_id] = turns
            self.grow[t.task_id] = grow
            self.prompt[t.task_id] = prompt

    def event(self, t: Task) -> None:
        tid = t.task_id
        if t.executing:
            self.s.set_executing(tid, False)
            if self.left[tid] == 0:
                gid = t.group_id
                self.s.finish(tid)
                if gid not in self.s.groups:
                    self.submit_group()
        elif self.left[tid] == 0:
            self.s.finish(tid)
            if t.group_id not in self.s.groups:
                self.submit_group()
        else:
            self.left[tid] -= 1
            size = t.tokens if t.measured else self.prompt[tid]
            # Observations vary; now and then one is long (a file, a page): those turns push
            # their rank over its budget.
            jitter = self.rng.uniform(0.5, 1.5) if self.rng.random() > BURST else BURST_X
            self.s.update_usage(tid, size + int(self.grow[tid] * jitter), executing=True)

    def events(self, k: int) -> None:
        # A task admitted or resumed by the last round starts its turn right away (its
        # coroutine was waiting for exactly that); then `k` events anywhere.
        for tid in self.woken:
            t = self.s.tasks.get(tid)
            if t is not None and t.state == "active" and not t.executing:
                self.event(t)
        self.woken = []
        active = [t for r in range(RANKS) for t in self.s.active_on(r)]
        done = 0
        while done < k and active:
            i = self.rng.randrange(len(active))
            t = active[i]
            if t.state != "active":  # finished by an earlier event
                active[i] = active[-1]
                active.pop()
                continue
            self.event(t)
            done += 1

    def round(self) -> tuple[float, int]:
        t0 = time.perf_counter()
        decisions = self.s.schedule()
        ms = (time.perf_counter() - t0) * 1e3
        self.woken = [d.task_id for d in decisions if not isinstance(d, Pause)]
        return ms, len(decisions)


def bench(kind: str, n: int, seed: int, rounds: int, events: int, warmup: int) -> dict:
    sim = Sim(kind, n, seed)
    for _ in range(n // GROUP):
        sim.submit_group(sized=True)
    cold_ms, admitted = sim.round()
    # Mid-step: tasks have played a few turns each, some have grown past their plan.
    for _ in range(warmup * n // 32):
        sim.events(32)
        sim.round()
    times: list[float] = []
    made = 0
    tries = 0
    while len(times) < rounds and tries < 50 * rounds:
        tries += 1
        sim.events(events)
        ms, k = sim.round()
        if k:
            times.append(ms)
            made += k
    if len(times) < rounds:
        raise RuntimeError(f"{kind} N={n}: only {len(times)} of {rounds} rounds made decisions")
    return {"median_ms": statistics.median(times), "max_ms": max(times), "cold_ms": cold_ms,
            "cold_admitted": admitted,
            "active": sim.s.n_active(),
            "paused": sum(t.state == "paused" for t in sim.s.tasks.values()),
            "decisions_per_round": made / len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", default="512,1024,2048,4096")
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--events", type=int, default=16, help="simulated events between rounds")
    ap.add_argument("--warmup", type=int, default=4,
                    help="untimed events after the cold round, per task")
    ap.add_argument("--no-vanilla", action="store_true")
    ap.add_argument("--idle", action="store_true",
                    help="engines reported idle: rounds also run CTB's release valve (parking)")
    args = ap.parse_args()
    global IDLE
    IDLE = args.idle
    sizes = [int(x) for x in args.sizes.split(",")]
    kinds = ["ctb"] + ([] if args.no_vanilla else ["vanilla"])
    res: dict[str, dict[int, dict]] = {k: {} for k in kinds}
    for n in sizes:
        for kind in kinds:
            reps = [bench(kind, n, seed, args.rounds, args.events, args.warmup)
                    for seed in range(args.repeats)]
            res[kind][n] = {
                "median_ms": statistics.median(r["median_ms"] for r in reps),
                "max_ms": max(r["max_ms"] for r in reps),
                "cold_ms": statistics.median(r["cold_ms"] for r in reps),
                **{k: statistics.fmean(r[k] for r in reps)
                   for k in ("cold_admitted", "active", "paused",
                             "decisions_per_round")},
            }
    print(f"one schedule() round, {RANKS} ranks, groups of {GROUP}, {args.events} events "
          f"between rounds; median of {args.repeats} medians over {args.rounds} rounds")
    head = f"{'sched':8} {'N':>5} {'round ms':>9} {'max ms':>8} {'cold ms':>8} " \
           f"{'admitted cold':>13} {'active':>7} {'paused':>7} {'decisions':>9}"
    print(head)
    print("-" * len(head))
    for kind in kinds:
        for n in sizes:
            r = res[kind][n]
            print(f"{kind:8} {n:>5} {r['median_ms']:>9.3f} {r['max_ms']:>8.3f} "
                  f"{r['cold_ms']:>8.1f} {r['cold_admitted']:>13.0f} {r['active']:>7.0f} "
                  f"{r['paused']:>7.0f} {r['decisions_per_round']:>9.1f}")
    lo, hi = min(sizes), max(sizes)
    ctb = res["ctb"]
    growth = ctb[hi]["median_ms"] / ctb[lo]["median_ms"]
    print(f"ctb growth t({hi})/t({lo}) = {growth:.2f}x (linear: {hi / lo:.0f}x)")
    out = {
        "ctb_round_ms": {str(n): round(ctb[n]["median_ms"], 4) for n in sizes},
        "ctb_round_max_ms": {str(n): round(ctb[n]["max_ms"], 4) for n in sizes},
        f"growth_{hi}_over_{lo}": round(growth, 3),
        "cold_round_ms": {str(n): round(ctb[n]["cold_ms"], 3) for n in sizes},
        f"cold_round_ms_{hi}": round(ctb[hi]["cold_ms"], 3),
        "decisions_per_round": {str(n): round(ctb[n]["decisions_per_round"], 2)
                                for n in sizes},
    }
    if "vanilla" in res:
        out["vanilla_round_ms"] = {str(n): round(res["vanilla"][n]["median_ms"], 4)
                                   for n in sizes}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
