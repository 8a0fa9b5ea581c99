"""A vision-language policy's image inputs on the host (no JAX): the Qwen-VL image processor in
Pillow and numpy.

`patch_image(image, vision, processing)` is transformers' `Qwen2VLImageProcessorPil` (also
Qwen2.5-VL's and, with its own mean/std and pixel bounds, Qwen3-VL's) for one RGB image: resize
to the nearest sides divisible by patch_size × merge_size whose area lies in [min_pixels,
max_pixels] (`smart_resize`, bicubic), scale to [0, 1], normalise per channel, and cut into
patch rows `[h/p · w/p, C · tp · p · p]` in spatial-merge-block order, the frame repeated
`temporal_patch_size` times; grid_thw = (1, h/p, w/p). A test checks it against transformers
value for value.

A chat template renders one placeholder per image (`<|vision_start|><|image_pad|><|vision_end|>`
in the Qwen-VL templates); `rope_index.expand_image_placeholders` repeats it as many times as
the image's merged grid has cells, as the processors expand the rendered chat.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

__all__ = ["ImageProcessing", "ImagePrompt", "PatchedImage", "image_prompt_for", "patch_image",
           "smart_resize"]

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


class PatchedImage(NamedTuple):
    """One image as the vision tower takes it: patch rows `pixels` [patches, C·tp·p·p]
    (spatial-merge-block order) and its `grid_thw` (t, h, w) in patches."""

    pixels: Any
    grid_thw: Any


@dataclasses.dataclass(frozen=True, kw_only=True)
class ImageProcessing:
    """The image processor's own settings (a checkpoint's preprocessor_config.json); patch,
    temporal patch and merge sizes come from model.vision. Defaults: Qwen2-VL / Qwen2.5-VL."""

    min_pixels: int = 56 * 56
    max_pixels: int = 28 * 28 * 1280
    mean: tuple[float, float, float] = CLIP_MEAN
    std: tuple[float, float, float] = CLIP_STD

    @classmethod
    def from_preprocessor_config(cls, hf: dict[str, Any]) -> ImageProcessing:
        """From a preprocessor_config.json (`size` {shortest_edge, longest_edge} or the older
        min_pixels / max_pixels keys)."""
        size = hf.get("size") or {}
        return cls(min_pixels=int(hf.get("min_pixels", size.get("shortest_edge", 56 * 56))),
                   max_pixels=int(hf.get("max_pixels", size.get("longest_edge",
                                                                28 * 28 * 1280))),
                   mean=tuple(hf.get("image_mean", CLIP_MEAN)),
                   std=tuple(hf.get("image_std", CLIP_STD)))


def smart_resize(height: int, width: int, factor: int, min_pixels: int,
                 max_pixels: int) -> tuple[int, int]:
    """Sides divisible by `factor`, area within [min_pixels, max_pixels], the aspect ratio
    kept as closely as possible (transformers' `smart_resize`)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError(f"an image of {width}x{height} pixels: its aspect ratio is over 200, "
                         "which the Qwen-VL image processor refuses; crop or pad it")
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def patch_image(image: Any, vision: Any, processing: ImageProcessing | None = None
                ) -> PatchedImage:
    """One image (a PIL image, or anything with `.pil()` such as `tiderl.envs.images.Image`)
    as patch rows and grid for `vision` (the model's VisionConfig)."""
    import PIL.Image

    proc = processing or ImageProcessing()
    pil = image.pil() if hasattr(image, "pil") else image
    p, m, tp = vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size
    h, w = smart_resize(pil.height, pil.width, p * m, proc.min_pixels, proc.max_pixels)
    rgb = pil.convert("RGB")
    if (w, h) != rgb.size:
        rgb = rgb.resize((w, h), resample=PIL.Image.Resampling.BICUBIC)
    x = np.asarray(rgb).transpose(2, 0, 1)
    # As transformers: rescaled in float64, cast to float32, normalised in float32.
    x = (x.astype(np.float64) * (1 / 255)).astype(np.float32)
    x = (x - np.asarray(proc.mean, np.float32)[:, None, None]) / np.asarray(
        proc.std, np.float32)[:, None, None]
    c, gh, gw = x.shape[0], h // p, w // p
    x = x.reshape(c, gh // m, m, p, gw // m, m, p).transpose(1, 4, 2, 5, 0, 3, 6)
    x = np.broadcast_to(x[:, :, :, :, :, None], (*x.shape[:5], tp, p, p))
    return PatchedImage(np.ascontiguousarray(x.reshape(gh * gw, c * tp * p * p)), (1, gh, gw))


@dataclasses.dataclass(frozen=True)
class ImagePrompt:
    """How a vision-language policy reads an observation's images (the rollout's episode loop
    uses it): each image's placeholder text of the chat template leads the observation's
    text (as a user message whose image parts come first), each image is patched
    (`patch_image`), and the rendered ids get each placeholder expanded to its image's
    token count."""

    vision: Any
    """The model's VisionConfig."""
    processing: ImageProcessing = ImageProcessing()
    placeholder: str = "<|vision_start|><|image_pad|><|vision_end|>"
    """What the chat template renders for one image (the Qwen-VL templates')."""

    def observation(self, text: str, images: Any) -> tuple[str, list[PatchedImage]]:
        """(the text to render, the images patched) of an observation."""
        images = list(images or ())
        return (self.placeholder * len(images) + text,
                [patch_image(im, self.vision, self.processing) for im in images])

    def expand(self, patched: list[PatchedImage], ids: Any) -> list[int]:
        """Rendered ids with each image's placeholder repeated to its token count (a
        ValueError when the ids hold another number of placeholders than `patched`)."""
        from tiderl.models.rope_index import expand_image_placeholders

        return expand_image_placeholders(ids, np.asarray([p.grid_thw for p in patched],
                                                         np.int64).reshape(-1, 3), self.vision)


def image_prompt_for(model: Any) -> ImagePrompt | None:
    """The ImagePrompt of a run's `model` config (None for a text policy): the image processor
    of the checkpoint folder's preprocessor_config.json when it has one, else Qwen2.5-VL's;
    `model.image_max_pixels` (when set) bounds the image area either way."""
    if model.vision is None:
        return None
    processing = ImageProcessing()
    pre = Path(model.checkpoint) / "preprocessor_config.json" if model.checkpoint else None
    if pre is not None and pre.is_file():
        try:
            processing = ImageProcessing.from_preprocessor_config(json.loads(pre.read_text()))
        except (ValueError, TypeError, AttributeError) as e:
            from tiderl.configlib import ConfigError

            raise ConfigError(f"{pre} is not a readable image processor config ({e}); fix or "
                              "remove it (then Qwen2.5-VL's settings apply)") from None
    if model.image_max_pixels:
        processing = dataclasses.replace(
            processing, max_pixels=model.image_max_pixels,
            min_pixels=min(processing.min_pixels, model.image_max_pixels))
    return ImagePrompt(model.vision, processing)
