"""The sliding image window in the rollout's episode loop (arXiv 2608.10402: once a trajectory
holds `env.image_window` images, 10 by default, it is split there and continues from its
`env.image_keep` most recent ones, 5 by default). No JAX.

The cut itself is `tiderl.train.image_window.cut`; this module applies it to a live episode
(`RolloutManager(image_window=, image_keep=)`). Before an observation is added to a context
that holds `window` images or more:

- the context so far (tokens, loss mask, the behaviour logprobs and weight versions exactly as
  sampled, its images) is appended to `Trajectory.segments`; it trains as a sequence of its
  own with the trajectory's advantage once the trajectory ends;
- the trajectory continues from the **head** (the system and task prompt, rendered without
  the first observation's images and closed as a finished user turn) followed by the context
  from the user turn of the observation that holds the first kept image (the template's
  after-action tokens, which the head's closing turn already ends with, are not repeated).
  The kept images are the same objects the engine was given (host copies, as for recompute);
  an observation's images stay together (when the first kept image shares its observation
  with older ones, those are kept too, so the continuation never opens inside an observation);
- the task's handle and KV are freed on its rank and the continuation, with the new
  observation, is prefilled from scratch (recompute); the scheduler no longer counts the
  group's prompt as shared by this task (`TaskTable.restart_context`).

A continuation that samples nothing (its fresh prefill did not fit rollout.max_context, or the
episode stopped first) is not a part of its own: the last segment becomes the trajectory's last
part again (`ImageWindow.settle`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from tiderl.envs.templates import Transcript, TurnTemplate
from tiderl.train.image_window import Segment, WindowError, cut, needs_cut

__all__ = ["ImageWindow", "task_head"]


def task_head(template: TurnTemplate, text: str, system: str | None) -> list[int]:
    """The system and task prompt a cut context continues with: the first prompt rendered with
    `text` (the first observation's text, without its images), less the assistant header
    (kept when the rendering does not end with it as a separate run)."""
    full = Transcript.start(template, text, system=system).tokens
    header = template.render(list(template.assistant_open))
    if header and full[-len(header):] == header:
        return full[:-len(header)]
    return full


class ImageWindow:
    """The window of one rollout (`window` 0: never cut)."""

    def __init__(self, window: int, keep: int):
        if window < 0 or window and not 0 < keep < window:
            raise ValueError(f"image_window={window}, image_keep={keep}: the window must be "
                             ">= 0 (0: never cut) and the kept images between 1 and the "
                             "window - 1 (env.image_window, env.image_keep)")
        self.window, self.keep = window, keep
        self.cuts = 0
        """Contexts cut so far (all episodes)."""

    def needs_cut(self, traj: Any) -> bool:
        """The trajectory's current part holds `window` images or more (cut it before its next
        observation)."""
        return self.window > 0 and len(traj.images) >= self.window

    def cut(self, traj: Any, transcript: Transcript, *, head: list[int], first_len: int,
            image_token: int) -> Transcript:
        """Cuts `traj`'s current part (`transcript`, whose first prompt is `first_len` tokens):
        appends it to `traj.segments` and returns the continuation's transcript; `traj`'s
        logprobs, versions and images become the continuation's."""
        n = len(transcript.tokens)
        pad = n - len(traj.logprobs)
        context = Segment(tokens=list(transcript.tokens), loss_mask=list(transcript.loss_mask),
                          logprobs=list(traj.logprobs) + [0.0] * pad,
                          versions=list(traj.versions) + [-1] * pad,
                          images=list(traj.images), image_token=image_token)
        if not needs_cut(context, self.window):
            raise ValueError(f"a context of {len(context.images)} images is below "
                             f"image_window={self.window}; nothing to cut")
        done, cont = self._cut(context, first_len)
        tail = cont.tokens[first_len:]
        at = n - len(tail)
        if context.loss_mask[at - 1]:  # the tail opens an observation that follows an action
            tail = tail[_after_action(transcript.template, tail):]
        tokens = list(head) + tail
        traj.segments.append(done)
        traj.logprobs, traj.versions = [0.0] * len(tokens), [-1] * len(tokens)
        traj.images = cont.images
        self.cuts += 1
        return dataclasses.replace(transcript, tokens=tokens, loss_mask=[0] * len(tokens),
                                   action_spans=[])

    def _cut(self, context: Segment, first_len: int) -> tuple[Segment, Segment]:
        """`cut` keeping an observation's images together: when the first kept image shares
        its observation with older ones, those are kept too (the continuation then opens with
        that whole observation, never inside it); with no such cut, `keep` as it is."""
        for keep in range(self.keep, len(context.images)):
            try:
                done, cont = cut(context, head_len=first_len, keep=keep)
            except WindowError:
                break
            if context.loss_mask[len(context.tokens) - len(cont.tokens) + first_len - 1]:
                return done, cont
        return cut(context, head_len=first_len, keep=self.keep)

    @staticmethod
    def settle(traj: Any) -> None:
        """A last part with no sampled token after a cut is not trained on its own: the last
        segment becomes the trajectory's last part again (call once `traj` is final)."""
        if traj.segments and not any(traj.loss_mask):
            seg = traj.segments.pop()
            traj.tokens, traj.loss_mask = seg.tokens, seg.loss_mask
            traj.logprobs, traj.versions, traj.images = seg.logprobs, seg.versions, seg.images


def _after_action(template: TurnTemplate, tail: list[int]) -> int:
    """How many of the tail's leading tokens are the template's after-action tokens (with the
    closing stop token an action cut at the action limit lacked): 0 when it opens otherwise."""
    for parts in ([template.stop[0], *template.after_action], list(template.after_action)):
        ids = template.render(parts)
        if ids and tail[:len(ids)] == ids:
            return len(ids)
    return 0
