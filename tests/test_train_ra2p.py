"""RA2P cost model: hand-computed C_dec / C_col (paper Appendix A) and the mode choice."""

import pytest

from tiderl.train.ra2p import PhaseCosts, c_col, c_dec, choose_mode, ras, tprm


def test_c_dec_by_hand():
    # M = 2 actors: fill = 0·t_ref + 1·t_ref = 1. RAS = 3, so δ = 0 and each term is
    # max(0, t_act_f + t_act_b) = 3: C_dec = 1 + 3·3 = 10.
    c = PhaseCosts(t_ref=1, t_act_f=1, t_act_b=2, t_swap=5, m_actor=2)
    assert c_dec([0, 0, 0], c) == 10
    # RAS = 1 (a = −2), then δ_2 = max(a_2, 0) = 4, δ_3 = 9 − 4 = 5, δ_4 = 10 − 9 = 1:
    # 1 + max(0,3) + max(4,3) + max(5,3) + max(1,3) = 1 + 3 + 4 + 5 + 3 = 16.
    assert c_dec([-2, 4, 9, 10], c) == 16
    assert ras([-2, 4, 9, 10]) == 1


def test_c_col_by_hand():
    c = PhaseCosts(t_ref=1, t_act_f=1, t_act_b=2, t_swap=5)
    # all 3 ready: one aggregate, T = (5 + 3·1) + (5 + 3·3) = 22, two swaps.
    assert c_col([0, 0, 0], c) == (22, 2)
    # a = [0, 1, 2, 30]: k=1 at T=0 → 0+5+1=6 → 6+5+3=14; a_2, a_3 ≤ 14 → k=2:
    # 14+5+2=21 → 21+5+6=32; a_4=30 ≤ 32 → k=1: 32+6 = 38 → 38+8 = 46.
    assert c_col([0, 1, 2, 30], c) == (46, 6)
    # memory cap 2 splits the initial burst of 3: (5+2)+(5+6)=18, then (5+1)+(5+3)=32.
    assert c_col([0, 0, 0], c, max_aggregate=2) == (32, 4)
    # idle until the first arrival at 10: 10 + 6 + 8 = 24.
    assert c_col([10], c) == (24, 2)


def test_high_ras_or_short_tprm_chooses_decoupled():
    c = PhaseCosts(t_ref=1, t_act_f=1, t_act_b=2, t_swap=1)
    high_ras = [0.0] * 8
    assert choose_mode(high_ras, c).mode == "decoupled"
    short_tprm = [0, 1, 2, 3, 4, 5]  # a new micro-batch every 1 < t_act_f + t_act_b
    choice = choose_mode(short_tprm, c)
    assert choice.mode == "decoupled" and choice.c_col > 1.1 * choice.c_dec


def test_low_ras_long_tprm_chooses_colocated():
    c = PhaseCosts(t_ref=1, t_act_f=1, t_act_b=2, t_swap=1)
    a = [20, 60, 100]
    # C_dec = 20 + 40 + 40 = 100; C_col = each arrival + (1+1) + (1+3) → 100 + 6 = 106.
    assert c_dec(a, c) == 100
    assert c_col(a, c) == (106, 6)
    choice = choose_mode(a, c, slack=0.1)
    assert choice.mode == "colocated" and choice.ras == 0
    assert tprm(a) == pytest.approx(100 / 3)


def test_choose_mode_needs_ready_times():
    with pytest.raises(ValueError, match="ready time"):
        choose_mode([], PhaseCosts(1, 1, 1, 1))
