"""CTB against request-level continuous batching: same engine, KV pool, task stream and seeds.

    python benchmarks/ctb.py [--repeats 3] [--workloads textworld,default,webshop] [--quick]
                             [--sweep full|short] [--noshare-caps all|pool] [--model DIR|PATH.gguf]

One rollout rank (one engine, one fixed KV pool) plays one step (N groups x G tasks, every task
to its end) against a real env server on loopback (aiohttp, in-process, injected latency).
Contenders, each with and without sibling prefix sharing (a GRPO group's prompt prefilled once
per rank, siblings take its pages copy-on-write):
  ctb            task-level scheduling (arXiv 2608.10402, Algorithm 1): token budgets, probe,
                 pause/resume by priority, waits and growth learned online
  vanilla@C      request-level batching with a fixed cap C on tasks in flight; a waiting task's
                 KV is evicted (LRU) when pages run short and re-prefilled when it returns.
                 C is swept: the pool-sized cap (KV capacity / mean context a turn needs,
                 measured), half and twice that, the paper's ~39% and ~78% of the step's
                 tasks, and all of them. Its best cap (shortest median step) is chosen per
                 workload and per sharing setting.
Fairness: one untimed warm-up run per contender (compiles, env server, caches); each keeps one
scheduler across its runs, as a job keeps one across steps, so the timed runs are steady-state
steps (CTB's online estimates of env waits and growth come from the runs before); contenders
interleaved and rotated per repeat, medians over repeats; hit rates pooled over repeats by
prompt tokens; sampling keys come from (task, position) and the envs are deterministic, so every
contender plays the same tasks (token-identical trajectories are checked and printed).
Per contender: KV hit rate (prompt tokens served from resident KV / needed), prefill tokens
computed and recomputed, generation (decode) throughput, engine busy fraction, mean tasks
executing / ready / waiting on their env, engine calls (decode steps, prefill batches), step
duration. Two lower bounds of the step, whatever the schedule: the longest task chain (a task's
injected env latencies and its decode at batch one) and the longest time a task takes played
alone (`--solo-tasks` of the longest chains, same tokens; the fastest of the repeats); the
targets are checked against them.
The last stdout line is one JSON object: `hit_rate_ratio` and `step_time_ratio` of CTB against
the best vanilla, both with sharing, at the worst workload, and `per_workload`.

`--model DIR|PATH.gguf` serves a real checkpoint instead of the tiny random byte-level policy
(an HF folder, or a GGUF file converted once into a cached one, as `model.checkpoint` is),
float32, layers scanned as the real-model preset serves them: prompts are written with its
tokenizer and chat template, with each task's system turn (the chat form of the default task,
a command form for TextWorld), and the workloads are `REAL_WORKLOADS`: fewer tasks and turns,
so that a step fits a CPU on which this model prefills about a hundred tokens a second, and a
KV pool smaller than the step's contexts (the fraction it holds is measured and printed: the
sum of every task's final context over the pool). There recomputing an evicted context costs
real compute. The same step is also played on a second engine whose pool holds every context
(`--free-pool-runs`, in the contenders' rotation; the median: `free_pool_s`), the reference for
what keeping every task's KV would give. `--ctb-variant k=v,...` adds CTB with those CTBConfig
overrides as one more contender (e.g. `park_below_busy=0`). The JSON then also has `model`,
`longest_context_workload` (the workload whose tasks end with the longest mean context) and
its `hit_rate_ratio`/`step_time_ratio`.

`--host-kv-pages N` runs every contender a second time on an engine with a host KV tier of N
pages (`rollout.host_kv_pages`; names end in `+host`): evicted contexts are copied back, not
computed again, and CTB budgets the pool and the tier together, as a job does. The hit rate
then counts restored tokens as served; `resident on the device` leaves them out. `host` in the
JSON compares CTB on the tier with the best vanilla cap on the tier and without it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, __file__.rsplit("/benchmarks/", 1)[0])

import jax  # noqa: E402

from tiderl.envs.adapters.base import Step  # noqa: E402
from tiderl.envs.adapters.default import GuessNumber  # noqa: E402
from tiderl.envs.client import EnvClient  # noqa: E402
from tiderl.envs.config import EnvConfig, LatencyConfig  # noqa: E402
from tiderl.envs.latency import LatencyModel  # noqa: E402
from tiderl.envs.server import EnvServer  # noqa: E402
from tiderl.envs.suites import adapter_class  # noqa: E402
from tiderl.envs.tasks import TaskSource  # noqa: E402
from tiderl.envs.templates import template_for  # noqa: E402
from tiderl.models.config import ModelConfig  # noqa: E402
from tiderl.models.policy import init_policy  # noqa: E402
from tiderl.models.tokenizer import ByteTokenizer, HFTokenizer  # noqa: E402
from tiderl.serving.config import RolloutConfig, kv_budget_tokens  # noqa: E402
from tiderl.serving.ctb import CTBConfig, make_scheduler  # noqa: E402
from tiderl.serving.engine import Engine, PrefillRequest  # noqa: E402
from tiderl.serving.rank import RolloutRank  # noqa: E402
from tiderl.serving.rollout import RolloutManager  # noqa: E402
from tiderl.serving.warmup import prime_engine  # noqa: E402

from learn_real import TEXTWORLD_SYSTEM  # noqa: E402  (benchmarks/: the script's folder)

CTB_OVERRIDES: dict = {}
VERBOSE = os.environ.get("CTB_BENCH_VERBOSE", "").lower() not in ("", "0", "false", "no")
MODEL = ModelConfig(d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=16, mlp_dim=128)


@dataclasses.dataclass(frozen=True)
class Workload:
    name: str
    suite: str
    options: tuple[str, ...]
    max_turns: int
    max_context: int
    num_pages: int
    """The KV pool: the same for every contender of this workload."""
    latency: LatencyConfig
    groups: int
    group_size: int
    action_tokens: int = 8
    prefill_buckets: tuple[int, ...] = (16, 64, 256)
    decode_buckets: tuple[int, ...] = (4, 8, 16, 32)
    system: str | None = None
    """The system turn (a real model's chat form); None: the byte template has none."""


WORKLOADS = {
    # TextWorld: ~650-token first observation (quest + room), ~40 tokens per turn after.
    "textworld": Workload(
        "textworld", "textworld", ("rooms=3", "objects=4", "quest_length=3"), max_turns=6,
        max_context=1024, num_pages=360, groups=4, group_size=6,
        latency=LatencyConfig(dist="lognormal", median_s=0.2, sigma=0.5, start_factor=2.0,
                              seed=1)),
    # Guess-the-number with a long guess budget: tiny prompt, many short turns.
    "default": Workload(
        "default", "default", ("n=8", "guesses=16"), max_turns=16, max_context=512,
        num_pages=96, groups=4, group_size=6,
        latency=LatencyConfig(dist="lognormal", median_s=0.1, sigma=0.5, start_factor=2.0,
                              seed=1)),
    # Shaped like the paper's WebShop (Table 4: ~8 turns, ~3,000-token contexts): the default
    # task's server with a ~400-byte page per observation (search results, product pages),
    # and a heavy-tailed env (Pareto, alpha 1.5: most steps fast, a few take seconds).
    # One group of 8: every turn prefills hundreds of tokens against a long context, which
    # this CPU engine computes at a few hundred to a few thousand tokens per second.
    "webshop": Workload(
        "webshop", "webshop", ("n=8", "guesses=8", "page=360"), max_turns=8,
        max_context=3584, num_pages=640, groups=1, group_size=8,
        latency=LatencyConfig(dist="pareto", scale_s=0.05, alpha=1.5, cap_s=3.0,
                              start_factor=2.0, seed=1)),
}

# With a real model (`--model`): the same envs in their chat form, at shapes a loaded 2-core CPU
# steps through in about a minute: SmolLM2-135M there takes ~0.1-0.5 s per engine call
# (a decode step, a prefill chunk), so one task's turn (a ~40-token observation, a reply cut
# at 4 tokens: a guess is "5" and <|im_end|>) costs ~1-2 s of compute. The envs' latencies are
# scaled to that (medians ~1.5 s, the tiny workloads' tens of ms would be ~2% of a turn, where
# no schedule has a wait to overlap): as in arXiv 2608.10402's setting, a wait on the env is
# comparable to a turn's compute (`--latency-scale` moves it). 6 tasks (2 groups of 3), a
# few turns. Token counts are SmolLM2's (~5 bytes a token on this text). Each pool holds
# about half of the step's final contexts or less (measured and printed as `pool /
# contexts`), and one task's max_context.
CHAT = ("format=chat",)
_REAL = dict(groups=2, group_size=3, action_tokens=4, prefill_buckets=(32, 128),
             decode_buckets=(2, 4, 8))
REAL_WORKLOADS = {
    # ~50-token system turn, ~25-token page per observation: ~90 tokens after the first
    # observation, ~+40 a turn, ~210 after 3 turns; 6 tasks end with ~1.2k tokens of context
    # against a 640-token pool. Heavy-tailed env (Pareto, alpha 1.5, median ~1.6 s, cap 6 s).
    "webshop": Workload(
        "webshop", "webshop", ("n=8", "guesses=3", "page=120", *CHAT), max_turns=3,
        max_context=384, num_pages=40, **_REAL,
        latency=LatencyConfig(dist="pareto", scale_s=1.0, alpha=1.5, cap_s=6.0,
                              start_factor=2.0, seed=1)),
    # TextWorld (2 rooms, 2 objects, quest 2): a ~150-token first observation, ~20 a turn.
    "textworld": Workload(
        "textworld", "textworld", ("rooms=2", "objects=2", "quest_length=2"), max_turns=3,
        max_context=384, num_pages=32, system=TEXTWORLD_SYSTEM, **_REAL,
        latency=LatencyConfig(dist="lognormal", median_s=1.5, sigma=0.5, start_factor=2.0,
                              seed=1)),
    # Many turns on a pool far smaller than the step's contexts: the webshop shape with a
    # ~12-token page, a number from 1 to 64 (few episodes end early), 8 guesses. Contexts
    # grow from ~100 to ~380 tokens, a turn adds ~35: the regime where keeping a waiting
    # task's KV saves most of its next prompt, and recomputing it costs real compute.
    "long": Workload(
        "long", "webshop", ("n=64", "guesses=8", "page=60", *CHAT), max_turns=8,
        max_context=512, num_pages=56, **_REAL,
        latency=LatencyConfig(dist="lognormal", median_s=4.0, sigma=0.5, start_factor=1.0,
                              seed=1)),
    # The same shape with contexts of agentic length: a ~70-token page each turn (~95 tokens
    # a turn with the feedback and the reply), contexts from ~100 to ~850 tokens, and shorter
    # env waits (median 2 s): the engine, not the environment, sets the step, so computing an
    # evicted context again costs seconds on the step's critical path.
    "deep": Workload(
        "deep", "webshop", ("n=64", "guesses=8", "page=360", *CHAT), max_turns=8,
        max_context=1024, num_pages=96, **_REAL,
        latency=LatencyConfig(dist="lognormal", median_s=2.0, sigma=0.5, start_factor=1.0,
                              seed=1)),
    # The default task's chat form: ~70-token prompt, ~20 tokens a turn, 5 guesses.
    "default": Workload(
        "default", "default", ("n=8", "guesses=5", *CHAT), max_turns=5, max_context=256,
        num_pages=24, **_REAL,
        latency=LatencyConfig(dist="lognormal", median_s=1.5, sigma=0.5, start_factor=2.0,
                              seed=1)),
}

WORDS = ("results for item price rating size color brand shipping review stars buy now add "
         "cart options pack of new used deal best seller compare details back next page "
         "description features material fit care returns free delivery in stock").split()


class WebShopShaped(GuessNumber):
    """The default task with a long pseudo web page appended to every observation: what the
    agent sees is `page` bytes of listing text, then the game's feedback. The first page
    depends on the group's seed only, so GRPO siblings share their prompt."""

    def __init__(self, options=None):
        opts = dict(options or {})
        self.page = int(opts.pop("page", "360"))
        super().__init__(opts)

    def reset(self, task):
        self._seed = int(task.get("seed", 0))
        self._turn = 0
        return self._page(0, "") + super().reset(task)

    def step(self, action: str) -> Step:
        st = super().step(action)
        self._turn += 1
        return dataclasses.replace(st, observation=self._page(self._turn, action) +
                                   st.observation)

    def _page(self, turn: int, action: str) -> str:
        rng = random.Random(f"{self._seed}/{turn}/{action[:8]}")
        out: list[str] = []
        n = 0
        while n < self.page:
            w = rng.choice(WORDS)
            out.append(w)
            n += len(w) + 1
        return " ".join(out)[: self.page] + "\n"


def printable(action: str) -> str:
    """Printable ASCII only: a NUL byte in a command segfaults TextWorld's frotz (and with it
    the env server), and control bytes trigger its hot keys. An untrained byte policy emits both."""
    return "".join(c if " " <= c <= "~" and c != "\\" else " " for c in action)


def adapter_for(suite: str):
    if suite == "webshop":
        return WebShopShaped
    cls = adapter_class(suite)
    if suite != "textworld":
        return cls

    class PrintableTextWorld(cls):  # type: ignore[misc, valid-type]
        def step(self, action: str):
            return super().step(printable(action))

    return PrintableTextWorld


def rollout_cfg(wl: Workload, stop_ids) -> RolloutConfig:
    return RolloutConfig(num_pages=wl.num_pages, page_size=16, max_slots=max(wl.decode_buckets),
                         max_context=wl.max_context, max_action_tokens=wl.action_tokens,
                         temperature=1.0, decode_buckets=wl.decode_buckets,
                         prefill_buckets=wl.prefill_buckets, stop_tokens=tuple(sorted(stop_ids)))


@dataclasses.dataclass(frozen=True)
class Policy:
    """What the engine serves and how turns are written: the tiny random byte-level policy, or
    a real checkpoint (`--model`) with its tokenizer and chat template."""
    graphdef: object
    params: object
    model: ModelConfig
    template: object
    name: str
    real: bool

    def system(self, wl: Workload) -> str | None:
        """The workload's system turn: none for the byte policy; a real model's chat form."""
        if not self.real:
            return None
        opts = dict(o.split("=", 1) for o in wl.options if not o.startswith("page="))
        suite = "default" if wl.suite == "webshop" else wl.suite
        return wl.system or adapter_class(suite).system_prompt(opts)


def load_policy(path: str) -> Policy:
    """`--model`: an HF checkpoint folder or a .gguf file (converted once into a cached HF
    folder, as `model.checkpoint` is); float32, layers scanned. Empty: the tiny policy."""
    if not path:
        graphdef, params = init_policy(MODEL, seed=0)
        return Policy(graphdef, params, MODEL, template_for(ByteTokenizer(), "byte"),
                      "tiny random policy, byte tokenizer", False)
    from pathlib import Path

    from flax import nnx

    from tiderl.models.gguf import gguf_folder, is_gguf
    from tiderl.models.hf import from_pretrained

    p = Path(path)
    if not p.exists():
        sys.exit(f"--model {path!r} not found: pass a local HF checkpoint folder (config.json, "
                 "*.safetensors, tokenizer.json) or a .gguf file")
    folder = gguf_folder(p) if is_gguf(p) else p
    if not (folder / "tokenizer.json").is_file():
        sys.exit(f"--model {path!r} has no tokenizer.json: the tasks' prompts need the "
                 "checkpoint's own tokenizer (save it beside the weights)")
    model = from_pretrained(folder, dtype="float32", scan_layers=True)
    graphdef, params = nnx.split(model)
    return Policy(graphdef, params, model.cfg, template_for(HFTokenizer(folder)), p.name, True)


@dataclasses.dataclass(frozen=True)
class Contender:
    kind: str  # "ctb" | "vanilla"
    share: bool
    cap: int = 0
    variant: str = ""
    """CTB with these CTBConfig overrides on top of `--ctb`'s (`--ctb-variant`)."""
    free: bool = False
    """The reference: every task in flight on the second engine, whose pool holds them all."""
    host: bool = False
    """On the engine with the host KV tier (`--host-kv-pages`): evicted KV copied back."""

    @property
    def name(self) -> str:
        if self.free:
            return "free pool"
        base = "ctb" if self.kind == "ctb" else f"vanilla@{self.cap}"
        return base + ("+share" if self.share else "") + (f"+{self.variant}" if self.variant
                                                          else "") + ("+host" if self.host
                                                                      else "")


def parse_overrides(text: str) -> dict:
    """`k=v,k2=v2` into CTBConfig field values (typed as the field's default)."""
    out = {}
    for kv in filter(None, text.split(",")):
        k, v = kv.split("=", 1)
        default = getattr(CTBConfig(), k)
        out[k] = (v.lower() in ("1", "true")) if isinstance(default, bool) else \
            type(default)(v)
    return out


def new_scheduler(rcfg: RolloutConfig, c: Contender):
    ctb = CTBConfig(**{"action_reserve": rcfg.max_action_tokens,
                       "vanilla_concurrency": max(1, c.cap),
                       "env_concurrency": rcfg.max_slots, "shared_prompts": c.share,
                       **CTB_OVERRIDES, **parse_overrides(c.variant)})
    # The rank's KV as a job budgets it: its pool and, on the tier's engine, the tier.
    return make_scheduler(c.kind, ctb, [kv_budget_tokens(rcfg)],
                          max_context=rcfg.max_context, page_size=rcfg.page_size)


def task_chains(trajs: list, wl: Workload, decode_step_s: float) -> dict[str, float]:
    """Per task, a lower bound on its own chain: its injected env latencies (seeded per task
    and turn, the same for every contender) plus one batch-of-one decode step per generated
    token after each turn's first. Prefill, env compute and every other task's work are left
    out: the step, which ends with its last task, cannot end sooner than the longest."""
    lat = LatencyModel(wl.latency)
    out = {}
    for t in trajs:
        steps = t.turns - (t.end_reason == "context_limit")
        env = sum(lat.sample(t.task_id, k) for k in range(steps + 1))
        out[t.task_id] = env + max(0, sum(t.loss_mask) - t.turns) * decode_step_s
    return out


async def run_step(engine: Engine, rcfg: RolloutConfig, wl: Workload, url: str, groups: list,
                   c: Contender, sched, decode_step_s: float, policy: Policy) -> dict:
    """One step (every group to its end) under one scheduler; returns its figures. The
    scheduler is the contender's own across its runs, as a job keeps one across its steps
    (what CTB learns online, environment waits and context growth, carries over); a finished
    group leaves nothing else behind in it."""
    rank = RolloutRank(0, engine, max_prefills_per_step=16, share_prefixes=c.share)
    await rank.start()
    active_samples: list[int] = []

    async def sample_active():
        while True:
            active_samples.append(sched.n_active())
            await asyncio.sleep(0.05)
            if VERBOSE and len(active_samples) % 40 == 0:
                print(f"    {c.name} t={len(active_samples) * 0.05:.0f}s active "
                      f"{sched.n_active()} pending {sched.pending()} turns {rank.stats.turns} "
                      f"phases {sched.phases.counts} {mgr.decisions}", file=sys.stderr,
                      flush=True)

    c0 = dataclasses.replace(engine.counters)
    async with EnvClient(url, EnvConfig(concurrency=256)) as env:
        mgr = RolloutManager([rank], sched, env, policy.template, max_turns=wl.max_turns,
                             system=policy.system(wl))
        sampler = asyncio.create_task(sample_active())
        t0 = time.perf_counter()
        trajs = await asyncio.gather(*(mgr.run_group(g) for g in groups))
        dt = time.perf_counter() - t0
        sampler.cancel()
        st = mgr.stats()
    await rank.close()
    trajs = [t for g in trajs for t in g]
    rs, c1 = rank.stats, engine.counters
    return {
        "step_s": dt,
        "prompt_tokens": st["prompt_tokens"],
        "cached_tokens": st["cached_tokens"],
        "computed_tokens": st["computed_tokens"],
        "recomputed_evicted": rs.recomputed_evicted,
        "shared_tokens": c1.prompt_tokens_shared - c0.prompt_tokens_shared,
        "restored_tokens": c1.prompt_tokens_restored - c0.prompt_tokens_restored,
        "decode_tokens": st["decode_tokens"],
        "decode_tok_s": st["decode_tokens"] / dt,
        "forced_evictions": st["forced_evictions"],
        "pauses": st["decisions"]["pause"],
        "parks": st["decisions"]["park"],
        "mean_active": statistics.fmean(active_samples) if active_samples else 0.0,
        "engine_busy": st["engine_busy"],
        "tasks_executing": st["tasks_executing"],
        "tasks_ready": st["tasks_ready"],
        "tasks_waiting": st["tasks_waiting"],
        "turns": rs.turns,
        "decode_steps": rs.decode_steps,
        "prefill_batches": rs.prefill_batches,
        "end_reasons": st["end_reasons"],
        "tasks": len(trajs),
        "chains": (chains := task_chains(trajs, wl, decode_step_s)),
        "path_bound_s": max(chains.values()),
        "context_tokens": sum(len(t.tokens) for t in trajs),
        "task_tokens": {t.task_id: hash(tuple(t.tokens)) for t in trajs},
        "signature": hash(tuple(tuple(t.tokens) for t in sorted(trajs, key=lambda t: t.task_id))),
    }


def warm_up(engine: Engine, rcfg: RolloutConfig) -> tuple[float, float]:
    """Compiles every kernel shape the steps can hit (`tiderl.serving.warmup.prime_engine`:
    row and length buckets, page-table widths), outside the timed steps. Returns the seconds
    that took and the fastest one-row decode step."""
    t0 = time.perf_counter()
    engine.init_decode_state()
    prime_engine(engine, rcfg)
    compile_s = time.perf_counter() - t0
    # The fastest decode step there is (one row, the smallest bucket): the critical path's
    # per-token floor. Only steps with the row still decoding count (once it stops, at its
    # action cap or a stop token, a step has nothing to do); a row that stops at once is
    # replaced by another prompt.
    times: list[float] = []
    for k in range(8):
        (h,) = engine.prefill_many(None, [PrefillRequest(None, [65 + k] * 8, 8,
                                                         task_id=10**6 + k)])
        state = engine.insert(h, engine.state)
        for _ in range(7):
            if not h.decoding:
                break
            t1 = time.perf_counter()
            state, _ = engine.generate(None, state)
            times.append(time.perf_counter() - t1)
        engine.free(h)
        if times:
            break
    return compile_s, min(times, default=0.0)


def prepare(wl: Workload, state_dir: str) -> list:
    suite = "default" if wl.suite == "webshop" else wl.suite
    opts = dict(o.split("=", 1) for o in wl.options if not o.startswith("page="))
    src = TaskSource(suite, "train", groups=max(wl.groups, 2), group_size=wl.group_size,
                     options=opts)
    groups = [src.element(k) for k in range(wl.groups)]
    if wl.suite == "textworld":  # compile the games outside the timed steps (~2.5 s each)
        from tiderl.envs.adapters.textworld import cache_dir_of, compile_game, game_shape

        for g in groups:  # into the env server's own state folder, where its sessions look
            compile_game(game_shape(g["tasks"][0], {}), cache_dir_of(state_dir))
    return groups


def free_pool(policy: Policy, rcfg: RolloutConfig, wl: Workload, context_tokens: int
              ) -> tuple[Engine, RolloutConfig]:
    """The second engine of the step with KV for every context: its pool holds every task's
    final context (page rounding and an action's reserve each included) and every task is in
    flight, so nothing is evicted or computed twice. A tight pool can only add work or waits
    to this (no schedule's step is expected below it; the order of work differs, so it is a
    measured reference, not a proof). It runs in the contenders' rotation, under the same
    load, and its runs must sample the step's tokens."""
    n = wl.groups * wl.group_size
    need = context_tokens + n * (rcfg.page_size + rcfg.max_action_tokens)
    big = dataclasses.replace(rcfg, num_pages=-(-need // rcfg.page_size) + 1)
    engine = Engine(policy.graphdef, policy.params, policy.model, big, seed=123)
    warm_up(engine, big)
    return engine, big


def sweep_caps(n_tasks: int, pool_cap: int, short: bool) -> list[int]:
    """Vanilla caps: the pool-sized one, half and twice it, ~39% / ~78% / all of the tasks
    (`short`: the pool-sized one, twice it and all of the tasks)."""
    caps = {pool_cap, round(2 * pool_cap), n_tasks} if short else {
        round(0.5 * pool_cap), pool_cap, round(2 * pool_cap), round(0.39 * n_tasks),
        round(0.78 * n_tasks), n_tasks}
    return sorted(c for c in caps if 1 <= c <= n_tasks)


async def bench_workload(wl: Workload, args, policy: Policy) -> dict:
    rcfg = rollout_cfg(wl, policy.template.stop_ids)
    engine = Engine(policy.graphdef, jax.device_put(policy.params, jax.devices()[0]),
                    policy.model, rcfg, seed=123)
    n_tasks = wl.groups * wl.group_size
    state_dir = tempfile.mkdtemp(prefix="tiderl-ctb-env-")  # the env server's; removed below
    groups = prepare(wl, state_dir)
    compile_s, decode_step_s = warm_up(engine, rcfg)
    print(f"  [{wl.name}] compiled in {compile_s:.1f}s; one-row decode step "
          f"{1e3 * decode_step_s:.1f} ms", file=sys.stderr, flush=True)
    env_cfg = EnvConfig(suite="default" if wl.suite == "webshop" else wl.suite,
                        options=tuple(o for o in wl.options), max_sessions=4096,
                        latency=wl.latency)
    capacity = rcfg.num_pages * rcfg.page_size
    runs: dict[Contender, list[dict]] = {}
    # One env worker thread: TextWorld's z-machine is not thread-safe (concurrent sessions in
    # threads crash it), so adapter calls are serialised; injected latency still overlaps.
    async with EnvServer(adapter_for(wl.suite), env_cfg, workers=1,
                         state_dir=state_dir).serve() as url:
        scheds: dict = {}

        async def once(c: Contender, label: str) -> dict:
            eng, cfg = (big, big_cfg) if c.free else (host, host_cfg) if c.host else \
                (engine, rcfg)
            if label == "sizing" or c not in scheds:
                scheds[c] = new_scheduler(cfg, c)
            r = await run_step(eng, cfg, wl, url, groups, c, scheds[c], decode_step_s, policy)
            if c.free and r["signature"] != probe["signature"]:
                raise RuntimeError("the step with a pool for every context sampled other "
                                   "tokens than the step's: its time would bound nothing")
            if c.free and r["forced_evictions"]:
                raise RuntimeError(f"the free pool ({big_cfg.num_pages} pages) still evicted")
            hit = r["cached_tokens"] / max(1, r["prompt_tokens"])
            print(f"  [{wl.name}] {label:7s} {c.name:18s} step {r['step_s']:6.2f}s hit "
                  f"{hit:.3f} computed {r['computed_tokens']:6d} restored "
                  f"{r['restored_tokens']:6d} evictions "
                  f"{r['forced_evictions']:4d} pauses {r['pauses']:3d}+{r['parks']:3d} busy "
                  f"{r['engine_busy']:.2f} exec/ready/wait {r['tasks_executing']:.1f}/"
                  f"{r['tasks_ready']:.1f}/{r['tasks_waiting']:.1f}", file=sys.stderr,
                  flush=True)
            return r

        # The pool-sized cap needs the mean context a turn needs: measured on an untimed run
        # with every task in flight (the caps sweep around it).
        big = big_cfg = host = host_cfg = None
        probe = await once(Contender("vanilla", True, n_tasks), "sizing")
        mean_ctx = probe["prompt_tokens"] / max(1, probe["turns"])
        pool_cap = max(1, round(capacity / mean_ctx))
        contenders = [Contender("ctb", True)]
        contenders += [Contender("ctb", True, variant=v) for v in args.ctb_variant]
        if args.noshare_caps != "none":
            contenders.append(Contender("ctb", False))
        caps = sweep_caps(n_tasks, pool_cap, args.quick or args.sweep == "short")
        contenders += [Contender("vanilla", True, cap) for cap in caps]
        # Without sharing: the whole sweep, or (--noshare-caps pool, a shorter run) the
        # pool-sized cap only.
        contenders += [Contender("vanilla", False, cap) for cap in caps
                       if args.noshare_caps == "all" or (args.noshare_caps == "pool" and
                                                         cap == pool_cap)]
        if args.host_kv_pages:
            contenders += [dataclasses.replace(c, host=True) for c in contenders]
        if args.only:
            keep = set(args.only.split(","))
            contenders = [c for c in contenders if c.name in keep]
        if any(c.host for c in contenders):
            host_cfg = dataclasses.replace(rcfg, host_kv_pages=args.host_kv_pages)
            host = Engine(policy.graphdef, engine.params, policy.model, host_cfg, seed=123)
            warm_up(host, host_cfg)
        free_c = Contender("vanilla", True, n_tasks, free=True)
        if args.free_pool_runs:
            big, big_cfg = free_pool(policy, rcfg, wl, probe["context_tokens"])
            contenders.append(free_c)
        for c in contenders:
            if not args.quick:
                await once(c, "warm-up")
            runs[c] = []
        for rep in range(args.repeats):
            k = rep % len(contenders)
            for c in contenders[k:] + contenders[:k]:  # rotated: no contender always first
                if not (c.free and rep >= args.free_pool_runs):
                    runs[c].append(await once(c, f"rep {rep}"))
        # The step ends with its last task, and no task finishes sooner than it would alone:
        # the tasks with the longest chains are replayed one at a time (same tokens, same env
        # latencies, the engine to themselves), the fastest of `repeats` runs each. The
        # longest of those is a measured lower bound for any schedule's step.
        ref = runs[contenders[0]][-1]
        free = [r["step_s"] for r in runs.pop(free_c, [])]
        contenders = [c for c in contenders if not c.free]
        specs = {s["task_id"]: s for g in groups for s in g["tasks"]}
        solo_c = Contender("vanilla", True, 1)
        solo: dict[str, float] = {}
        for tid in sorted(ref["chains"], key=lambda k: -ref["chains"][k])[:args.solo_tasks]:
            one = [{"group_id": specs[tid]["group_id"], "tasks": [specs[tid]]}]
            best = math.inf
            for _ in range(max(1, args.repeats)):
                r = await run_step(engine, rcfg, wl, url, one, solo_c,
                                   new_scheduler(rcfg, solo_c), decode_step_s, policy)
                if r["task_tokens"][tid] != ref["task_tokens"][tid]:
                    raise RuntimeError(f"task {tid} played alone sampled other tokens than in "
                                       "the step: its time alone would bound nothing")
                best = min(best, r["step_s"])
            solo[tid] = best
            print(f"  [{wl.name}] alone   {tid:18s} {best:6.2f}s (chain bound "
                  f"{ref['chains'][tid]:.2f}s)", file=sys.stderr, flush=True)
    shutil.rmtree(state_dir, ignore_errors=True)
    keys = ("step_s", "computed_tokens", "recomputed_evicted", "shared_tokens", "restored_tokens",
            "decode_tokens", "decode_tok_s", "forced_evictions", "pauses", "parks", "mean_active",
            "engine_busy", "tasks_executing", "tasks_ready", "tasks_waiting", "decode_steps",
            "prefill_batches", "path_bound_s")
    med = {}
    for c, rs in runs.items():
        m = {k: statistics.median(r[k] for r in rs) for k in keys}
        # Pooled over the repeats by tokens (not a mean of per-run rates).
        m["prompt_tokens"] = sum(r["prompt_tokens"] for r in rs)
        m["cached_tokens"] = sum(r["cached_tokens"] for r in rs)
        m["hit_rate"] = m["cached_tokens"] / max(1, m["prompt_tokens"])
        # Found resident on the device (the host tier's restores left out).
        m["device_hit_rate"] = (m["cached_tokens"] - sum(r["restored_tokens"] for r in rs)) \
            / max(1, m["prompt_tokens"])
        med[c] = m
    sigs = {r["signature"] for rs in runs.values() for r in rs}
    return {"workload": wl, "contenders": contenders, "median": med,
            "identical_tokens": len(sigs) == 1, "tasks": n_tasks, "capacity_tokens": capacity,
            "mean_context": mean_ctx, "pool_cap": pool_cap,
            "solo_bound_s": max(solo.values(), default=0.0), "solo": solo,
            "free_pool_s": statistics.median(free) if free else 0.0, "free_pool_runs": free,
            "end_reasons": runs[contenders[0]][0]["end_reasons"],
            # Every task's final context (the sizing run, all tasks in flight) against the pool.
            "context_tokens": probe["context_tokens"],
            "pool_over_contexts": capacity / max(1, probe["context_tokens"]),
            # The hit rate without recompute: a turn's new tokens (its observation; a group's
            # prompt once, where sharing held) are computed whatever the schedule. The run that
            # computed the fewest of them sets it (the trajectories, so the prompt tokens, are
            # the same in every run): a hit-rate target above it asks for fewer first-time
            # tokens than any run computed.
            "hit_ceiling": 1 - min((r["computed_tokens"] - r["recomputed_evicted"]) /
                                   max(1, r["prompt_tokens"]) for rs in runs.values()
                                   for r in rs)}


ROWS = [("KV hit rate (pooled)", "hit_rate", "{:.3f}"),
        ("  resident on the device", "device_hit_rate", "{:.3f}"),
        ("prefill tokens computed", "computed_tokens", "{:.0f}"),
        ("  recomputed after eviction", "recomputed_evicted", "{:.0f}"),
        ("  shared from a sibling", "shared_tokens", "{:.0f}"),
        ("  restored from the host tier", "restored_tokens", "{:.0f}"),
        ("forced evictions", "forced_evictions", "{:.0f}"),
        ("CTB pauses (over budget)", "pauses", "{:.0f}"),
        ("CTB parks (release valve)", "parks", "{:.0f}"),
        ("mean tasks in flight", "mean_active", "{:.1f}"),
        ("tasks executing (mean)", "tasks_executing", "{:.2f}"),
        ("tasks ready (mean)", "tasks_ready", "{:.2f}"),
        ("tasks waiting on env (mean)", "tasks_waiting", "{:.2f}"),
        ("engine busy fraction", "engine_busy", "{:.2f}"),
        ("decode steps", "decode_steps", "{:.0f}"),
        ("prefill batches", "prefill_batches", "{:.0f}"),
        ("generation tokens/s", "decode_tok_s", "{:.1f}"),
        ("step duration s (median)", "step_s", "{:.2f}"),
        ("critical-path bound s", "path_bound_s", "{:.2f}")]


def host_report(res: dict, out: dict) -> None:
    """With the host KV tier (`--host-kv-pages`, sharing on): CTB on it against the best
    vanilla cap on it (the tier is an engine option, so both get it) and against the best
    vanilla without it; `out["host"]`."""
    med, cs = res["median"], res["contenders"]
    vs_host = [c for c in cs if c.kind == "vanilla" and c.share and c.host]
    vs_dev = [c for c in cs if c.kind == "vanilla" and c.share and not c.host]
    for ctb in (c for c in cs if c.kind == "ctb" and c.share and c.host and not c.variant):
        out["host"] = host_figures(med, ctb, vs_host, vs_dev)


def host_figures(med: dict, ctb, vs_host: list, vs_dev: list) -> dict:
    """`host_report`'s figures for one CTB contender on the tier."""
    m = med[ctb]
    o: dict = {"step_s_ctb": round(m["step_s"], 3), "hit_rate_ctb": round(m["hit_rate"], 4),
               "device_hit_rate_ctb": round(m["device_hit_rate"], 4),
               "computed_ctb": round(m["computed_tokens"])}
    for tag, vs in (("vs_vanilla_host", vs_host), ("vs_vanilla", vs_dev)):
        if not vs:
            continue
        b = med[best := min(vs, key=lambda c: med[c]["step_s"])]
        o[tag] = {"best_vanilla": best.name, "step_s_vanilla": round(b["step_s"], 3),
                  "step_time_ratio": round(m["step_s"] / b["step_s"], 3),
                  "hit_rate_vanilla": round(b["hit_rate"], 4),
                  "hit_rate_ratio": round(m["hit_rate"] / max(b["hit_rate"], 1e-9), 3),
                  "device_hit_rate_ratio": round(m["device_hit_rate"] /
                                                 max(b["device_hit_rate"], 1e-9), 3),
                  "computed_vanilla": round(b["computed_tokens"])}
        print(f"[host tier] {ctb.name} / {best.name}: step x{o[tag]['step_time_ratio']:.3f} "
              f"({m['step_s']:.2f}s vs {b['step_s']:.2f}s), hit rate "
              f"x{o[tag]['hit_rate_ratio']:.2f} (resident on the device "
              f"x{o[tag]['device_hit_rate_ratio']:.2f}), prefill computed "
              f"{m['computed_tokens']:.0f} vs {b['computed_tokens']:.0f}")
    return o


def report(res: dict, real: bool = False) -> dict:
    wl, med, cs = res["workload"], res["median"], res["contenders"]
    print(f"\n== {wl.name}: {res['tasks']} tasks ({wl.groups} groups x {wl.group_size}; {wl.suite} "
          f"{' '.join(wl.options)}), max_turns {wl.max_turns}, KV pool {wl.num_pages} pages = "
          f"{res['capacity_tokens']} tokens, mean context per turn {res['mean_context']:.0f} "
          f"(pool-sized cap {res['pool_cap']}), env latency {wl.latency.dist}")
    for share in (True, False):
        cols = [c for c in cs if c.share == share]
        if not cols:  # --noshare-caps none
            continue
        print(f"{'':30s}" + "".join(f"{c.name:>19s}" for c in cols))
        for label, key, fmt in ROWS:
            print(f"{label:30s}" + "".join(f"{fmt.format(med[c][key]):>19s}" for c in cols))
    print(f"same tokens in every run: {res['identical_tokens']}; end reasons: "
          f"{res['end_reasons']}")
    out: dict = {}
    for share in (True, False):
        tag = "share" if share else "noshare"
        ctb = next((c for c in cs if c.kind == "ctb" and c.share == share and not c.variant
                    and not c.host), None)
        vs = [c for c in cs if c.kind == "vanilla" and c.share == share and not c.host]
        if ctb is None or not vs:  # `--only` left no pair to compare
            continue
        best = min(vs, key=lambda c: med[c]["step_s"])
        top_hit = max(med[c]["hit_rate"] for c in vs)
        m, b = med[ctb], med[best]
        bound = max(m["path_bound_s"], res["solo_bound_s"])
        out[tag] = {
            "best_vanilla": best.name, "best_cap": best.cap,
            "hit_rate_ctb": round(m["hit_rate"], 4), "hit_rate_vanilla": round(b["hit_rate"], 4),
            "hit_rate_ratio": round(m["hit_rate"] / max(b["hit_rate"], 1e-9), 3),
            "hit_rate_ratio_vs_best_hit": round(m["hit_rate"] / max(top_hit, 1e-9), 3),
            "step_s_ctb": round(m["step_s"], 3), "step_s_vanilla": round(b["step_s"], 3),
            "step_time_ratio": round(m["step_s"] / b["step_s"], 3),
            "throughput_ratio": round(m["decode_tok_s"] / max(b["decode_tok_s"], 1e-9), 3),
            "prefill_computed_ratio": round(m["computed_tokens"] / max(b["computed_tokens"], 1),
                                            3),
            "engine_busy_ctb": round(m["engine_busy"], 3),
            "engine_busy_vanilla": round(b["engine_busy"], 3),
            "tasks_executing_ctb": round(m["tasks_executing"], 2),
            "tasks_waiting_ctb": round(m["tasks_waiting"], 2),
            # What the targets (hit rate >= 2x, step <= 0.85x) ask of any scheduler here: 2x
            # the best vanilla's hit rate must be <= 1; 0.85x its step is out of reach when
            # it is under a lower bound of the step (the longest task chain, `task_chains`,
            # or the longest time a task takes alone); one above it is not thereby reachable.
            "path_bound_s": round(m["path_bound_s"], 3),
            "solo_bound_s": round(res["solo_bound_s"], 3),
            "free_pool_s": round(res["free_pool_s"], 3),
            "step_target_s": round(0.85 * b["step_s"], 3),
            "hit_target_possible": 2 * b["hit_rate"] <= 1.0,
            "step_target_below_bound": 0.85 * b["step_s"] < bound,
            # Below the step with every context resident: no schedule of this pool is
            # expected to reach it (a reference measured on this engine, not a proof).
            "step_target_below_free_pool": 0.85 * b["step_s"] < res["free_pool_s"],
        }
        for v in (c for c in cs if c.kind == "ctb" and c.variant and c.share == share
                  and not c.host):
            mv = med[v]
            out[tag].setdefault("variants", {})[v.variant] = {
                "hit_rate": round(mv["hit_rate"], 4),
                "hit_rate_ratio": round(mv["hit_rate"] / max(b["hit_rate"], 1e-9), 3),
                "step_s": round(mv["step_s"], 3),
                "step_time_ratio": round(mv["step_s"] / b["step_s"], 3),
                "engine_busy": round(mv["engine_busy"], 3)}
        o = out[tag]
        print(f"[{tag}] CTB / best vanilla ({best.name}): hit rate x{o['hit_rate_ratio']:.2f} "
              f"(x{o['hit_rate_ratio_vs_best_hit']:.2f} vs the best vanilla hit rate), step "
              f"time x{o['step_time_ratio']:.3f}, generation throughput "
              f"x{o['throughput_ratio']:.2f}, prefill computed x{o['prefill_computed_ratio']:.2f}")
        step_verdict = "impossible for any schedule" if o["step_target_below_bound"] else \
            "below the step with every context resident" if \
            o["step_target_below_free_pool"] else "not ruled out"
        print(f"[{tag}] targets: hit rate {2 * b['hit_rate']:.3f} "
              f"({'possible' if o['hit_target_possible'] else 'impossible: over 1'}), step "
              f"{o['step_target_s']:.2f}s against a step of at least {bound:.2f}s (longest "
              f"task chain {o['path_bound_s']:.2f}s, longest task alone "
              f"{o['solo_bound_s']:.2f}s; every context resident, median of "
              f"{len(res['free_pool_runs'])}: {o['free_pool_s']:.2f}s): {step_verdict}")
    host_report(res, out)
    out["identical_tokens"] = res["identical_tokens"]
    out["pool_cap"] = res["pool_cap"]
    if real:
        print(f"KV pool {res['capacity_tokens']} tokens = {res['pool_over_contexts']:.2f} of the "
              f"step's final contexts ({res['context_tokens']} tokens over {res['tasks']} tasks, "
              f"mean {res['context_tokens'] / res['tasks']:.0f})")
        out["capacity_tokens"] = res["capacity_tokens"]
        out["context_tokens"] = res["context_tokens"]
        out["pool_over_contexts"] = round(res["pool_over_contexts"], 3)
        out["hit_rate_no_recompute"] = round(res["hit_ceiling"], 4)
        if "share" in out:
            need = 1.5 * out["share"]["hit_rate_vanilla"]
            out["share"]["hit_target_1_5x_within_no_recompute"] = need <= res["hit_ceiling"]
            print(f"hit rate without recompute {res['hit_ceiling']:.3f} (only first-time "
                  f"tokens computed, the fewest of any run): 1.5x the best vanilla's is "
                  f"{need:.3f}, {'within' if need <= res['hit_ceiling'] else 'above'} it")
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workloads", default="",
                    help="default: textworld,default,webshop (with --model, REAL_WORKLOADS: "
                         "webshop,textworld,long,deep,default)")
    ap.add_argument("--model", default="",
                    help="serve this checkpoint (HF folder or .gguf file) instead of the tiny "
                         "random policy, on REAL_WORKLOADS")
    ap.add_argument("--quick", action="store_true",
                    help="fewer caps and no warm-up runs (a look, not a measurement)")
    ap.add_argument("--sweep", choices=("full", "short"), default="full",
                    help="vanilla caps: full (pool-sized, half and twice it, ~39%%/~78%%/all "
                         "of the tasks) or short (pool-sized, twice it, all tasks; warm-ups kept)")
    ap.add_argument("--noshare-caps", choices=("all", "pool", "none"), default="all",
                    help="vanilla caps without sharing: the whole sweep, or the pool-sized "
                         "cap only (fewer runs; the headline figures are with sharing), or "
                         "none (no contender without sharing, CTB's included)")
    ap.add_argument("--ctb", default="", help="CTBConfig overrides, e.g. growth_horizon=0.25")
    ap.add_argument("--only", default="",
                    help="run only these contenders (exploration), e.g. ctb+share,vanilla@24+share")
    ap.add_argument("--solo-tasks", type=int, default=3,
                    help="tasks with the longest chains replayed alone for the step's lower "
                         "bound (0: none)")
    ap.add_argument("--free-pool-runs", type=int, default=-1,
                    help="timed runs of the step with a pool that holds every context (a "
                         "second engine in the contenders' rotation, in its first N repeats; "
                         "its median is a reference for the step; 0: none; default: "
                         "--repeats with --model, else 0)")
    ap.add_argument("--ctb-variant", action="append", default=[],
                    help="one more CTB contender with these CTBConfig overrides (on top of "
                         "--ctb), e.g. park_below_busy=0; repeatable")
    ap.add_argument("--host-kv-pages", type=int, default=0,
                    help="also run every contender on a second engine with a host KV tier of "
                         "this many pages (rollout.host_kv_pages; names end in +host)")
    ap.add_argument("--latency-scale", type=float, default=1.0,
                    help="multiply every workload's env latency (how the result depends on "
                         "the env-wait / compute ratio: a faster or slower machine)")
    args = ap.parse_args(argv)
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: at least 1 timed run per contender is needed "
                 "(medians, the alone replays); use --repeats 1 for a quick look")
    if args.free_pool_runs < 0:
        args.free_pool_runs = args.repeats if args.model else 0
    CTB_OVERRIDES.update(parse_overrides(args.ctb))
    for v in args.ctb_variant:
        parse_overrides(v)  # a bad one fails here, not after the first workload
    table = REAL_WORKLOADS if args.model else WORKLOADS
    names = args.workloads.split(",") if args.workloads else list(table)
    if unknown := [n for n in names if n not in table]:
        ap.error(f"--workloads {','.join(unknown)}: unknown; choose from {','.join(table)}")
    t0 = time.perf_counter()
    policy = load_policy(args.model)
    if policy.real:
        print(f"serving {policy.name}: {policy.model.n_layers} layers, d {policy.model.d_model}, "
              f"vocab {policy.model.vocab_size}", file=sys.stderr, flush=True)
    summary: dict = {}
    longest: dict[str, float] = {}
    for name in names:
        wl = table[name]
        if args.latency_scale != 1.0:
            x = args.latency_scale
            wl = dataclasses.replace(wl, latency=dataclasses.replace(
                wl.latency, median_s=wl.latency.median_s * x, scale_s=wl.latency.scale_s * x,
                cap_s=wl.latency.cap_s * x))
        res = asyncio.run(bench_workload(wl, args, policy))
        summary[name] = report(res, policy.real)
        longest[name] = res["context_tokens"] / res["tasks"]
    share = {k: w["share"] for k, w in summary.items() if "share" in w}
    if not share:
        sys.exit("no workload ran CTB and vanilla both with sharing: nothing to compare "
                 "(`--only` must name ctb+share and at least one vanilla@C+share)")
    head = {
        "hit_rate_ratio": min(w["hit_rate_ratio"] for w in share.values()),
        "step_time_ratio": max(w["step_time_ratio"] for w in share.values()),
        "throughput_ratio": min(w["throughput_ratio"] for w in share.values()),
        "met": all(w["hit_rate_ratio"] >= 2.0 and w["step_time_ratio"] <= 0.85
                   for w in share.values()),
        # Per workload, the targets no scheduler can meet there (see `report`).
        "ruled_out": {k: [x for x, out in (("hit_rate", not w["hit_target_possible"]),
                                           ("step_time", w["step_target_below_bound"])) if out]
                      for k, w in share.items()},
        "repeats": args.repeats, "quick": args.quick, "noshare_caps": args.noshare_caps,
        "sweep": "short" if args.quick else args.sweep,
        "latency_scale": args.latency_scale,
        "wall_s": round(time.perf_counter() - t0, 1),
        "per_workload": summary,
    }
    if policy.real:
        # The acceptance for a real model: the workload whose tasks end with the longest
        # contexts (the most KV to keep or recompute), hit rate >= 1.5x and step <= 0.85x.
        top = max((k for k in share), key=lambda k: longest[k])
        if "host" in summary[top]:
            head["longest_host"] = summary[top]["host"]
        head.update({"model": policy.name, "longest_context_workload": top,
                     "longest_hit_rate_ratio": share[top]["hit_rate_ratio"],
                     "longest_step_time_ratio": share[top]["step_time_ratio"],
                     "longest_met": share[top]["hit_rate_ratio"] >= 1.5 and
                     share[top]["step_time_ratio"] <= 0.85,
                     "longest_step_target_below_free_pool":
                         share[top]["step_target_below_free_pool"]})
    print(json.dumps(head))
    return head


if __name__ == "__main__":
    main()
