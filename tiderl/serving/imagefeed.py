"""The vision side of the engine's prefill: the encoder over one call's images and each prefill
chunk's image inputs (a vision-language policy only; text-only engines never come here).

A `prefill_many` call runs the vision tower once, over every image whose placeholder tokens some
row computes (after an eviction or a flush: every image of the context again, from the patches
its `Prefix` keeps on the host). The images of all rows go into one patch batch, an image
shared by several rows (a GRPO group's prompt) once, padded to a patch-count bucket
(`patch_bucket`: powers of two and 1.5× powers of two, at least 256 patches), so the encoder
compiles once per bucket and attention band used (`ImageInput.band_l`: a power of two bounding
the call's largest image). Its merged features stay on the device; each prefill chunk then
gathers its placeholder tokens' rows from them (`ImageFeatures.chunk`: a chunk may hold part of
an image, or images of several rows) into the chunk's input embeddings (`make_mm_inputs`, also
one trace per shape), and gets its [B, T, 3] M-RoPE positions. A chunk without placeholders
runs as text, at each row's token index + rope delta.
"""

from __future__ import annotations

import collections
import functools
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from tiderl.models.decoder import DTYPES
from tiderl.models.vision import image_input
from tiderl.serving.mrope import ImageSpan, positions, rope_delta

MIN_PATCH_BUCKET = 256


def patch_bucket(n: int, multiple: int) -> int:
    """The padded patch count for `n` patches: the least of 2^k and 3·2^(k-1) (>= 256) that
    holds them, rounded up to a multiple of `multiple` (spatial_merge_size²)."""
    n = max(n, MIN_PATCH_BUCKET)
    k = max(n - 1, 1).bit_length()
    size = 3 << (k - 2) if k >= 2 and 3 << (k - 2) >= n else 1 << k
    return -(-size // multiple) * multiple


@functools.lru_cache(maxsize=8)
def make_encoder(graphdef: nnx.GraphDef):
    """Jitted vision tower: params, ImageInput -> (merged features [N/m², D], deepstack
    features), in compute dtype; `trace_counts` per (padded patch count, attention band)."""
    trace_counts: collections.Counter = collections.Counter()

    def encode(params, images):
        band = 0 if images.band_l is None else images.band_l.shape[0]
        trace_counts[("encode", images.patches_nf.shape[0], band)] += 1
        return nnx.merge(graphdef, params).image_features(images)

    jitted = jax.jit(encode)
    jitted.trace_counts = trace_counts
    return jitted


@functools.lru_cache(maxsize=8)
def make_mm_inputs(graphdef: nnx.GraphDef):
    """Jitted input embeddings of a chunk: token `[b, t]` takes feature row `idx_bt[b, t]`
    when >= 0, else its token embedding (the scatter of `VisionLanguageModel.
    multimodal_inputs`, by explicit rows); deepstack features likewise, zeros at text."""

    def mm_inputs(params, tokens_bt, idx_bt, feats_md, deep):
        model = nnx.merge(graphdef, params)
        cd = DTYPES[model.cfg.compute_dtype]
        at_bt1 = (idx_bt >= 0)[..., None]
        rows_bt = jnp.maximum(idx_bt, 0)
        x_btd = jnp.where(at_bt1, jnp.take(feats_md, rows_bt, axis=0).astype(cd),
                          model.embed(tokens_bt).astype(cd))
        adds = tuple(jnp.where(at_bt1, jnp.take(d, rows_bt, axis=0).astype(cd), 0).astype(cd)
                     for d in deep)
        return x_btd, adds

    return jax.jit(mm_inputs)


class ImageFeatures:
    """The encoder's features for one prefill call's images, and each chunk's image inputs."""

    def __init__(self, encode, mm_inputs, params, vision, spans: Sequence[ImageSpan]):
        self.mm_inputs, self.params = mm_inputs, params
        self.offset: dict[bytes, int] = {}
        unique: list[ImageSpan] = []
        for s in spans:
            if s.digest not in self.offset:
                self.offset[s.digest] = sum(u.n_tokens for u in unique)
                unique.append(s)
        self.images = len(unique)
        if not unique:
            self.feats = None
            return
        pixels = np.concatenate([s.pixels for s in unique])
        m2 = vision.spatial_merge_size ** 2
        self.patches = patch_bucket(pixels.shape[0], m2)
        inp = image_input(pixels, [s.grid_thw for s in unique], vision, pad_to=self.patches)
        self.feats, self.deep = encode(params, inp)

    def chunk(self, tokens_bt: np.ndarray, rows: Sequence[tuple[Sequence[ImageSpan], int, int]]
              ) -> tuple[np.ndarray, Any] | None:
        """(positions [B, T, 3], (inputs [B, T, D], deepstack adds)) of a chunk whose row i
        computes context tokens [pos_i, pos_i + n_i) of a context with spans `spans_i`
        (`rows[i] = (spans_i, pos_i, n_i)`); None when no row holds an image token there."""
        b, t = tokens_bt.shape
        idx_bt = np.full((b, t), -1, np.int32)
        for i, (spans, pos, n) in enumerate(rows):
            for s in spans:
                lo, hi = max(s.start, pos), min(s.end, pos + n)
                if lo < hi:
                    first = self.offset[s.digest] + lo - s.start
                    idx_bt[i, lo - pos:hi - pos] = np.arange(first, first + hi - lo)
        if not (idx_bt >= 0).any():
            return None
        pos_bt3 = np.zeros((b, t, 3), np.int32)
        for i, (spans, pos, n) in enumerate(rows):
            pos_bt3[i, :n] = positions(spans, pos, pos + n)
        inputs = self.mm_inputs(self.params, tokens_bt, idx_bt, self.feats, self.deep)
        return pos_bt3, inputs


def needed_spans(rows: Sequence[tuple[Sequence[ImageSpan], int, int]]) -> list[ImageSpan]:
    """The spans whose placeholders some row computes (`(spans, start, end)` per row)."""
    return [s for spans, start, end in rows for s in spans if s.start < end and s.end > start]


def text_delta(spans: Sequence[ImageSpan], pos: int) -> int:
    """Rope delta of text at token `pos` (the spans ending at or before it)."""
    return rope_delta(spans, before=pos)
