"""The sliding image window in the simulated rollout loop (arXiv 2608.10402, Appendix C.2). No JAX.

A GUI task brings a screenshot each round (`tiderl.sim.envs.IMAGE` runs of image tokens). Once
its context holds `window` images, the context is cut before the next observation, with the
production rule (`tiderl.train.image_window.cut`): the context so far becomes a training segment
(`Trajectory.segments`, trained with the trajectory's advantage) and the task continues from the
head (the prompt's text) plus the turns of its `keep` most recent images. The continuation is
recomputed: the task's KV on its rank is freed and the rank prefills the kept context with the
new observation, the vision tower included (`SimEngine.image_token`).

`WindowedRollout` is the production `RolloutManager` with that cut added around its turns (the
production loop does not cut yet): the scheduler sees the windowed context (CTB's footprints
count the kept images' tokens, not the whole history), the engine holds only it, and the
trajectory ends as its segments plus the last part.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tiderl.serving.pages import StopReason
from tiderl.serving.rollout import RolloutManager
from tiderl.serving.trajectory import Trajectory
from tiderl.train.image_window import Segment, cut, image_runs, needs_cut


@dataclasses.dataclass
class _Window:
    ctx: Segment
    head: int | None = None
    """Tokens before the first image (the prompt's text): what every continuation keeps."""
    segments: list[Segment] = dataclasses.field(default_factory=list)
    cut_away: int = 0
    """Tokens of the full transcript no longer in the context (the scheduler's offset)."""
    restart: bool = False
    """A cut happened since the last turn: the next turn recomputes the continuation."""


class _WindowedUsage:
    """The scheduler as the rollout loop sees it: a task's usage is its windowed context. The
    loop reports its whole transcript when the environment answers; the cut is made there
    (before the observation is appended, as the production rule has it)."""

    def __init__(self, sched: Any, owner: WindowedRollout):
        self._sched, self._owner = sched, owner

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sched, name)

    def update_usage(self, task_id: str, tokens: int, **kw: Any) -> None:
        w = self._owner.sim_windows.get(task_id)
        if w is not None and kw.get("ready"):
            self._owner.maybe_cut(w)
        self._sched.update_usage(task_id, tokens - (w.cut_away if w else 0), **kw)


class WindowedRollout(RolloutManager):
    """A `RolloutManager` whose tasks' contexts keep at most `window` images (see the module
    docstring); `image_token` marks the image tokens."""

    def __init__(self, *args: Any, window: int, keep: int, image_token: int, **kw: Any):
        super().__init__(*args, **kw)
        self.sim_window, self.sim_keep, self.image_token = window, keep, image_token
        self.sim_windows: dict[str, _Window] = {}
        self.cuts = 0
        """Cuts made so far (each a recompute of its continuation)."""
        self.sched = _WindowedUsage(self.sched, self)

    def maybe_cut(self, w: _Window) -> None:
        if w.head is None or not needs_cut(w.ctx, self.sim_window):
            return
        done, cont = cut(w.ctx, head_len=w.head, keep=self.sim_keep)
        w.cut_away += len(done.tokens) - len(cont.tokens)
        w.segments.append(done)
        w.ctx, w.restart = cont, True
        self.cuts += 1

    async def _episode(self, ep: Any) -> Trajectory:
        tid = ep.task.task_id
        self.sim_windows[tid] = _Window(ctx=Segment([], [], [], [], image_token=self.image_token))
        try:
            traj = await super()._episode(ep)
            w = self.sim_windows[tid]
            c = w.ctx
            traj.tokens, traj.loss_mask = list(c.tokens), list(c.loss_mask)
            traj.logprobs, traj.versions = list(c.logprobs), list(c.versions)
            traj.segments = w.segments
            return traj
        finally:
            self.sim_windows.pop(tid, None)

    async def _turn(self, ep: Any, new_tokens: list[int], *,
                    max_action_tokens: int | None = None,
                    images: list[Any] | None = None) -> Any:
        w = self.sim_windows.get(ep.task.task_id)
        if w is None:  # an agent-driven episode: not windowed
            return await super()._turn(ep, new_tokens, max_action_tokens=max_action_tokens,
                                       images=images)
        runs = image_runs(new_tokens, self.image_token)
        if w.head is None:
            w.head = len(w.ctx.tokens) + (runs[0][0] if runs else len(new_tokens))
        pending = list(new_tokens)
        if w.restart:  # recompute: drop the task's KV, prefill the continuation afresh
            w.restart = False
            if ep.holder is not None and self.ranks[ep.holder] is not None:
                self.ranks[ep.holder].finish(ep.key)
            ep.holder, ep.handoff = None, None
            pending = list(w.ctx.tokens) + pending
        n = len(w.ctx.tokens)
        w.ctx.add_observation(new_tokens, [None] * len(runs))
        result = await super()._turn(ep, pending, max_action_tokens=max_action_tokens,
                                     images=images)
        if result.stop_reason == StopReason.CONTEXT_LIMIT and not result.action_tokens:
            del w.ctx.tokens[n:], w.ctx.loss_mask[n:], w.ctx.logprobs[n:], w.ctx.versions[n:]
            del w.ctx.images[len(w.ctx.images) - len(runs):]
            return result
        c = w.ctx
        c.tokens += list(result.action_tokens)
        c.loss_mask += [1] * len(result.action_tokens)
        c.logprobs += [float(x) for x in result.logprobs]
        c.versions += [int(v) for v in result.versions]
        return result
