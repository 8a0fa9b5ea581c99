"""Images on the OpenAI-compatible endpoint: `image_url` parts with data URLs parsed and kept
with their message (checked against env.images), and — every policy here being text-only — a
request with images answered 400 saying the policy has no vision tower; bad images (too large,
too many, not an image, not a data URL) are a clear 400 naming the limit, through the real
openai client, and the task goes on."""

from __future__ import annotations

import asyncio
import base64
import io
import random

import pytest
from test_agents_endpoint import _post, _with_gate, tok  # noqa: F401 - tok is a fixture

from tiderl.agents.chat import ChatError, difference, normalize_messages
from tiderl.envs.config import ImageConfig

openai = pytest.importorskip("openai")

LIMITS = ImageConfig(max_images=2, max_bytes=30_000, max_total_bytes=40_000, max_side=256,
                     max_pixels=40_000)


def data_url(w=16, h=12, fmt="PNG", noise=False, color=(9, 99, 199)) -> str:
    from PIL import Image as PILImage

    im = PILImage.new("RGB", (w, h), color)
    if noise:
        im = PILImage.frombytes("RGB", (w, h), random.Random(w * h).randbytes(w * h * 3))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    mime = {"PNG": "image/png", "JPEG": "image/jpeg", "GIF": "image/gif"}[fmt]
    return f"data:{mime};base64,{base64.b64encode(buf.getvalue()).decode()}"


def user(*images: str, text="What is on the screen?") -> dict:
    return {"role": "user", "content": [{"type": "text", "text": text}, *(
        {"type": "image_url", "image_url": {"url": u}} for u in images)]}


def test_image_parts_are_parsed_and_kept_with_their_message():
    (m,) = normalize_messages([{"role": "user", "content": [
        {"type": "text", "text": "left "}, {"type": "image_url", "image_url": {
            "url": data_url(16, 12), "detail": "high"}},
        {"type": "text", "text": "right"},
        {"type": "image_url", "image_url": data_url(20, 10, fmt="JPEG")}]}], LIMITS)
    assert m["content"] == "left right" and m["image_at"] == (5, 10)
    assert [(i.mime, i.width, i.height) for i in m["images"]] == [("image/png", 16, 12),
                                                                  ("image/jpeg", 20, 10)]
    assert m["images"][0].pil().convert("RGB").getpixel((3, 3)) == (9, 99, 199)
    # A resent history must carry the same images at the same places.
    (same,) = normalize_messages([user(data_url(16, 12), text="left right")], LIMITS)
    assert difference(same, m) is not None  # one image, not two
    other = normalize_messages([user(data_url(16, 12, color=(1, 1, 1)))], LIMITS)[0]
    mine = normalize_messages([user(data_url(16, 12))], LIMITS)[0]
    assert difference(mine, mine) is None and "images" in difference(other, mine)


def test_bad_image_parts_are_a_400_naming_the_limit():
    cases = {
        "bytes": ([user(data_url(150, 150, noise=True))], "env.images.max_bytes",
                  "image_too_large"),
        "side": ([user(data_url(300, 8))], "env.images.max_side", "image_too_large"),
        "pixels": ([user(data_url(250, 250))], "env.images.max_pixels", "image_too_large"),
        "many": ([user(data_url(), data_url()), user(data_url())], "env.images.max_images",
                 "image_too_large"),
        "total": ([user(data_url(90, 90, noise=True), data_url(91, 90, noise=True))],
                  "env.images.max_total_bytes", "image_too_large"),
        "not_image": ([user("data:image/png;base64," + base64.b64encode(b"hi").decode())],
                      "not an image", "invalid_image"),
        "gif": ([user(data_url(fmt="GIF"))], "not PNG or JPEG", "invalid_image"),
        "http": ([user("https://example.com/cat.png")], "not a base64 data URL",
                 "invalid_image"),
        "base64": ([user("data:image/png;base64,@@@")], "not valid base64", "invalid_image"),
        "mime": ([user(data_url().replace("image/png", "image/jpeg"))],
                 "says mime 'image/jpeg'", "invalid_image"),
        "shape": ([{"role": "user", "content": [{"type": "image_url"}]}],
                  "must be {'url'", "invalid_image"),
        "audio": ([{"role": "user", "content": [{"type": "input_audio"}]}],
                  "neither a text part", None),
    }
    for name, (msgs, words, code) in cases.items():
        with pytest.raises(ChatError) as e:
            normalize_messages(msgs, LIMITS)
        assert e.value.status == 400 and words in e.value.message, (name, e.value.message)
        assert e.value.code == code, name


def test_the_openai_client_gets_a_400_no_vision_and_the_task_goes_on(tok):  # noqa: F811
    def check(base):
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        out = {}
        for name, msg in (("ok_image", user(data_url())),
                          ("too_big", user(data_url(150, 150, noise=True))),
                          ("not_image", user("data:image/png;base64,aGVsbG8=")),
                          ("too_many", user(data_url(), data_url(), data_url()))):
            try:
                client.chat.completions.create(model="x", messages=[msg])
                out[name] = (200, "")
            except openai.BadRequestError as e:
                out[name] = (e.status_code, e.body["message"], e.body["code"])
        reply = client.chat.completions.create(
            model="x", messages=[{"role": "user", "content": "What is 2 + 3?"}])
        out["text"] = (200, reply.choices[0].message.content)
        out["raw"] = _post(base + "/chat/completions", {"messages": [user(data_url())]})
        return out

    out, t, runner, _ = asyncio.run(_with_gate(tok, ["five"], check, images=LIMITS))
    assert out["ok_image"][0] == 400 and out["ok_image"][2] == "no_vision"
    assert "the policy has no vision tower" in out["ok_image"][1]
    assert out["too_big"][:1] == (400,) and "env.images.max_bytes" in out["too_big"][1]
    assert out["not_image"][2] == "invalid_image" and "not an image" in out["not_image"][1]
    assert "env.images.max_images" in out["too_many"][1]
    assert out["text"] == (200, "five")
    # The text request after four refused ones is a retry-free first turn: the task went on.
    assert out["raw"][0] == 400 and out["raw"][1]["error"]["code"] == "no_vision"
    assert t.turns == 1 and runner.endpoint.requests[400] >= 5
