"""The simulator's multi-modal workloads: GUI workloads from the paper's Table 4, Qwen3-VL-4B's
vision tower in prefill and training, the sliding image window in the rollout loop, and the
experiments' --workload flag (no JAX)."""

import pytest

from tiderl.sim.costs import SimCostModel, load_profile, model_shape
from tiderl.sim.vision_tower import QWEN3_VL_4B, SCREEN
from tiderl.sim.workloads import WORKLOADS, Sampler, Workload, workload


# -- vision tower ----------------------------------------------------------------------------
def test_a_screenshot_is_880_image_tokens_for_qwen3_vl():
    # 1280×720 → sides divisible by 16·2 = 32: 720/32 = 22.5 rounds (half to even) to 22,
    # so 704×1280 pixels, 44×80 patches of 16, merged 2×2: 880 tokens.
    assert QWEN3_VL_4B.grid(*SCREEN) == (44, 80)
    assert QWEN3_VL_4B.patches(*SCREEN) == 3520
    assert QWEN3_VL_4B.image_tokens(*SCREEN) == 880
    assert WORKLOADS["osworld"].image_tokens == WORKLOADS["scienceboard"].image_tokens == 880


def test_the_towers_flops_follow_its_shape():
    n, d, m = 3520, 1024, 4096
    f = QWEN3_VL_4B.flops_breakdown(*SCREEN)
    assert f["patch_embed"] == 2 * (3 * 2 * 16 * 16) * d * n
    assert f["block_matmuls"] == 2 * 24 * (4 * d * d + 2 * d * m) * n
    assert f["attention"] == 4 * 24 * d * n * n  # full attention over the image's patches
    assert f["mergers"] == 2 * 4 * ((4 * d) ** 2 + 4 * d * 2560) * 880  # merger + 3 deepstack
    assert QWEN3_VL_4B.flops_per_image(*SCREEN) == pytest.approx(3.547e12, rel=1e-3)
    # The tower's weights (~0.41B parameters) are served beside the decoder's.
    vl, text = model_shape("qwen3-vl-4b"), model_shape("qwen3-4b")
    assert vl.weight_bytes - text.weight_bytes == QWEN3_VL_4B.weight_bytes(2)
    assert QWEN3_VL_4B.weight_bytes(2) / 2 == pytest.approx(0.41e9, rel=0.02)


def test_prefill_and_training_charge_the_tower_for_image_tokens():
    prof = load_profile("h100")
    vl, text = SimCostModel(prof, model_shape("qwen3-vl-4b")), SimCostModel(
        prof, model_shape("qwen3-4b"))
    rows = [(0, 2000)]
    # The decoder's part is the same; the tower adds one screenshot's FLOPs at prefill MFU
    # (3.55 TFLOPs at 0.6 × 989 TFLOP/s: compute-bound, ~6 ms).
    extra = vl.prefill(rows, image_tokens=880) - vl.prefill(rows)
    assert extra == pytest.approx(QWEN3_VL_4B.flops_per_image(*SCREEN) / (989e12 * 0.6),
                                  rel=1e-9)
    assert text.prefill(rows, image_tokens=880) == text.prefill(rows)  # no tower, no charge
    # Training: the frozen tower runs in every forward (Ref and Actor), not in the backward.
    lens = [[8000], [8000]]
    assert vl.actor_forward(lens, images=(1760, 0)) > vl.actor_forward(lens)
    assert vl.ref_forward(lens, images=(1760, 0)) > vl.ref_forward(lens)
    assert vl.actor_backward(lens, images=(1760, 0)) == vl.actor_backward(lens)


