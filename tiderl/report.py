"""`python -m tiderl.report RUN_DIR`: PNG plots and a one-page `report.md` of a run from its
metrics.jsonl. No JAX.

Writes RUN_DIR/plots/{reward, waits, goodput, loss, entropy, lengths, optim, timeline,
roles}.png (each curve only when the records carry it: older runs get fewer plots; roles.png is
the ERS role timeline, for runs that log cells per role), RUN_DIR/report.md (the summary table
and the plots) and prints the summary.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

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
    paths += _training_plots(plt, steps, out)
    if path := _timeline(plt, steps, out):
        paths.append(path)
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


def _series(steps: Sequence[dict], key: str) -> tuple[list[float], list[float]]:
    """(steps, values) where the record has a finite `key` (older runs lack the new curves)."""
    pts = [(r["step"], r[key]) for r in steps
           if isinstance(r.get(key), (int, float)) and math.isfinite(r[key])]
    return [p[0] for p in pts], [p[1] for p in pts]


def _lines(ax, steps: Sequence[dict], keys: Sequence[tuple[str, str]], style: str = "-") -> bool:
    drawn = False
    for key, label in keys:
        xs, ys = _series(steps, key)
        if xs:
            ax.plot(xs, ys, style, label=label)
            drawn = True
    return drawn


def _training_plots(plt, steps: Sequence[dict], out: Path) -> list[Path]:
    """loss.png, entropy.png, lengths.png, optim.png: the trainer's and the rollout's curves."""
    paths = []
    if _series(steps, "pg_loss")[0]:
        fig, ax = plt.subplots(figsize=(7, 4))
        _lines(ax, steps, [("pg_loss", "policy loss (clipped surrogate)"),
                           ("loss", "total loss (with KL and entropy terms)")])
        xs, kl = _series(steps, "kl")
        if any(kl):  # KL on (trainer.kl_coef > 0): its own axis, it is orders smaller
            ax2 = ax.twinx()
            ax2.plot(xs, kl, "C3--", label="KL to the reference")
            ax2.set_ylabel("KL (per action token)")
            ax2.legend(loc="lower right")
        paths.append(_save(fig, ax, out / "loss.png", "step", "loss per action token",
                           "Policy loss and KL"))
    if _series(steps, "entropy")[0]:
        fig, ax = plt.subplots(figsize=(7, 4))
        _lines(ax, steps, [("entropy", "entropy of the policy at action tokens")])
        paths.append(_save(fig, ax, out / "entropy.png", "step", "nats",
                           "Policy entropy (mean over action tokens)"))
    if _series(steps, "response_len_mean")[0]:
        fig, axes = plt.subplots(1, 3, figsize=(14, 4))
        panels = [([("response_len_mean", "mean"), ("response_len_max", "max")],
                   "action tokens per trajectory", "Response length (all turns)"),
                  ([("traj_len_mean", "mean"), ("traj_len_max", "max")],
                   "tokens per trajectory", "Trajectory length (prompt, observations, actions)"),
                  ([("turns_mean", "mean"), ("turns_max", "max")], "actions per episode",
                   "Turns per episode")]
        for ax, (keys, ylabel, title) in zip(axes, panels, strict=True):
            _lines(ax, steps, keys, ".-")
            _finish(ax, "step", ylabel, title)
        paths.append(_write(fig, out / "lengths.png"))
    if _series(steps, "grad_norm")[0]:
        fig, axes = plt.subplots(2, 2, figsize=(11, 7))
        panels = [([("grad_norm", "gradient norm (before clipping)")], "norm", "Gradient norm"),
                  ([("clip_frac", "clip fraction")], "fraction of action tokens",
                   "Clip fraction (ratio clipped against the advantage's sign)"),
                  ([("lr", "learning rate")], "lr", "Learning rate"),
                  ([("staleness_mean", "mean"), ("staleness_max", "max")], "versions behind",
                   "Staleness of the trained groups")]
        for ax, (keys, ylabel, title) in zip(axes.flat, panels, strict=True):
            _lines(ax, steps, keys)
            ax.ticklabel_format(axis="y", useOffset=False)  # a slow lr decay reads as values
            _finish(ax, "step", ylabel, title)
        paths.append(_write(fig, out / "optim.png"))
    return paths


def _timeline(plt, steps: Sequence[dict], out: Path) -> Path | None:
    """timeline.png over wall time: when the trainer trained (and sync mode's rollouts), RWT
    and TWT accumulating, and the rollout/trainer role counts when the records carry them."""
    if not steps or "t_train_start" not in steps[0]:
        return None
    roles = any("rollout_ranks" in r for r in steps)
    fig, axes = plt.subplots(3 if roles else 2, 1, figsize=(10, 8 if roles else 6),
                             sharex=True)
    ax = axes[0]
    spans = [(r["t_train_start"], r["t_train_end"] - r["t_train_start"]) for r in steps]
    ax.broken_barh(spans, (1.6, 0.8), color="C1", alpha=0.3,
                   label="a step: waiting for its groups, then training")
    # The trainer's own work (its phase times), drawn at the end of each step's span.
    busy = [(r["t_train_end"] - b, b) for r in steps
            if (b := sum(r.get(f"time_{k}", 0.0) or 0.0
                         for k in ("ref", "actor_fwd", "actor_bwd", "swap", "apply"))) > 0]
    if busy:
        ax.broken_barh(busy, (1.6, 0.8), color="C1", label="trainer busy (Ref, Actor, apply)")
    if "t_rollout_start" in steps[0]:
        ax.broken_barh([(r["t_rollout_start"], r["t_rollout_end"] - r["t_rollout_start"])
                        for r in steps if "t_rollout_start" in r], (0.6, 0.8), color="C0",
                       label="rollout (sync mode)")
    else:  # rollout runs throughout, idle only for RWT (its total per step, drawn at its end)
        ax.broken_barh([(0.0, steps[-1]["t_train_end"])], (0.6, 0.8), color="C0", alpha=0.3,
                       label="rollout running")
        idle = [(r["t_train_end"] - r["rwt_s"], r["rwt_s"]) for r in steps if r.get("rwt_s")]
        if idle:
            ax.broken_barh(idle, (0.6, 0.8), color="0.4", label="rollout idle (RWT)")
    ax.set_yticks([1, 2], ["rollout", "trainer"])
    ax.set_ylim(0.4, 3.5)  # room above the bars for the legend
    ax.set_title("Timeline")
    ax.legend(loc="upper center", ncols=2, fontsize="small")
    ax.grid(alpha=0.3)
    ax = axes[1]
    t = [r["wall_s"] for r in steps]
    for key, label in (("rwt_s", "RWT (rollout idle, staleness bound)"),
                       ("twt_s", "TWT (trainer idle, waiting for data)")):
        acc, total = [], 0.0
        for r in steps:
            total += r.get(key) or 0.0
            acc.append(total)
        ax.plot(t, acc, ".-", label=label)
    _finish(ax, "" if roles else "wall time (s)", "cumulative seconds", "RWT and TWT")
    if roles:
        ax = axes[2]
        top = 1
        for key, label, style in (("rollout_ranks", "rollout ranks", "o-"),
                                  ("trainer_ranks", "trainer ranks", "s--")):
            pts = [(r["wall_s"], r[key]) for r in steps if key in r]
            ax.step([p[0] for p in pts], [p[1] for p in pts], style, where="post", label=label,
                    markersize=3)
            top = max([top, *(p[1] for p in pts)])
        ax.set_ylim(0, top + 1)
        ax.yaxis.get_major_locator().set_params(integer=True)
        _finish(ax, "wall time (s)", "count", "Roles (rollout ranks vs trainer devices)")
    return _write(fig, out / "timeline.png")


def _finish(ax, xlabel: str, ylabel: str, title: str) -> None:
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    ax.set_title(title)


def _write(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _save(fig, ax, path: Path, xlabel: str, ylabel: str, title: str) -> Path:
    """Labels, grid, legend and title of a one-axes figure; writes and closes it."""
    _finish(ax, xlabel, ylabel, title)
    return _write(fig, path)


# What report.md's table shows: (label, summary key or step-record key, format).
ROWS = [("steps", "steps", "d"), ("ended", "ended", "s"), ("wall time (s)", "wall_s", ".1f"),
        ("goodput (consumed action tok/s)", "goodput", ".1f"),
        ("generation throughput (tok/s)", "gen_throughput", ".1f"),
        ("KV hit rate", "kv_hit_rate", ".3f"), ("RWT total (s)", "rwt_s", ".1f"),
        ("TWT total (s)", "twt_s", ".1f"), ("train reward first", "reward_first", ".3f"),
        ("train reward last", "reward_last", ".3f"),
        ("eval success first", "eval_success_first", ".3f"),
        ("eval success last", "eval_success_last", ".3f"),
        ("eval success best", "eval_success_best", ".3f"),
        ("dropped groups", "dropped", "s"), ("failed tasks", "failed_tasks", "s"),
        ("non-finite updates skipped", "nonfinite_skipped", "d")]
LAST = [("policy loss", "pg_loss", ".4f"), ("KL", "kl", ".4g"), ("entropy", "entropy", ".3f"),
        ("gradient norm", "grad_norm", ".3f"), ("clip fraction", "clip_frac", ".3f"),
        ("learning rate", "lr", ".3g"), ("response tokens (mean)", "response_len_mean", ".1f"),
        ("trajectory tokens (mean)", "traj_len_mean", ".1f"),
        ("turns per episode (mean)", "turns_mean", ".2f"),
        ("staleness (mean)", "staleness_mean", ".2f")]
PLOTS = ["reward", "loss", "entropy", "lengths", "optim", "waits", "goodput", "timeline",
         "roles"]


def write_report(run_dir: str | Path, plots: Sequence[Path] = ()) -> Path:
    """RUN_DIR/report.md: the summary table, the last step's curves and every plot."""
    run_dir = Path(run_dir)
    records = read_metrics(run_dir)
    s = summarize(records)
    if (path := run_dir / "summary.json").is_file():
        s["ended"] = json.loads(path.read_text()).get("ended", "")
    steps = [r for r in records if r.get("kind") == "step"]
    last = steps[-1] if steps else {}
    lines = [f"# tiderl run `{run_dir}`", ""]
    if (cfg := run_dir / "config.yaml").is_file():
        import yaml

        mode = (yaml.safe_load(cfg.read_text()) or {}).get("controller", {}).get("mode", "?")
        lines += [f"Mode `{mode}`; config in `config.yaml`, every record in `metrics.jsonl`.",
                  ""]
    lines += ["| metric | value |", "| --- | --- |"]
    lines += [f"| {label} | {_cell(s.get(key), fmt)} |" for label, key, fmt in ROWS
              if key in s]
    lines += [f"| {label} (last step) | {_cell(last.get(key), fmt)} |" for label, key, fmt
              in LAST if key in last]
    lines.append("")
    names = {p.stem for p in plots} | {p.stem for p in (run_dir / "plots").glob("*.png")}
    for name in [n for n in PLOTS if n in names] + sorted(names - set(PLOTS)):
        lines += [f"![{name}](plots/{name}.png)", ""]
    samples = sorted((run_dir / "samples").glob("step_*.jsonl"),
                     key=lambda p: int(p.stem.split("_")[1]))
    if samples:
        lines += [f"Decoded evaluation trajectories: `samples/` ({len(samples)} evaluations, "
                  f"newest `{samples[-1].relative_to(run_dir)}`).", ""]
    out = run_dir / "report.md"
    out.write_text("\n".join(lines))
    return out


def _cell(v: Any, fmt: str) -> str:
    if v is None:
        return "–"
    if isinstance(v, dict):
        return ", ".join(f"{k} {x}" for k, x in v.items()) or "none"
    if fmt == "s" or not isinstance(v, (int, float)):
        return str(v).replace("|", "/")
    if isinstance(v, float) and not math.isfinite(v):
        return "–"
    return format(v, fmt)


def main(argv: list[str] | None = None) -> int:
    from tiderl.control.logs import setup_logging

    p = argparse.ArgumentParser(prog="python -m tiderl.report",
                                description="Plot a tiderl run folder's metrics.jsonl as PNGs "
                                            "and write its one-page report.md.")
    p.add_argument("run_dir")
    args = p.parse_args(argv)
    setup_logging()
    try:
        paths = write_plots(args.run_dir)
        report = write_report(args.run_dir, paths)
    except FileNotFoundError as e:
        print(f"tiderl.report: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(summarize(read_metrics(args.run_dir)), indent=2))
    for path in [*paths, report]:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
