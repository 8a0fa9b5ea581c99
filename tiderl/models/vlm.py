"""Vision-language policies (Qwen2.5-VL, Qwen3-VL): the decoder with a vision tower.

`VisionLanguageModel` is the built-in `Decoder` (same parameters under the same names, plus
`visual`) and is called the same way, with images as an optional extra:

    logits, cache = policy(tokens, positions, segment_ids, cache=None, images=ImageInput)

- `tokens` hold one `model.vision.image_token_id` placeholder per merged image feature
  (`placeholder_count`), in the order of the images in `images`; the tower's features replace
  those tokens' embeddings (Qwen3-VL also adds its deepstack features to the first layers'
  outputs at those tokens);
- `positions` are [B, T, 3] multimodal (t, h, w) positions from `mrope_positions` — text
  tokens count up on all three axes, an image's tokens sit on its merged grid starting where
  the text stopped, and the text after it resumes past the image's larger side (transformers'
  `get_rope_index`). [B, T] positions (text only) are plain RoPE.
- with `model.train_vision=false` the tower's output is cut from the gradient, so its
  parameters get none.

Without `images` it is the text decoder (M-RoPE on equal t/h/w positions is plain RoPE).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from tiderl.models.config import ModelConfig
from tiderl.models.decoder import DTYPES, AttentionCache, Decoder
from tiderl.models.lora import LoraSpec
from tiderl.models.vision import ImageInput, VisionTower, image_input

__all__ = ["ImageInput", "VisionLanguageModel", "expand_image_placeholders", "image_input",
           "mrope_positions", "placeholder_count"]


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
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        out[i:i + n] = pos + np.stack([tt, hh, ww], -1).reshape(n, 3)
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


class VisionLanguageModel(Decoder):
    """The built-in decoder plus `visual`, a `VisionTower` (models/vision.py)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, lora: LoraSpec | None = None):
        if cfg.vision is None:
            raise ValueError("VisionLanguageModel needs model.vision (the vision tower)")
        super().__init__(cfg, rngs=rngs, lora=lora)
        self.visual = VisionTower(cfg.vision, rngs=rngs, dtype=DTYPES[cfg.param_dtype])

    def __call__(
        self,
        tokens_bt: Int[Array, "B T"],
        positions_bt: Int[Array, "B T"] | Int[Array, "B T 3"],
        segment_ids_bt: Int[Array, "B T"],
        *,
        cache: AttentionCache | None = None,
        images: ImageInput | None = None,
    ) -> tuple[Float[Array, "B T V"], AttentionCache | None]:
        h_btd, cache = self.hidden_states(tokens_bt, positions_bt, segment_ids_bt, cache=cache,
                                          images=images)
        return self.logits(h_btd), cache

    def hidden_states(self, tokens_bt, positions_bt, segment_ids_bt, *, cache=None,
                      images: ImageInput | None = None, **kwargs):
        """`Decoder.hidden_states` with the image features in place of the placeholders."""
        if images is not None:
            inputs, adds = self.multimodal_inputs(tokens_bt, images)
            kwargs.update(inputs_btd=inputs, layer_adds=adds)
        return super().hidden_states(tokens_bt, positions_bt, segment_ids_bt, cache=cache,
                                     **kwargs)

    def image_features(self, images: ImageInput) -> tuple[Array, tuple[Array, ...]]:
        """The tower's merged features [N/m², D] and deepstack features, in compute dtype;
        cut from the gradient when `model.train_vision` is false."""
        cd = DTYPES[self.cfg.compute_dtype]
        feats, deep = self.visual(images, cd)
        if not self.cfg.train_vision:
            feats, deep = jax.lax.stop_gradient((feats, deep))
        return feats, deep

    def multimodal_inputs(self, tokens_bt: Array, images: ImageInput,
                          ) -> tuple[Array, tuple[Array, ...]]:
        """(input embeddings with the k-th placeholder token's replaced by the k-th image
        feature, per deepstack level the features at the placeholders and zeros elsewhere)."""
        feats, deep = self.image_features(images)
        cd = feats.dtype
        mask_bt = tokens_bt == self.cfg.vision.image_token_id
        # The k-th placeholder (row-major) takes feature k; clipped reads beyond are masked.
        idx_bt = jnp.clip(jnp.cumsum(mask_bt.reshape(-1)).reshape(mask_bt.shape) - 1, 0,
                          feats.shape[0] - 1)

        def scatter(values_md, base_btd):
            return jnp.where(mask_bt[..., None], jnp.take(values_md, idx_bt, axis=0), base_btd)

        inputs = scatter(feats, self.embed(tokens_bt).astype(cd))
        zeros = jnp.zeros((*tokens_bt.shape, feats.shape[-1]), cd)
        return inputs, tuple(scatter(d, zeros) for d in deep)
