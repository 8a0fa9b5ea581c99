"""Run metrics: one record per step to `metrics.jsonl`, Prometheus gauges, a live console
line, and the end-of-run summary. No JAX.

Definitions: goodput = generated (action) tokens consumed by an actor update per
wall-clock second since the run started; generation throughput = decoded tokens per second;
KV hit rate = prompt tokens served from resident KV ÷ prompt tokens needed; RWT = time rollout
sat idle because of the staleness bound; TWT = time the trainer sat idle waiting for data.

Per step, over the trajectories the update trained on (`trajectory_metrics`): response length
= action (sampled) tokens of a trajectory, over all its turns; trajectory length = all its
tokens (prompt, observations, template and actions); turns = actions taken; staleness =
trainer version − the oldest weight version that sampled a token of the group. The trainer
adds the policy loss and its parts, entropy, gradient norm, clip fraction and learning rate
(`tiderl.train.executor`).
"""

from __future__ import annotations

import collections
import json
import logging
import math
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

GAUGES = ("goodput", "gen_throughput", "kv_hit_rate", "reward_mean", "eval_success", "rwt_s",
          "twt_s", "step_time_s", "version", "staleness_mean", "rollout_ranks", "trainer_ranks",
          # training curves
          "loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac", "lr",
          "response_len_mean", "traj_len_mean", "turns_mean", "staleness_max")
CURVES = ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac", "lr",
          "response_len_mean", "traj_len_mean", "turns_mean", "staleness_mean")
"""The training curves the summary keeps from the last step (`summary["last"]`)."""
LIVE_GAUGES = ("episodes_live", "episodes_done", "episodes_failed", "groups_ready",
               "groups_in_flight", "dropped_in_a_row", "kv_pages_in_use")
"""Refreshed every second from the rollout while a step fills (`MetricsSink.progress`)."""

log = logging.getLogger(__name__)


