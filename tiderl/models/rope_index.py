"""M-RoPE positions and image placeholders of the vision-language policies, on the host (numpy,
no JAX: the trainer's packing and the control plane use them).

- `placeholder_count`: how many placeholder tokens each image's merged grid takes;
- `expand_image_placeholders`: a rendered chat's single placeholder per image repeated that many
  times (what the Qwen2.5-VL/Qwen3-VL processors do);
- `mrope_positions`: [B, T, 3] multimodal (t, h, w) positions, transformers' `get_rope_index`
  for images (text counts up on all three axes; an image's tokens sit on its merged grid
  starting where the text stopped; the text after it resumes past the grid's larger side);
  `sequence_positions` is one sequence's [L, 3].
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tiderl.models.config import ModelConfig

__all__ = ["expand_image_placeholders", "mrope_positions", "placeholder_count",
           "sequence_positions"]


def placeholder_count(grid_thw: Any, spatial_merge_size: int) -> list[int]:
    """How many image placeholder tokens each image of `grid_thw` [images, 3] takes."""
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    return [int(t * h * w) // spatial_merge_size ** 2 for t, h, w in grid.tolist()]


def expand_image_placeholders(ids: Any, grid_thw: Any, vision: Any) -> list[int]:
    """Token ids with each image's single placeholder (what the Qwen-VL chat templates render:
    `<|vision_start|><|image_pad|><|vision_end|>`) repeated `placeholder_count` times, image k
    of `grid_thw` at the k-th placeholder, as the Qwen2.5-VL/Qwen3-VL processors expand the
    rendered chat. `vision`: the model's `VisionConfig`."""
    counts = placeholder_count(grid_thw, vision.spatial_merge_size)
    out: list[int] = []
    k = 0
    for i in (int(t) for t in ids):
        if i != vision.image_token_id:
            out.append(i)
            continue
        if k == len(counts):
            raise ValueError(f"the ids hold more image placeholders than grid_thw's {len(counts)}"
                             " images; pass every image of the conversation")
        out += [i] * counts[k]
        k += 1
    if k != len(counts):
        raise ValueError(f"grid_thw has {len(counts)} images but the ids hold {k} image "
                         "placeholders")
    return out


def grid_positions(grid_thw: Any, merge: int) -> np.ndarray:
    """[t·(h/merge)·(w/merge), 3] (t, h, w) offsets of one image's merged tokens, row-major:
    what an image run adds to the position of the text before it."""
    t, h, w = (int(x) for x in grid_thw)
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h // merge), np.arange(w // merge),
                             indexing="ij")
    return np.stack([tt, hh, ww], -1).reshape(-1, 3)


def _row_positions(tokens_t: np.ndarray, grids: list[list[int]], image_token: int,
                   m: int) -> np.ndarray:
    """[T, 3] positions of one sequence whose image runs take `grids` in order (popped)."""
    out = np.zeros((len(tokens_t), 3), np.int64)
    is_image = tokens_t == image_token
    pos = i = 0
    while i < len(tokens_t):
        if not is_image[i]:
            out[i] = pos
            pos, i = pos + 1, i + 1
            continue
        if not grids:
            raise ValueError("the tokens hold more image placeholder runs than grid_thw has "
                             "images; pass each image's grid")
        t, h, w = grids.pop(0)
        gh, gw = h // m, w // m
        n = t * gh * gw
        if (i + n > len(tokens_t) or not is_image[i:i + n].all()
                or (i + n < len(tokens_t) and is_image[i + n])):
            raise ValueError(f"an image placeholder run at token {i} is not the {n} tokens "
                             f"grid_thw {[t, h, w]} needs; emit placeholder_count(...) tokens "
                             "per image")
        out[i:i + n] = pos + grid_positions((t, h, w), m)
        pos, i = pos + max(gh, gw), i + n
    return out


def mrope_positions(tokens_bt: Any, grid_thw: Any, cfg: ModelConfig,
                    segment_ids_bt: Any = None) -> np.ndarray:
    """[B, T, 3] M-RoPE positions (transformers' `get_rope_index` for images): the images of
    `grid_thw` are taken in order, row by row. With `segment_ids_bt` (packed rows) each segment
    starts again at 0; padding (segment 0) gets position 0."""
    if cfg.vision is None:
        raise ValueError("mrope_positions needs a vision-language config (model.vision)")
    tokens = np.asarray(tokens_bt)
    segs = np.ones_like(tokens) if segment_ids_bt is None else np.asarray(segment_ids_bt)
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist() if grid_thw is not None \
        else []
    out = np.zeros((*tokens.shape, 3), np.int64)
    for b in range(tokens.shape[0]):
        for s in np.unique(segs[b]):
            if s == 0:
                continue
            at = np.nonzero(segs[b] == s)[0]
            out[b, at] = _row_positions(tokens[b, at], grids, cfg.vision.image_token_id,
                                        cfg.vision.spatial_merge_size)
    if grids:
        raise ValueError(f"grid_thw has {len(grids)} more image(s) than the tokens have "
                         "placeholder runs")
    return out


def sequence_positions(tokens: Any, grid_thw: Any, image_token_id: int,
                       spatial_merge_size: int) -> np.ndarray:
    """int32 [L, 3] M-RoPE positions of one sequence whose placeholder runs take the images of
    `grid_thw` [images, 3] in order (`mrope_positions` of one row, from the two vision keys)."""
    toks = np.asarray(tokens).reshape(-1)
    grids = np.asarray(grid_thw, np.int64).reshape(-1, 3).tolist()
    out = _row_positions(toks, grids, image_token_id, spatial_merge_size)
    if grids:
        raise ValueError(f"grid_thw has {len(grids)} more image(s) than the tokens have "
                         "placeholder runs")
    return out.astype(np.int32)
