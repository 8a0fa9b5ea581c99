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

import jax
import jax.numpy as jnp
from flax import nnx
from jaxtyping import Array, Float, Int

from tiderl.models.config import ModelConfig
from tiderl.models.decoder import DTYPES, AttentionCache, Decoder
from tiderl.models.lora import LoraSpec
from tiderl.models.rope_index import expand_image_placeholders, mrope_positions, placeholder_count
from tiderl.models.vision import ImageInput, VisionTower, image_input

__all__ = ["ImageInput", "VisionLanguageModel", "expand_image_placeholders", "image_input",
           "mrope_positions", "placeholder_count"]


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
