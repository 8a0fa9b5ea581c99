"""Step-level credit (trainer.advantage=gigpo, arXiv 2505.10978): step groups of recurring
anchors, discounted returns, the combined advantage on each turn's action tokens, what the
buffer keeps and drops, the packed micro-batch, and a real launch of the default task.

Expected values are written out by hand from the definitions: R_k = gamma^(T−1−k)·R, a step
group's advantage (R_k − mean) / (std_ddof1 + eps), A = A_episode + omega·A_step. Float32
storage: compared with rel 1e-6 / abs 1e-6.
"""

import json
import math
import subprocess
import sys

import numpy as np
import pytest

from tiderl.configlib import ConfigError
from tiderl.envs.protocol import EndReason
from tiderl.serving.trajectory import Trajectory
from tiderl.train.advantages import (StepCredit, action_turns, group_advantages, step_advantages,
                                     step_credit, token_advantages)
from tiderl.train.config import TrainerConfig

EPS = 1e-6
P = [10, 11]  # the group's shared prompt


def episode(actions, observations):
    """tokens, loss mask of a transcript: P, a_0, o_1, a_1, o_2, ..., a_{T−1}."""
    tokens, mask = list(P), [0] * len(P)
    for k, a in enumerate(actions):
        if k:
            tokens += observations[k - 1]
            mask += [0] * len(observations[k - 1])
        tokens += a
        mask += [1] * len(a)
    return tokens, mask


def traj(i, actions, observations, reward, reason=EndReason.done):
    tokens, mask = episode(actions, observations)
    return Trajectory(task_id=f"g/m{i}", group_id="g", is_eval=False, tokens=tokens,
                      loss_mask=mask, logprobs=[-0.5 * m for m in mask],
                      versions=[0 if m else -1 for m in mask], reward=reward, end_reason=reason,
                      turns=len(actions))


def norm(rs):
    """The hand formula: (r − mean) / (std_ddof1 + eps), zero when all are equal."""
    rs = np.asarray(rs, np.float64)
    if np.ptp(rs) == 0:
        return np.zeros_like(rs)
    return (rs - rs.mean()) / (rs.std(ddof=1) + EPS)


# Three siblings: τ0 and τ1 guess 5 first and see [20, 21]; τ2 guesses 4 and sees [23], or
# [20, 21] as well in the 'same observation' variant; τ1 needs a third turn.
def group(tau2_obs=(23,)):
    return [
        ([[5], [6]], [[20, 21]], 1.0),
        ([[5], [7], [8]], [[20, 21], [22]], 0.0),
        ([[4], [6, 9]], [list(tau2_obs)], 1.0),
    ]


def run_steps(spec, credit):
    eps_ = [episode(a, o) for a, o, _ in spec]
    return step_advantages([t for t, _ in eps_], [m for _, m in eps_], [r for *_, r in spec],
                           credit)


def test_action_turns_are_the_runs_of_the_loss_mask():
    assert action_turns([0, 0, 1, 1, 0, 1, 0, 0, 1]) == [(2, 4), (5, 6), (8, 9)]
    assert action_turns([0, 0]) == [] and action_turns([]) == []
    tokens, mask = episode([[5], [6, 9]], [[20, 21]])
    assert action_turns(mask) == [(2, 3), (5, 7)] and tokens[5:7] == [6, 9]


def test_history_anchors_exact_step_advantages():
    g = 0.5
    st = run_steps(group(), StepCredit(gamma=g, eps=EPS))
    # turn 0: all three share the prompt; returns γ^(T−1)·R = γ, γ²·0, γ.
    a0 = norm([g, 0.0, g])
    # turn 1: τ0 and τ1 share P+[5]+[20,21] (returns 1, γ·0); τ2's context differs.
    a1 = norm([1.0, 0.0])
    want = [[a0[0], a1[0]], [a0[1], a1[1], 0.0], [a0[2], 0.0]]
    for got, w in zip(st.per_turn, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)
    assert a0[0] == pytest.approx(1 / math.sqrt(3), rel=1e-5)  # (γ/3) / (γ/√3)
    assert a1[0] == pytest.approx(1 / math.sqrt(2), rel=1e-5)
    assert (st.turns, st.anchored, st.anchored_later, st.groups) == (7, 5, 2, 2)


