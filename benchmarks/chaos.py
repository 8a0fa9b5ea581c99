"""Chaos: short multi-rank jobs, one per injected fault, under KV and env-latency pressure.

Every run is a real `tiderl.launch` job in its own process (`configs/tiny-8dev.yaml`: 8 fake
CPU devices; 3 rollout ranks by default, a 4-device FSDP actor and a decoupled Ref with
`trainer.kl_coef=0.001`; a 1-layer d_model=32 policy; `rollout.num_pages=24`; groups of 8, 4 per
step; actions of up to 3 tokens so decode runs, with reward-less groups kept at zero advantage so
a random policy still trains) against a real env server process (`python -m tiderl.envs
serve`, Pareto latency scale 20 ms, alpha 1.5, cap 2 s) on a fixed 127.0.0.1 port, with real
orbax checkpoints. Faults, one run each, one after another:

    none            the same job with no fault (baseline under the same pressure)
    prefill_raise   one rank's engine raises once in prefill, on a turn >= 2 of some task
                    (an observation appended to a resident context), after the first sync
    decode_raise    one rank's engine raises once in generate (decode), after the first sync
    rank_dead       one rank's engine raises on every call from the start (prefill, generate,
                    insert, evict, free, fork, update_weights, flush; not init/stats)
    env_kill        SIGKILL of the env server mid-run, down 5 s, restarted on the same port
    env_503         an aiohttp reverse proxy in front of the env server answers 503 to every
                    request for 5 s mid-run (forwards everything otherwise)
    sigkill_resume  SIGKILL of the job once a checkpoint of step >= steps/2 exists, then
                    `--resume RUN_DIR` to the end (checks no group is trained twice)
    nan             NaN written into the accumulated gradient at one step: that update must be
                    skipped (counted in `nonfinite_skipped`) and the run go on
    nan_stop        NaN in every gradient from one step on: the run must stop cleanly after
                    `controller.max_nonfinite_steps` (exit 3, with a checkpoint)
    nan_reward      a proxy in front of the env server rewrites rewards: every 4th /end reply
                    NaN, every 5th /observation reply +inf (those tasks end bad_reward; their
                    groups train on the rest or are dropped, counted)
    null_reward     the proxy rewrites /end replies: every 4th reward null, every 6th a string,
                    every 9th without its reward field (bad_reward, as above)
    long_action     the env server accepts actions of at most 2 characters (env
                    max_action_chars=2) while the policy writes up to 3 tokens: longer actions
                    answer 413 and end action_too_long, which still trains
    bad_options     a rogue client keeps sending /start with options clients may not set
                    (cache_dir, max_sessions, an unknown key) to the job's env server: each
                    must get 400 and open no session, and the job must not notice

Engine and NaN faults need code inside the job: the job runs as
`python benchmarks/chaos.py --child FAULT ... -- LAUNCH_ARGS`, which subclasses the real
`tiderl.serving.engine.Engine` (installed as `tiderl.runtime.job.Engine`) or wraps
`tiderl.train.backend.TrainerBackend.apply`, then calls `tiderl.launch.main(LAUNCH_ARGS)`.
Every run (faults outside the job too) goes through that wrapper so a hung job can be made to
dump its threads, its await tree and its asyncio tasks (SIGUSR1) into its log before it is
killed; the table names the frame the job is stuck at.
For sigkill_resume the figures are the resumed process's (the killed one writes no summary).

Figures come from the run folder: `metrics.jsonl` (last step record: `dropped`,
`failed_tasks`, `nonfinite_skipped`) and `summary.json` (`rollout`: the rollout manager's
stats). Tasks lost = tasks_submitted - tasks_ended - tasks_live (n/a when summary.json or those
keys are missing: a crashed or killed run writes none). A run crashed when it exits non-zero
where it should finish, exits otherwise than expected, or makes no progress before a timeout.

    python benchmarks/chaos.py [--steps 40] [--ranks 3] [--only env_kill,nan] [key=value ...]

The last stdout line is one JSON object:
{"chaos": {"lost_tasks": N, "crashed_runs": N, "faults": {FAULT: {"finished": bool,
 "steps": n, "lost": n|null, "failed": n, "dropped": n, ...}}}}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
FAULTS = ("none", "prefill_raise", "decode_raise", "rank_dead", "env_kill", "env_503",
          "sigkill_resume", "nan", "nan_stop", "nan_reward", "null_reward", "long_action",
          "bad_options")
REWARD_FAULTS = ("nan_reward", "null_reward")
ROGUE_OPTIONS = ({"cache_dir": "/etc"}, {"max_sessions": "1"}, {"no_such_option": "1"})
ENGINE_FAULTS = ("prefill_raise", "decode_raise", "rank_dead")
ENV_OPTIONS = ("format_bonus=0.1", "hint=range", "targets=member")  # the embedded default's
LATENCY = ("latency.dist=pareto", "latency.scale_s=0.02", "latency.alpha=1.5",
           "latency.cap_s=2.0")


# =============================================================================================
# Child side: runs inside the job's process.
# =============================================================================================

def _mark(path: str, **rec) -> None:
    """Appends one injection record (the parent reads them to know the fault really fired)."""
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"t": time.time(), **rec}) + "\n")


class ChaosFault(RuntimeError):
    """The injected engine failure."""


def install_engine_fault(kind: str, rank: int, marker: str) -> None:
    import itertools

    import tiderl.runtime.job
    from tiderl.serving.engine import Engine

    counter = itertools.count()
    fired = {"n": 0}
    device_calls = ("prefill", "generate", "insert", "evict", "free", "fork",
                    "update_weights", "flush")

    class ChaosEngine(Engine):
        """tiderl.runtime.job builds one engine per rollout rank, in rank order: instance k is rank k."""

        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            self.chaos_rank = next(counter)

        def _target(self) -> bool:
            return self.chaos_rank == rank

        def prefill_many(self, params, requests):
            if self._target():
                if kind == "rank_dead":
                    self._die("prefill_many")
                # Turn >= 2: a resident task gets its next observation appended.
                later = [r for r in requests if r.existing_prefix is not None
                         and r.true_length > 0 and r.existing_prefix.action_tokens]
                if kind == "prefill_raise" and not fired["n"] and self.version >= 1 and later:
                    fired["n"] += 1
                    _mark(marker, fault=kind, rank=rank, call="prefill_many",
                          version=self.version, batch=len(requests),
                          task=later[0].existing_prefix.task_id,
                          context=len(later[0].existing_prefix.tokens))
                    raise ChaosFault(f"chaos: injected prefill failure on rank {rank}")
            return super().prefill_many(params, requests)

        def generate(self, params, decode_state):
            if self._target():
                if kind == "rank_dead":
                    self._die("generate")
                active = [h for h in self._state(decode_state).slots
                          if h is not None and h.decoding]
                if kind == "decode_raise" and not fired["n"] and self.version >= 1 and active:
                    fired["n"] += 1
                    _mark(marker, fault=kind, rank=rank, call="generate",
                          version=self.version, decoding=len(active))
                    raise ChaosFault(f"chaos: injected decode failure on rank {rank}")
            return super().generate(params, decode_state)

        def _die(self, call: str) -> None:
            fired["n"] += 1
            if fired["n"] <= 3:
                _mark(marker, fault=kind, rank=rank, call=call, version=self.version)
            raise ChaosFault(f"chaos: rank {rank} is dead ({call})")

    if kind == "rank_dead":
        def dead(name):
            base = getattr(Engine, name)

            def call(self, *a, **kw):
                if self._target():
                    self._die(name)
                return base(self, *a, **kw)
            call.__name__ = name
            return call

        for name in device_calls:  # prefill goes through prefill_many; generate is above
            if name not in ("generate",):
                setattr(ChaosEngine, name, dead(name))
    tiderl.runtime.job.Engine = ChaosEngine


def install_nan_fault(first: int, every: bool, marker: str) -> None:
    import jax
    import jax.numpy as jnp

    from tiderl.train.backend import TrainerBackend

    orig = TrainerBackend.apply
    calls = {"n": 0}

    def apply(self):
        calls["n"] += 1
        if self._grads is not None and (calls["n"] == first or (every and calls["n"] >= first)):
            self._grads = jax.tree.map(
                lambda g: jax.device_put(g * jnp.asarray(jnp.nan, g.dtype), g.sharding),
                self._grads)
            _mark(marker, fault="nan", apply_call=calls["n"], version=self.version)
        return orig(self)

    TrainerBackend.apply = apply


def _await_tree(aw, depth: int = 0, seen: set | None = None) -> list[str]:
    """Where an awaitable is stuck: its coroutine chain (following `cr_await`), then, when it
    waits on a task or a gather, the chains of those. Leaf frames are marked CHAOS-STUCK."""
    import asyncio

    seen = set() if seen is None else seen
    if id(aw) in seen or depth > 6:
        return []
    seen.add(id(aw))
    lines, pad = [], "  " * depth
    task = aw if isinstance(aw, asyncio.Task) else None
    if task is not None:
        if task.done():
            return []
        lines.append(f"{pad}task {task.get_name()}")
        aw = task.get_coro()
    last = last_own = None
    while aw is not None:
        frame = getattr(aw, "cr_frame", None) or getattr(aw, "gi_frame", None)
        if frame is None:
            break
        f = frame.f_code.co_filename
        f = f[f.rfind("tiderl/"):] if "tiderl/" in f else Path(f).name
        last = f"{frame.f_code.co_name} {f}:{frame.f_lineno}"
        if f.startswith("tiderl/"):
            last_own = last
        lines.append(f"{pad}  {last}")
        nxt = getattr(aw, "cr_await", None) or getattr(aw, "gi_yieldfrom", None)
        if nxt is None or not (hasattr(nxt, "cr_frame") or hasattr(nxt, "gi_frame")):
            aw = nxt
            break
        aw = nxt
    if task is not None and not isinstance(aw, asyncio.Future):
        aw = getattr(task, "_fut_waiter", None) or aw  # what the task is blocked on
    children = []
    if isinstance(aw, asyncio.Task):
        children = [aw]
    elif isinstance(aw, asyncio.Future):
        children = [c for c in getattr(aw, "_children", []) or []  # a gather's children
                    if not c.done()]
    if children:
        for c in children[:8]:
            lines += _await_tree(c, depth + 1, seen)
        if len(children) > 8:
            lines.append(f"{pad}  ... and {len(children) - 8} more")
    elif last is not None:
        lines.append(f"CHAOS-STUCK {last_own or last}"
                     + (f" (awaiting {type(aw).__name__})" if aw is not None else ""))
    return lines


def install_dump_handler() -> None:
    """SIGUSR1: every thread's stack, the main coroutine's await tree and every asyncio task's
    stack to stderr (hang reports)."""
    import asyncio
    import faulthandler

    def dump(_sig, _frame):
        print("\n===== chaos: SIGUSR1 dump (threads) =====", file=sys.stderr, flush=True)
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        try:
            tasks = asyncio.all_tasks(asyncio.get_running_loop())
        except RuntimeError:
            tasks = set()
        main = [t for t in tasks if getattr(t.get_coro(), "__name__", "") == "run_job"]
        print("===== chaos: the job's await tree =====", file=sys.stderr)
        for t in main:
            print("\n".join(_await_tree(t)), file=sys.stderr)
        print(f"===== chaos: {len(tasks)} asyncio tasks =====", file=sys.stderr, flush=True)
        for t in tasks:
            t.print_stack(limit=6, file=sys.stderr)
        sys.stderr.flush()

    signal.signal(signal.SIGUSR1, dump)


def child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="chaos.py --child")
    p.add_argument("--child", required=True, choices=FAULTS)
    p.add_argument("--marker", default="")
    p.add_argument("--rank", type=int, default=1)
    p.add_argument("--nan-step", type=int, default=3)
    p.add_argument("launch", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    launch = a.launch[1:] if a.launch[:1] == ["--"] else a.launch
    install_dump_handler()
    if a.child in ENGINE_FAULTS:
        install_engine_fault(a.child, a.rank, a.marker)
    elif a.child in ("nan", "nan_stop"):
        install_nan_fault(a.nan_step, a.child == "nan_stop", a.marker)
    from tiderl.launch import main

    return main(launch)


# =============================================================================================
# Parent side: env server, proxy, job processes, figures.
# =============================================================================================

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_env_server(port: int, log_path: Path, extra: list[str]) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tiderl.envs", "serve", "--suite", "default",
           "--port", str(port), *[f"--option={o}" for o in ENV_OPTIONS], *LATENCY, *extra]
    log = open(log_path, "a")
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True, cwd=REPO,
                         env={**os.environ, "PYTHONWARNINGS": "ignore"})
    line = p.stdout.readline()
    if "url=" not in line:
        p.kill()
        raise RuntimeError(f"env server did not start: {line!r} (see {log_path})")
    # Keep draining its stdout so it never blocks on a full pipe.
    threading.Thread(target=lambda: [log.write(x) for x in p.stdout], daemon=True).start()
    return p


def stop(p: subprocess.Popen | None, sig: int = signal.SIGKILL) -> None:
    if p is not None and p.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(p.pid, sig) if _own_group(p) else p.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(15)


def _own_group(p: subprocess.Popen) -> bool:
    with contextlib.suppress(ProcessLookupError):
        return os.getpgid(p.pid) == p.pid
    return False


class Proxy503:
    """A real aiohttp reverse proxy on its own thread and loop: forwards every request to
    `upstream`, except that while `fail_until` is in the future it answers 503 itself."""

    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.port = free_port()
        self.fail_until = 0.0
        self.refused = self.forwarded = 0
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="proxy503")

    def __enter__(self) -> Proxy503:
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        import asyncio

        asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def fail_for(self, seconds: float) -> None:
        self.fail_until = time.monotonic() + seconds

    def _main(self) -> None:
        import asyncio

        self._loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self._loop)
        self._loop.run_until_complete(self._start())
        self._ready.set()
        self._loop.run_forever()

    async def _start(self) -> None:
        import aiohttp
        from aiohttp import web

        self._http = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=256),
            timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application(client_max_size=8 << 20)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _shutdown(self) -> None:
        await self._runner.cleanup()
        await self._http.close()

    async def _handle(self, request):
        import aiohttp
        from aiohttp import web

        if time.monotonic() < self.fail_until:
            self.refused += 1
            return web.json_response({"error": "chaos proxy: service unavailable"}, status=503)
        body = await request.read()
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "accept")}
        try:
            async with self._http.request(request.method, self.upstream + str(request.rel_url),
                                          data=body, headers=headers) as r:
                data = self.edit(request.path, r.status, await r.read())
                out = {k: v for k, v in r.headers.items()
                       if k.lower() in ("content-type", "retry-after", "allow")}
                self.forwarded += 1
                return web.Response(body=data, status=r.status, headers=out)
        except (aiohttp.ClientError, OSError) as e:  # upstream down: what a real proxy says
            return web.json_response({"error": f"chaos proxy: upstream: {e}"}, status=502)

    def edit(self, path: str, status: int, data: bytes) -> bytes:
        """The upstream reply's body as forwarded (unchanged here)."""
        return data


