"""Step-level credit on the default task: held-out success of GRPO vs GiGPO after N updates.

    python benchmarks/credit.py [--steps 200] [--seeds 0 1 2] [--eval-every 50] [--out DIR]
                                [--advantages grpo gigpo] [--reuse] [key=value ...]

Runs `python -m tiderl.launch seed=S trainer.advantage=A controller.steps=N ...` one run at a
time (the embedded default otherwise: the guess-a-number task and its 90k-parameter policy),
GRPO and GiGPO alternating per seed, and reads each run's evaluations (greedy, the 64 held-out
groups) from its metrics.jsonl. Printed per run: the success curve (update, success) and wall
time; for GiGPO the share of turns that fell in a recurring anchor (and of those after the
first turn, which always recurs). Extra `key=value` arguments go to every run (e.g.
trainer.gigpo_anchor=observation). With --reuse, a run folder under --out that already holds a
run that completed its updates with the same seed and advantage is read, not run again (e.g.
after one run of several hit controller.time_limit_s). The last line is one JSON object with
the headline figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def completed(run_dir: Path, adv: str, seed: int, steps: int) -> bool:
    """A finished run of these settings is in `run_dir` (for --reuse)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
        config = (run_dir / "config.yaml").read_text()
    except (OSError, ValueError):
        return False
    return (summary.get("ended") == f"completed {steps} of {steps} steps"
            and f"advantage: {adv}\n" in config and f"\nseed: {seed}\n" in "\n" + config)


def run(adv: str, seed: int, steps: int, eval_every: int, out: Path, extra: list[str],
        reuse: bool = False) -> dict:
    run_dir = out / f"{adv}_s{seed}"
    if reuse and completed(run_dir, adv, seed, steps):
        return read(run_dir, adv, seed, None, reused=True)
    cmd = [sys.executable, "-m", "tiderl.launch", f"seed={seed}", f"trainer.advantage={adv}",
           f"controller.steps={steps}", f"controller.eval_every={eval_every}",
           "controller.checkpoint_every=0", "controller.console=false", f"run_dir={run_dir}",
           *extra]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({r.returncode}):\n{r.stderr[-2000:]}")
    return read(run_dir, adv, seed, wall)


def read(run_dir: Path, adv: str, seed: int, wall: float | None, reused: bool = False
         ) -> dict:
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    evals = [(e["step"], e["eval_success"]) for e in recs if e.get("kind") == "eval"]
    steps_done = [s for s in recs if s.get("kind") == "step"]
    credit = steps_done[-1].get("step_credit", {}) if steps_done else {}
    summary = json.loads((run_dir / "summary.json").read_text())
    res = {"advantage": adv, "seed": seed, "updates": len(steps_done),
           "wall_s": None if wall is None else round(wall, 1),
           "run_wall_s": round(summary["wall_s"], 1), "reused": reused, "curve": evals,
           "final": evals[-1][1] if evals else float("nan")}
    if credit:
        n = max(1, credit["turns"])
        res["anchored_turn_share"] = round(credit["anchored_turns"] / n, 3)
        if "anchored_later_turns" in credit:  # turns after the first (which always recur)
            res["later_anchored_turn_share"] = round(credit["anchored_later_turns"] / n, 3)
    print(json.dumps(res), flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--advantages", nargs="+", default=["grpo", "gigpo"],
                    choices=["grpo", "gigpo"])
    ap.add_argument("--reuse", action="store_true",
                    help="read completed runs already under --out instead of running them")
    ap.add_argument("--out", type=Path, default=None, help="run folders (default: a temp dir)")
    ap.add_argument("extra", nargs="*", help="more key=value overrides for every run")
    a = ap.parse_args()
    out = a.out or Path(tempfile.mkdtemp(prefix="tiderl-credit-"))
    res: dict[str, list[dict]] = {adv: [] for adv in a.advantages}
    for s in a.seeds:
        for adv in a.advantages:
            res[adv].append(run(adv, s, a.steps, a.eval_every, out, a.extra, a.reuse))
    head = {"updates": a.steps, "seeds": a.seeds}
    for adv, rs in res.items():
        finals = [r["final"] for r in rs]
        head[f"{adv}_heldout_success"] = finals
        head[f"{adv}_mean"] = round(statistics.fmean(finals), 3)
        head[f"{adv}_updates"] = [r["updates"] for r in rs]
        head[f"{adv}_run_wall_s"] = [r["run_wall_s"] for r in rs]
        head[f"{adv}_curves"] = [r["curve"] for r in rs]
    if "gigpo" in res:
        for k in ("anchored_turn_share", "later_anchored_turn_share"):
            head[f"gigpo_{k}"] = [r.get(k) for r in res["gigpo"]]
    head["overrides"] = a.extra
    print(json.dumps(head))


if __name__ == "__main__":
    main()
