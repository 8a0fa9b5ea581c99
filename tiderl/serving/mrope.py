"""A task's images on the host: where they sit in its context, their M-RoPE positions, and what
makes two contexts' images the same. No JAX.

A vision-language task's context is token ids as for text (token in, token out) in which each
image is a run of `model.vision.image_token_id` placeholders (`placeholder_count` of its grid);
the task's `Prefix` keeps one `ImageSpan` per image: the run's first token index, the image's
grid and its patch rows (the image processor's `pixel_values`), kept on the host for as long as
the task lives, so a prefill after an eviction, a weight flush or a migration runs the vision
encoder again on the same patches.

Positions follow transformers' Qwen2.5-VL / Qwen3-VL (`get_rope_index`): text tokens count up on
all three (t, h, w) axes, an image's tokens sit on its merged grid starting where the text
stopped, and the text after it resumes past the grid's larger side. So every text token after
the last image is at `token index + rope_delta` on all three axes (`rope_delta` = the sum over
the images of (larger merged side − placeholder count), transformers' `rope_deltas`): decoding
needs one integer per task, and only a prefill whose tokens include placeholders needs the
[T, 3] positions (`positions`: rows of `rope_index.sequence_positions`, for a range of the context,
from its spans).

Prefix sharing compares token ids, and every image's placeholders are the same id: two contexts
agree only up to the first image whose pixels differ (`shared_prefix`), however equal their
token ids are.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from tiderl.models.rope_index import grid_positions
from tiderl.models.vision_inputs import PatchedImage

__all__ = ["ImageSpan", "PatchedImage", "context_key", "positions", "rope_delta",
           "shared_prefix", "spans_in"]


@dataclasses.dataclass(frozen=True, eq=False)
class ImageSpan:
    """One image of a task's context: its placeholder run `[start, start + n_tokens)` and its
    patches (host numpy, never changed)."""

    start: int
    grid_thw: tuple[int, int, int]
    pixels: np.ndarray = dataclasses.field(repr=False)
    merge: int
    digest: bytes = dataclasses.field(repr=False)
    """Hash of the patches and grid: two spans hold the same image iff their digests match."""

    @property
    def n_tokens(self) -> int:
        t, h, w = self.grid_thw
        return t * h * w // (self.merge * self.merge)

    @property
    def end(self) -> int:
        return self.start + self.n_tokens

    @property
    def advance(self) -> int:
        """Positions the text moves past the image: the merged grid's larger side."""
        _, h, w = self.grid_thw
        return max(h, w) // self.merge

    def at(self, start: int) -> ImageSpan:
        """The same image with its placeholder run starting at token `start`."""
        return dataclasses.replace(self, start=start)


def _span(image: Any, start: int, merge: int) -> ImageSpan:
    pixels, grid = image
    pixels = np.ascontiguousarray(np.asarray(pixels, np.float32))
    g = np.asarray(grid, np.int64).reshape(-1)
    if g.shape != (3,) or (g <= 0).any() or (g[1:] % merge).any():
        raise ValueError(f"image grid_thw {g.tolist()}: expected 3 positive sizes (t, h, w) with "
                         f"h and w multiples of model.vision.spatial_merge_size={merge}")
    if pixels.ndim != 2 or pixels.shape[0] != int(g.prod()):
        raise ValueError(f"image pixels of shape {pixels.shape} do not hold the {int(g.prod())} "
                         f"patch rows of grid_thw {g.tolist()}; pass the image processor's "
                         "pixel_values and image_grid_thw together, one image at a time")
    pixels.setflags(write=False)
    digest = hashlib.blake2b(pixels.tobytes() + g.tobytes(), digest_size=16).digest()
    return ImageSpan(start=start, grid_thw=(int(g[0]), int(g[1]), int(g[2])), pixels=pixels,
                     merge=merge, digest=digest)


def spans_in(tokens: Sequence[int], offset: int, images: Sequence[Any] | None,
             image_token: int | None, merge: int) -> list[ImageSpan]:
    """The spans of `images` (PatchedImage-likes, in order) in `tokens`, appended to a context
    at token `offset`: image k takes the k-th run of `placeholder_count` image tokens. A
    ValueError names a count that does not match."""
    images = list(images or ())
    toks = np.asarray(tokens, np.int64).reshape(-1)
    is_image = toks == image_token if image_token is not None else np.zeros(len(toks), bool)
    if images and image_token is None:
        raise ValueError("a prefill with images needs a vision-language policy (model.vision); "
                         "this engine's model is text only")
    out, i = [], 0
    for k, image in enumerate(images):
        span = _span(image, 0, merge)
        hits = np.flatnonzero(is_image[i:])
        at = i + int(hits[0]) if hits.size else len(toks)
        n = span.n_tokens
        if at + n > len(toks) or not is_image[at:at + n].all():
            raise ValueError(f"image {k + 1} (grid_thw {list(span.grid_thw)}) needs {n} "
                             f"consecutive image placeholder tokens (id {image_token}) after "
                             f"token {i}; expand each image's placeholder "
                             "(models.vlm.expand_image_placeholders) before the prefill")
        out.append(span.at(offset + at))
        i = at + n
    if is_image[i:].any():
        raise ValueError(f"the tokens hold {int(is_image.sum())} image placeholder tokens but "
                         f"the {len(images)} image(s) given take "
                         f"{sum(s.n_tokens for s in out)}; pass every image whose placeholders "
                         "the tokens hold")
    return out


def rope_delta(spans: Sequence[ImageSpan], before: int | None = None) -> int:
    """M-RoPE position minus token index of a text token after the spans (those ending at or
    before token `before`, or all)."""
    return sum(s.advance - s.n_tokens for s in spans if before is None or s.end <= before)


def positions(spans: Sequence[ImageSpan], start: int, end: int) -> np.ndarray:
    """int32 [end - start, 3] M-RoPE (t, h, w) positions of context tokens [start, end)."""
    idx = np.arange(start, end, dtype=np.int64)
    out = np.repeat(idx[:, None], 3, axis=1)
    delta = 0  # position minus index of the text before the current span
    for s in spans:  # in context order
        if s.start >= end:
            break
        if s.end > start:
            grid = grid_positions(s.grid_thw, s.merge) + s.start + delta
            lo, hi = max(s.start, start), min(s.end, end)
            out[lo - start:hi - start] = grid[lo - s.start:hi - s.start]
        step = s.advance - s.n_tokens
        out[max(s.end - start, 0):] += step  # the text after it (later images overwrite theirs)
        delta += step
    return out.astype(np.int32)


def shared_prefix(a: Sequence[ImageSpan], b: Sequence[ImageSpan], n: int) -> int:
    """The longest m <= n such that contexts with spans `a` and `b` (whose first n token ids
    agree) hold the same images in their first m tokens: m stops at the first image that is
    not in both at the same place, or whose pixels differ."""
    pa = {s.start: s for s in a if s.start < n}
    pb = {s.start: s for s in b if s.start < n}
    for start in sorted(set(pa) | set(pb)):
        x, y = pa.get(start), pb.get(start)
        if x is None or y is None or x.digest != y.digest:
            return start
    return n


def context_key(tokens: Sequence[int], spans: Sequence[ImageSpan]) -> tuple:
    """A hashable key equal for two contexts iff their token ids and images are equal."""
    return tuple(tokens) + tuple((s.start, s.digest) for s in spans)
