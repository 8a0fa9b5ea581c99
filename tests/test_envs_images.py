"""Images in the env protocol on a real aiohttp server (127.0.0.1, port 0) and the real client:
observations carry PNG/JPEG both ways, every limit of env.images answers 413/422 naming its key,
not-an-image is refused, the session and the server go on; an adapter breaking a limit is a
500 that closes only its session; the client refuses replies over its own limits; a text-only
rollout reads images as placeholder lines."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import io
import random

import aiohttp
import pytest

from tiderl.envs.adapters.base import Adapter, Observation, Step
from tiderl.envs.client import EnvClient
from tiderl.envs.config import EnvConfig, ImageConfig
from tiderl.envs.images import Image, ImageError, check_all, from_bytes, placeholders, png
from tiderl.envs.protocol import EndReason
from tiderl.envs.server import EnvServer

LIMITS = ImageConfig(max_images=3, max_bytes=40_000, max_total_bytes=60_000, max_side=512,
                     max_pixels=200_000)


def picture(w: int, h: int, color=(200, 30, 40), fmt: str = "PNG", noise: bool = False) -> bytes:
    from PIL import Image as PILImage

    im = PILImage.new("RGB", (w, h), color)
    if noise:  # incompressible pixels: the encoded size grows with the area
        im = PILImage.frombytes("RGB", (w, h), random.Random(w * h).randbytes(w * h * 3))
    buf = io.BytesIO()
    im.save(buf, format=fmt)
    return buf.getvalue()


def wire(data: bytes, mime: str | None = "image/png") -> dict:
    out = {"data": base64.b64encode(data).decode()}
    if mime:
        out["mime"] = mime
    return out


class Pictures(Adapter):
    """Takes images and sends them: reset shows a w x h picture; each step echoes the sizes of
    the images it was sent, and action 'big' / 'junk' / 'many' returns a picture breaking a
    limit (an adapter bug)."""

    accepts_images = True

    def reset(self, task):
        self.got = [(im.width, im.height) for im in task.get("images", ())]
        return Observation(f"start, got {self.got}", [png(_pil(task.get("w", 32), 24))])

    def step(self, action, images=()):
        sizes = [(im.width, im.height, im.mime) for im in images]
        extra = {"big": [picture(600, 100)], "junk": [b"GIF89a not really"],
                 "many": [picture(8, 8)] * 4}.get(action, [picture(16, 16, fmt="JPEG")])
        return Step(f"got {sizes}", action == "end", 0.0, extra)

    def close(self):
        return 1.0, {}


class TextOnly(Pictures):
    accepts_images = False


def _pil(w, h):
    from PIL import Image as PILImage

    return PILImage.new("RGB", (w, h), (10, 120, 200))


@contextlib.asynccontextmanager
async def serving(adapter=Pictures, server_limits=LIMITS, client_limits=LIMITS, **kw):
    cfg = EnvConfig(retries=0, images=server_limits, max_request_bytes=1 << 20, **kw)
    server = EnvServer(adapter, cfg)
    async with server.serve() as url, EnvClient(url, EnvConfig(retries=0, images=client_limits)
                                                ) as env, aiohttp.ClientSession() as http:
        yield server, url, env, http


async def post(http, url, body):
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


def test_from_bytes_checks_format_size_and_decodes():
    im = from_bytes(picture(40, 30), LIMITS)
    assert (im.mime, im.width, im.height) == ("image/png", 40, 30)
    assert from_bytes(picture(40, 30, fmt="JPEG"), LIMITS).mime == "image/jpeg"
    cases = {
        b"hello, not an image": (422, "not an image Pillow can read"),
        picture(20, 20, fmt="GIF"): (422, "GIF, not PNG or JPEG"),
        picture(513, 10): (413, "env.images.max_side"),
        picture(500, 500): (413, "env.images.max_pixels"),
        picture(200, 200, noise=True): (413, "env.images.max_bytes"),
        picture(64, 64)[:-40]: (422, "does not decode as PNG"),  # truncated
    }
    for data, (status, words) in cases.items():
        with pytest.raises(ImageError) as e:
            from_bytes(data, LIMITS, where="obs image 0")
        assert e.value.status == status and words in e.value.message, e.value.message
        assert e.value.message.startswith("obs image 0")
    with pytest.raises(ImageError, match="is image/png but says mime 'image/jpeg'"):
        from_bytes(picture(8, 8), LIMITS, mime="image/jpeg")
    with pytest.raises(ImageError, match="4 images, over the limit of 3 .env.images.max_images"):
        check_all([picture(8, 8)] * 4, LIMITS, where="step")
    mid = picture(110, 100, noise=True)  # ~33 kB each: two pass alone, not together
    assert len(mid) < LIMITS.max_bytes < 2 * len(mid)
    with pytest.raises(ImageError, match="env.images.max_total_bytes"):
        check_all([mid, mid], LIMITS, where="step")


def test_placeholders_name_each_image():
    ims = [Image(b"x", "image/png", 320, 200), Image(b"y", "image/jpeg", 8, 9)]
    assert placeholders("look", ims) == ("look\n[image 1: image/png 320x200]\n"
                                         "[image 2: image/jpeg 8x9]")
    assert placeholders("look", []) == "look"


@pytest.mark.asyncio
async def test_images_travel_both_ways_and_decode_to_the_same_pixels():
    async with serving() as (_, _, env, _):
        sent = from_bytes(picture(20, 10, color=(1, 2, 3)), LIMITS)
        s = await env.start({"task_id": "t", "w": 48}, images=(sent,))
        assert s.ok and s.observation == "start, got [(20, 10)]"
        (im,) = s.images
        assert (im.mime, im.width, im.height) == ("image/png", 48, 24)
        assert im.pil().convert("RGB").getpixel((5, 5)) == (10, 120, 200)
        r = await env.step(s.session, "look", images=(sent, sent))
        assert r.ok and r.observation == "got [(20, 10, 'image/png'), (20, 10, 'image/png')]"
        assert [(i.mime, i.width) for i in r.images] == [("image/jpeg", 16)]
        r = await env.step(s.session, "look")  # no images: none reach the adapter
        assert r.ok and r.observation == "got []"
        assert (await env.end(s.session)).ok


@pytest.mark.asyncio
async def test_bad_request_images_answer_4xx_naming_the_limit_and_the_session_goes_on():
    async with serving() as (server, url, env, http):
        s = await env.start({"task_id": "t"})
        other = await env.start({"task_id": "u"})
        ok = wire(picture(8, 8))
        bad = {
            "many": ([ok] * 4, 413, "env.images.max_images"),
            "bytes": ([wire(picture(200, 200, noise=True))], 413, "env.images.max_bytes"),
            "side": ([wire(picture(600, 8))], 413, "env.images.max_side"),
            "pixels": ([wire(picture(450, 450))], 413, "env.images.max_pixels"),
            "total": ([wire(picture(110, 100, noise=True))] * 2, 413,
                      "env.images.max_total_bytes"),
            "not_image": ([wire(b"\x89PNG but not really")], 422, "not an image"),
            "base64": ([{"data": "%%% not base64", "mime": "image/png"}], 422, "not valid base64"),
            "mime": ([wire(picture(8, 8), "image/jpeg")], 422, "says mime 'image/jpeg'"),
            "shape": ([{"bytes": "x"}], 422, "'images[0]' must be an object with 'data'"),
            "not_list": ("abc", 422, "'images' must be a list"),
        }
        for name, (images, status, words) in bad.items():
            for route, body in (("/observation", {"session": s.session, "action": "x"}),
                                ("/start", {"task": {"task_id": "v"}})):
                got, reply = await post(http, url + route, {**body, "images": images})
                assert got == status and words in reply["error"], (name, route, got, reply)
        # Nothing reached an adapter, no session started, and both sessions go on.
        assert server.live_sessions == 2
        for sess in (s, other):
            r = await env.step(sess.session, "look")
            assert r.ok and r.turn == 1 and r.observation == "got []", r
        health = await env.health()
        assert health.ok and health.body["sessions"] == 2


@pytest.mark.asyncio
async def test_an_adapter_that_takes_no_images_refuses_them_with_422():
    async with serving(adapter=TextOnly) as (server, url, env, http):
        s = await env.start({"task_id": "t"})
        got, reply = await post(http, url + "/observation",
                                {"session": s.session, "action": "x",
                                 "images": [wire(picture(8, 8))]})
        assert got == 422 and "takes none (its adapter does not set accepts_images)" in \
            reply["error"]
        r = await env.step(s.session, "look")
        assert r.ok and r.turn == 1
        bad = await env.start({"task_id": "u"}, images=(from_bytes(picture(8, 8), LIMITS),))
        assert bad.reason == EndReason.env_error and "HTTP 422" in bad.error
        assert server.live_sessions == 1


@pytest.mark.asyncio
async def test_adapter_images_over_a_limit_are_its_failure_and_close_only_its_session():
    async with serving() as (server, _, env, _):
        a = await env.start({"task_id": "a"})
        b = await env.start({"task_id": "b"})
        for action, words in (("big", "env.images.max_side"), ("junk", "not an image"),
                              ("many", "env.images.max_images")):
            s = await env.start({"task_id": action})
            r = await env.step(s.session, action)
            assert r.reason == EndReason.env_error and "HTTP 500" in r.error and words in r.error
            assert "closed" in r.error
        assert server.live_sessions == 2
        assert (await env.step(a.session, "look")).ok and (await env.step(b.session, "x")).ok
        # reset's images too: a 500, and no session is left behind
        s = await env.start({"task_id": "wide", "w": 700})
        assert s.reason == EndReason.env_error and "env.images.max_side" in s.error
        assert server.live_sessions == 2


@pytest.mark.asyncio
async def test_the_client_refuses_replies_over_its_own_limits_and_ends_the_session():
    tight = ImageConfig(max_side=40)
    async with serving(client_limits=tight) as (server, _, env, _):
        s = await env.start({"task_id": "t", "w": 41})  # the server allows it, the client not
        assert s.reason == EndReason.env_error and "env.images.max_side" in s.error
        await asyncio.sleep(0)
        assert server.live_sessions == 0  # the client ended the session it refused
        s = await env.start({"task_id": "t", "w": 40})
        assert s.ok
        r = await env.step(s.session, "look")  # a 16x16 JPEG: fine
        assert r.ok
    async with serving(client_limits=ImageConfig(max_images=1)) as (_, _, env, _):
        s = await env.start({"task_id": "t"})
        r = await env.step(s.session, "many")  # the server refuses its own adapter first
        assert r.reason == EndReason.env_error and "HTTP 500" in r.error


@pytest.mark.asyncio
async def test_a_retried_start_replays_its_images_and_kept_replies_are_bounded_by_bytes(
        monkeypatch):
    import tiderl.envs.server as server_mod

    async with serving() as (server, url, _, http):
        body = {"task": {"task_id": "t", "w": 40}, "request_id": "r1"}
        first = await post(http, url + "/start", body)
        again = await post(http, url + "/start", body)  # the first reply was "lost": a retry
        assert first == again and first[0] == 200 and len(first[1]["images"]) == 1
        assert server.live_sessions == 1
        one = server._start_reply_bytes
        assert one == len(first[1]["images"][0]["data"]) > 0
        monkeypatch.setattr(server_mod, "_START_REPLY_IMAGE_BYTES", 3 * one)
        for i in range(5):
            await post(http, url + "/start", {"task": {"task_id": f"u{i}", "w": 40},
                                              "request_id": f"q{i}"})
        assert len(server._start_replies) == 3 and server._start_reply_bytes == 3 * one
        assert "r1" not in server._start_replies  # the oldest went first
