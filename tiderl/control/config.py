"""Controller config: run mode, steps, batch, staleness, evaluation, checkpoints (JAX-free)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from tiderl.configlib import ConfigError
from tiderl.control.ers import ERSConfig


@dataclasses.dataclass(frozen=True, kw_only=True)
class ControllerConfig:
    """The RL loop: which baseline mode, how long, how big a step, and what to report."""

    mode: Literal["tiderl", "sync", "async", "stream"] = "tiderl"
    """tiderl: CTB + streaming RA2P. sync: global barrier, rollout and training alternate.
    async: request-level rollout, trainer waits for the global batch (colocated, aggregated).
    stream: request-level rollout, micro-batches streamed, Ref/Actor alternate per micro-batch."""
    steps: int = 60
    groups_per_step: int = 8
    """B_ideal, in groups: a step trains on this many complete groups."""
    min_groups_per_step: int = 0
    """B_min, in groups (elastic batch): 0 means B_ideal (no early steps)."""
    groups_per_microbatch: int = 2
    """A micro-batch is formed as soon as this many groups are ready (streaming modes)."""
    max_staleness: int = 1
    """Tokens generated more than this many versions before the update are dropped (counted)."""
    eval_every: int = 10
    """Evaluate on the held-out split (all `env.eval_groups` groups) every K steps (0: never);
    eval runs during the next step."""
    eval_temperature: float = 0.0
    """Sampling temperature of evaluation tasks (0: greedy, as verl's validation default)."""
    checkpoint_every: int = 20
    """Save a checkpoint every N steps, and at the end (0: never)."""
    keep_checkpoints: int = 2
    """Newest checkpoints kept in <run_dir>/checkpoints."""
    max_nonfinite_steps: int = 3
    """Consecutive non-finite updates (skipped) after which the run stops with a checkpoint."""
    min_ok_per_group: int = 2
    """A group trains on its tasks that ended with a verdict when at least this many did
    (others failed in the env); otherwise the whole group is dropped and counted."""
    warn_dropped_in_a_row: int = 16
    """Warn (on the console, with what it means and what to try) once this many groups in a
    row ended without becoming trainable (zero reward variance, too few tasks ok), then each
    time that count doubles (0: never)."""
    max_dropped_in_a_row: int = 0
    """Stop the run (checkpoint, one-line reason, exit code 3) once this many groups in a row
    were dropped (DAPO's bound on generation batches; 0: no limit)."""
    warn_starved_s: float = 300.0
    """Warn when the trainer has waited this long for its next trainable group, dropped
    groups or not (e.g. a slow env: no group ends at all), then each time that doubles
    (0: never)."""
    max_starved_s: float = 0.0
    """Stop the run like `max_dropped_in_a_row` once the trainer waited this long (0: no
    limit); `time_limit_s` still bounds the whole run."""
    console: bool = True
    """A live progress line (rollout while a step fills, then the step's numbers) and the
    final report. On a terminal the line redraws every second; otherwise (a pipe, a log file)
    a plain line is logged every `progress_every_s`."""
    progress_every_s: float = 10.0
    """Seconds between the plain progress lines when the console is not a terminal."""
    loggers: tuple[Literal["jsonl", "tensorboard", "wandb"], ...] = ("jsonl",)
    """Where step and eval records go besides the console: jsonl (`metrics.jsonl`, always
    written: resume and `tiderl.report` read it), tensorboard (event files in
    `<run_dir>/tensorboard`, tensorboardX) and wandb (`<run_dir>/wandb`); both extras come
    with `pip install -e '.[logging]'`."""
    wandb_project: str = "tiderl"
    wandb_mode: Literal["offline", "online"] = "offline"
    """offline writes the W&B run folder without network (`wandb sync` uploads it later)."""
    eval_samples: int = 8
    """Trajectories of each evaluation decoded to `<run_dir>/samples/step_K.jsonl` (and one
    shown on the console); 0 writes none."""
    prometheus_port: int = -1
    """Serve Prometheus metrics on prometheus_host:PORT (0: any free port, -1: off)."""
    prometheus_host: str = "127.0.0.1"
    """Address the Prometheus endpoint binds (loopback unless you mean to expose it)."""
    prometheus_token: str = ""
    """Bearer token the endpoint requires; off loopback one is generated if unset, into
    <run_dir>/prometheus_token (mode 0600; the token itself is never logged)."""
    time_limit_s: float = 0.0
    """Stop after this much wall time (0: no limit); the run still evaluates and reports."""
    system_prompt: str = ""
    """System turn before each task's first observation ('' for none); needs a turn template
    with a system role (ChatML, Llama 3), not the byte tokenizer's."""
    ers: Literal["auto", "on", "off"] = "auto"
    """Elastic Resource Scaling: cells move between rollout, trainer and Ref at sync boundaries
    by readiness (tiderl/control/ers.py). auto: on in `tiderl` mode, off in the baselines."""
    elastic: ERSConfig = dataclasses.field(default_factory=ERSConfig)
    """ERS bounds and hysteresis, and τ (also the elastic batch's wait budget)."""

    @property
    def ers_on(self) -> bool:
        return self.ers == "on" or self.ers == "auto" and self.mode == "tiderl"

    def __post_init__(self):
        for name in ("steps", "groups_per_step", "groups_per_microbatch", "keep_checkpoints",
                     "max_nonfinite_steps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"config key 'controller.{name}' must be positive, got "
                                  f"{getattr(self, name)}")
        for name in ("max_staleness", "eval_every", "checkpoint_every", "min_groups_per_step",
                     "warn_dropped_in_a_row", "max_dropped_in_a_row", "warn_starved_s",
                     "max_starved_s", "eval_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config key 'controller.{name}' must be >= 0")
        if self.min_groups_per_step > self.groups_per_step:
            raise ConfigError("config key 'controller.min_groups_per_step' must not exceed "
                              "controller.groups_per_step (B_min ≤ B_ideal)")
        if self.ers == "on" and self.mode == "sync":
            raise ConfigError("config key 'controller.ers'='on' with controller.mode='sync': "
                              "sync alternates rollout and training on the same devices, so "
                              "there are no cells to move; set controller.ers=off or another "
                              "mode")
        if self.progress_every_s <= 0:
            raise ConfigError("config key 'controller.progress_every_s' must be positive")
        if "jsonl" not in self.loggers:
            raise ConfigError(
                f"config key 'controller.loggers'={list(self.loggers)} lacks 'jsonl': "
                "metrics.jsonl is the run's record (resume and tiderl.report read it); add "
                "it, e.g. controller.loggers=[jsonl,tensorboard]")
        if self.min_ok_per_group < 1:
            raise ConfigError("config key 'controller.min_ok_per_group' must be >= 1")
