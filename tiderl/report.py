"""`python -m tiderl.report RUN_DIR`: PNG plots of a run from its metrics.jsonl. No JAX.

Writes RUN_DIR/plots/{reward.png, waits.png, goodput.png} and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from tiderl.control.metrics import read_metrics, summarize


def write_plots(run_dir: str | Path) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run_dir)
    steps = [r for r in records if r.get("kind") == "step"]
    evals = [r for r in records if r.get("kind") == "eval"]
    out = Path(run_dir) / "plots"
    out.mkdir(parents=True, exist_ok=True)
    paths = []

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["step"] for r in steps], [r["reward_mean"] for r in steps], label="train reward")
    if evals:
        ax.plot([e["step"] for e in evals], [e["eval_success"] for e in evals], "o-",
                label="held-out success")
    ax.set_ylim(-0.02, 1.02)
    paths.append(_save(fig, ax, out / "reward.png", "step", "reward / success",
                       "Reward and evaluation"))

    fig, ax = plt.subplots(figsize=(7, 4))
    xs = [r["step"] for r in steps]
    ax.bar(xs, [r["rwt_s"] for r in steps], label="RWT (rollout idle)", alpha=0.7)
    ax.bar(xs, [r["twt_s"] for r in steps], bottom=[r["rwt_s"] for r in steps],
           label="TWT (trainer idle)", alpha=0.7)
    ax.plot(xs, [r["step_time_s"] for r in steps], "k.-", label="step time")
    paths.append(_save(fig, ax, out / "waits.png", "step", "seconds", "Wait times per step"))

    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot([r["wall_s"] for r in steps], [r["goodput"] for r in steps], label="goodput")
    ax.plot([r["wall_s"] for r in steps], [r["gen_throughput"] for r in steps],
            label="generation throughput")
    paths.append(_save(fig, ax, out / "goodput.png", "wall time (s)", "tokens / s",
                       "Goodput (tokens consumed by updates per second)"))
    return paths


def _save(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Labels, grid, legend and title of a one-axes figure; writes and closes it."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiderl.report",
                                description="Plot a tiderl run folder's metrics.jsonl as PNGs.")
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    try:
        paths = write_plots(args.run_dir)
    except FileNotFoundError as e:
        print(f"tiderl.report: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summarize(read_metrics(args.run_dir)), indent=2))
    for path in paths:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
