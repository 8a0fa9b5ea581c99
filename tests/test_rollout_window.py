"""The sliding image window in the rollout's episode loop (serving/rollout_window.py): a real gui
env server, the host-side engine (`SimEngine`) behind a real `RolloutRank`, CTB, and a
vision-language `ImagePrompt`. A 12-image trajectory with window 10, keep 5 becomes one cut
segment (images 1-10) and a last part (the head + images 6-12), token for token; the
continuation is prefilled from scratch; every sampled token is trained exactly once with its
behaviour logprob and version; the buffer and micro-batcher the runtime uses train both parts
with the trajectory's advantage. No JAX in the rollout path (the batcher's module imports it).
"""

import asyncio

import numpy as np
import pytest

pytest.importorskip("transformers")

from test_models_vision_inputs import _vl_tokenizer  # noqa: E402

SYSTEM = "You operate a desktop."
WINDOW, KEEP = 10, 5


def _setup(tmp_path):
    from tiderl.envs.templates import chatml_template
    from tiderl.models.config import VisionConfig
    from tiderl.models.vision_inputs import ImageProcessing, ImagePrompt

    _, tok = _vl_tokenizer(tmp_path)
    tmpl = chatml_template(tok)
    vision = VisionConfig(patch_size=4, image_token_id=tok.token_to_id("<|image_pad|>"))
    return tok, tmpl, ImagePrompt(vision, ImageProcessing(min_pixels=64, max_pixels=4096))


class _EnvLog:
    """The env client, passing every call through, keeping each task's replies."""

    def __init__(self, env, before_step=None):
        self.env, self.replies, self.before_step = env, {}, before_step
        self._task = {}

    async def start(self, spec):
        r = await self.env.start(spec)
        self._task[r.session] = spec["task_id"]
        self.replies[spec["task_id"]] = [r]
        return r

    async def step(self, session, action):
        if self.before_step is not None:
            await self.before_step(self._task[session], len(self.replies[self._task[session]]))
        r = await self.env.step(session, action)
        self.replies[self._task[session]].append(r)
        return r

    def __getattr__(self, name):
        return getattr(self.env, name)