def test_observation_anchors_pool_turns_and_siblings_that_history_keeps_apart():
    g = 0.5
    spec = group(tau2_obs=(20, 21))  # τ2 guessed 4, yet sees what τ0 and τ1 saw
    hist = run_steps(spec, StepCredit(gamma=g, eps=EPS, anchor="history"))
    np.testing.assert_allclose(hist.per_turn[2][1], 0.0)  # a different context: no group
    obs = run_steps(spec, StepCredit(gamma=g, eps=EPS, anchor="observation"))
    # [20, 21] precedes τ0's turn 1 (return 1), τ1's turn 1 (γ·0), τ2's turn 1 (1); τ1's
    # turn 2 follows [22] alone.
    a1 = norm([1.0, 0.0, 1.0])
    a0 = norm([g, 0.0, g])
    want = [[a0[0], a1[0]], [a0[1], a1[1], 0.0], [a0[2], a1[2]]]
    for got, w in zip(obs.per_turn, want, strict=True):
        np.testing.assert_allclose(got, w, rtol=1e-6, atol=1e-6)
    # Pooled over turns: an observation seen at turns 1 and 2 is one anchor.
    spec2 = [([[5], [7], [8]], [[20, 21], [20, 21]], 1.0), ([[5], [9]], [[22]], 0.0)]
    st = run_steps(spec2, StepCredit(gamma=g, eps=EPS, anchor="observation"))
    # τ0's turns 1 and 2 (returns γ·1, 1) share [20, 21].
    np.testing.assert_allclose(st.per_turn[0][1:], norm([g, 1.0]), rtol=1e-6)
    assert st.groups == 2 and st.anchored_later == 2  # the prompt (turn 0s) and [20, 21]
    np.testing.assert_allclose(st.per_turn[0][0], norm([g * g, 0.0])[0], rtol=1e-6)


def test_mean_norm_gamma_one_and_single_sibling():
    st = run_steps(group(), StepCredit(gamma=1.0, norm="mean"))
    np.testing.assert_allclose(st.per_turn[0], [1 / 3, 0.5], rtol=1e-6)
    np.testing.assert_allclose(st.per_turn[1], [-2 / 3, -0.5, 0.0], rtol=1e-6)
    np.testing.assert_allclose(st.per_turn[2], [1 / 3, 0.0], rtol=1e-6)
    one = run_steps(group()[:1], StepCredit())
    assert one.anchored == 0 and one.groups == 0 and not np.any(one.per_turn[0])


def test_all_equal_returns_give_zero_step_advantages():
    spec = [([[5], [6]], [[20]], 1.0), ([[5], [7]], [[20]], 1.0), ([[4], [6]], [[21]], 1.0)]
    st = run_steps(spec, StepCredit(gamma=0.9))
    assert st.groups == 2 and st.anchored == 5
    assert all(not np.any(a) for a in st.per_turn)


def test_gamma_one_history_turn_zero_step_advantage_is_the_episode_advantage():
    """The whole group shares turn 0's context: with gamma = 1 its step group is the episode
    group, so the step advantage equals the episode advantage there."""
    spec = group()
    ep = group_advantages([[r for *_, r in spec]], eps=EPS).advantages[0]
    st = run_steps(spec, StepCredit(gamma=1.0, eps=EPS))
    np.testing.assert_allclose([a[0] for a in st.per_turn], ep, rtol=1e-6)


