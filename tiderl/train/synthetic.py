"""Synthetic trajectories for tests and benchmarks (numpy, no JAX)."""

from __future__ import annotations

import numpy as np

from tiderl.train.dispatch import TrainSequence


def synthetic_trajectories(n: int, *, vocab: int, min_len: int, max_len: int, seed: int = 0,
                           advantages: np.ndarray | None = None, versions: tuple[int, ...] = (0,),
                           behaviour_mean: float = -4.0, behaviour_std: float = 0.1
                           ) -> list[TrainSequence]:
    """`n` prompt+action sequences: the second half of each is the action (masked) part."""
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(min_len, max_len + 1))
        tokens = rng.integers(1, vocab, length).astype(np.int32)
        mask = np.zeros(length, bool)
        mask[max(1, length // 2):] = True
        blp = rng.normal(behaviour_mean, behaviour_std, length).astype(np.float32)
        adv = float(rng.normal()) if advantages is None else float(advantages[i])
        ver = np.asarray(rng.choice(versions, length), np.int32)
        out.append(TrainSequence(i, tokens, mask, blp, adv, ver))
    return out