async def _play(tmp_path, *, window, keep=KEEP, group_size=2, n_ranks=1, scheduler="ctb",
                num_pages=None, drain_before_step=None):
    """Plays one gui group (5 oracle turns: a 12-turn budget no random action solves, so 12
    screenshots reach the context) on `n_ranks` ranks whose engines have `num_pages` pages of
    16 tokens. `drain_before_step`: before the first task's step of that number (from 1), its
    rank is drained. Returns (trajectories, the engines' prefill requests, each task's turn
    results, the env's replies, what the scheduler held at each fresh prefill after a cut,
    tok, tmpl, prompt, the manager, the ranks)."""
    from tiderl.envs.adapters.gui import GuiDesktop
    from tiderl.envs.client import EnvClient
    from tiderl.envs.config import EnvConfig
    from tiderl.envs.server import EnvServer
    from tiderl.envs.tasks import TaskSource
    from tiderl.serving.ctb import CTBConfig, make_scheduler
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager, numeric_id
    from tiderl.sim.fakes import SimEngine
    from tiderl.sim.virtual_engine import DigitActions

    tok, tmpl, prompt = _setup(tmp_path)
    requests, results, at_fresh, held = [], {}, [], []
    sched = make_scheduler(scheduler, CTBConfig(), [1 << 16] * n_ranks, max_context=8192)

    class Recording(SimEngine):
        """Records each prefill request (and, at a fresh one after the first turn, whether
        the task still holds a slot and what the scheduler holds for it); a new weight version
        per call and a distinct logprob per sampled token, so both are traceable."""

        draws = 0
        seen: set[int] = set()

        def prefill_many(self, params, reqs):
            self.update_weights(None, version=self.version + 1, flush=False)
            for r in reqs:
                fresh = r.existing_prefix is None
                requests.append((r.task_id, fresh, list(r.tokens[:r.true_length]),
                                 list(r.images or ())))
                if fresh and any(p.task_id == r.task_id for p in self.slots.values()):
                    held.append(r.task_id)  # a fresh prefill while the task's old KV is held
                if fresh and r.task_id in self.seen:  # a continuation
                    tid = next(t for t in sched.tasks
                               if numeric_id(t) == r.task_id)
                    t = sched.tasks[tid]
                    sched._check_indexes()
                    ctb = scheduler == "ctb"  # (the vanilla scheduler plans no usage)
                    at_fresh.append((tid, t.tokens, t.prompt_tokens,
                                     sched.usage(t.rank) if ctb else None,
                                     sched._usage_of(sched.active_on(t.rank)) if ctb else None))
                self.seen.add(r.task_id)
            return super().prefill_many(params, reqs)

        def _sample(self, h, n):
            super()._sample(h, n)
            for j in range(n):
                Recording.draws += 1
                h.logprobs[len(h.logprobs) - n + j] = -Recording.draws / 1024

    class Rank(RolloutRank):
        def turn(self, task_id, new_tokens, prefix=None, **kw):
            fut = super().turn(task_id, new_tokens, prefix, **kw)
            sid = kw["sample_id"]
            fut.add_done_callback(lambda f: f.cancelled() or f.exception() is not None
                                  or results.setdefault(sid, []).append(f.result()))
            return fut

    cfg = EnvConfig(suite="gui", options=("width=320", "height=200", "min_turns=5",
                                          "max_turns=5"), retries=0)
    ranks = [Rank(i, Recording(max_action_tokens=8, max_context=8192, num_pages=num_pages,
                               actions=DigitActions(0, length=4),
                               stop_tokens=tuple(tmpl.stop_ids)))
             for i in range(n_ranks)]
    for rank in ranks:
        await rank.start()
    task, drained = "train/e0/g0/m0", []

    async def drain(task_id, steps_before):
        if task_id == task and steps_before + 1 == drain_before_step:
            drained.append(mgr.episodes[task_id].holder)
            await mgr.drain_rank(drained[-1])
            assert mgr.episodes[task_id].handoff is not None  # the drain handed it over

    try:
        async with EnvServer(GuiDesktop, cfg).serve() as url, EnvClient(url, cfg) as client:
            env = _EnvLog(client, drain if drain_before_step else None)
            mgr = RolloutManager(ranks, sched, env, tmpl, max_turns=20, system=SYSTEM,
                                 images=prompt, image_window=window, image_keep=keep)
            trajs = await mgr.run_group(TaskSource("gui", "train", groups=1,
                                                   group_size=group_size).element(0))
    finally:
        for rank in ranks:
            await rank.close()
    assert held == [] and len(drained) == bool(drain_before_step)
    return trajs, requests, results, env.replies, at_fresh, tok, tmpl, prompt, mgr, ranks


def _oracle(tmpl, prompt, replies, results):
    """The uncut context, rendered from the env's replies and the sampled actions: per
    observation its ids' offset, its ids and its images; per turn its action."""
    from tiderl.envs.templates import Transcript

    text, images = prompt.observation(replies[0].observation, replies[0].images)
    tr = Transcript.start(tmpl, text, system=SYSTEM,
                          expand=lambda ids: prompt.expand(images, ids))
    obs = [(0, list(tr.tokens), images)]
    for k, res in enumerate(results):
        tr.add_action(res.action_tokens)
        if k + 1 < len(results):
            at = len(tr)
            text, images = prompt.observation(replies[k + 1].observation, replies[k + 1].images)
            ids = tr.add_observation(text, expand=lambda ids, im=images: prompt.expand(im, ids))
            obs.append((at, ids, images))
    return tr, obs