def test_token_advantages_put_each_turns_advantage_on_its_action_tokens():
    tokens, mask = episode([[5], [6, 9]], [[20, 21]])
    out = token_advantages(mask, 0.25, np.array([1.0, -2.0], np.float32), 0.5)
    assert out.dtype == np.float32 and out.shape == (len(tokens),)
    np.testing.assert_allclose(out, [0.25, 0.25, 0.75, 0.25, 0.25, -0.75, -0.75])


# -- the buffer ---------------------------------------------------------------------------------


def make_buffer(credit=None, **kw):
    from tiderl.control.buffer import ReadinessBuffer

    return ReadinessBuffer(groups_per_microbatch=1, max_staleness=4,
                           min_ok_per_group=kw.pop("min_ok", 2), step_credit=credit,
                           adv_eps=EPS, **kw)


def test_buffer_combines_episode_and_step_advantages_per_token():
    g, omega = 0.5, 0.5
    spec = group()
    buf = make_buffer(StepCredit(gamma=g, omega=omega, eps=EPS))
    rg = buf.add_group([traj(i, a, o, r) for i, (a, o, r) in enumerate(spec)], now=0.0)
    assert rg is not None
    ep = norm([1.0, 0.0, 1.0])
    a0, a1 = norm([g, 0.0, g]), norm([1.0, 0.0])
    steps = [[a0[0], a1[0]], [a0[1], a1[1], 0.0], [a0[2], 0.0]]
    for seq, e, st in zip(rg.seqs, ep, steps, strict=True):
        adv = np.asarray(seq.advantage)
        turns = action_turns(seq.action_mask)
        assert adv.shape == seq.tokens.shape and len(turns) == len(st)
        for (s0, s1), a in zip(turns, st, strict=True):
            np.testing.assert_allclose(adv[s0:s1], e + omega * a, rtol=1e-6, atol=1e-6)
    assert buf.summary()["step_credit"] == {"turns": 7, "anchored_turns": 5,
                                            "anchored_later_turns": 2, "step_groups": 2}


def test_buffer_default_grpo_is_unchanged():
    spec = group()
    buf = make_buffer()
    rg = buf.add_group([traj(i, a, o, r) for i, (a, o, r) in enumerate(spec)], now=0.0)
    assert [type(s.advantage) for s in rg.seqs] == [float] * 3
    np.testing.assert_allclose([s.advantage for s in rg.seqs], norm([1.0, 0.0, 1.0]),
                               rtol=1e-6)
    assert "step_credit" not in buf.summary()


def test_failed_tasks_are_left_out_of_the_step_groups():
    """τ3 failed (env_error) after the same first turn as τ0 and τ1, with reward 1: the result
    equals the group without it, as for the episode advantage."""
    spec = group()
    credit = StepCredit(gamma=0.5, eps=EPS)
    full = make_buffer(credit).add_group(
        [traj(i, a, o, r) for i, (a, o, r) in enumerate(spec)]
        + [traj(3, [[5], [6]], [[20, 21]], 1.0, EndReason.env_error)], now=0.0)
    ref = make_buffer(credit).add_group(
        [traj(i, a, o, r) for i, (a, o, r) in enumerate(spec)], now=0.0)
    assert len(full.seqs) == 3
    for s, t in zip(full.seqs, ref.seqs, strict=True):
        np.testing.assert_array_equal(s.advantage, t.advantage)


def test_equal_rewards_drop_the_group_only_without_step_signal():
    credit = StepCredit(gamma=0.9, eps=EPS)
    same = [traj(0, [[5], [6]], [[20]], 1.0), traj(1, [[4], [6]], [[21]], 1.0)]
    buf = make_buffer(credit)
    assert buf.add_group(same, now=0.0) is None and buf.dropped["zero_variance"] == 1
    # Both win, one in fewer turns: discounted returns differ at the shared first turn.
    quick = [traj(0, [[5]], [], 1.0), traj(1, [[4], [6]], [[21]], 1.0)]
    rg = buf.add_group(quick, now=1.0)
    assert rg is not None and buf.dropped["zero_variance"] == 1
    a0 = norm([1.0, 0.9])
    np.testing.assert_allclose(rg.seqs[0].advantage[2], a0[0], rtol=1e-6)
    np.testing.assert_allclose(rg.seqs[1].advantage[[2, 4]], [a0[1], 0.0], atol=1e-6)
    # GRPO drops the same group.
    assert make_buffer().add_group(quick, now=0.0) is None
    # A single sibling: no episode signal, no recurring anchor: dropped.
    assert make_buffer(credit, min_ok=1).add_group(quick[:1], now=0.0) is None