def test_the_engine_charges_the_tower_for_the_image_tokens_it_computes():
    from tiderl.serving.pages import PrefillRequest
    from tiderl.sim.virtual_engine import SimEngine

    costs = SimCostModel(load_profile("h100"), model_shape("qwen3-vl-4b"))
    charged = {}
    for tok in (None, ord("i")):
        e = SimEngine(costs=costs, num_pages=1024, max_context=8192, max_action_tokens=8,
                      stop_tokens=(260,), image_token=tok)
        ctx = [ord("p")] * 100 + [ord("i")] * 880
        e.prefill_many(None, [PrefillRequest(None, ctx, len(ctx), task_id=1)])
        charged[tok] = e.take_cost_s()
    assert charged[ord("i")] - charged[None] == pytest.approx(costs.vision_prefill(880))


# -- workloads -------------------------------------------------------------------------------
def _final_context(w: Workload, plan) -> int:
    """Tokens of the context a planned task ends in: the prompt's text, then per kept image
    its screenshot, its observation's text (the prompt's screenshot has none) and its action."""
    k, was_cut = w.final_images(plan.rounds)
    turns = range(plan.rounds - k, plan.rounds)
    text = sum(plan.obs_tokens[i - 1] for i in turns if i >= 1)
    assert was_cut == (plan.rounds - k > 0)
    return w.prompt_tokens + k * (w.image_tokens + w.action_tokens) + text


@pytest.mark.parametrize("name", ["osworld", "scienceboard"])
def test_gui_workloads_reproduce_table_4(name):
    # Table 4 (arXiv 2608.10402): OSWorld 35→15 rounds, 12,000 tokens, 5–9 images;
    # ScienceBoard 39→29 rounds, 24,000→23,000 tokens, 8–15 images. Tolerance as the text
    # workloads': rounds 8%, tokens 10% over 500 tasks.
    w = workload(name)
    s = Sampler({name: w}, seed=1)
    for step, k in ((0, 0), (w.drift_steps, 1)):
        plans = [s.plan(name, f"t{step}/{i}", step) for i in range(500)]
        assert sum(p.rounds for p in plans) / 500 == pytest.approx(w.rounds[k], rel=0.08)
        ctx = sum(_final_context(w, p) for p in plans) / 500
        assert ctx == pytest.approx(w.tokens[k], rel=0.1)
        assert max(p.rounds for p in plans) <= w.max_turns == 50
        imgs = [w.final_images(p.rounds)[0] for p in plans if p.rounds > w.image_window]
        # After a cut the context holds keep + 1 .. window images.
        assert min(imgs) >= w.image_keep + 1 and max(imgs) <= w.image_window
    assert (workload("osworld").image_window, workload("osworld").image_keep) == (10, 5)
    assert (workload("scienceboard").image_window, workload("scienceboard").image_keep) == (16, 8)


def test_final_images_follow_the_window():
    w = workload("osworld")  # window 10, keep 5; one image with the prompt, one per round after
    assert [w.final_images(n)[0] for n in (1, 9, 10, 11, 15, 16, 20, 21)] == \
        [1, 9, 10, 6, 10, 6, 10, 6]
    assert [w.final_images(n)[1] for n in (10, 11)] == [False, True]


# -- the sliding image window in the rollout loop --------------------------------------------
TINY = Workload(name="tinygui", rounds=(9, 9), tokens=(400, 400), prompt_tokens=20,
                action_tokens=6, max_turns=14, max_context=4096, latency_median_s=0.5,
                latency_sigma=0.5, start_median_s=1.0, image_tokens=16, image_window=4,
                image_keep=2)