def test_a_twelve_image_trajectory_is_cut_once_and_continues_from_the_kept_images(tmp_path):
    """Window 10, keep 5: each task of the group ends after 12 turns with 12 screenshots in its
    context, cut once before the 11th observation. The segment is the whole context up to the
    10th action (images 1-10, every action trained, logprobs and versions as sampled); the last
    part is the head (system + task text, no image) + the context from observation 6's user
    turn on + observations 11-12 with their actions, whose 11th and 12th actions alone are
    trained; the engine got the continuation as a fresh prefill (the old KV freed first, the
    kept images the same objects it was handed before) and the scheduler holds the task at
    the continuation's size with no shared prompt."""
    from tiderl.envs.protocol import EndReason
    from tiderl.envs.templates import Transcript
    from tiderl.serving.rollout import numeric_id

    trajs, requests, results, replies, at_fresh, tok, tmpl, prompt, mgr, _ = asyncio.run(
        _play(tmp_path, window=WINDOW))
    assert mgr.window.cuts == mgr.stats()["window_cuts"] == 2
    image_token = prompt.vision.image_token_id
    for t in trajs:
        sid = numeric_id(t.task_id)
        res = results[sid]
        assert t.end_reason == EndReason.done and t.turns == len(res) == 12, t.error
        tr, obs = _oracle(tmpl, prompt, replies[t.task_id], res)
        assert len(obs) == 12 and all(len(im) == 1 for _, _, im in obs)
        shots = [im[0] for _, _, im in obs]
        mine = [(fresh, toks, ims) for s, fresh, toks, ims in requests if s == sid]
        assert len(mine) == 12  # one prefill per turn
        # What the engine was handed: observations 1-10 appended to the task's context, then
        # the continuation prefilled from scratch with the kept images and the 11th screenshot.
        assert [f for f, _, _ in mine] == [True] + [False] * 9 + [True, False]
        assert [len(ims) for _, _, ims in mine] == [1] * 10 + [6, 1]
        handed = [ims[0] for _, _, ims in mine[:10]] + [mine[10][2][-1], mine[11][2][0]]
        for im, shot in zip(handed, shots, strict=True):  # the env's screenshots, in order
            assert np.array_equal(im.pixels, shot.pixels) and im.grid_thw == shot.grid_thw
        # The kept images are the objects handed before (host copies, as for recompute).
        assert [x is y for x, y in zip(mine[10][2][:5], handed[5:10], strict=True)] == [True] * 5

        # The cut segment: exactly the uncut context up to the 10th action.
        assert len(t.segments) == 1
        seg = t.segments[0]
        end10 = obs[10][0]  # where the 11th observation starts in the uncut context
        assert seg.tokens == tr.tokens[:end10] and seg.loss_mask == tr.loss_mask[:end10]
        assert [a is b for a, b in zip(seg.images, handed[:10], strict=True)] == [True] * 10
        assert seg.image_token == image_token

        # The last part: the head, the context from observation 6's user turn, then turns 11-12.
        head = tok.decode(t.tokens[:_head_len(t.tokens, tok)], skip_special=False)
        assert head == (f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n"
                        f"{replies[t.task_id][0].observation}<|im_end|>\n")
        n_head = _head_len(t.tokens, tok)
        text_only = Transcript.start(tmpl, replies[t.task_id][0].observation, system=SYSTEM)
        assert t.tokens[:n_head] == text_only.tokens[:n_head]
        after = len(tok.encode("\n"))  # chatml's after-action tokens, already ending the head
        at6, ids6, _ = obs[5]
        assert tok.decode(ids6[:after], skip_special=False) == "\n"
        kept = tr.tokens[at6 + after:end10]
        rest = tr.tokens[end10:]
        assert t.tokens == t.tokens[:n_head] + kept + rest
        assert mine[10][1] == t.tokens[:n_head + len(kept) + len(obs[10][1])]
        assert [a is b for a, b in zip(t.images, handed[5:], strict=True)] == [True] * 7
        assert t.tokens.count(image_token) == sum(
            1 for x in tr.tokens[at6:] if x == image_token)
        tail_mask = [0] * (n_head + len(kept)) + tr.loss_mask[end10:]
        assert t.loss_mask == tail_mask

        # Every sampled token trained exactly once, with its logprob and version.
        def trained(part):
            on = [i for i, m in enumerate(part.loss_mask) if m]
            return ([part.tokens[i] for i in on], [part.logprobs[i] for i in on],
                    [part.versions[i] for i in on])

        parts = [trained(seg), trained(t)]
        for j, field in enumerate(("action_tokens", "logprobs", "versions")):
            want = [x for r in res for x in getattr(r, field)]
            assert parts[0][j] + parts[1][j] == want, field
        assert len(set(parts[0][1] + parts[1][1])) == sum(len(r.logprobs) for r in res)
        assert len(set(parts[0][2] + parts[1][2])) > 1  # several weight versions sampled
        for part in (seg, t):
            off = [i for i, m in enumerate(part.loss_mask) if not m]
            assert all(part.logprobs[i] == 0.0 and part.versions[i] == -1 for i in off)
        assert t.action_token_count == sum(len(r.action_tokens) for r in res)
        assert t.min_version == min(x for r in res for x in r.versions)

    # The scheduler at each fresh prefill: the task at the continuation's size, no prompt
    # counted as shared, its rank's usage equal to a recount.
    assert len(at_fresh) == 2
    for tid, tokens, prompt_tokens, usage, recount in at_fresh:
        assert tokens == len(requests_for(requests, numeric_id(tid))[10])
        assert prompt_tokens == 0 and usage == recount


