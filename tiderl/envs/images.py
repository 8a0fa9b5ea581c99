"""Images in the env protocol and the agent endpoint: decoded, checked, carried. No JAX.

On the wire an image is `{"data": "<base64 of the PNG or JPEG file>", "mime": "image/png"}`
(`mime` is optional: the bytes say what they are, and a `mime` that disagrees is refused). A
message carries its images as a list beside its text, e.g. an /observation reply
`{"observation": "...", "images": [{"data": ..., "mime": "image/png"}], ...}`; the agent
endpoint takes them as OpenAI `image_url` content parts with data URLs
(`data:image/png;base64,...`).

Every image is checked against `env.images` (ImageConfig) before anything else sees it: how
many (`max_images`), each one's encoded size (`max_bytes`), all of them together
(`max_total_bytes`), its width and height (`max_side`, `max_pixels`, read from the header before
any pixel is decoded), and that it decodes as PNG or JPEG (Pillow decodes it in full). A failed
check is an `ImageError` naming the image, the limit and its config key.

A text-only policy reads each image as a placeholder line, `[image 1: image/png 320x200]`
(`placeholders`), so an image observation never stops a text run.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import hashlib
import io
from collections.abc import Mapping, Sequence
from typing import Any

from tiderl.envs.config import ImageConfig

MIMES = {"PNG": "image/png", "JPEG": "image/jpeg"}
"""Formats accepted (Pillow's format name -> mime type)."""


class ImageError(ValueError):
    """An image refused: `status` is the HTTP code a server answers, the message names the
    image, the limit and its config key."""

    def __init__(self, message: str, status: int = 422):
        super().__init__(message)
        self.status = status
        self.message = message


@dataclasses.dataclass(frozen=True)
class Image:
    """One checked image: its encoded bytes (PNG or JPEG), mime type and pixel size."""

    data: bytes = dataclasses.field(repr=False)
    mime: str
    width: int
    height: int

    @property
    def digest(self) -> str:
        """sha256 of the bytes (two messages carry the same image iff their digests match)."""
        return hashlib.sha256(self.data).hexdigest()

    def wire(self) -> dict[str, str]:
        """The JSON form: `{"data": base64, "mime": ...}`."""
        return {"data": base64.b64encode(self.data).decode("ascii"), "mime": self.mime}

    def data_url(self) -> str:
        """`data:<mime>;base64,...` (an OpenAI image_url)."""
        return f"data:{self.mime};base64,{base64.b64encode(self.data).decode('ascii')}"

    def pil(self) -> Any:
        """The decoded PIL image."""
        from PIL import Image as PILImage

        return PILImage.open(io.BytesIO(self.data))

    def placeholder(self, index: int) -> str:
        return f"[image {index}: {self.mime} {self.width}x{self.height}]"


def from_bytes(data: bytes, limits: ImageConfig, *, where: str = "image",
               mime: str | None = None) -> Image:
    """`data` checked against `limits` and decoded; an ImageError naming `where` otherwise."""
    from PIL import Image as PILImage
    from PIL import UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"{where} has {len(data)} bytes, over the limit of {limits.max_bytes} "
                         "(env.images.max_bytes); send a smaller image or raise "
                         "env.images.max_bytes", 413)
    try:
        im = PILImage.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise ImageError(f"{where} is not an image Pillow can read ({type(e).__name__}); send "
                         "PNG or JPEG bytes") from None
    fmt = im.format or ""
    if fmt not in MIMES:
        raise ImageError(f"{where} is {fmt or 'an unknown format'}, not PNG or JPEG; convert it")
    if mime is not None and mime != MIMES[fmt]:
        raise ImageError(f"{where} is {MIMES[fmt]} but says mime {mime!r}; send the right "
                         "mime or leave it out")
    w, h = im.size
    if max(w, h) > limits.max_side:
        raise ImageError(f"{where} is {w}x{h} pixels, over the limit of {limits.max_side} per "
                         "side (env.images.max_side); downscale it or raise env.images.max_side",
                         413)
    if w * h > limits.max_pixels:
        raise ImageError(f"{where} is {w}x{h} = {w * h} pixels, over the limit of "
                         f"{limits.max_pixels} (env.images.max_pixels); downscale it or raise "
                         "env.images.max_pixels", 413)
    try:
        im.load()  # the whole file decodes (a truncated or corrupt one fails here)
    except (OSError, ValueError, SyntaxError) as e:
        raise ImageError(f"{where} does not decode as {fmt} ({type(e).__name__}: {e}); send "
                         "a complete PNG or JPEG file") from None
    return Image(data=bytes(data), mime=MIMES[fmt], width=w, height=h)