def _play(windowed: bool, groups: int = 3, size: int = 4):
    from tiderl.envs.templates import template_for
    from tiderl.serving.ctb import CTBConfig, make_scheduler
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager
    from tiderl.sim.clock import run_virtual
    from tiderl.sim.cluster import _Bytes
    from tiderl.sim.envs import SimAgentEnv
    from tiderl.sim.virtual_engine import SimEngine
    from tiderl.sim.window import WindowedRollout

    sampler = Sampler({"tinygui": TINY}, seed=3)
    tmpl = template_for(_Bytes(), "byte")
    costs = SimCostModel(load_profile("h100"), model_shape("qwen3-vl-4b"))
    usage: list[tuple[str, int]] = []

    async def go():
        eng = SimEngine(costs=costs, num_pages=4096, page_size=16, max_slots=64,
                        max_context=4096, max_action_tokens=64, actions=sampler,
                        stop_tokens=tuple(sorted(tmpl.stop_ids)), image_token=ord("i"))
        rank = RolloutRank(0, eng)
        await rank.start()
        sched = make_scheduler("ctb", CTBConfig(), [4096 * 16], max_context=4096,
                               max_tasks_per_rank=64)
        record = sched.update_usage

        def spy(tid, tokens, **kw):
            usage.append((tid, tokens))
            record(tid, tokens, **kw)

        sched.update_usage = spy
        env = SimAgentEnv(sampler)
        kw = {"window": 4, "keep": 2, "image_token": ord("i")} if windowed else {}
        cls = WindowedRollout if windowed else RolloutManager
        mgr = cls([rank], sched, env, tmpl, max_turns=TINY.max_turns, **kw)
        out = []
        for g in range(groups):
            gid = f"g{g}"
            spec = {"group_id": gid, "tasks": [
                {"task_id": f"{gid}/m{m}", "group_id": gid, "suite": "tinygui"}
                for m in range(size)]}
            out += await mgr.run_group(spec)
        await rank.close()
        return mgr, out

    mgr, trajs = run_virtual(go())
    return mgr, trajs, usage


def _images(tokens):
    from tiderl.train.image_window import image_runs

    return len(image_runs(tokens, ord("i")))


