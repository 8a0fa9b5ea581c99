"""The sliding image window of image tasks (arXiv 2608.10402: a trajectory that holds
`env.image_window` images, 10 by default, is split there and continues from its
`env.image_keep` most recent ones, 5 by default). Host logic, no JAX.

A task's context is token ids in which each image is a run of placeholder tokens (as the
vision-language policies take them). Before an observation is appended to a context that holds
`window` images or more, the context is cut:

- the whole context so far becomes a training **segment**: its tokens, loss mask, behaviour
  logprobs and versions unchanged, with its images, trained with the trajectory's advantage
  once the trajectory ends (every action token in the context it was sampled in);
- the **continuation** is the head (the system and task prompt, `head_len` tokens) followed by
  the context from the start of the observation that holds the first kept image: the `keep`
  most recent images with the turns around them. Its tokens are all context (loss mask 0): the
  actions in it were trained in the segment, sampled with the longer context. The engine
  prefills it from scratch (recompute), and the task goes on from there.

A 12-image trajectory with window 10, keep 5 is two segments: images 1–10 with every action up
to the 10th image's reply, then the head + images 6–12 whose actions after image 10 are trained.
`Segment.sequence` makes the `TrainSequence` the trainer packs (train/dispatch.py) with its
images (the trainer computes their M-RoPE positions).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiderl.train.dispatch import TrainSequence

__all__ = ["Segment", "WindowError", "cut", "image_runs", "needs_cut"]


class WindowError(ValueError):
    """A context the window cannot cut (names the problem and the fix)."""


@dataclasses.dataclass
class Segment:
    """A context (or a finished part of one): token in, token out, with its images."""

    tokens: list[int]
    loss_mask: list[int]
    logprobs: list[float]
    """Behaviour logprob per token (0 off the mask)."""
    versions: list[int]
    """Weight version per token (-1 off the mask)."""
    images: list[Any] = dataclasses.field(default_factory=list)
    """(patch rows, grid_thw) per image, in the order of the placeholder runs."""
    image_token: int = -1
    """The policy's image placeholder id (`model.vision.image_token_id`)."""

    def __post_init__(self):
        n = len(self.tokens)
        if not len(self.loss_mask) == len(self.logprobs) == len(self.versions) == n:
            raise WindowError(f"a segment's tokens ({n}), loss_mask ({len(self.loss_mask)}), "
                              f"logprobs ({len(self.logprobs)}) and versions "
                              f"({len(self.versions)}) differ in length; record one per token")

    def add_observation(self, ids: Sequence[int], images: Sequence[Any] = ()) -> None:
        """Appends context tokens (an observation, with the images of its placeholder runs)."""
        n = len(ids)
        self.tokens += list(ids)
        self.loss_mask += [0] * n
        self.logprobs += [0.0] * n
        self.versions += [-1] * n
        self.images += list(images)

    def add_action(self, ids: Sequence[int], logprobs: Sequence[float], version: int) -> None:
        """Appends sampled tokens with their behaviour logprobs and weight version."""
        if len(logprobs) != len(ids):
            raise WindowError(f"an action of {len(ids)} tokens came with {len(logprobs)} "
                              "logprobs; record one per sampled token")
        self.tokens += list(ids)
        self.loss_mask += [1] * len(ids)
        self.logprobs += [float(x) for x in logprobs]
        self.versions += [int(version)] * len(ids)

    def sequence(self, uid: int, advantage: float | np.ndarray) -> TrainSequence:
        """The segment as a `TrainSequence` with its images."""
        return TrainSequence(uid=uid, tokens=np.asarray(self.tokens, np.int32),
                             action_mask=np.asarray(self.loss_mask, bool),
                             behaviour_logprobs=np.asarray(self.logprobs, np.float32),
                             advantage=advantage, versions=np.asarray(self.versions, np.int32),
                             images=tuple(self.images))


def image_runs(tokens: Sequence[int], image_token: int) -> list[tuple[int, int]]:
    """[start, end) of each maximal run of image placeholder tokens."""
    is_image = np.asarray(tokens, np.int64) == image_token
    edges = np.flatnonzero(np.diff(np.concatenate([[0], is_image.astype(np.int8), [0]])))
    return [(int(a), int(b)) for a, b in zip(edges[::2], edges[1::2], strict=True)]


def needs_cut(context: Segment, window: int) -> bool:
    """Whether `context` is cut before its next observation: it holds `window` images or
    more (window 0: never)."""
    return window > 0 and len(context.images) >= window


def cut(context: Segment, *, head_len: int, keep: int) -> tuple[Segment, Segment]:
    """(the segment to train on: `context` as it is, the continuation: the head + the context
    from the start of the observation holding the first of the `keep` most recent images, all
    of it context). A WindowError when the images and their placeholder runs disagree, or the
    head reaches into the kept part."""
    runs = image_runs(context.tokens, context.image_token)
    if len(runs) != len(context.images):
        raise WindowError(f"the context holds {len(runs)} image placeholder runs but "
                          f"{len(context.images)} images; record each image with its run")
    if not 0 < keep < len(runs):
        raise WindowError(f"env.image_keep={keep} must be at least 1 and below the "
                          f"{len(runs)} images of the context being cut (env.image_window)")
    first = len(runs) - keep
    at = runs[first][0]
    # Back to where that image's observation starts: after the action before it (the
    # observation's opening template tokens and text stay with the image).
    while at > 0 and not context.loss_mask[at - 1]:
        at -= 1
    if at < head_len or runs[first - 1][1] > at:
        # The observation also holds an older image, or starts inside the head: cut at the
        # kept image itself.
        at = runs[first][0]
    if at < head_len:
        raise WindowError(f"the head ({head_len} tokens) reaches into the kept images (token "
                          f"{at}); keep the head to the system and task prompt")
    tail = slice(at, len(context.tokens))
    n_head, n_tail = head_len, len(context.tokens) - at
    cont = Segment(tokens=list(context.tokens[:head_len]) + list(context.tokens[tail]),
                   loss_mask=[0] * (n_head + n_tail), logprobs=[0.0] * (n_head + n_tail),
                   versions=[-1] * (n_head + n_tail), images=list(context.images[first:]),
                   image_token=context.image_token)
    done = dataclasses.replace(context, tokens=list(context.tokens),
                               loss_mask=list(context.loss_mask),
                               logprobs=list(context.logprobs), versions=list(context.versions),
                               images=list(context.images))
    return done, cont