def requests_for(requests, sid):
    return [toks for s, _, toks, _ in requests if s == sid]


def _head_len(tokens, tok):
    """Tokens up to the end of the first user turn (the second <|im_end|>, and its newline)."""
    end = tok.token_to_id("<|im_end|>")
    at = [i for i, x in enumerate(tokens) if x == end][1] + 1
    return at + len(tok.encode("\n"))


def test_the_buffer_and_batcher_train_both_parts_with_the_trajectorys_advantage(tmp_path):
    """The cut trajectories of a group, through the runtime's `ReadinessBuffer` and
    `MicroBatcher`: each trajectory's segment and last part become sequences with its
    advantage, their images the same objects in order, and the packed micro-batches' loss
    mask covers every sampled token of both parts once."""
    from tiderl.config import load_config
    from tiderl.control.buffer import ReadinessBuffer
    from tiderl.runtime.parts import MicroBatcher

    trajs = asyncio.run(_play(tmp_path, window=WINDOW))[0]
    trajs[0].reward, trajs[1].reward = 1.0, 0.0  # random clicks solve nothing: give it signal
    buf = ReadinessBuffer(groups_per_microbatch=1, max_staleness=100, min_ok_per_group=2)
    g = buf.add_group(trajs, now=0.0)
    assert g is not None and len(g.seqs) == 4
    assert g.action_tokens == sum(t.action_token_count for t in trajs)
    assert g.min_version == min(t.min_version for t in trajs)
    for t, (cut, last) in zip(trajs, (g.seqs[:2], g.seqs[2:]), strict=True):
        assert cut.advantage == last.advantage and cut.advantage != 0
        for seq, part in ((cut, t.segments[0]), (last, t)):
            assert seq.tokens.tolist() == part.tokens
            assert seq.action_mask.tolist() == [bool(m) for m in part.loss_mask]
            assert [a is b for a, b in zip(seq.images, part.images, strict=True)] == \
                [True] * len(part.images)
    assert g.seqs[0].advantage > 0 > g.seqs[2].advantage
    cfg = load_config(None, ["trainer.row_len=2048", "trainer.rows_per_rank=4"])
    mbs = MicroBatcher(cfg, 1, "decoupled")(g.seqs, True)
    on = np.concatenate([mb.loss_mask_bt.ravel() > 0 for mb in mbs])
    adv = np.concatenate([mb.advantages_bt.ravel() for mb in mbs])
    assert int(on.sum()) == g.action_tokens
    assert sorted(set(np.round(adv[on], 6))) == sorted({round(float(s.advantage), 6)
                                                        for s in g.seqs})
    assert sum(len(mb.images) for mb in mbs) == sum(len(s.images) for s in g.seqs) == 2 * 17


def test_window_zero_never_cuts(tmp_path):
    """image_window=0 (the default): the same 12-screenshot episode stays one context."""
    trajs, requests, *_, mgr, _ = asyncio.run(_play(tmp_path, window=0, group_size=1))
    (t,) = trajs
    assert mgr.window.cuts == 0 and t.segments == [] and len(t.images) == 12
    assert [fresh for _, fresh, _, _ in requests] == [True] + [False] * 11


def test_window_settings_are_checked():
    from tiderl.serving.rollout_window import ImageWindow

    for window, keep in ((-1, 5), (10, 0), (10, 10)):
        with pytest.raises(ValueError, match="image_window"):
            ImageWindow(window, keep)
    assert ImageWindow(0, 5).window == 0


