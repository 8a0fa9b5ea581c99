"""Run metrics: one record per step to `metrics.jsonl`, Prometheus gauges, a live console
line, and the end-of-run summary. No JAX.

Definitions: goodput = generated (action) tokens consumed by an actor update per
wall-clock second since the run started; generation throughput = decoded tokens per second;
KV hit rate = prompt tokens served from resident KV ÷ prompt tokens needed; RWT = time rollout
sat idle because of the staleness bound; TWT = time the trainer sat idle waiting for data.
"""

from __future__ import annotations

import collections
import json
import math
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

GAUGES = ("goodput", "gen_throughput", "kv_hit_rate", "reward_mean", "eval_success", "rwt_s",
          "twt_s", "step_time_s", "version", "staleness_mean", "rollout_ranks", "trainer_ranks")


class MetricsSink:
    """Appends step records to JSONL, mirrors headline numbers to Prometheus and the console.

    Memory stays bounded however long the run: the summary is folded in as records arrive and
    only the most recent `keep_records` are held (the file has them all)."""

    def __init__(self, run_dir: str | Path, *, console: bool = True, prometheus_port: int = -1,
                 total_steps: int = 0, keep_records: int = 1000,
                 prometheus_host: str = "127.0.0.1", prometheus_token: str = ""):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.records: collections.deque[dict[str, Any]] = collections.deque(maxlen=keep_records)
        self.summary = Summary()
        self.registry = CollectorRegistry()
        self.gauges = {k: Gauge(f"tiderl_{k}", k, registry=self.registry) for k in GAUGES}
        self.port = None
        self._server = None
        if prometheus_port >= 0:
            from tiderl.control.promserve import MetricsServer

            self._server = MetricsServer(self.registry, prometheus_host, prometheus_port,
                                         prometheus_token)
            self.port = self._server.port
        self.total_steps = total_steps
        self._progress = None
        self._task = None
        self._last_eval = float("nan")
        if console:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("[bold]tiderl[/] step {task.completed}/{task.total}"), BarColumn(),
                TextColumn("{task.fields[line]}"), TimeElapsedColumn(), transient=False)
            self._progress.start()
            self._task = self._progress.add_task("train", total=total_steps, line="starting")

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
        if record.get("kind") == "eval":
            self._last_eval = record.get("eval_success", float("nan"))
        if self._progress is not None and record.get("kind") == "step":
            line = (f"reward {record.get('reward_mean', float('nan')):.2f}  "
                    f"eval {self._last_eval:.2f}  "
                    f"goodput {record.get('goodput', 0):.0f} tok/s  "
                    f"hit {record.get('kv_hit_rate', 0):.2f}  "
                    f"TWT {record.get('twt_s', 0):.1f}s RWT {record.get('rwt_s', 0):.1f}s")
            self._progress.update(self._task, completed=record["step"], line=line)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        if self._progress is not None:
            self._progress.stop()
            self._progress = None


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
