"""TensorBoard and Weights & Biases sinks for the run's step and eval records. No JAX.

`controller.loggers` picks them (`metrics.jsonl` is always written). Both are fed by
`SinkThread`, off the event loop: tensorboardX serialises protobufs and W&B talks to its own
service process, and neither may stall env I/O. A sink that fails is logged once and switched
off; it never stops the run.

Scalars: every number of a record, under `train/<key>` (step records) or `eval/<key>`
(evaluations), nested dicts flattened as `<key>/<sub>` (e.g. `train/dropped/zero_variance`);
lists and strings are left to `metrics.jsonl`. The x-axis is the training step.
"""

from __future__ import annotations

import importlib.util
import logging
import math
import queue
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tiderl.configlib import ConfigError

log = logging.getLogger(__name__)

EXTRA = "pip install -e '.[logging]'"
MODULES = {"tensorboard": "tensorboardX", "wandb": "wandb"}


def check_loggers(loggers: Sequence[str]) -> None:
    """ConfigError naming `controller.loggers` when a chosen sink's package is missing."""
    for name in loggers:
        module = MODULES.get(name)
        if module is not None and importlib.util.find_spec(module) is None:
            raise ConfigError(f"config key 'controller.loggers' includes {name!r}, but the "
                              f"{module} package is not installed; {EXTRA} (or drop {name})")


def scalars(record: Mapping[str, Any]) -> Iterator[tuple[str, float]]:
    """(tag, value) for every finite number of a record, `<kind>/<key>[/<sub>]`."""
    prefix = "eval" if record.get("kind") == "eval" else "train"
    for key, value in record.items():
        if key in ("kind", "step"):  # the x-axis
            continue
        if isinstance(value, Mapping):
            for sub, v in value.items():
                if (x := _number(v)) is not None:
                    yield f"{prefix}/{key}/{sub}", x
        elif (x := _number(value)) is not None:
            yield f"{prefix}/{key}", x


def _number(v: Any) -> float | None:
    if isinstance(v, bool):
        return float(v)
    if isinstance(v, (int, float)) and math.isfinite(v):
        return float(v)
    return None


def samples_markdown(samples: Sequence[Mapping[str, Any]], limit: int = 2000) -> str:
    """Decoded trajectories as a Markdown list (TensorBoard renders text as Markdown)."""
    out = []
    for s in samples:
        turns = " ⏵ ".join(f"`{o!r}` → **{a!r}**" for o, a in
                           zip(s["observations"], s["actions"], strict=False))
        out.append(f"- {s['task_id']} reward {s['reward']:.3f} ({s['end_reason']}): "
                   f"{turns}"[:limit])
    return "\n".join(out)


class TensorBoardSink:
    def __init__(self, run_dir: Path):
        from tensorboardX import SummaryWriter
        from tensorboardX.proto.summary_pb2 import Summary

        self.dir = run_dir / "tensorboard"
        self.writer = SummaryWriter(str(self.dir), flush_secs=10)
        self._summary = Summary

    def log(self, record: Mapping[str, Any]) -> None:
        # One event per record holding every scalar: `add_scalar` per tag queues one event
        # each through a small bounded queue, and a record has ~60 numbers.
        values = [self._summary.Value(tag=tag, simple_value=v) for tag, v in scalars(record)]
        self.writer._get_file_writer().add_summary(self._summary(value=values),
                                                   int(record.get("step", 0)))

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        self.writer.add_text("eval/samples", samples_markdown(samples), step)

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, run_dir: Path, *, project: str, mode: str, config: Mapping[str, Any]):
        import wandb

        self.wandb = wandb
        self.run = wandb.init(
            project=project, name=run_dir.name, dir=str(run_dir), mode=mode,
            config=dict(config), reinit="create_new",
            settings=wandb.Settings(silent=True, console="off", disable_git=True,
                                    x_disable_stats=True))
        # One x-axis for both record kinds: eval records of step k arrive after step k+1's
        # training record has started, which W&B's own monotonic `step` would reject.
        self.run.define_metric("step")
        for kind in ("train", "eval"):
            self.run.define_metric(f"{kind}/*", step_metric="step")

    @property
    def dir(self) -> Path:
        return Path(self.run.dir).parent

    def log(self, record: Mapping[str, Any]) -> None:
        self.run.log({"step": int(record.get("step", 0)), **dict(scalars(record))})

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        cols = ["task_id", "reward", "end_reason", "turns", "transcript"]
        table = self.wandb.Table(columns=cols)
        for s in samples:
            table.add_data(s["task_id"], s["reward"], s["end_reason"], s["turns"],
                           s.get("text", ""))
        self.run.log({"step": step, "eval/samples": table})

    def close(self) -> None:
        self.run.finish()


class SinkThread:
    """Feeds the chosen sinks from a queue on one worker thread (opened there, too: importing
    tensorboardX and starting W&B take seconds)."""

    def __init__(self, run_dir: str | Path, loggers: Sequence[str], *,
                 wandb_project: str = "tiderl", wandb_mode: str = "offline",
                 config: Mapping[str, Any] | None = None):
        check_loggers(loggers)
        self.run_dir = Path(run_dir)
        self.names = [n for n in loggers if n in MODULES]
        self._opts = {"project": wandb_project, "mode": wandb_mode, "config": config or {}}
        self.sinks: dict[str, Any] = {}
        self._q: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="tiderl-sinks", daemon=True)
        self._thread.start()

    def log(self, record: Mapping[str, Any]) -> None:
        self._q.put(("log", record))

    def log_samples(self, step: int, samples: Sequence[Mapping[str, Any]]) -> None:
        self._q.put(("samples", (step, list(samples))))

    def close(self, timeout: float = 60.0) -> None:
        """Flushes and closes every sink (waits for the queue to drain)."""
        if self._thread.is_alive():
            self._q.put(("stop", None))
            self._thread.join(timeout)

    def _open(self, name: str) -> Any:
        if name == "tensorboard":
            return TensorBoardSink(self.run_dir)
        return WandbSink(self.run_dir, **self._opts)

    def _run(self) -> None:
        for name in self.names:
            self._guard(name, lambda n=name: self.sinks.__setitem__(n, self._open(n)))
        while True:
            kind, payload = self._q.get()
            if kind == "stop":
                for name, sink in list(self.sinks.items()):
                    self._guard(name, sink.close)
                return
            for name, sink in list(self.sinks.items()):
                if kind == "log":
                    self._guard(name, sink.log, payload)
                else:
                    self._guard(name, sink.log_samples, *payload)

    def _guard(self, name: str, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except Exception as e:  # noqa: BLE001 - a metrics sink never stops the run
            log.warning("controller.loggers: the %s sink failed (%s: %s); it is off for the "
                        "rest of the run", name, type(e).__name__, e)
            self.sinks.pop(name, None)
