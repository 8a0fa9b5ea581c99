"""`python -m tiderl.report RUN_DIR`: PNG plots of a run from its metrics.jsonl. No JAX.

Writes RUN_DIR/plots/{reward.png, waits.png, goodput.png, roles.png} and prints the summary
(roles.png: the ERS role timeline, for runs that log cells per role).
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
    if roles := write_roles_plot(records, out / "roles.png"):
        paths.append(roles)
    return paths


def write_roles_plot(records: list[dict], path: Path) -> Path | None:
    """The role timeline: cells per role after each step's boundary (stacked), with every
    role change marked by its rule (cold_start, consumption, generation, eval, ...)."""
    import matplotlib.pyplot as plt

    steps = [r for r in records if r.get("kind") == "step" and "rollout_cells" in r]
    if not steps:
        return None
    changes = [r for r in records if r.get("kind") == "role_change"]
    xs = [r["step"] for r in steps]
    ys = [[r.get(f"{role}_cells", 0) for r in steps] for role in ("rollout", "trainer", "ref")]
    first = next((c for c in changes if c["step"] == 0), None)
    if first is not None:  # the configured layout, then the cold-start plan before step 1
        xs = [-1, 0, *xs]
        for y, role in zip(ys, ("rollout", "trainer", "ref"), strict=True):
            y[:0] = [len(first.get("before", first["cells"]).get(role, [])),
                     len(first["cells"].get(role, []))]
    xs.append(xs[-1] + 1)  # the last boundary's roles hold for the next step
    for y in ys:
        y.append(y[-1])
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.stackplot(xs, *ys, labels=["rollout", "trainer", "Ref"], step="post", alpha=0.8)
    for c in changes:
        ax.axvline(c["step"], color="k", lw=0.6, alpha=0.5)
        ax.text(c["step"], sum(y[0] for y in ys) * 1.01, c.get("rule", ""), rotation=90,
                fontsize=7, va="bottom", ha="right")
    ax.set_ylim(0, sum(y[0] for y in ys) * 1.35)
    return _save(fig, ax, path, "step (roles after its boundary)", "cells",
                 f"Roles over the run ({len(changes)} changes)")


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