def test_the_window_cuts_trajectories_into_trained_segments():
    plain_mgr, plain, _ = _play(False)
    mgr, trajs, usage = _play(True)
    assert all(t.ok for t in trajs) and len(trajs) == 12
    by_id = {t.task_id: t for t in plain}
    cuts = 0
    for t in trajs:
        k, was_cut = TINY.final_images(t.turns)
        assert len(t.segments) == (0 if not was_cut else 1 + (t.turns - 5) // 2)
        cuts += len(t.segments)
        # Each cut segment held the whole window; each part after the first starts with the
        # head (the prompt's text, before the first screenshot), and the last part holds the
        # images final_images says.
        assert all(_images(s.tokens) == 4 for s in t.segments)
        head = t.segments[0].tokens[:t.segments[0].tokens.index(ord("i"))] if was_cut else []
        for part in [*t.segments[1:], t]:
            if was_cut:
                assert part.tokens[:len(head)] == head
        assert _images(t.tokens) == k
        # Every action is trained in exactly one part: one trained stop token per turn.
        parts = [*t.segments, t]
        assert sum(1 for p in parts for tok, m in zip(p.tokens, p.loss_mask, strict=True)
                   if m and tok == 260) == t.turns
        for p in parts:
            assert len(p.tokens) == len(p.loss_mask) == len(p.logprobs) == len(p.versions)
        if not was_cut:  # no cut: the same trajectory as the production loop's
            ref = by_id[t.task_id]
            assert (t.tokens, t.loss_mask) == (ref.tokens, ref.loss_mask)
            assert t.logprobs == pytest.approx(ref.logprobs)
    assert cuts == mgr.cuts > 0
    # CTB's footprint is the windowed context: no report beyond the longest part plus one
    # observation, where the production loop reports the whole history.
    longest = max(len(p.tokens) for t in trajs for p in [*t.segments, t])
    assert max(n for _, n in usage) <= longest + 16 + 4 + 5 * TINY.obs_mean(9, 400)
    assert max(len(t.tokens) for t in plain) > longest


def test_a_windowed_job_trains_its_segments():
    from tiderl.sim.cluster import SimConfig, simulate_job

    r = simulate_job(SimConfig(mode="tiderl", model="qwen3-vl-4b", gpus=2, rollout_ratio=0.5,
                               workloads=("osworld",), steps=1, groups_per_step=2,
                               group_size=2, eval_every=0, tokens_per_gpu=32768))
    assert r.controller.manager.cuts > 0
    step = r.steps[-1]
    # Consumed: every action token of the step's groups, segments included (sequences > tasks).
    assert step["action_tokens"] > 0 and r.trainer.version == 1


# -- the --workload flag ---------------------------------------------------------------------
class _Stop(Exception):
    pass


@pytest.mark.parametrize("name,default", [("fig8", ("webshop", "alfworld")),
                                          ("table2", ("osworld",))])
def test_the_workload_flag_picks_the_runs_workload(monkeypatch, tmp_path, name, default):
    from tiderl.sim import experiments

    seen = []

    def capture(cfgs, jobs=1, follow=None):
        seen.append(dict(cfgs))
        raise _Stop

    monkeypatch.setattr(experiments, "run_all", capture)
    for argv, wls in (([], default), (["--workload", "osworld"], ("osworld",)),
                      (["--workload", "scienceboard"], ("scienceboard",))):
        seen.clear()
        with pytest.raises(_Stop):
            experiments.main([name, "--steps", "1", "--jobs", "1", "--planner", "",
                              "--out", str(tmp_path), *argv])
        cfgs = list(seen[0].values())
        assert {c.workloads for c in cfgs} == {wls}
        gui = wls != ("webshop", "alfworld")
        assert {c.model for c in cfgs} == ({"qwen3-vl-4b"} if gui else {"qwen2.5-7b"})
        if name == "fig8":  # the baselines swept as for text
            assert {c.mode for c in cfgs} >= {"sync", "async", "stream"}
            assert {c.rollout_ratio for c in cfgs if c.mode == "async"} == {0.125, 0.25, 0.375,
                                                                            0.5}


def test_the_workload_flag_refuses_bad_input(capsys):
    from tiderl.sim import experiments

    for argv in (["fig8", "--workload", "nope"], ["fig4", "--workload", "osworld"]):
        with pytest.raises(SystemExit) as e:
            experiments.main(argv)
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--workload: sim workload 'nope' is unknown" in err
    assert "--workload applies to fig8 and table2, not fig4" in err


def test_gui_windows_must_agree_in_one_job(rank_calls):
    from tiderl.configlib import ConfigError
    from tiderl.sim.cluster import SimConfig, simulate_job

    started = rank_calls("start")
    with pytest.raises(ConfigError, match="mix image windows"):
        simulate_job(SimConfig(workloads=("osworld", "scienceboard"), steps=1, gpus=2))
    assert started == []  # refused before any rank started (none is left running)


def test_the_gui_path_imports_no_jax():
    import subprocess
    import sys

    code = ("import sys, tiderl.sim.window, tiderl.sim.vision_tower, tiderl.sim.cluster\n"
            "print('jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False"]


def test_table2_runs_ra2p_at_fixed_splits_beside_ers(monkeypatch, tmp_path):
    """With the sweep, table2 also runs +RA2P (no planner, request-level scheduler) at other
    fixed rollout shares: the split ERS starts away from, known only in hindsight."""
    from tiderl.sim import experiments

    seen = []

    def capture(cfgs, jobs=1, follow=None):
        seen.append(dict(cfgs))
        raise _Stop

    monkeypatch.setattr(experiments, "run_all", capture)
    for argv, splits in (([], {0.375, 0.5, 0.625}), (["--no-sweep"], set())):
        seen.clear()
        with pytest.raises(_Stop):
            experiments.main(["table2", "--steps", "1", "--jobs", "1", "--out", str(tmp_path),
                              *argv])
        cfgs = seen[0]
        fixed = {k: c for k, c in cfgs.items() if k.startswith("+RA2P @")}
        assert {c.rollout_ratio for c in fixed.values()} == splits
        assert all(c.planner == "" and c.scheduler == "vanilla" and c.mode == "tiderl"
                   for c in fixed.values())
        assert cfgs["+ERS"].rollout_ratio == cfgs["+RA2P"].rollout_ratio == 0.25