class RewardProxy(Proxy503):
    """The proxy, rewriting rewards in replies (`nan_reward`, `null_reward`): what a buggy
    external environment sends. `rewrote` counts the replies changed."""

    def __init__(self, upstream: str, kind: str):
        super().__init__(upstream)
        self.kind = kind
        self.counts = {"/end": 0, "/observation": 0}
        self.rewrote: dict[str, int] = {}

    def edit(self, path: str, status: int, data: bytes) -> bytes:
        if status != 200 or path not in self.counts:
            return data
        self.counts[path] += 1
        n = self.counts[path]
        body = json.loads(data)
        what = None
        if self.kind == "nan_reward":
            if path == "/end" and n % 4 == 0:
                body["reward"], what = float("nan"), "nan"
            elif path == "/observation" and n % 5 == 0:
                body["reward"], what = float("inf"), "inf"
        elif path == "/end":
            if n % 9 == 0:
                body.pop("reward", None)
                what = "missing"
            elif n % 6 == 0:
                body["reward"], what = "high", "string"
            elif n % 4 == 0:
                body["reward"], what = None, "null"
        if what is None:
            return data
        self.rewrote[what] = self.rewrote.get(what, 0) + 1
        return json.dumps(body).encode()  # NaN / Infinity literals, as Python's json writes