def _started(tmp_path, *, seed, n_pics):
    """A transcript begun with the first of `n_pics` random 24x16 pictures (the task's first
    screenshot) and its trajectory holding that image: (tok, tmpl, prompt, pics, transcript,
    first prompt length, trajectory)."""
    import functools

    import PIL.Image

    from tiderl.envs.protocol import EndReason
    from tiderl.envs.templates import Transcript
    from tiderl.serving.trajectory import Trajectory

    tok, tmpl, prompt = _setup(tmp_path)
    rng = np.random.default_rng(seed)
    pics = [PIL.Image.fromarray(rng.integers(0, 256, (16, 24, 3), dtype=np.uint8))
            for _ in range(n_pics)]
    text, ims = prompt.observation("find the file", pics[:1])
    tr = Transcript.start(tmpl, text, system=SYSTEM, expand=functools.partial(prompt.expand, ims))
    traj = Trajectory(task_id="t", group_id="g", is_eval=False, tokens=[], loss_mask=[],
                      logprobs=[], versions=[], reward=0.0, end_reason=EndReason.done, turns=0)
    traj.images += ims
    return tok, tmpl, prompt, pics, tr, len(tr), traj


def test_a_cut_after_actions_ended_at_the_action_limit_and_a_continuation_that_samples_nothing(
        tmp_path):
    """Actions that ended at the action limit (no stop token: the next observation opens with
    the stop token and the after-action tokens, which the head's closed turn already ends
    with): the continuation is the head + the kept observation's user turn on. A continuation
    that then samples nothing (its prefill refused) is not a part of its own: `settle` makes
    the cut segment the last part again."""
    import functools

    from tiderl.serving.rollout_window import ImageWindow, task_head

    tok, tmpl, prompt, pics, tr, first_len, traj = _started(tmp_path, seed=3, n_pics=3)
    obs = []
    for k in (1, 2, 3):
        at = len(tr)
        act = tok.encode(f"click {k}")  # no <|im_end|>: ended at the action limit
        tr.add_action(act)
        traj.logprobs += [0.0] * (at - len(traj.logprobs)) + [-k / 8] * len(act)
        traj.versions += [-1] * (at - len(traj.versions)) + [k] * len(act)
        if k < 3:
            text, ims = prompt.observation(f"step {k} done", pics[k:k + 1])
            obs.append((len(tr), tr.add_observation(
                text, expand=functools.partial(prompt.expand, ims))))
            traj.images += ims
    window = ImageWindow(3, 1)
    assert window.needs_cut(traj)
    uncut = list(tr.tokens), list(tr.loss_mask), list(traj.images)
    head = task_head(tmpl, "find the file", SYSTEM)
    assert tok.decode(head, skip_special=False) == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nfind the file<|im_end|>\n")
    cont = window.cut(traj, tr, head=head, first_len=first_len,
                      image_token=prompt.vision.image_token_id)
    at2, ids2 = obs[1]
    lead = len(tmpl.render([tmpl.stop[0], *tmpl.after_action]))
    assert tok.decode(ids2[:lead], skip_special=False) == "<|im_end|>\n"
    assert cont.tokens == head + uncut[0][at2 + lead:] and cont.loss_mask == [0] * len(cont)
    (seg,) = traj.segments
    assert (seg.tokens, seg.loss_mask) == uncut[:2]
    assert [a is b for a, b in zip(seg.images, uncut[2], strict=True)] == [True] * 3
    assert traj.images[0] is uncut[2][2] and len(traj.images) == 1
    trained = [(seg.logprobs[i], seg.versions[i]) for i, m in enumerate(seg.loss_mask) if m]
    assert sorted(set(trained)) == [(-3 / 8, 3), (-2 / 8, 2), (-1 / 8, 1)]
    assert traj.logprobs == [0.0] * len(cont) and traj.versions == [-1] * len(cont)

    # The continuation's prefill was refused: the trajectory keeps only what the engine took.
    traj.tokens, traj.loss_mask, traj.logprobs, traj.versions = [], [], [], []
    ImageWindow.settle(traj)
    assert traj.segments == [] and (traj.tokens, traj.loss_mask) == uncut[:2]
    assert [a is b for a, b in zip(traj.images, uncut[2], strict=True)] == [True] * 3
    ImageWindow.settle(traj)  # nothing cut: unchanged
    assert traj.tokens == uncut[0]


