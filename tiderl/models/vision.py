"""The vision tower of the Qwen2.5-VL and Qwen3-VL policies, as a Flax NNX module.

An image arrives as the HF image processor hands it over: `pixel_values` [N, C·tp·p·p], one
row per patch (channels, then `temporal_patch_size` frames, then a p×p square), the patches of
an image in spatial-merge-block order (each m×m block of neighbouring patches consecutive, m =
`spatial_merge_size`), and `grid_thw` [images, 3] (frames/tp, patch rows, patch columns).
`image_input` turns those into an `ImageInput` (host-side numpy: each patch's 2-D position, the
frame it belongs to, its attention window, Qwen3-VL's position-table taps); the tower turns that
into one feature per m×m block, [N/m², out_dim], in the same order as the image placeholder
tokens they replace.

- patch embedding: the HF Conv3d with kernel = stride = (tp, p, p) is one matmul per patch row;
- 2-D rotary positions: half of each head's frequencies turn with the patch row, half with the
  column (`rotate` of layers.py);
- attention blocks (pre-norm, residual): Qwen2.5-VL attends within windows of
  `window_size` pixels except in `fullatt_blocks` (whole frame); Qwen3-VL always over the
  frame. transformers permutes the patches window by window and attends over contiguous
  runs; here the patches stay in place and the mask says which attend to which (the same
  softmax over the same keys);
- the merger: norm, m² neighbouring patches concatenated, MLP (GELU) to the language width;
  Qwen3-VL adds learned position embeddings (bilinearly resampled per image) after the patch
  embedding, and deepstack mergers on some blocks' outputs (fed to the first LM layers).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jaxtyping import Array, Float, Int

from tiderl.models.config import VisionConfig
from tiderl.models.layers import attend, rms_norm, rotate

NORM_EPS = 1e-6  # both families' vision norms
ATTN_CHUNK = 1024  # queries per attention chunk over more patches (a 1280×720 frame: 4,784)


class ImageInput(NamedTuple):
    """The images of one forward, patch rows ready for the tower (a pytree: jit-friendly).

    Rows with `frame_n == 0` are padding (each attends only to itself; their merged features
    are never used)."""

    patches_nf: Float[Array, "N F"]
    pos_n2: Int[Array, "N 2"]
    """Each patch's (row, column) in its image."""
    frame_n: Int[Array, " N"]
    """1 + the index of the (image, frame) the patch belongs to: full attention's segments."""
    window_n: Int[Array, " N"]
    """1 + the index of the patch's attention window (Qwen2.5-VL's windowed blocks)."""
    taps_n4: Int[Array, "N 4"]
    """Qwen3-VL: the four learned-position rows blended into the patch's position embedding."""
    weights_n4: Float[Array, "N 4"]
    band_l: Int[Array, " L"] | None = None
    """Zeros whose length L (a power of two, static under jit) bounds every frame's patch
    count: attention chunks then read only the keys within L of their queries (frames are
    contiguous), not all N. None: every key."""