class RogueClient:
    """A second client of the job's env server, sending /start with options clients may not
    set (ROGUE_OPTIONS) every `period_s` on its own thread; counts the replies by status."""

    def __init__(self, url: str, period_s: float = 0.5):
        self.url, self.period_s = url, period_s
        self.statuses: dict[int, int] = {}
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._main, daemon=True, name="rogue")

    def __enter__(self) -> RogueClient:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(30)

    def _main(self) -> None:
        import urllib.error
        import urllib.request

        k = 0
        while not self._stop.wait(self.period_s):
            options = ROGUE_OPTIONS[k % len(ROGUE_OPTIONS)]
            k += 1
            body = json.dumps({"task": {"task_id": f"rogue{k}", "seed": k},
                               "options": options}).encode()
            req = urllib.request.Request(self.url + "/start", data=body, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=10) as resp:
                    status, text = resp.status, resp.read().decode()
            except urllib.error.HTTPError as e:
                status, text = e.code, e.read().decode(errors="replace")
            except OSError as e:  # the server is busy or restarting: not what is tested
                self.errors.append(f"{type(e).__name__}: {e}")
                continue
            self.statuses[status] = self.statuses.get(status, 0) + 1
            if status != 400 or next(iter(options)) not in text:
                self.errors.append(f"{options} -> HTTP {status}: {text[:160]}")


