"""A vision tower's shape and what one screenshot costs it: image tokens and FLOPs. No JAX.

Qwen3-VL's vision tower (the Hugging Face `vision_config` of Qwen/Qwen3-VL-4B-Instruct: depth
24, width 1024, MLP 4096, 16 heads, patch 16, temporal patch 2, 2×2 merge to 2560, deepstack
mergers after blocks 5, 11 and 17) turns an image into patches, runs them through ViT blocks
with full attention inside each image, and merges each 2×2 group of patches into one token of
the language model. Everything here follows from that shape and the image processor's resize
rule (`tiderl.models.vision_inputs.smart_resize`, the Qwen-VL one):

- a 1280×720 screenshot is resized to sides divisible by patch × merge = 32 (704×1280; its
  area, 901,120 pixels, lies inside the processor's [65,536, 16,777,216]), so it is 44 × 80 =
  3,520 patches and 3,520 / 4 = **880 image tokens** in the language model;
- one image costs `flops_per_image`: the patch embedding (a linear map of 3·2·16·16 = 1,536
  values per patch), every block's matmuls (QKV, output, two-layer MLP) over its patches and
  its full attention (4·d per (query, key) pair over the image's patches), and the merger and
  deepstack mergers (a 4·d → 4·d → out MLP per merged token): 3.55 TFLOPs for the screenshot
  above (`flops_breakdown` says which part is what).
"""

from __future__ import annotations

import dataclasses
import functools

from tiderl.models.vision_inputs import smart_resize


@dataclasses.dataclass(frozen=True, kw_only=True)
class VisionShape:
    """A Qwen-VL vision tower (non-gated MLP, full attention in every block, no window)."""

    name: str
    depth: int
    d_model: int
    n_heads: int
    mlp_dim: int
    out_dim: int
    patch_size: int
    temporal_patch_size: int = 2
    spatial_merge_size: int = 2
    in_channels: int = 3
    deepstack: int = 0
    """Deepstack mergers (Qwen3-VL: one per `deepstack_visual_indexes` entry)."""
    min_pixels: int = 65_536
    max_pixels: int = 16_777_216
    """The image processor's area bounds (Qwen3-VL's preprocessor_config.json `size`:
    shortest_edge 65,536, longest_edge 16,777,216)."""

    @property
    def factor(self) -> int:
        return self.patch_size * self.spatial_merge_size

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """(patch rows, patch columns) of a `width`×`height` image after the resize."""
        h, w = smart_resize(height, width, self.factor, self.min_pixels, self.max_pixels)
        return h // self.patch_size, w // self.patch_size

    def patches(self, width: int, height: int) -> int:
        gh, gw = self.grid(width, height)
        return gh * gw

    def image_tokens(self, width: int, height: int) -> int:
        """Language-model tokens of one image: its patches after the merge."""
        return self.patches(width, height) // self.spatial_merge_size ** 2

    @functools.cached_property
    def block_params(self) -> int:
        """Matmul weights of one ViT block: QKV (d → 3d), output (d → d), MLP d → m → d."""
        d = self.d_model
        return 3 * d * d + d * d + 2 * d * self.mlp_dim

    @functools.cached_property
    def merger_params(self) -> int:
        """One merger: 4 merged patches (4d) → 4d → out."""
        wide = self.d_model * self.spatial_merge_size ** 2
        return wide * wide + wide * self.out_dim

    def flops_breakdown(self, width: int, height: int) -> dict[str, float]:
        """Forward FLOPs of one image by part (2 per multiply-accumulate)."""
        n = self.patches(width, height)
        merged = n // self.spatial_merge_size ** 2
        patch_in = self.in_channels * self.temporal_patch_size * self.patch_size ** 2
        return {"patch_embed": 2.0 * patch_in * self.d_model * n,
                "block_matmuls": 2.0 * self.depth * self.block_params * n,
                "attention": 4.0 * self.depth * self.d_model * n * n,
                "mergers": 2.0 * (1 + self.deepstack) * self.merger_params * merged}

    def flops_per_image(self, width: int, height: int) -> float:
        return sum(self.flops_breakdown(width, height).values())

    def weight_bytes(self, dtype_bytes: int = 2) -> int:
        patch_in = self.in_channels * self.temporal_patch_size * self.patch_size ** 2
        return dtype_bytes * (patch_in * self.d_model + self.depth * self.block_params
                              + (1 + self.deepstack) * self.merger_params)


# From the Hugging Face config.json of Qwen/Qwen3-VL-4B-Instruct (vision_config).
QWEN3_VL_4B = VisionShape(name="qwen3-vl-4b", depth=24, d_model=1024, n_heads=16, mlp_dim=4096,
                          out_dim=2560, patch_size=16, deepstack=3)

SCREEN = (1280, 720)
"""Screenshot size of the paper's GUI tasks (arXiv 2608.10402, Appendix C.2)."""