class MetricsSink:
    """Appends step records to JSONL, mirrors them to Prometheus, TensorBoard / W&B
    (`loggers`) and the console.

    Console: on a terminal a live two-line display (the last step's numbers, then what the
    rollout is doing now), redrawn every second; otherwise one logged line per step and a
    rollout line every `progress_every_s`. Memory stays bounded however long the run: the
    summary is folded in as records arrive and only the most recent `keep_records` are held
    (the file has them all)."""

    def __init__(self, run_dir: str | Path, *, console: bool = True, prometheus_port: int = -1,
                 total_steps: int = 0, keep_records: int = 1000,
                 loggers: Sequence[str] = ("jsonl",), progress_every_s: float = 10.0,
                 wandb_project: str = "tiderl", wandb_mode: str = "offline",
                 run_config: Mapping[str, Any] | None = None,
                 prometheus_host: str = "127.0.0.1", prometheus_token: str = ""):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep_records)
        self.summary = Summary()
        self.registry = CollectorRegistry()
        self.gauges = {k: Gauge(f"tiderl_{k}", k, registry=self.registry)
                       for k in GAUGES + LIVE_GAUGES}
        self.port = None
        self._server = None
        if prometheus_port >= 0:
            from tiderl.control.promserve import MetricsServer

            self._server = MetricsServer(self.registry, prometheus_host, prometheus_port,
                                         prometheus_token, run_dir=run_dir)
            self.port = self._server.port
        self.sinks = None
        if any(x != "jsonl" for x in loggers):
            from tiderl.control.sinks import SinkThread

            self.sinks = SinkThread(run_dir, loggers, wandb_project=wandb_project,
                                    wandb_mode=wandb_mode, config=run_config)
        self.total_steps = total_steps
        self.console = console
        self.progress_every_s = progress_every_s
        self.last_progress: dict[str, Any] | None = None
        """The latest rollout snapshot (`tiderl.control.progress.snapshot`)."""
        self._lines = {"step": f"step 0/{total_steps} · starting: building engines, trainer "
                               "and env server", "rollout": ""}
        self._last_eval = float("nan")
        self._last_logged = -math.inf
        self._t0 = time.monotonic()
        self._live = None
        if console:
            from tiderl.control.logs import console_is_terminal

            if console_is_terminal():
                from rich.live import Live

                self._live = Live(get_renderable=self._render, refresh_per_second=2,
                                  transient=False)
                self._live.start()

    def log(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self.records.append(clean)
        self.summary.add(clean)
        with self.path.open("a") as f:
            f.write(json.dumps(clean) + "\n")
        for k, g in self.gauges.items():
            v = record.get(k)
            if isinstance(v, (int, float)) and math.isfinite(v):
                g.set(v)
        if self.sinks is not None:
            self.sinks.log(clean)
        if record.get("kind") == "eval":
            self._last_eval = record.get("eval_success", float("nan"))
        if self.console and record.get("kind") == "step":
            self._lines["step"] = step_line(record, self.total_steps, self._last_eval)
            if self._live is None:
                log.info("%s", self._lines["step"])

    def progress(self, snap: dict[str, Any], *, force: bool = False) -> None:
        """The rollout's live numbers (called every second while the run goes; `force` logs
        the line now, off a terminal, e.g. next to a warning or as a run stops)."""
        from tiderl.control.progress import format_line

        self.last_progress = snap
        for k in LIVE_GAUGES:
            v = snap.get(k)
            if isinstance(v, (int, float)):
                self.gauges[k].set(v)
        if not self.console:
            return
        self._lines["rollout"] = format_line(snap)
        if self.summary.last is None:  # no step yet: say so instead of "starting"
            self._lines["step"] = f"step 0/{self.total_steps} · no step trained yet"
        now = time.monotonic()
        if self._live is None and (force or now - self._last_logged >= self.progress_every_s):
            self._last_logged = now
            log.info("%s", self._lines["rollout"])

    def log_samples(self, step: int, samples: list[dict[str, Any]], path: Path) -> None:
        """An evaluation's decoded trajectories: the first on the console, all to the sinks."""
        from tiderl.control.samples import one_line

        if samples and self.console:
            log.info("eval sample at step %d (%d in %s): %s", step, len(samples), path,
                     one_line(samples[0]))
        if self.sinks is not None and samples:
            self.sinks.log_samples(step, samples)

    def _render(self) -> Any:
        from rich.text import Text

        elapsed = time.monotonic() - self._t0
        head = Text.assemble(("tiderl ", "bold"), self._lines["step"],
                             (f"  {elapsed // 60:.0f}:{elapsed % 60:02.0f}", "yellow"))
        if not self._lines["rollout"]:
            return head
        return Text("\n").join([head, Text("  " + self._lines["rollout"], style="dim")])

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._live is not None:
            self._live.stop()
            self._live = None
        if self.sinks is not None:
            self.sinks.close()
            self.sinks = None


def step_line(r: Mapping[str, Any], total: int, last_eval: float) -> str:
    """A step record's headline numbers on one line."""
    def num(k: str, fmt: str = ".2f") -> str:
        v = r.get(k)
        return "-" if not isinstance(v, (int, float)) else format(v, fmt)

    return (f"step {r['step']}/{total} · reward {num('reward_mean')} eval {last_eval:.2f} · "
            f"goodput {num('goodput', '.0f')} tok/s · hit {num('kv_hit_rate')} · "
            f"TWT {num('twt_s', '.1f')}s RWT {num('rwt_s', '.1f')}s · loss {num('pg_loss', '.3f')}"
            f" entropy {num('entropy')} · len {num('response_len_mean', '.1f')} tok "
            f"{num('turns_mean', '.1f')} turns")


def trajectory_metrics(trajs: Sequence[Any]) -> dict[str, float]:
    """Mean and max response length, trajectory length and turns of the trained trajectories."""
    out: dict[str, float] = {}
    for name, values in (("response_len", [t.action_token_count for t in trajs]),
                         ("traj_len", [len(t.tokens) for t in trajs]),
                         ("turns", [t.turns for t in trajs])):
        out[f"{name}_mean"] = sum(values) / len(values) if values else float("nan")
        out[f"{name}_max"] = max(values, default=float("nan"))
    return out


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, dict):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if hasattr(v, "item"):
        return v.item()
    return v


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; pass a run folder written by tiderl.launch")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


class Summary:
    """The end-of-run report, folded in one record at a time (constant memory)."""

    def __init__(self) -> None:
        self.first: dict[str, Any] | None = None
        self.last: dict[str, Any] | None = None
        self.rwt_s = self.twt_s = 0.0
        self.evals: list[float] = []  # first, last, best

    def add(self, r: dict[str, Any]) -> None:
        if r.get("kind") == "step":
            self.first = self.first or r
            self.last = r
            self.rwt_s += r["rwt_s"]
            self.twt_s += r["twt_s"]
        elif r.get("kind") == "eval":
            e = r["eval_success"]
            e = float("nan") if e is None else e
            self.evals = [e, e, e] if not self.evals else [self.evals[0], e,
                                                           max(self.evals[2], e)]

    def result(self) -> dict[str, Any]:
        if self.last is None:
            return {"steps": 0}
        last = self.last
        out = {
            "steps": last["step"],
            "wall_s": last["wall_s"],
            "goodput": last["goodput"],
            "gen_throughput": last["gen_throughput"],
            "kv_hit_rate": last["kv_hit_rate"],
            "rwt_s": self.rwt_s,
            "twt_s": self.twt_s,
            "consumed_tokens": last["consumed_tokens"],
            "reward_first": self.first["reward_mean"],
            "reward_last": last["reward_mean"],
            "dropped": last.get("dropped", {}),
            "failed_tasks": last.get("failed_tasks", {}),
            "nonfinite_skipped": last.get("nonfinite_skipped", 0),
            "last": {k: last[k] for k in CURVES if k in last},
        }
        if self.evals:
            out["eval_success_first"], out["eval_success_last"], out["eval_success_best"] = \
                self.evals
        return out


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """The end-of-run report from the step records (and the final eval record, if any)."""
    s = Summary()
    for r in records:
        s.add(r)
    return s.result()
