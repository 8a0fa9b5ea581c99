"""Bad rewards and over-long actions through the episode runner (real engines, a real env
server on 127.0.0.1) and a whole job: tasks end bad_reward or action_too_long as values, the
rest of each group trains, and a run with NaN rewards on some episodes completes its steps."""

from __future__ import annotations

import asyncio
import math

import jax
import pytest

from tiderl.control.buffer import ReadinessBuffer
from tiderl.envs.adapters.default import GuessNumber
from tiderl.envs.client import EnvClient
from tiderl.envs.config import EnvConfig
from tiderl.envs.protocol import EndReason
from tiderl.envs.server import EnvServer
from tiderl.envs.tasks import TaskSource
from tiderl.envs.templates import template_for
from tiderl.models.config import ModelConfig
from tiderl.models.policy import init_policy
from tiderl.models.tokenizer import ByteTokenizer
from tiderl.serving.config import RolloutConfig
from tiderl.serving.ctb import CTBConfig, make_scheduler
from tiderl.serving.engine import Engine
from tiderl.serving.rank import RolloutRank
from tiderl.serving.rollout import RolloutManager

MODEL = ModelConfig(vocab_size=272, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=16,
                    mlp_dim=64)


class MemberRewards(GuessNumber):
    """The default task, except that member 0's /end reward is NaN and member 1's None (an
    env with a bug on some episodes)."""

    def reset(self, task):
        self.member = int(task.get("member", 0))
        return super().reset(task)

    def close(self):
        reward, info = super().close()
        return {0: float("nan"), 1: None}.get(self.member, reward), info


class NanSome(GuessNumber):
    """Member 0 of every group ends with a NaN reward."""

    def reset(self, task):
        self.member = int(task.get("member", 0))
        return super().reset(task)

    def close(self):
        reward, info = super().close()
        return (float("nan") if self.member == 0 else reward), info


async def play(adapter, env_cfg: EnvConfig, *, max_action_tokens: int, groups=2, group_size=4):
    tok = ByteTokenizer()
    tmpl = template_for(tok, "byte")
    rcfg = RolloutConfig(num_pages=64, page_size=8, max_slots=8, max_context=256,
                         max_action_tokens=max_action_tokens, temperature=1.0,
                         decode_buckets=(8,), prefill_buckets=(16, 64),
                         stop_tokens=tuple(sorted(tmpl.stop_ids)))
    graphdef, params = init_policy(MODEL, seed=0)
    engine = Engine(graphdef, jax.device_put(params, jax.devices()[0]), MODEL, rcfg, seed=123)
    rank = RolloutRank(0, engine)
    await rank.start()
    sched = make_scheduler("ctb", CTBConfig(action_reserve=max_action_tokens),
                           [rcfg.num_pages * rcfg.page_size], max_context=rcfg.max_context)
    src = TaskSource("default", "train", groups=groups, group_size=group_size)
    try:
        async with EnvServer(adapter, env_cfg).serve() as url, EnvClient(url, env_cfg) as env:
            mgr = RolloutManager([rank], sched, env, tmpl, max_turns=4)
            out = await asyncio.gather(*(mgr.run_group(src.element(k)) for k in range(groups)))
    finally:
        await rank.close()
    return out, mgr


def test_bad_env_rewards_end_those_tasks_and_their_groups_train_on_the_rest():
    cfg = EnvConfig(retries=0)
    groups, mgr = asyncio.run(play(MemberRewards, cfg, max_action_tokens=1))
    buf = ReadinessBuffer(groups_per_microbatch=1, max_staleness=4, min_ok_per_group=2,
                          zero_var="keep")
    for trajs in groups:
        by_member = {int(t.task_id.rsplit("m", 1)[1]): t for t in trajs}
        assert by_member[0].end_reason == by_member[1].end_reason == EndReason.bad_reward
        assert "reward" in by_member[0].error and not by_member[0].ok
        assert all(by_member[m].ok and math.isfinite(by_member[m].reward) for m in (2, 3))
        g = buf.add_group(trajs, now=0.0)
        assert g is not None and len(g.seqs) == 2
    assert mgr.end_reasons["bad_reward"] == 4 and buf.failed_tasks["bad_reward"] == 4
    assert mgr.stats()["tasks_live"] == 0


def test_over_long_actions_end_action_too_long_and_are_trained():
    # Actions of up to 4 byte tokens against a server that takes 2 characters.
    cfg = EnvConfig(retries=0, max_action_chars=2)
    groups, mgr = asyncio.run(play(GuessNumber, cfg, max_action_tokens=4))
    trajs = [t for g in groups for t in g]
    long = [t for t in trajs if t.end_reason == EndReason.action_too_long]
    assert long, mgr.end_reasons
    assert all(t.ok and sum(t.loss_mask) >= 3 and math.isfinite(t.reward) for t in long)
    assert "env_error" not in mgr.end_reasons
    buf = ReadinessBuffer(groups_per_microbatch=1, max_staleness=4, min_ok_per_group=2,
                          zero_var="keep")
    for g in groups:
        assert buf.add_group(g, now=0.0) is not None  # trained, not dropped
    assert not buf.failed_tasks


@pytest.mark.entry
def test_a_run_with_nan_rewards_on_some_episodes_completes_its_steps(tmp_path):
    from tiderl.config import load_config
    from tiderl.runtime.job import run_job

    tiny = ["cluster.fake_cpu_devices=8", "model.n_layers=1", "model.d_model=32",
            "model.mlp_dim=64", "model.head_dim=8", "controller.groups_per_step=2",
            "controller.groups_per_microbatch=1", "controller.eval_every=0",
            "controller.console=false", "env.group_size=4", "controller.checkpoint_every=0",
            "trainer.zero_var_groups=keep"]
    cfg = load_config(None, [*tiny, f"run_dir={tmp_path / 'run'}", "controller.steps=2",
                             "controller.time_limit_s=300",
                             "env.suite=test_rollout_bad_rewards:NanSome"])
    summary = asyncio.run(run_job(cfg))
    assert summary["steps"] == 2 and summary["ended"] == "completed 2 of 2 steps", summary
    assert summary["rollout"]["end_reasons"].get("bad_reward", 0) >= 4
