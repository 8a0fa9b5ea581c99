"""Soak: the default job for N minutes, watching its memory (RSS) and KV pool occupancy.

Runs the embedded default job (`tiderl.launch` with no preset) in a child process with
`controller.steps` set very high and `controller.time_limit_s = N*60` (so it trains for N
minutes, then runs its final evaluation and exits), `run_dir` in a temp folder, plus any
`key=value` overrides given here. Every `--interval` seconds it samples the job process's
VmRSS from /proc/PID/status (and the RSS of its descendants, if any) and the step count from
`metrics.jsonl`.

Definitions (t = seconds since the job process started):
  warm-up RSS  the median RSS over [t_w, t_w + 60 s], t_w = max(N/6 minutes, the time step 20
               was first logged)
  end RSS      the median RSS over the last minute of training: [t_end - 60 s, t_end], t_end =
               when the last step record appeared (before the final evaluation and plots)
  rss_growth_frac = end / warm - 1
On runs too short for disjoint windows the windows are clipped to [t_w, t_end] and flagged.

KV pool occupancy: read from `metrics.jsonl` if step records carry `pages_in_use` (per rank or
not). If they do not, a probe thread in the job process (the child is
`python benchmarks/soak.py --child -- LAUNCH_ARGS`, which wraps `RolloutRank.__init__` to find
the ranks and then calls `tiderl.launch.main`) samples each rank's `engine.pages.pages_in_use`
and its live/paused task counts into `kv_pool.jsonl`; `--no-probe` runs `python -m
tiderl.launch` itself and reports only what the metrics hold.

    python benchmarks/soak.py --minutes 30 [--interval 3] [key=value ...]

The last stdout line is one JSON object:
{"soak": {"minutes": N, "rss_growth_frac": x, "rss_warm_mb": ..., "rss_end_mb": ..., "steps": n,
 ...}}
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# -- child: the job itself, plus the KV probe ---------------------------------------------------

def child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="soak.py --child")
    p.add_argument("--child", action="store_true", required=True)
    p.add_argument("--probe-out", default="")
    p.add_argument("--interval", type=float, default=3.0)
    p.add_argument("launch", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    launch = a.launch[1:] if a.launch[:1] == ["--"] else a.launch
    if a.probe_out:
        install_kv_probe(Path(a.probe_out), a.interval)
    from tiderl.launch import main

    return main(launch)


def install_kv_probe(out: Path, interval: float) -> None:
    from tiderl.serving.rank import RolloutRank

    ranks: list = []
    init = RolloutRank.__init__

    def wrapped(self, *a, **kw):
        init(self, *a, **kw)
        ranks.append(self)

    RolloutRank.__init__ = wrapped

    def loop() -> None:
        while True:
            time.sleep(interval)
            rec = {"wall": time.time(), "ranks": []}
            for r in list(ranks):
                eng, pages = r.engine, getattr(r.engine, "pages", None)
                if pages is None:
                    continue
                try:  # plain reads of another thread's state: a torn value is fine here
                    tasks = list(r.tasks.values())
                    rec["ranks"].append({
                        "rank": r.rank_id, "pages_in_use": int(pages.pages_in_use),
                        "num_pages": int(eng.cfg.num_pages), "tasks": len(tasks),
                        "paused": sum(bool(t.paused) for t in tasks),
                        "failed": r.failed is not None})
                except (RuntimeError, AttributeError):
                    continue
            if rec["ranks"]:
                with out.open("a") as f:
                    f.write(json.dumps(rec) + "\n")

    threading.Thread(target=loop, name="soak-kv-probe", daemon=True).start()


# -- parent -------------------------------------------------------------------------------------

def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    return 0  # a zombie has no VmRSS line


def descendants(pid: int) -> list[int]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        with contextlib.suppress(OSError, IndexError, ValueError):
            stat = Path(f"/proc/{d}/stat").read_text()
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            kids.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        for c in kids.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class MetricsTail:
    """Reads new complete lines of metrics.jsonl as they appear."""

    def __init__(self, path: Path):
        self.path, self.offset, self.steps, self.ino = path, 0, [], None

    def poll(self) -> None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return
        if st.st_ino != self.ino or st.st_size < self.offset:  # a new file: start over
            self.ino, self.offset, self.steps = st.st_ino, 0, []
        with self.path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        self.offset += end
        for line in data[:end].splitlines():
            with contextlib.suppress(json.JSONDecodeError):
                r = json.loads(line)
                if r.get("kind") == "step":
                    self.steps.append(r)


def median_in(samples: list[tuple[float, float]], lo: float, hi: float) -> float | None:
    xs = [v for t, v in samples if lo <= t <= hi]
    return statistics.median(xs) if xs else None


def find_pages(rec: dict) -> list[tuple[str, float]]:
    """(key path, value) of every numeric field whose name mentions pages in a step record."""
    out = []

    def walk(x, path):
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")
        elif isinstance(x, (int, float)) and not isinstance(x, bool) and "pages" in path:
            out.append((path, float(x)))

    walk(rec, "")
    return out


def read_num_pages(run: Path) -> int | None:
    try:
        import yaml

        return int(yaml.safe_load((run / "config.yaml").read_text())["rollout"]["num_pages"])
    except Exception:  # noqa: BLE001 - only a label for the figures
        return None


def occupancy_row(label: str, xs: list[tuple[float, float]], num_pages: int | None,
                  windows) -> dict:
    """Prints and returns median (warm window, end window), mean and max of a page series."""
    vals = [v for _, v in xs]
    (wlo, whi), (elo, ehi) = windows
    w, e = median_in(xs, wlo, whi), median_in(xs, elo, ehi)
    frac = (lambda v: None if v is None or not num_pages else v / num_pages)  # noqa: E731
    f = lambda v: "n/a" if v is None else (f"{v:.0f}" + (f" ({v / num_pages:.1%})"  # noqa: E731
                                                          if num_pages else ""))
    print(f"    {label}: median warm {f(w)} → end {f(e)}; mean {f(statistics.fmean(vals))}, "
          f"max {f(max(vals))}")
    return {"warm": w, "end": e, "mean": statistics.fmean(vals), "max": max(vals),
            "frac_warm": frac(w), "frac_end": frac(e), "frac_max": frac(max(vals))}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--child" in argv:
        return child_main(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="extra key=value overrides go to the job")
    p.add_argument("--minutes", type=float, default=30.0, help="training time (default 30)")
    p.add_argument("--interval", type=float, default=3.0, help="seconds between samples")
    p.add_argument("--warm-step", type=int, default=20,
                   help="warm-up ends no earlier than this step (default 20)")
    p.add_argument("--no-probe", action="store_true",
                   help="run python -m tiderl.launch directly (no KV probe thread in the job)")
    p.add_argument("--workdir", default="", help="run folder parent (default: a temp folder)")
    p.add_argument("--keep", action="store_true", help="keep the temp run folder")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    a = p.parse_args(argv)
    work = Path(a.workdir or tempfile.mkdtemp(prefix="tiderl-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run = work / f"run-{stamp}"  # a fresh folder: never read a previous run's metrics
    log_path = work / f"job-{stamp}.log"
    probe = work / f"kv_pool-{stamp}.jsonl"
    launch = [f"controller.steps={10**7}", f"controller.time_limit_s={a.minutes * 60:g}",
              f"run_dir={run}", "controller.console=false", *a.overrides]
    if a.no_probe:
        cmd = [sys.executable, "-m", "tiderl.launch", *launch]
    else:
        cmd = [sys.executable, str(Path(__file__).resolve()), "--child", "--probe-out",
               str(probe), "--interval", str(a.interval), "--", *launch]
    print(f"soak: {a.minutes:g} min of the default job; run folder {run}; log {log_path}",
          flush=True)
    log = open(log_path, "w")
    log.write("$ " + " ".join(cmd) + "\n")
    log.flush()
    t0, wall0 = time.monotonic(), time.time()
    job = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                           start_new_session=True,
                           env={**os.environ, "PYTHONWARNINGS": "ignore"})
    tail = MetricsTail(run / "metrics.jsonl")
    samples: list[dict] = []  # t, rss_mb, tree_mb, steps
    deadline = a.minutes * 60 + 900  # startup, the final evaluation, plots
    next_print = 60.0
    try:
        while job.poll() is None:
            t = time.monotonic() - t0
            if t > deadline:
                print(f"soak: the job is still running {deadline:.0f}s in; killing it",
                      flush=True)
                break
            tail.poll()
            kb = rss_kb(job.pid)
            if kb is not None:
                tree = kb + sum(rss_kb(c) or 0 for c in descendants(job.pid))
                samples.append({"t": t, "rss_mb": kb / 1024, "tree_mb": tree / 1024,
                                "steps": len(tail.steps)})
            if t >= next_print:
                next_print += 60
                print(f"  t={t:6.0f}s steps={len(tail.steps):6d} "
                      f"rss={samples[-1]['rss_mb'] if samples else float('nan'):8.1f} MB",
                      flush=True)
            time.sleep(a.interval)
    finally:
        if job.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(job.pid, signal.SIGKILL)
        rc = job.wait()
        log.close()
    tail.poll()
    t_exit = time.monotonic() - t0
    steps = tail.steps
    n_steps = steps[-1]["step"] if steps else 0
    if not samples:
        print("soak: no RSS samples (the job ended at once); see", log_path)
        print(json.dumps({"soak": {"minutes": a.minutes, "rss_growth_frac": None,
                                   "rss_warm_mb": None, "rss_end_mb": None, "steps": n_steps,
                                   "exit": rc}}))
        return 1
    # Step times: when each step record first appeared to us.
    t_step = lambda k: next((s["t"] for s in samples if s["steps"] >= k), None)  # noqa: E731
    t_end = t_step(len(steps)) if steps else samples[-1]["t"]
    t20 = t_step(a.warm_step) if len(steps) >= a.warm_step else None
    t_w = max(a.minutes * 60 / 6, t20 if t20 is not None else 0.0)
    flags = []
    if t20 is None:
        flags.append(f"step {a.warm_step} was never reached")
    rss = [(s["t"], s["rss_mb"]) for s in samples]
    w_lo, w_hi = t_w, t_w + 60
    e_lo, e_hi = t_end - 60, t_end
    if w_hi > e_lo:
        flags.append("run too short: warm-up and end windows overlap or are clipped")
        w_hi = min(w_hi, t_end)
        e_lo = max(e_lo, w_lo)
    warm = median_in(rss, w_lo, w_hi)
    end = median_in(rss, e_lo, e_hi)
    growth = (end / warm - 1) if warm and end else None
    peak = max(v for _, v in rss)
    last = rss[-1][1]

    print(f"\njob exit {rc} after {t_exit:.0f}s; {n_steps} steps; training ended at "
          f"t={t_end:.0f}s")
    if rc != 0:
        text = log_path.read_text(errors="replace").splitlines()
        print("  last log lines:\n    " + "\n    ".join(text[-8:]))
    print(f"warm-up window [{w_lo:.0f}, {w_hi:.0f}]s (t_w = max(N/6 min = "
          f"{a.minutes * 10:.0f}s, step {a.warm_step} at "
          f"{'n/a' if t20 is None else f'{t20:.0f}s'})); end window [{e_lo:.0f}, {e_hi:.0f}]s")
    for f in flags:
        print(f"  note: {f}")
    print(f"\n{'':18s}{'RSS MB':>10s}")
    print(f"{'warm-up (median)':18s}{warm if warm is not None else float('nan'):10.1f}")
    print(f"{'end (median)':18s}{end if end is not None else float('nan'):10.1f}")
    print(f"{'growth':18s}{growth * 100 if growth is not None else float('nan'):9.1f}%")
    print(f"{'peak':18s}{peak:10.1f}")
    print(f"{'last sample':18s}{last:10.1f}")
    tree_extra = max(s["tree_mb"] - s["rss_mb"] for s in samples)
    if tree_extra > 0:
        print(f"  (descendant processes added up to {tree_extra:.1f} MB)")

    print(f"\nRSS curve\n{'t (s)':>8s}{'step':>8s}{'RSS MB':>10s}")
    k = 12
    idx = sorted({round(i * (len(samples) - 1) / (k - 1)) for i in range(k)})
    for i in idx:
        s = samples[i]
        print(f"{s['t']:8.0f}{s['steps']:8d}{s['rss_mb']:10.1f}")

    # KV pool occupancy: per rank, pages in use as a fraction of rollout.num_pages.
    num_pages = read_num_pages(run)
    kv: dict = {"num_pages": num_pages, "sources": []}
    print(f"\nKV pool occupancy (pages in use / rollout.num_pages = {num_pages}), per rank:")
    windows = ((w_lo, w_hi), (e_lo, e_hi))
    # (a) the step records: sampled when the step is logged, i.e. right after the weight sync
    # that flushed stale KV, so they read low.
    t_rec = [t_step(k + 1) for k in range(len(steps))]
    series: dict[str, list[tuple[float, float]]] = {}
    for t, rec in zip(t_rec, steps, strict=True):
        for key, v in find_pages(rec):
            if t is not None:
                series.setdefault(key, []).append((t, v))
    if series:
        kv["sources"].append("metrics.jsonl")
        print("  from metrics.jsonl step records (logged right after each weight sync, which "
              "flushes stale KV: a low reading by construction)")
        for key, xs in sorted(series.items()):
            kv[f"metrics:{key}"] = occupancy_row(key, xs, num_pages, windows)
    else:
        print("  metrics.jsonl step records hold no pages_in_use field")
    # (b) the in-job probe: sampled on a clock, whatever the job is doing.
    if probe.is_file():
        recs = [json.loads(x) for x in probe.read_text().splitlines() if x.strip()]
        by_rank: dict[int, list[tuple[float, float]]] = {}
        held: dict[int, list[tuple[float, float]]] = {}
        for r in recs:
            for x in r["ranks"]:
                by_rank.setdefault(x["rank"], []).append((r["wall"] - wall0, x["pages_in_use"]))
                held.setdefault(x["rank"], []).append((r["wall"] - wall0, x["tasks"]))
        if by_rank:
            kv["sources"].append("probe")
            print(f"  from the in-job probe (kv_pool.jsonl, every {a.interval:g}s)")
            for rank, xs in sorted(by_rank.items()):
                row = occupancy_row(f"rank {rank} pages_in_use", xs, num_pages, windows)
                tw, te = (median_in(held[rank], lo, hi) for lo, hi in windows)
                print(f"    tasks held by rank {rank}: median warm {tw} → end {te}")
                kv[f"probe:rank{rank}"] = {**row, "tasks_warm": tw, "tasks_end": te}
    elif a.no_probe:
        print("  (probe off: --no-probe)")
    if steps:
        hit = [r.get("kv_hit_rate") for r in steps if r.get("kv_hit_rate") is not None]
        if hit:
            print(f"  kv_hit_rate (cumulative) at the end: {hit[-1]:.3f}")
    with contextlib.suppress(FileNotFoundError, json.JSONDecodeError):
        roll = json.loads((run / "summary.json").read_text()).get("rollout", {})
        if roll:
            print(f"  summary rollout: forced_evictions {roll.get('forced_evictions')}, "
                  f"decisions {roll.get('decisions')}, tasks_live "
                  f"{roll.get('tasks_live', 'n/a')}")

    out = {"soak": {
        "minutes": a.minutes, "rss_growth_frac": growth, "rss_warm_mb": warm,
        "rss_end_mb": end, "steps": n_steps, "rss_peak_mb": peak, "rss_last_mb": last,
        "exit": rc, "t_warm_s": t_w, "t_train_end_s": t_end,
        "warm_definition": f"median RSS over [t_w, t_w+60s], t_w = max(N/6 min, step "
                           f"{a.warm_step}); end = median over the last 60 s of training",
        "flags": flags, "kv": kv, "run_dir": str(run),
    }}
    if not a.keep and not a.workdir:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
        out["soak"]["run_dir"] = None
    print(json.dumps(out))
    return 0 if rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
