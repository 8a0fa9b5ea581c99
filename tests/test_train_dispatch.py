"""Micro-batch dispatch: property tests (hypothesis) and packing; the JAX-free import check."""

import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiderl.train.dispatch import (
    TrainSequence,
    elastic_take,
    lpt_assign,
    microbatches,
    pack_microbatch,
    plan_microbatches,
    zigzag_assign,
)
from tiderl.train.synthetic import synthetic_trajectories

lengths_st = st.lists(st.integers(1, 64), min_size=1, max_size=60)


def _flat(plan):
    return [i for mb in plan.mbs for rank in mb for i in rank]


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 4), st.integers(1, 3), st.sampled_from(["lpt", "zigzag"]),
       st.sampled_from(["decoupled", "colocated"]))
def test_every_sequence_once_budgets_and_balance(lengths, n_ranks, rows, balance, order):
    budget = rows * 64
    plan, rest = plan_microbatches(lengths, n_ranks=n_ranks, rank_budget=budget, order=order,
                                   balance=balance)
    assert rest == []
    assert sorted(_flat(plan)) == list(range(len(lengths)))  # exactly once
    for mb, loads in zip(plan.mbs, plan.loads(lengths), strict=False):
        assert len(mb) == n_ranks
        assert max(loads) <= budget  # token budget per rank
        longest = max(lengths[i] for rank in mb for i in rank)
        assert max(loads) - min(loads) <= longest  # balance within one sequence length


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 4), st.integers(1, 3))
def test_decoupled_final_microbatch_is_smallest_and_ends_with_shortest(lengths, n_ranks, rows):
    plan, _ = plan_microbatches(lengths, n_ranks=n_ranks, rank_budget=rows * 64,
                                order="decoupled")
    totals = [sum(loads) for loads in plan.loads(lengths)]
    assert totals[-1] == min(totals)
    last = [i for rank in plan.mbs[-1] for i in rank]
    assert min(lengths[i] for i in last) == min(lengths)
    # inside each rank the longest go first, so the shortest is the last sequence fed
    for mb in plan.mbs:
        for rank in mb:
            assert [lengths[i] for i in rank] == sorted((lengths[i] for i in rank), reverse=True)


@settings(max_examples=200, deadline=None)
@given(lengths_st, st.integers(1, 4))
def test_lpt_and_zigzag_balance_within_one_sequence(lengths, n_ranks):
    for ranks in (lpt_assign(lengths, n_ranks)[0], zigzag_assign(lengths, n_ranks)):
        loads = [sum(lengths[i] for i in r) for r in ranks]
        assert sorted(i for r in ranks for i in r) == list(range(len(lengths)))
        assert max(loads) - min(loads) <= max(lengths)


@settings(max_examples=100, deadline=None)
@given(lengths_st, st.integers(1, 4), st.integers(1, 3))
def test_streaming_emits_only_saturated_microbatches(lengths, n_ranks, rows):
    budget = rows * 64
    plan, rest = plan_microbatches(lengths, n_ranks=n_ranks, rank_budget=budget, final=False,
                                   fill=0.9)
    assert sorted(_flat(plan) + rest) == list(range(len(lengths)))
    for loads in plan.loads(lengths):
        assert sum(loads) >= 0.9 * n_ranks * budget  # early micro-batches saturate all ranks


def test_early_microbatches_full_last_small():
    lengths = [60] * 7 + [5]
    plan, _ = plan_microbatches(lengths, n_ranks=2, rank_budget=128, order="decoupled")
    totals = [sum(loads) for loads in plan.loads(lengths)]
    # the first saturates both ranks (2 × 2 × 60 ≤ 2 × 128); the rest and the shortest trail
    assert totals == [240, 185]
    assert plan.mbs[-1][0][-1] == 7 or plan.mbs[-1][1][-1] == 7


def test_packing_layout_and_shift_convention():
    trajs = synthetic_trajectories(9, vocab=50, min_len=3, max_len=20, seed=1, versions=(0, 1))
    mbs, rest = microbatches(trajs, n_ranks=2, row_len=32, rows_per_rank=2)
    assert rest == []
    seen = []
    for mb in mbs:
        assert mb.tokens_bt.shape[0] % 2 == 0 and mb.tokens_bt.shape[1] == 32
        per_rank_rows = mb.tokens_bt.shape[0] // 2
        for r in range(2):
            assert (mb.segment_ids_bt[r * per_rank_rows:(r + 1) * per_rank_rows] > 0).sum() \
                <= 2 * 32
        for b in range(mb.tokens_bt.shape[0]):
            for seg in range(1, mb.segment_ids_bt[b].max() + 1):
                idx = np.nonzero(mb.segment_ids_bt[b] == seg)[0]
                n = len(idx)
                match = [t for t in trajs if t.length == n and
                         np.array_equal(t.tokens, mb.tokens_bt[b, idx])]
                assert match, "packed tokens reproduce a trajectory"
                t = match[0]
                seen.append(t.uid)
                np.testing.assert_array_equal(mb.positions_bt[b, idx], np.arange(n))
                np.testing.assert_array_equal(mb.loss_mask_bt[b, idx], t.action_mask)
                assert mb.loss_mask_bt[b, idx[0]] == 0  # a segment's first token is no action
                np.testing.assert_array_equal(mb.versions_bt[b, idx], t.versions)
                assert np.all(mb.advantages_bt[b, idx] == np.float32(t.advantage))
    assert sorted(seen) == list(range(9))
    assert mbs[0].n_action_tokens == int(mbs[0].loss_mask_bt.sum())


def test_rejects_sequences_too_long_or_starting_with_action():
    with pytest.raises(ValueError, match="trainer.row_len"):
        pack_microbatch([TrainSequence(0, np.ones(40, np.int32), np.zeros(40, bool),
                                    np.zeros(40, np.float32), 0.0)], [[0]], row_len=32)
    with pytest.raises(ValueError, match="first token"):
        TrainSequence(0, np.ones(4, np.int32), np.ones(4, bool), np.zeros(4, np.float32), 0.0)


def test_elastic_batch_bounds():
    assert elastic_take(10, 0, batch_min=4, batch_ideal=8) == (8, True)
    assert elastic_take(3, 0, batch_min=4, batch_ideal=8) == (3, False)  # below B_min: wait
    assert elastic_take(2, 3, batch_min=4, batch_ideal=8) == (2, True)   # ≥ B_min, drained
    assert elastic_take(0, 8, batch_min=4, batch_ideal=8) == (0, True)


def test_control_plane_modules_import_without_jax():
    code = ("import sys, tiderl.train, tiderl.train.dispatch, tiderl.train.ra2p, "
            "tiderl.train.advantages, tiderl.train.synthetic, tiderl.train.config; "
            "assert 'jax' not in sys.modules, sorted(m for m in sys.modules if 'jax' in m)")
    subprocess.run([sys.executable, "-c", code], check=True)
