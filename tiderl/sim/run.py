"""Runs the real controller, CTB, rollout ranks and buffer against the cost-model stand-ins of
`tiderl.sim.fakes` on whatever loop is running (a virtual-time loop under looptime). No JAX.

`python -m tiderl.sim.run` prints the run summary as JSON on virtual time.
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
from typing import Any

from tiderl.control.buffer import ReadinessBuffer
from tiderl.control.config import ControllerConfig
from tiderl.control.controller import Controller, Hooks
from tiderl.control.metrics import MetricsSink
from tiderl.envs.tasks import TaskSource
from tiderl.envs.templates import template_for
from tiderl.models.tokenizer import ByteTokenizer
from tiderl.serving.ctb import CTBConfig, make_scheduler
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager
from tiderl.sim.fakes import FlatTrainer, SimEngine, SimGuessEnv
from tiderl.train.dispatch import microbatches


class SeedStream:
    """The simulator's own JAX-free workload stream (a run's goes through grain, `tiderl.runtime.taskstream`):
    a suite's groups in seed order, with the controller's stream interface."""

    def __init__(self, source: TaskSource):
        self.source, self.position = source, 0

    def __next__(self) -> dict:
        g = self.source.element(self.position)
        self.position += 1
        return g

    def element(self, k: int) -> dict:
        return self.source.element(k)

    def get_state(self) -> dict:
        return {"position": self.position}


async def simulate(cfg: ControllerConfig, *, ranks: int = 2, group_size: int = 4,
                   env_step_s: float = 2.0, per_mb_s: float = 0.5, scheduler: str = "ctb",
                   run_dir: str | None = None, engine_cls: type = SimEngine,
                   env: SimGuessEnv | None = None, zero_var: str = "keep",
                   checkpoint: Any = None, max_turns: int = 4) -> dict[str, Any]:
    tmpl = template_for(ByteTokenizer(), "byte")
    engines = [engine_cls(seed=7, stop_tokens=tuple(tmpl.stop_ids)) for _ in range(ranks)]
    rank_objs = [RolloutRank(i, e) for i, e in enumerate(engines)]
    for r in rank_objs:
        await r.start()
    sched = make_scheduler(scheduler, CTBConfig(action_reserve=1), [4096] * ranks,
                           max_context=512, max_tasks_per_rank=64)
    env = env or SimGuessEnv(step_s=env_step_s)
    trainer = FlatTrainer(per_mb_s=per_mb_s)

    async def sync_weights(weights: Any, version: int) -> None:
        await asyncio.gather(*(r.update_weights(weights, version) for r in rank_objs))

    def make_mbs(seqs: list, final: bool) -> list:
        return microbatches(seqs, n_ranks=1, row_len=128, rows_per_rank=8, final=True)[0]

    src = TaskSource("default", "train", groups=1000, group_size=group_size)
    eval_src = TaskSource("default", "eval", groups=4, group_size=group_size)
    manager = RolloutManager(rank_objs, sched, env, tmpl, max_turns=max_turns)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = MetricsSink(run_dir or tmp, console=False)
        controller = Controller(
            cfg, manager=manager, trainer=trainer,
            hooks=Hooks(sync_weights=sync_weights, make_microbatches=make_mbs,
                        checkpoint=checkpoint),
            train_stream=SeedStream(src), eval_groups=[eval_src.element(k) for k in range(4)],
            metrics=metrics,
            buffer=ReadinessBuffer(groups_per_microbatch=cfg.groups_per_microbatch,
                                   max_staleness=cfg.max_staleness,
                                   min_ok_per_group=cfg.min_ok_per_group, zero_var=zero_var))
        try:
            summary = await controller.run()
        finally:  # a run that stops with an error (StarvedStop, ...) leaves no rank running
            for r in rank_objs:
                await r.close()
        records = metrics.records
    return {"summary": summary, "records": records, "trainer_steps": len(trainer.steps),
            "env_pauses": env.pauses, "controller": controller}


def main() -> int:
    import looptime  # the virtual clock: sleeps take no real time

    from tiderl.control.logs import setup_logging

    setup_logging()

    cfg = ControllerConfig(steps=5, groups_per_step=4, eval_every=2, console=False,
                           checkpoint_every=0, min_ok_per_group=1)

    async def go() -> dict:
        return await simulate(cfg)

    loop = looptime.new_event_loop(start=0.0)
    try:
        out = loop.run_until_complete(go())
    finally:
        loop.close()
    print(json.dumps({**out["summary"], "trainer_steps": out["trainer_steps"],
                      "jax_loaded": "jax" in sys.modules}, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
