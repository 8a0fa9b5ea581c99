"""Micro-batch formation: token budgets, LPT / zig-zag rank balance, small-final ordering, packing.

Pure host logic (numpy, no JAX): the controller's buffer and the simulator call it directly.

The training batch format (`MicroBatch.arrays()`, consumed by train/ref_actor.py), rows of
`row_len` tokens, rank-major (rows [r·R, (r+1)·R) belong to data-parallel rank r):

| array | dtype | meaning |
| --- | --- | --- |
| tokens_bt | int32 | packed token ids; padding is 0 |
| positions_bt | int32 | position within its own sequence (0 at each sequence start) |
| segment_ids_bt | int32 | 1, 2, ... per sequence in a row; 0 = padding |
| loss_mask_bt | float32 | 1 where the token at t is an action token whose logprob is trained |
| behaviour_logprobs_bt | float32 | the engine's logprob of the token at t (0 off-mask) |
| advantages_bt | float32 | the sequence's advantage on each of its tokens (or one per token) |
| versions_bt | int32 | weight version that generated the token at t (staleness weights) |

With images (a vision-language policy) the micro-batch carries them beside the arrays
(`MicroBatch.images`: each (patch rows, grid_thw), in the row-major order of their placeholder
runs in `tokens_bt`, as the policy's forward takes them); the trainer turns them into the vision
tower's input, replaces `positions_bt` by the [B, T, 3] M-RoPE positions of each sequence
(`models.vlm.mrope_positions` with the segment ids) and recomputes the image features in the
Ref and Actor forwards.

Shift convention: every per-token quantity is aligned with the *predicted* token. The logprob at
t is `log_softmax(logits[t − 1] / T)[tokens[t]]`, so a sequence's first token can never be an
action token (it has no prediction inside its segment) and `loss_mask` at t = 0 of a segment is 0.
This is the alignment the engine returns (one logprob per generated token), so behaviour logprobs
are copied verbatim.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

Balance = Literal["lpt", "zigzag"]
Order = Literal["decoupled", "colocated"]


@dataclasses.dataclass(frozen=True)
class TrainSequence:
    """One sequence to train on: exactly the tokens the engine saw and produced."""

    uid: int
    tokens: np.ndarray
    """int32 [L], prompt, observations and actions in order."""
    action_mask: np.ndarray
    """bool [L], True where the policy generated the token (trained)."""
    behaviour_logprobs: np.ndarray
    """float32 [L], the engine's logprob of each generated token (ignored off the mask)."""
    advantage: float | np.ndarray
    """One advantage for the whole sequence, or float32 [L] per token (step-level credit:
    each turn's action tokens carry their turn's advantage)."""
    versions: np.ndarray | int = 0
    """Weight version per token ([L]) or one version for the whole sequence."""
    images: tuple[Any, ...] = ()
    """The sequence's images in the order of their placeholder runs, each (patch rows
    [patches, C·tp·p·p] float32, grid_thw (t, h, w)) as the image processor gives them."""

    def __post_init__(self):
        n = len(self.tokens)
        if len(self.action_mask) != n or len(self.behaviour_logprobs) != n:
            raise ValueError(f"trajectory {self.uid}: tokens ({n}), action_mask "
                             f"({len(self.action_mask)}) and behaviour_logprobs "
                             f"({len(self.behaviour_logprobs)}) must have equal lengths")
        if np.ndim(self.advantage) and np.shape(self.advantage) != (n,):
            raise ValueError(f"trajectory {self.uid}: per-token advantages have shape "
                             f"{np.shape(self.advantage)}, not ({n},) like its tokens")
        if n and bool(self.action_mask[0]):
            raise ValueError(f"trajectory {self.uid}: its first token is marked as an action, "
                             "but it has no prediction inside the sequence; start with a prompt")

    @property
    def length(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass(frozen=True)
class Plan:
    """Sequence indices per micro-batch and rank: `mbs[i][r]` lists indices into the input."""

    mbs: list[list[list[int]]]

    def loads(self, lengths: Sequence[int]) -> list[list[int]]:
        return [[sum(lengths[j] for j in rank) for rank in mb] for mb in self.mbs]


def lpt_assign(lengths: Sequence[int], n_ranks: int, *, cap: int | None = None
               ) -> tuple[list[list[int]], list[int]]:
    """Longest-processing-time-first: longest sequence to the least-loaded rank.

    With `cap`, a sequence that fits no rank is returned in the second list. Max − min rank load
    stays within the longest assigned sequence (each item lands on the current minimum).
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ranks: list[list[int]] = [[] for _ in range(n_ranks)]
    load = [0] * n_ranks
    rest = []
    for i in order:
        r = min(range(n_ranks), key=lambda k: (load[k], k))
        if cap is not None and load[r] + lengths[i] > cap:
            rest.append(i)
            continue
        ranks[r].append(i)
        load[r] += lengths[i]
    return ranks, rest


def zigzag_assign(lengths: Sequence[int], n_ranks: int) -> list[list[int]]:
    """Sort by length and deal in a snake (0..R−1, R−1..0, ...): the paper's colocated balance."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    ranks: list[list[int]] = [[] for _ in range(n_ranks)]
    for pos, i in enumerate(order):
        rnd, k = divmod(pos, n_ranks)
        ranks[k if rnd % 2 == 0 else n_ranks - 1 - k].append(i)
    return ranks


def plan_microbatches(lengths: Sequence[int], *, n_ranks: int, rank_budget: int,
                      order: Order = "decoupled", balance: Balance = "lpt",
                      final: bool = True, fill: float = 0.9) -> tuple[Plan, list[int]]:
    """Groups ready sequences into micro-batches of at most `rank_budget` tokens per rank.

    Early micro-batches are filled first (longest first) so each saturates all ranks; with
    `final=False` only micro-batches reaching `fill` of their capacity are emitted and the rest
    is returned as leftover (it waits for more ready data). With `final=True` everything is
    emitted and the last micro-batch is the smallest; in decoupled order the globally smallest
    sequence is held back for it, so the last sequence through the pipeline is the shortest.
    Returns (plan, leftover indices).
    """
    if n_ranks <= 0 or rank_budget <= 0:
        raise ValueError(f"n_ranks={n_ranks}, rank_budget={rank_budget} must be positive")
    for i, n in enumerate(lengths):
        if n > rank_budget:
            raise ValueError(f"sequence {i} has {n} tokens, over the per-rank budget of "
                             f"{rank_budget}; raise trainer.rows_per_rank × trainer.row_len or "
                             "lower rollout.max_context")
    todo = list(range(len(lengths)))
    held: int | None = None
    if final and order == "decoupled" and len(todo) > 1:
        held = min(todo, key=lambda i: (lengths[i], -i))
        todo.remove(held)
    mbs: list[list[list[int]]] = []
    while todo:
        sub = [lengths[i] for i in todo]
        ranks, rest = lpt_assign(sub, n_ranks, cap=rank_budget)
        mbs.append([[todo[j] for j in rank] for rank in ranks])
        todo = [todo[j] for j in rest]
    if balance == "zigzag":
        mbs = [_rebalance_zigzag(mb, lengths, n_ranks, rank_budget) for mb in mbs]
    total = lambda mb: sum(lengths[i] for rank in mb for i in rank)  # noqa: E731
    mbs.sort(key=lambda mb: -total(mb))
    leftover: list[int] = []
    if not final:
        cap = n_ranks * rank_budget
        while mbs and total(mbs[-1]) < fill * cap:
            leftover.extend(i for rank in mbs.pop() for i in rank)
        return Plan(mbs), sorted(leftover)
    if held is not None:
        last = mbs[-1] if mbs else None
        fits = last is not None and min(sum(lengths[i] for i in r) for r in last) + \
            lengths[held] <= rank_budget
        grown = total(last) + lengths[held] if last is not None else 0
        if fits and (len(mbs) == 1 or grown <= total(mbs[-2])):
            r = min(range(n_ranks), key=lambda k: (sum(lengths[i] for i in last[k]), k))
            last[r].append(held)
        else:
            mbs.append([[held]] + [[] for _ in range(n_ranks - 1)])
    for mb in mbs:  # longest first inside a rank; the smallest sequence goes last
        for rank in mb:
            rank.sort(key=lambda i: (-lengths[i], i))
    return Plan(mbs), leftover


def _rebalance_zigzag(mb: list[list[int]], lengths: Sequence[int], n_ranks: int,
                      rank_budget: int) -> list[list[int]]:
    flat = [i for rank in mb for i in rank]
    ranks = zigzag_assign([lengths[i] for i in flat], n_ranks)
    out = [[flat[j] for j in rank] for rank in ranks]
    if max(sum(lengths[i] for i in r) for r in out) > rank_budget:
        return mb  # the snake overflowed a rank's budget; keep the LPT assignment
    return out


def elastic_take(ready: int, consumed: int, *, batch_min: int, batch_ideal: int) -> tuple[int, bool]:
    """How many ready sequences to take now, and whether the step may end after them.

    A step consumes up to `batch_ideal` sequences; once it holds `batch_min` it ends as soon as
    nothing more is ready instead of waiting (the elastic batch of ERS, [B_min, B_ideal]).
    """
    take = max(0, min(ready, batch_ideal - consumed))
    after = consumed + take
    return take, after >= batch_ideal or (after >= batch_min and take == ready)


@dataclasses.dataclass(frozen=True)
class MicroBatch:
    """Packed host arrays of one micro-batch plus the bookkeeping the trainer reports."""

    tokens_bt: np.ndarray
    positions_bt: np.ndarray
    segment_ids_bt: np.ndarray
    loss_mask_bt: np.ndarray
    behaviour_logprobs_bt: np.ndarray
    advantages_bt: np.ndarray
    versions_bt: np.ndarray
    uids: tuple[int, ...]
    images: tuple[Any, ...] = ()
    """(patch rows, grid_thw) per image, in the row-major order of the placeholder runs."""

    @property
    def n_seqs(self) -> int:
        return len(self.uids)

    @property
    def n_action_tokens(self) -> int:
        return int(self.loss_mask_bt.sum())

    def arrays(self) -> dict[str, np.ndarray]:
        """The pytree the jitted functions take (host uids stay behind)."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("uids", "images")}


def seqs_with_actions(mb: MicroBatch) -> int:
    """Sequences of `mb` with at least one action token (the seq_mean divisor)."""
    rows, cols = np.nonzero(mb.loss_mask_bt > 0)
    return len(set(zip(rows.tolist(), mb.segment_ids_bt[rows, cols].tolist(), strict=False)))


def pack_rows(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """First-fit decreasing of sequences into rows of `row_len` tokens."""
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        n = lengths[i]
        if n > row_len:
            raise ValueError(f"sequence {i} has {n} tokens, more than trainer.row_len={row_len}; "
                             "raise trainer.row_len or lower rollout.max_context")
        for r, f in enumerate(free):
            if f >= n:
                rows[r].append(i)
                free[r] -= n
                break
        else:
            rows.append([i])
            free.append(row_len - n)
    return rows


def bucket_rows(n: int) -> int:
    """Rows per rank rounded up to a power of two: one compiled shape per bucket."""
    return 1 << max(0, (n - 1).bit_length())


def pack_microbatch(trajs: Sequence[TrainSequence], ranks: Sequence[Sequence[int]], *,
                    row_len: int, min_rows: int = 1) -> MicroBatch:
    """Packs the trajectories `ranks[r]` of each data-parallel rank into rank-major rows."""
    per_rank = [pack_rows([trajs[i].length for i in rank], row_len) for rank in ranks]
    r_rows = bucket_rows(max(min_rows, *(len(rows) for rows in per_rank)))
    shape = (len(ranks) * r_rows, row_len)
    tokens = np.zeros(shape, np.int32)
    positions = np.zeros(shape, np.int32)
    segs = np.zeros(shape, np.int32)
    mask = np.zeros(shape, np.float32)
    blp = np.zeros(shape, np.float32)
    adv = np.zeros(shape, np.float32)
    ver = np.zeros(shape, np.int32)
    uids, images = [], []
    # Rows in increasing order, sequences in row order: the images are collected in the
    # row-major order of their placeholders, the order the policy's forward assigns them.
    for r, (rank, rows) in enumerate(zip(ranks, per_rank, strict=False)):
        for k, row in enumerate(rows):
            b, t0 = r * r_rows + k, 0
            for seg, j in enumerate(row, start=1):
                tr = trajs[rank[j]]
                n = tr.length
                sl = slice(t0, t0 + n)
                tokens[b, sl] = tr.tokens
                positions[b, sl] = np.arange(n)
                images.extend(tr.images)
                segs[b, sl] = seg
                m = np.asarray(tr.action_mask, bool)
                mask[b, sl] = m
                blp[b, sl] = np.where(m, tr.behaviour_logprobs, 0.0)
                adv[b, sl] = tr.advantage
                ver[b, sl] = tr.versions
                uids.append(tr.uid)
                t0 += n
    return MicroBatch(tokens, positions, segs, mask, blp, adv, ver, tuple(uids), tuple(images))


def microbatches(trajs: Sequence[TrainSequence], *, n_ranks: int, row_len: int,
                 rows_per_rank: int, order: Order = "decoupled", balance: Balance = "lpt",
                 final: bool = True, fill: float = 0.9
                 ) -> tuple[list[MicroBatch], list[TrainSequence]]:
    """Plans and packs ready trajectories; returns (micro-batches, trajectories left waiting)."""
    lengths = [t.length for t in trajs]
    plan, rest = plan_microbatches(lengths, n_ranks=n_ranks, rank_budget=rows_per_rank * row_len,
                                   order=order, balance=balance, final=final, fill=fill)
    mbs = [pack_microbatch(trajs, mb, row_len=row_len) for mb in plan.mbs]
    return mbs, [trajs[i] for i in rest]