def read_records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            if line.strip():
                out.append(json.loads(line))
    return out


def step_records(run: Path) -> list[dict]:
    return [r for r in read_records(run) if r.get("kind") == "step"]


def last_step(run: Path) -> int:
    s = step_records(run)
    return max((r.get("step", 0) for r in s), default=0)


def checkpoint_steps(run: Path) -> list[int]:
    d = run / "checkpoints"
    if not d.is_dir():
        return []
    return sorted(int(x.name) for x in d.iterdir() if x.name.isdigit())


_ERR = re.compile(r"^[\s│|]*((?:[\w.]+\.)?\w*(?:Error|Exception|Stop|Fault)\b:?.*?)[\s│|]*$")


def error_line(log_text: str) -> str:
    """The last exception line of a log (plain or rich tracebacks), or a launch 'stopped:'."""
    lines = log_text.splitlines()
    for line in reversed(lines):
        if line.startswith("tiderl.launch: "):
            return line.strip()
    for line in reversed(lines):
        m = _ERR.match(line)
        if m and ":" in m.group(1) and not m.group(1).startswith(("raise ", "except ")):
            return m.group(1).strip()[:300]
    return ""


class Job:
    """One job process (the chaos child wrapper around tiderl.launch.main) with a log file."""

    def __init__(self, fault: str, launch_args: list[str], log_path: Path, marker: Path,
                 rank: int, nan_step: int):
        self.log_path = log_path
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", fault,
               "--marker", str(marker), "--rank", str(rank), "--nan-step", str(nan_step),
               "--", *launch_args]
        self.log = open(log_path, "a")
        self.log.write("$ " + " ".join(cmd) + "\n")
        self.log.flush()
        self.t0 = time.monotonic()
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=REPO,
                                  start_new_session=True,
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"})

    def dump_and_kill(self) -> None:
        """A hang: ask the job for its stacks, then SIGKILL its process group."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.p.pid, signal.SIGUSR1)
        time.sleep(3)
        stop(self.p)

    def kill(self) -> None:
        stop(self.p)


def watch(job: Job, run: Path, *, timeout_s: float, stall_s: float, first_step_s: float,
          on_tick=None) -> tuple[int | None, str]:
    """Waits for the job; returns (exit code or None if it had to be killed, why)."""
    last_n, last_t = last_step(run), time.monotonic()
    while True:
        rc = job.p.poll()
        if rc is not None:
            return rc, ""
        now = time.monotonic()
        n = last_step(run)
        if n != last_n:
            last_n, last_t = n, now
        if on_tick is not None and on_tick(n):
            return None, "stopped by the chaos driver"
        limit = stall_s if n else first_step_s
        if now - last_t > limit:
            job.dump_and_kill()
            return None, f"hang: no new step for {now - last_t:.0f}s (at step {n})"
        if now - job.t0 > timeout_s:
            job.dump_and_kill()
            return None, f"timeout: {timeout_s:.0f}s (at step {n})"
        time.sleep(0.5)


def figures(run: Path) -> dict:
    """Steps, failures, drops and lost tasks from the run folder (None where unknown)."""
    steps = step_records(run)
    last = steps[-1] if steps else {}
    summary = None
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        summary = json.loads((run / "summary.json").read_text())
    roll = (summary or {}).get("rollout") or {}
    keys = ("tasks_submitted", "tasks_ended", "tasks_live")
    lost = None
    if all(k in roll for k in keys):
        lost = roll["tasks_submitted"] - roll["tasks_ended"] - roll["tasks_live"]
    failed = dict(last.get("failed_tasks") or {})
    dropped = dict(last.get("dropped") or {})
    return {
        "steps": max((r.get("step", 0) for r in steps), default=0),
        "failed": failed, "dropped": dropped, "lost": lost,
        "lost_why": "" if lost is not None else (
            "no summary.json" if summary is None else "summary.json rollout lacks "
            + ",".join(k for k in keys if k not in roll)),
        "tasks": {k: roll.get(k) for k in keys},
        "live_end": roll.get("tasks_live"),
        "nonfinite_skipped": last.get("nonfinite_skipped", 0),
        "migrations": (roll.get("decisions") or {}).get("migrate"),
        "ended": (summary or {}).get("ended", ""),
        "end_reasons": roll.get("end_reasons") or last.get("end_reasons") or {},
    }


def markers(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def base_args(a, run: Path, url: str, steps: int) -> list[str]:
    r = a.ranks
    actor, ref, fsdp = (4, 8 - r - 4, 2) if r <= 3 else (2, 8 - r - 2, 2)
    return [
        "--config", "configs/tiny-8dev.yaml",
        f"rollout.ranks={r}", f"trainer.actor_devices={actor}", f"trainer.fsdp={fsdp}",
        f"trainer.ref_devices={ref}", f"rollout.num_pages={a.num_pages}",
        # Actions of up to 3 tokens: decode runs (with 1 it never does: prefill samples the
        # whole action) and a weight sync can land mid-action. A random byte policy then
        # rarely answers validly, so reward-less groups are kept (zero advantage) instead of
        # dropped: the run must make progress whatever the policy does.
        f"rollout.max_action_tokens={a.action_tokens}", "trainer.zero_var_groups=keep",
        "trainer.kl_coef=0.001",
        *[f"env.{x}" for x in LATENCY], f"env.url={url}",
        f"controller.steps={steps}", f"controller.groups_per_step={a.groups_per_step}",
        "controller.groups_per_microbatch=1", f"env.group_size={a.group_size}",
        "controller.eval_every=0", "controller.console=false", "controller.time_limit_s=0",
        "model.n_layers=1", "model.d_model=32", "model.mlp_dim=64", "model.head_dim=8",
        f"run_dir={run}", *a.overrides,
    ]


def run_fault(fault: str, a, work: Path) -> dict:
    """One run with one fault; returns its row."""
    run = work / fault
    log_path = work / f"{fault}.log"
    env_log = work / f"{fault}.env.log"
    marker = work / f"{fault}.inject.jsonl"
    port = free_port()
    steps = a.steps
    trigger = max(2, steps // 3)
    row: dict = {"fault": fault, "expected": "finish", "rc": None, "why": "", "injected": False,
                 "notes": []}
    t0 = time.monotonic()
    server_args = ["max_action_chars=2"] if fault == "long_action" else []
    server = start_env_server(port, env_log, server_args)
    proxy = rogue = None
    try:
        url = f"http://127.0.0.1:{port}"
        if fault == "bad_options":
            rogue = RogueClient(url).__enter__()
        if fault == "env_503" or fault in REWARD_FAULTS:
            proxy = (Proxy503(url) if fault == "env_503" else RewardProxy(url, fault)).__enter__()
            url = f"http://127.0.0.1:{proxy.port}"
        args = base_args(a, run, url, steps)
        if fault == "sigkill_resume":
            args.append("controller.checkpoint_every=2")
        if fault == "nan_stop":
            row["expected"] = "clean stop (exit 3)"
        job = Job(fault, args, log_path, marker, a.fault_rank, a.nan_step)
        state = {"done": False}

        def tick(n: int) -> bool:
            nonlocal server
            if state["done"]:
                return False
            if fault == "env_kill" and n >= trigger:
                state["done"] = True
                server.send_signal(signal.SIGKILL)
                server.wait(10)
                _mark(str(marker), fault=fault, at_step=n, down_s=a.outage_s)
                time.sleep(a.outage_s)  # the job keeps running meanwhile
                server = start_env_server(port, env_log, server_args)
                row["notes"].append(f"env server SIGKILLed at step {n}, back after "
                                    f"{a.outage_s:g}s")
            elif fault == "env_503" and n >= trigger:
                state["done"] = True
                proxy.fail_for(a.outage_s)
                _mark(str(marker), fault=fault, at_step=n, window_s=a.outage_s)
                row["notes"].append(f"503 for {a.outage_s:g}s from step {n}")
            elif fault == "sigkill_resume":
                ck = checkpoint_steps(run)
                if ck and ck[-1] >= math.ceil(steps / 2):
                    state["done"] = True
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(job.p.pid, signal.SIGKILL)
                    job.p.wait(30)
                    _mark(str(marker), fault=fault, at_step=n, checkpoints=ck)
                    row["notes"].append(f"SIGKILL at step {n} (checkpoints {ck})")
                    return True
            return False

        rc, why = watch(job, run, timeout_s=a.timeout, stall_s=a.stall, first_step_s=a.stall + 60,
                        on_tick=tick)
        if fault == "sigkill_resume" and why == "stopped by the chaos driver":
            before = step_records(run)
            saved = checkpoint_steps(run)
            job = Job("none", ["--resume", str(run)], log_path, marker,
                      a.fault_rank, a.nan_step)
            rc, why = watch(job, run, timeout_s=a.timeout, stall_s=a.stall,
                            first_step_s=a.stall + 60)
            resumes = run / "resumes.jsonl"
            frm = json.loads(resumes.read_text().splitlines()[0])["from_step"] \
                if resumes.is_file() else None
            row["notes"].append(f"resumed from step {frm}")
            if frm is not None:
                after = step_records(run)
                tb = {g for r in before if r["step"] <= frm for g in r.get("group_ids", [])}
                ta = {g for r in after if r["step"] > frm for g in r.get("group_ids", [])}
                row["dup_groups"] = len(tb & ta)
                seq = [r["step"] for r in after]
                if seq != list(range(1, len(seq) + 1)):
                    row["notes"].append(f"step sequence after resume is {seq}")
                if frm not in saved:
                    row["notes"].append(f"resumed from {frm}, not a saved checkpoint {saved}")
        elif fault == "sigkill_resume" and not why and rc == 0:
            row["notes"].append("the job finished before the kill (no checkpoint >= steps/2 "
                                "seen in time)")
        row["rc"], row["why"] = rc, why
        if isinstance(proxy, RewardProxy):
            row["rewrote"] = dict(proxy.rewrote)
            row["notes"].append(f"proxy rewrote rewards {proxy.rewrote}")
        elif proxy is not None:
            row["notes"].append(f"proxy refused {proxy.refused}, forwarded {proxy.forwarded}")
    finally:
        if rogue is not None:
            rogue.__exit__(None, None, None)
            row["rogue"] = {"statuses": rogue.statuses, "wrong": rogue.errors[:5]}
            row["notes"].append(f"rogue /start replies {rogue.statuses}"
                                + (f"; unexpected: {rogue.errors[:3]}" if rogue.errors else ""))
        stop(server)
        if proxy is not None:
            proxy.__exit__(None, None, None)
    row["wall_s"] = time.monotonic() - t0
    row.update(figures(run))
    allm = markers(marker)
    inj = [m for m in allm if "fault" in m]
    row["injected"] = fault == "none" or bool(inj)
    reasons = row.get("end_reasons") or {}
    if fault in REWARD_FAULTS:
        row["injected"] = bool(row.get("rewrote"))
        row["notes"].append(f"bad_reward tasks {reasons.get('bad_reward', 0)}")
    elif fault == "long_action":
        row["injected"] = bool(reasons.get("action_too_long"))
        row["notes"].append(f"action_too_long tasks {reasons.get('action_too_long', 0)} "
                            "(trained)")
    elif fault == "bad_options":
        row["injected"] = bool((row.get("rogue") or {}).get("statuses"))
    if inj and fault in ENGINE_FAULTS:
        i = inj[0]
        row["notes"].append(f"raised in {i['call']} on rank {i['rank']} at version "
                            f"{i['version']}" + (f" (task {i['task']}, context {i['context']})"
                                                 if "task" in i else ""))
    if inj and fault.startswith("nan"):
        row["notes"].append(f"NaN grads at apply #{inj[0]['apply_call']}"
                            + (f" (and {len(inj) - 1} more)" if len(inj) > 1 else ""))
    log_text = log_path.read_text(errors="replace") if log_path.is_file() else ""
    if fault in ENGINE_FAULTS and "quarantining rollout rank" in log_text:
        row["notes"].append("rank quarantined")
    row["error"] = error_line(log_text) if (row["rc"] not in (0,) or row["why"]) else ""
    stuck = list(dict.fromkeys(x.split(" ", 1)[1] for x in log_text.splitlines()
                               if x.startswith("CHAOS-STUCK ")))
    if stuck:
        row["why"] += "; stuck at " + ", ".join(stuck[:3])
        if row["error"].startswith("ChaosFault"):
            row["error"] = ""  # the injected fault itself, not what went wrong after it
    # Verdict.
    if fault == "nan_stop":
        ck = checkpoint_steps(run)
        row["finished"] = row["rc"] == 3 and "non-finite" in log_text and bool(ck) \
            and ck[-1] == row["steps"]
        if row["finished"]:  # the expected stop: its message is the end reason, no error
            row["ended"] = row["error"] + f" (checkpoint of step {ck[-1]} saved)"
            row["error"] = ""
    else:
        row["finished"] = row["rc"] == 0 and row["steps"] >= steps
    if fault in REWARD_FAULTS and not reasons.get("bad_reward"):
        row["finished"] = False
        row["why"] += "; no task ended bad_reward"
    if fault == "long_action" and row["failed"].get("action_too_long"):
        row["finished"] = False
        row["why"] += "; action_too_long tasks were not trained"
    if fault == "bad_options":
        rg = row.get("rogue") or {}
        if rg.get("wrong") or set(rg.get("statuses") or {}) - {400}:
            row["finished"] = False
            row["why"] += "; a forbidden option was not refused with 400"
    row["crashed"] = not row["finished"]
    return row


def fmt_counts(d: dict) -> str:
    n = sum(d.values())
    return f"{n}" + (" (" + ", ".join(f"{k}:{v}" for k, v in sorted(d.items())) + ")" if d
                     else "")


def print_table(rows: list[dict], steps: int) -> None:
    print()
    hdr = (f"{'fault':15s} {'inj':>4s} {'rc':>5s} {'steps':>7s} {'lost':>5s} {'migr':>5s} "
           f"{'skip':>4s} {'wall':>6s}  {'finished':9s} failed (reason) | dropped (why)")
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        lost = "n/a" if r["lost"] is None else str(r["lost"])
        rc = "kill" if r["rc"] is None else str(r["rc"])
        fin = "yes" if r["finished"] else ("HANG" if r["why"].startswith(("hang", "timeout"))
                                           else "CRASH")
        print(f"{r['fault']:15s} {'yes' if r['injected'] else 'NO':>4s} {rc:>5s} "
              f"{r['steps']:>3d}/{steps:<3d} {lost:>5s} {str(r['migrations']):>5s} "
              f"{r['nonfinite_skipped']:>4d} {r['wall_s']:6.0f}  {fin:9s} "
              f"{fmt_counts(r['failed'])} | {fmt_counts(r['dropped'])}")
    print()
    for r in rows:
        bits = list(r["notes"])
        if r.get("dup_groups") is not None:
            bits.append(f"groups trained twice across the resume: {r['dup_groups']}")
        if r["lost"] is None:
            bits.append(f"lost n/a: {r['lost_why']}")
        if r["why"]:
            bits.append(r["why"])
        if r["error"]:
            bits.append(f"error: {r['error']}")
        if r["ended"]:
            bits.append(f"ended: {r['ended']}")
        if not r["injected"]:
            bits.append("FAULT NOT INJECTED (the run ended before its trigger)")
        print(f"{r['fault']:15s} expected {r['expected']}; " + "; ".join(bits))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        return child_main(argv)
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="extra key=value overrides go to every job (after the chaos defaults)")
    p.add_argument("--steps", type=int, default=40, help="steps per run (default 40)")
    p.add_argument("--only", default="", help=f"comma list of faults: {','.join(FAULTS)}")
    p.add_argument("--ranks", type=int, default=3, choices=(2, 3, 4),
                   help="rollout ranks (8 fake devices in all; default 3)")
    p.add_argument("--num-pages", type=int, default=24, help="KV pages per rank (default 24)")
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--groups-per-step", type=int, default=4)
    p.add_argument("--action-tokens", type=int, default=3,
                   help="rollout.max_action_tokens (default 3; >1 so decode runs)")
    p.add_argument("--fault-rank", type=int, default=1, help="rank the engine faults hit")
    p.add_argument("--nan-step", type=int, default=3, help="step whose gradient gets NaN")
    p.add_argument("--outage-s", type=float, default=5.0, help="env kill / 503 window")
    p.add_argument("--timeout", type=float, default=600, help="seconds per job process")
    p.add_argument("--stall", type=float, default=120,
                   help="seconds without a new step that count as a hang (+60 s before step 1)")
    p.add_argument("--workdir", default="", help="keep run folders and logs here "
                   "(default: a new temp folder, kept; printed)")
    p.add_argument("--clean", action="store_true", help="delete the work folder at the end")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    a = p.parse_args(argv)
    faults = [f.strip() for f in a.only.split(",") if f.strip()] or list(FAULTS)
    for f in faults:
        if f not in FAULTS:
            p.error(f"unknown fault {f!r}; choose from {', '.join(FAULTS)}")
    if not 0 <= a.fault_rank < a.ranks:
        p.error(f"--fault-rank {a.fault_rank} is not a rank of {a.ranks}")
    work = Path(a.workdir or tempfile.mkdtemp(prefix="tiderl-chaos-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"chaos: {len(faults)} runs of {a.steps} steps, {a.ranks} rollout ranks, "
          f"num_pages={a.num_pages}, group {a.group_size} x {a.groups_per_step}/step; "
          f"logs and run folders in {work}", flush=True)
    rows = []
    for f in faults:
        for old in (work / f, work / f"{f}.log", work / f"{f}.env.log", work / f"{f}.inject.jsonl"):
            if old.is_dir():
                shutil.rmtree(old)
            elif old.exists():
                old.unlink()
        r = run_fault(f, a, work)
        rows.append(r)
        lost = "n/a" if r["lost"] is None else r["lost"]
        print(f"[{f}] {'finished' if r['finished'] else 'NOT finished'}: rc={r['rc']} "
              f"steps={r['steps']}/{a.steps} lost={lost} failed={sum(r['failed'].values())} "
              f"dropped={sum(r['dropped'].values())} wall={r['wall_s']:.0f}s"
              + (f" — {r['why']}" if r["why"] else "")
              + (f" — {r['error']}" if r["error"] else ""), flush=True)
    print_table(rows, a.steps)
    known = [r["lost"] for r in rows if r["lost"] is not None]
    out = {"chaos": {
        "lost_tasks": sum(known) if known else None,
        "lost_unknown_runs": len(rows) - len(known),
        "crashed_runs": sum(r["crashed"] for r in rows),
        "steps": a.steps, "ranks": a.ranks, "workdir": str(work),
        "faults": {r["fault"]: {
            "finished": r["finished"], "steps": r["steps"], "lost": r["lost"],
            "failed": sum(r["failed"].values()), "dropped": sum(r["dropped"].values()),
            "dropped_failed": r["dropped"].get("failed_tasks", 0),
            "injected": r["injected"], "rc": r["rc"], "skipped": r["nonfinite_skipped"],
            "migrations": r["migrations"], "error": r["error"] or r["why"],
            **({"dup_groups": r["dup_groups"]} if "dup_groups" in r else {}),
        } for r in rows},
    }}
    if a.clean:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