def check_all(images: Sequence[Image | bytes], limits: ImageConfig, *, where: str
              ) -> tuple[Image, ...]:
    """Images (checked Image objects, or raw PNG/JPEG bytes to check) within the count and total
    limits; an ImageError naming `where` otherwise."""
    if len(images) > limits.max_images:
        raise ImageError(f"{where} carries {len(images)} images, over the limit of "
                         f"{limits.max_images} (env.images.max_images); send fewer or raise "
                         "env.images.max_images", 413)
    out = [im if isinstance(im, Image) else from_bytes(bytes(im), limits,
                                                       where=f"{where} image {i}")
           for i, im in enumerate(images)]
    for i, im in enumerate(out):
        if isinstance(images[i], Image):  # built by the caller: its limits still apply
            _recheck(im, limits, f"{where} image {i}")
    _total(out, limits, where)
    return tuple(out)


def _recheck(im: Image, limits: ImageConfig, where: str) -> None:
    if (len(im.data) > limits.max_bytes or max(im.width, im.height) > limits.max_side
            or im.width * im.height > limits.max_pixels):
        from_bytes(im.data, limits, where=where)  # raises with the limit named


def _total(images: Sequence[Image], limits: ImageConfig, where: str) -> None:
    total = sum(len(im.data) for im in images)
    if total > limits.max_total_bytes:
        raise ImageError(f"{where} carries {total} bytes of images, over the limit of "
                         f"{limits.max_total_bytes} (env.images.max_total_bytes); send fewer or "
                         "smaller images or raise env.images.max_total_bytes", 413)


def from_wire(raw: Any, limits: ImageConfig, *, where: str) -> tuple[Image, ...]:
    """A JSON `images` list (`[{"data": base64, "mime"?: ...}]`, or null/absent: none) decoded
    and checked; an ImageError naming the entry otherwise."""
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise ImageError(f"'{where}' must be a list of {{\"data\": base64, \"mime\": ...}} "
                         f"objects, got {type(raw).__name__}")
    if len(raw) > limits.max_images:
        raise ImageError(f"'{where}' carries {len(raw)} images, over the limit of "
                         f"{limits.max_images} (env.images.max_images); send fewer or raise "
                         "env.images.max_images", 413)
    out = []
    for i, entry in enumerate(raw):
        at = f"{where}[{i}]"
        if not isinstance(entry, Mapping) or not isinstance(entry.get("data"), str):
            raise ImageError(f"'{at}' must be an object with 'data' (base64 of a PNG or JPEG "
                             "file) and an optional 'mime'")
        mime = entry.get("mime")
        if mime is not None and not isinstance(mime, str):
            raise ImageError(f"'{at}.mime' must be a string such as 'image/png'")
        out.append(from_bytes(b64decode(entry["data"], limits, where=at), limits, where=at,
                              mime=mime))
    _total(out, limits, where)
    return tuple(out)


def b64decode(text: str, limits: ImageConfig, *, where: str) -> bytes:
    """Base64 text to bytes, refusing (before decoding) text too long for env.images.max_bytes."""
    if len(text) > 4 * (limits.max_bytes // 3 + 1) + 4:
        raise ImageError(f"{where} has about {len(text) * 3 // 4} bytes, over the limit of "
                         f"{limits.max_bytes} (env.images.max_bytes); send a smaller image or "
                         "raise env.images.max_bytes", 413)
    try:
        return base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        raise ImageError(f"{where} is not valid base64; send the file's bytes base64-encoded"
                         ) from None


def to_wire(images: Sequence[Image]) -> list[dict[str, str]]:
    return [im.wire() for im in images]


def placeholders(text: str, images: Sequence[Image]) -> str:
    """`text` with one placeholder line per image, for a policy that reads no images."""
    if not images:
        return text
    marks = "\n".join(im.placeholder(i + 1) for i, im in enumerate(images))
    return f"{text}\n{marks}" if text else marks


def png(pil_image: Any) -> Image:
    """A PIL image encoded as PNG (deterministic bytes for the same pixels)."""
    buf = io.BytesIO()
    pil_image.save(buf, format="PNG", compress_level=1)
    w, h = pil_image.size
    return Image(data=buf.getvalue(), mime="image/png", width=w, height=h)


__all__ = ["Image", "ImageError", "MIMES", "b64decode", "check_all", "from_bytes", "from_wire",
           "placeholders", "png", "to_wire"]