def test_packed_microbatch_carries_per_token_advantages():
    from tiderl.train.dispatch import TrainSequence, microbatches

    spec = group()
    buf = make_buffer(StepCredit(gamma=0.5, eps=EPS))
    rg = buf.add_group([traj(i, a, o, r) for i, (a, o, r) in enumerate(spec)], now=0.0)
    mbs, rest = microbatches(rg.seqs, n_ranks=2, row_len=8, rows_per_rank=2)
    assert not rest
    by_uid = {s.uid: s for s in rg.seqs}
    seen = 0
    for mb in mbs:
        order = iter(mb.uids)
        for b in range(mb.tokens_bt.shape[0]):
            for seg in range(1, int(mb.segment_ids_bt[b].max()) + 1):
                idx = np.flatnonzero(mb.segment_ids_bt[b] == seg)
                s = by_uid[next(order)]
                np.testing.assert_array_equal(mb.tokens_bt[b, idx], s.tokens)
                np.testing.assert_array_equal(mb.advantages_bt[b, idx], s.advantage)
                seen += 1
    assert seen == 3
    with pytest.raises(ValueError, match="per-token advantages have shape"):
        TrainSequence(uid=9, tokens=np.zeros(3, np.int32), action_mask=np.zeros(3, bool),
                      behaviour_logprobs=np.zeros(3, np.float32), advantage=np.zeros(2))


# -- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,key", [
    ({"advantage": "ppo"}, "trainer.advantage"),
    ({"gigpo_anchor": "state"}, "trainer.gigpo_anchor"),
    ({"gigpo_step_norm": "max"}, "trainer.gigpo_step_norm"),
    ({"gigpo_gamma": 0.0}, "trainer.gigpo_gamma"),
    ({"gigpo_gamma": 1.5}, "trainer.gigpo_gamma"),
    ({"gigpo_omega": -1.0}, "trainer.gigpo_omega"),
    ({"gigpo_omega": float("nan")}, "trainer.gigpo_omega"),
])
def test_bad_credit_config_is_one_line_error(kw, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")) as e:
        TrainerConfig(**kw)
    assert "\n" not in str(e.value)


def test_step_credit_from_config():
    assert step_credit(TrainerConfig()) is None
    c = step_credit(TrainerConfig(advantage="gigpo", gigpo_omega=0.5, gigpo_gamma=0.9,
                                  gigpo_anchor="observation", gigpo_step_norm="mean",
                                  adv_eps=1e-5))
    assert c == StepCredit(omega=0.5, gamma=0.9, anchor="observation", norm="mean", eps=1e-5)


@pytest.mark.entry
@pytest.mark.slow
def test_launch_default_task_with_gigpo(tmp_path):
    """A real run of the default task (smaller policy, 3 updates) with step-level credit:
    completes, and every step record counts turns in recurring anchors."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "tiderl.launch", "trainer.advantage=gigpo",
                        "controller.steps=3", "controller.eval_every=0",
                        "controller.checkpoint_every=0", "controller.groups_per_step=4",
                        "env.group_size=4", "model.n_layers=1", "model.d_model=32",
                        "model.mlp_dim=64", "model.head_dim=8", f"run_dir={run_dir}"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    steps = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [s for s in steps if s.get("kind") == "step"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    for s in steps:
        c = s["step_credit"]
        assert c["turns"] >= c["anchored_turns"] > 0 and c["step_groups"] > 0