def merge_order_rc(h: int, w: int, m: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of each patch of an h×w frame, in spatial-merge-block order."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    shape = (h // m, m, w // m, m)
    return (rows.reshape(shape).transpose(0, 2, 1, 3).reshape(-1),
            cols.reshape(shape).transpose(0, 2, 1, 3).reshape(-1))


def _bilinear_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """Taps and weights along one axis of a `side`-long table resampled to `size` positions
    (align_corners, border clamp), in fp32 as transformers computes them."""
    src = index.astype(np.float32) * np.float32(side - 1) / np.float32(max(size - 1, 1))
    floor = np.floor(src)
    raw = floor.astype(np.int64)[:, None] + np.arange(2)
    dist = np.abs(src[:, None] - floor[:, None] - np.arange(2, dtype=np.float32))
    return np.clip(raw, 0, side - 1), np.clip(1 - dist, 0, None).astype(np.float32)


def image_input(pixel_values: Any, grid_thw: Any, cfg: VisionConfig,
                pad_to: int = 0) -> ImageInput:
    """The `ImageInput` of processor output `pixel_values` [N, C·tp·p·p] and `grid_thw`
    [images, 3]; `pad_to` > N pads the patch rows (a bucketed shape). A ValueError names a
    mismatch between the two."""
    pixels = np.asarray(pixel_values, np.float32)
    grid = np.asarray(grid_thw, np.int64).reshape(-1, 3)
    m, p, tp = cfg.spatial_merge_size, cfg.patch_size, cfg.temporal_patch_size
    width = cfg.in_channels * tp * p * p
    if pixels.ndim != 2 or pixels.shape[1] != width:
        raise ValueError(f"pixel_values of shape {pixels.shape}: expected [patches, {width}] "
                         f"(in_channels·temporal_patch_size·patch_size² of model.vision)")
    if (grid[:, 1:] % m).any() or (grid <= 0).any():
        raise ValueError(f"grid_thw {grid.tolist()}: heights and widths must be positive "
                         f"multiples of spatial_merge_size={m}")
    if int(grid.prod(1).sum()) != pixels.shape[0]:
        raise ValueError(f"pixel_values has {pixels.shape[0]} patch rows but grid_thw "
                         f"{grid.tolist()} makes {int(grid.prod(1).sum())}; pass the image "
                         "processor's pixel_values and image_grid_thw together")
    win = max(cfg.window_size // m // p, 1)
    pos, frames, windows, taps, weights = [], [], [], [], []
    n_frames = n_windows = 0
    side = int(round(cfg.num_position_embeddings ** 0.5))
    for t, h, w in grid.tolist():
        rows, cols = merge_order_rc(h, w, m)
        # The window of a patch: that of its merged token, (row // m // win, col // m // win).
        wid = (rows // m // win) * (-(-(w // m) // win)) + cols // m // win
        for _ in range(t):
            pos.append(np.stack([rows, cols], -1))
            n_frames += 1
            frames.append(np.full(h * w, n_frames))
            windows.append(n_windows + 1 + wid)
            n_windows += int(wid.max()) + 1
            if side:
                (th, wh), (tw, ww) = _bilinear_taps(rows, h, side), _bilinear_taps(cols, w, side)
                taps.append((th[:, :, None] * side + tw[:, None, :]).reshape(-1, 4))
                weights.append((wh[:, :, None] * ww[:, None, :]).reshape(-1, 4))
    n = pixels.shape[0]
    if not side:
        taps, weights = [np.zeros((n, 4), np.int64)], [np.zeros((n, 4), np.float32)]
    pad = max(pad_to - n, 0)
    if pad % (m * m):
        raise ValueError(f"pad_to={pad_to}: pad by a multiple of spatial_merge_size²={m * m}")

    def cat(parts, dtype):
        x = np.concatenate(parts).astype(dtype)
        return jnp.asarray(np.pad(x, [(0, pad)] + [(0, 0)] * (x.ndim - 1)))

    longest = int((grid[:, 1] * grid[:, 2]).max()) if len(grid) else 1
    band = jnp.zeros(1 << max(longest - 1, 0).bit_length(), jnp.int8)
    return ImageInput(cat([pixels], np.float32), cat(pos, np.int32), cat(frames, np.int32),
                      cat(windows, np.int32), cat(taps, np.int32), cat(weights, np.float32),
                      band)


def _param(rngs: nnx.Rngs, shape: tuple[int, ...], names: tuple[str | None, ...], std: float,
           dtype: Any) -> nnx.Param:
    value = (std * jax.random.normal(rngs.params(), shape, jnp.float32)).astype(dtype)
    return nnx.Param(value, out_sharding=names, eager_sharding=False)


def _const(value: float, shape: tuple[int, ...], names: tuple[str | None, ...],
           dtype: Any) -> nnx.Param:
    return nnx.Param(jnp.full(shape, value, dtype), out_sharding=names, eager_sharding=False)


def layer_norm(x: Array, scale: Array, bias: Array, eps: float) -> Array:
    """LayerNorm in fp32, cast back to the input dtype."""
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
    y = (x32 - mean) * jax.lax.rsqrt(var + eps) * scale.astype(jnp.float32)
    return (y + bias.astype(jnp.float32)).astype(x.dtype)


ACTS = {"silu": jax.nn.silu, "gelu": lambda x: jax.nn.gelu(x, approximate=False),
        "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class Norm(nnx.Module):
    """RMSNorm (Qwen2.5-VL) or LayerNorm (Qwen3-VL) over the last axis, eps 1e-6."""

    def __init__(self, dim: int, layer: bool, dtype: Any):
        self.scale_d = _const(1.0, (dim,), ("norm",), dtype)
        self.bias_d = _const(0.0, (dim,), ("norm",), dtype) if layer else None

    def __call__(self, x: Array) -> Array:
        if self.bias_d is None:
            return rms_norm(x, self.scale_d[...], NORM_EPS)
        return layer_norm(x, self.scale_d[...], self.bias_d[...], NORM_EPS)


class Linear(nnx.Module):
    """x·W + b (W stored [in, out])."""

    def __init__(self, rngs: nnx.Rngs, d_in: int, d_out: int, names: tuple[str | None, str | None],
                 dtype: Any, std: float = 0.02, bias: bool = True):
        self.w_io = _param(rngs, (d_in, d_out), names, std, dtype)
        self.b_o = _const(0.0, (d_out,), (names[1],), dtype) if bias else None

    def __call__(self, x: Array) -> Array:
        y = x @ self.w_io[...].astype(x.dtype)
        return y if self.b_o is None else y + self.b_o[...].astype(x.dtype)


class VisionBlock(nnx.Module):
    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype: Any):
        d, f, layer = cfg.d_model, cfg.mlp_dim, cfg.kind == "qwen3_vl"
        self.cfg = cfg
        self.norm1 = Norm(d, layer, dtype)
        self.norm2 = Norm(d, layer, dtype)
        self.qkv = Linear(rngs, d, 3 * d, ("embed", "heads"), dtype)
        self.proj = Linear(rngs, d, d, ("heads", "embed"), dtype)
        if layer:  # fc1 → act → fc2
            self.fc1 = Linear(rngs, d, f, ("embed", "mlp"), dtype)
            self.fc2 = Linear(rngs, f, d, ("mlp", "embed"), dtype)
        else:  # SwiGLU with biases
            self.gate = Linear(rngs, d, f, ("embed", "mlp"), dtype)
            self.up = Linear(rngs, d, f, ("embed", "mlp"), dtype)
            self.down = Linear(rngs, f, d, ("mlp", "embed"), dtype)

    def __call__(self, x_nd: Array, ang_nf: Array, ids_n: Array, chunk: int,
                 band: int = 0) -> Array:
        n, h, dh = x_nd.shape[0], self.cfg.n_heads, self.cfg.head_dim
        qkv = self.qkv(self.norm1(x_nd)).reshape(1, n, 3, h, dh)
        q = rotate(qkv[:, :, 0], ang_nf[None])
        k = rotate(qkv[:, :, 1], ang_nf[None])
        out = segment_attend(q, k, qkv[:, :, 2], ids_n, chunk, band)
        x_nd = x_nd + self.proj(out.reshape(n, h * dh))
        y = self.norm2(x_nd)
        act = ACTS[self.cfg.act]
        if self.cfg.kind == "qwen3_vl":
            return x_nd + self.fc2(act(self.fc1(y)))
        return x_nd + self.down(act(self.gate(y)) * self.up(y))


class PatchMerger(nnx.Module):
    """Norm, m² neighbouring patches concatenated, Linear → GELU → Linear to `out_dim`.
    `post_shuffle` (Qwen3-VL's deepstack mergers) normalises after concatenating."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype: Any,
                 post_shuffle: bool = False):
        wide = cfg.d_model * cfg.spatial_merge_size ** 2
        self.wide, self.post_shuffle = wide, post_shuffle
        self.norm = Norm(wide if post_shuffle else cfg.d_model, cfg.kind == "qwen3_vl", dtype)
        self.fc1 = Linear(rngs, wide, wide, ("embed", "mlp"), dtype)
        self.fc2 = Linear(rngs, wide, cfg.out_dim, ("mlp", "embed"), dtype)

    def __call__(self, x_nd: Array) -> Array:
        x = self.norm(x_nd.reshape(-1, self.wide)) if self.post_shuffle else self.norm(x_nd)
        x = x.reshape(-1, self.wide)
        return self.fc2(jax.nn.gelu(self.fc1(x), approximate=False))


def _same(ids_c: Array, at_c: Array, ids_n: Array) -> Array:
    """[c, N]: queries (ids `ids_c` at rows `at_c`) attend to keys of equal id; padding rows
    (id 0) only to themselves."""
    eye = at_c[:, None] == jnp.arange(ids_n.shape[0])[None, :]
    return ((ids_c[:, None] == ids_n[None, :]) & (ids_n != 0)[None, :]) | eye


def segment_attend(q_1nhd: Array, k_1nhd: Array, v_1nhd: Array, ids_n: Array,
                   chunk: int, band: int = 0) -> Array:
    """Bidirectional attention within segments (`ids_n`: frame or window ids), `chunk` queries
    at a time when N exceeds it (each chunk's scores recomputed in the backward, as
    `layers.attend_query_chunked`): a screenshot's thousands of patches never hold an
    [H, N, N] score array. 0 = dense. `band` > 0 (every segment contiguous and at most `band`
    long): a chunk reads only the keys within `band` of its queries — [H, chunk, chunk +
    2·band] scores, not [H, chunk, N] (a batch of screenshots costs linear, not quadratic,
    in their number)."""
    n = ids_n.shape[0]
    at_n = jnp.arange(n)
    if not chunk or n <= chunk:
        return attend(q_1nhd, k_1nhd, v_1nhd, _same(ids_n, at_n, ids_n)[None])
    m = -(-n // chunk)
    pad = m * chunk - n
    q_m1chd = jnp.pad(q_1nhd, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(
        1, m, chunk, *q_1nhd.shape[2:]).swapaxes(0, 1)
    ids_mc = jnp.pad(ids_n, (0, pad)).reshape(m, chunk)
    at_mc = jnp.arange(m * chunk).reshape(m, chunk)
    if band and chunk + 2 * band < n:
        width = chunk + 2 * band
        edge = ((0, 0), (band, pad + band), (0, 0), (0, 0))
        k_pad, v_pad = jnp.pad(k_1nhd, edge), jnp.pad(v_1nhd, edge)
        ids_pad = jnp.pad(ids_n, (band, pad + band))  # id 0: masked

        @jax.checkpoint
        def near(xs):
            q, ids_c, at_c = xs
            s = at_c[0]  # the chunk's first query; its keys start `band` before it
            k = jax.lax.dynamic_slice_in_dim(k_pad, s, width, axis=1)
            v = jax.lax.dynamic_slice_in_dim(v_pad, s, width, axis=1)
            ids_k = jax.lax.dynamic_slice_in_dim(ids_pad, s, width)
            at_k = s - band + jnp.arange(width)
            mask = (((ids_c[:, None] == ids_k[None, :]) & (ids_k != 0)[None, :])
                    | (at_c[:, None] == at_k[None, :]))
            return attend(q, k, v, mask[None])

        out = jax.lax.map(near, (q_m1chd, ids_mc, at_mc))
        return out.swapaxes(0, 1).reshape(1, m * chunk, *q_1nhd.shape[2:])[:, :n]

    @jax.checkpoint
    def one(xs):
        q, ids_c, at_c = xs
        return attend(q, k_1nhd, v_1nhd, _same(ids_c, at_c, ids_n)[None])

    out = jax.lax.map(one, (q_m1chd, ids_mc, at_mc))
    return out.swapaxes(0, 1).reshape(1, m * chunk, *q_1nhd.shape[2:])[:, :n]


class VisionTower(nnx.Module):
    """Patch rows → merged image features [N/m², out_dim] (+ deepstack features)."""

    def __init__(self, cfg: VisionConfig, *, rngs: nnx.Rngs, dtype: Any = jnp.float32):
        d = cfg.d_model
        width = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        self.cfg = cfg
        self.patch = Linear(rngs, width, d, (None, "embed"), dtype,
                            bias=cfg.kind == "qwen3_vl")
        if cfg.num_position_embeddings:
            self.pos_embed_nd = _param(rngs, (cfg.num_position_embeddings, d), (None, "embed"),
                                       0.02, dtype)
        self.blocks = nnx.List([VisionBlock(cfg, rngs=rngs, dtype=dtype)
                                for _ in range(cfg.depth)])
        self.merger = PatchMerger(cfg, rngs=rngs, dtype=dtype)
        self.deepstack = nnx.List([PatchMerger(cfg, rngs=rngs, dtype=dtype, post_shuffle=True)
                                   for _ in cfg.deepstack_blocks])

    def angles(self, pos_n2: Array) -> Array:
        """2-D RoPE angles [N, Dh/2]: Dh/4 frequencies on the row, the same on the column."""
        quarter = self.cfg.head_dim // 2
        inv = 1.0 / (self.cfg.rope_theta ** (jnp.arange(0, quarter, 2, dtype=jnp.float32)
                                             / quarter))
        pos = pos_n2.astype(jnp.float32)
        return jnp.concatenate([pos[:, :1] * inv, pos[:, 1:] * inv], axis=-1)

    def __call__(self, images: ImageInput, compute_dtype: Any = jnp.float32,
                 attn_chunk: int = ATTN_CHUNK) -> tuple[Array, tuple[Array, ...]]:
        """(merged features [N/m², out_dim], deepstack features); attention runs
        `attn_chunk` queries at a time over more patches than that (0: dense)."""
        cfg = self.cfg
        x = self.patch(images.patches_nf.astype(compute_dtype))
        if cfg.num_position_embeddings:
            table = self.pos_embed_nd[...].astype(jnp.float32)
            pe = (jnp.take(table, images.taps_n4, axis=0)
                  * images.weights_n4[..., None]).sum(1)
            x = x + pe.astype(x.dtype)
        ang = self.angles(images.pos_n2)
        windowed = images.window_n if cfg.kind == "qwen2_5_vl" else images.frame_n
        band = 0 if images.band_l is None else images.band_l.shape[0]
        deep = []
        for i, block in enumerate(self.blocks):
            ids = images.frame_n if i in cfg.fullatt_blocks else windowed
            x = block(x, ang, ids, attn_chunk, band)
            if i in cfg.deepstack_blocks:
                deep.append(self.deepstack[cfg.deepstack_blocks.index(i)](x))
        return self.merger(x), tuple(deep)