def _parts(t):
    """A trajectory's parts by value: tokens, masks and image pixels of each."""
    return [(p.tokens, p.loss_mask, [(im.pixels.tobytes(), tuple(im.grid_thw))
                                     for im in p.images]) for p in [*t.segments, t]]


@pytest.mark.parametrize("case", ["evictions", "drained"])
def test_cuts_under_kv_pressure_and_after_a_drained_rank_give_the_same_trajectories(
        tmp_path, case):
    """Sampling is keyed by task and position, so a task's trajectory does not depend on
    where or how often its KV was computed. The vanilla scheduler on a pool too small for
    both tasks' contexts (the rank evicts the idle one, LRU, and recomputes it), or a second
    rank taking over after the first task's rank is drained right before the step whose
    observation is cut (the cut drops the handle the drain handed over): both tasks are cut
    once and their parts equal the unhindered run's, token for token and image for image."""
    from tiderl.serving.rollout import numeric_id

    base = asyncio.run(_play(tmp_path / "base", window=WINDOW))
    if case == "evictions":
        # 110 pages of 16 tokens: one task's context (up to ~1,500 tokens) fits, two do not.
        run = asyncio.run(_play(tmp_path / "run", window=WINDOW, scheduler="vanilla",
                                num_pages=110))
        assert sum(r.stats.forced_evictions for r in run[-1]) > 0
    else:
        run = asyncio.run(_play(tmp_path / "run", window=WINDOW, n_ranks=2,
                                drain_before_step=10))
        mgr, requests = run[-2], run[1]
        assert sum(r is None for r in mgr.ranks) == 1  # the task's rank was drained
        # The cut task's continuation was prefilled from scratch (not from the handed-over
        # handle) on the rank left.
        sid = numeric_id("train/e0/g0/m0")
        assert [fresh for s, fresh, _, _ in requests if s == sid] == \
            [True] + [False] * 9 + [True, False]
    for want, got in zip(base[0], run[0], strict=True):
        assert got.task_id == want.task_id and len(got.segments) == 1
        assert _parts(got) == _parts(want)


def test_an_observations_images_stay_together_in_the_continuation(tmp_path):
    """Two screenshots per observation, window 4, keep 1: the most recent image shares its
    observation with the one before, so both are kept and the continuation opens with that
    whole observation (its user turn), never between its images."""
    import functools

    from tiderl.serving.rollout_window import ImageWindow, task_head

    tok, tmpl, prompt, pics, tr, first_len, traj = _started(tmp_path, seed=4, n_pics=5)
    starts = []
    for k, shown in ((1, pics[1:3]), (2, pics[3:5])):
        tr.add_action(tok.encode(f"click {k}") + [tok.token_to_id("<|im_end|>")])
        text, ims = prompt.observation(f"step {k} done", shown)
        starts.append(len(tr))
        tr.add_observation(text, expand=functools.partial(prompt.expand, ims))
        traj.images += ims
    tr.add_action(tok.encode("click 3") + [tok.token_to_id("<|im_end|>")])
    traj.logprobs = [-0.5 * m for m in tr.loss_mask]
    traj.versions = [m - 1 for m in tr.loss_mask]
    uncut, images = list(tr.tokens), list(traj.images)
    head = task_head(tmpl, "find the file", SYSTEM)
    cont = ImageWindow(4, 1).cut(traj, tr, head=head, first_len=first_len,
                                 image_token=prompt.vision.image_token_id)
    after = len(tok.encode("\n"))
    assert cont.tokens == head + uncut[starts[1] + after:]
    assert tok.decode(cont.tokens[len(head):len(head) + 3], skip_special=False).startswith(
        "<|im_start|>user\n")
    assert [a is b for a, b in zip(traj.images, images[3:], strict=True)] == [True, True]
    assert traj.segments[0].tokens == uncut and len(traj.segments[0].images) == 5
