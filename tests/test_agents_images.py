"""Images on the OpenAI-compatible endpoint: `image_url` parts with data URLs parsed and kept
with their message (checked against env.images); a vision-language policy (the manager's
`ImagePrompt`) reads them — each image's placeholder where its part came, expanded, patched and
handed to the engine with its turn's tokens, in `Trajectory.images` in order, never twice — and
a text policy answers 400 saying it has no vision tower; bad images (too large, too many, not an
image, not a data URL) are a clear 400 naming the limit, through the real openai client, and
the task goes on."""

from __future__ import annotations

import asyncio
import base64
import io
import random

import numpy as np

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


# -- a vision-language policy --------------------------------------------------------------------
def _vlm_harness(folder, tokenizer: str):
    """(tokenizer, template, ImagePrompt) of a tiny VLM: the local HF tokenizer with the
    Qwen2-VL chat template (test_models_vision_inputs), or the byte tokenizer's template."""
    from test_models_vision_inputs import _vl_tokenizer

    from tiderl.envs.templates import template_for
    from tiderl.models.config import VisionConfig
    from tiderl.models.tokenizer import ByteTokenizer
    from tiderl.models.vision_inputs import ImageProcessing, ImagePrompt

    hf, tok = _vl_tokenizer(folder) if tokenizer == "hf" else (None, ByteTokenizer())
    vision = VisionConfig(patch_size=4, image_token_id=tok.token_to_id("<|image_pad|>"))
    return hf, tok, template_for(tok), ImagePrompt(vision, ImageProcessing(min_pixels=64,
                                                                           max_pixels=4096))


async def _vlm_task(tok, template, prompt, script, check):
    """One gated agent task on a RolloutManager with `prompt` (a VLM): `check(base_url)` in a
    thread; (its result, the trajectory, what each prefill of the task received)."""
    import test_agents_endpoint as ep

    from tiderl.agents.runner import episode_backend
    from tiderl.envs.config import EnvConfig
    from tiderl.serving.ctb import CTBConfig, make_scheduler
    from tiderl.serving.rank import RolloutRank
    from tiderl.serving.rollout import RolloutManager

    prefills: list[tuple[list[int], list]] = []

    class Recording(ep.ScriptedEngine):
        def prefill_many(self, params, requests):
            for r in requests:
                prefills.append((list(r.tokens), list(r.images or [])))
            return super().prefill_many(params, requests)

    stop = template.stop[0]
    engine = Recording([tok.encode(t) + [stop] for t in script],
                       stop_tokens=tuple(template.stop_ids))
    rank = RolloutRank(0, engine)
    await rank.start()
    sched = make_scheduler("ctb", CTBConfig(), [1 << 16], max_context=4096)
    cfg = EnvConfig(agent="test_agents_endpoint:gated", max_turns=4)
    ep.GATE.clear()
    ep.GATE.update(ready=asyncio.Event(), release=asyncio.Event(), returns=1.0)
    try:
        async with episode_backend(cfg, template, max_action_tokens=64,
                                   temperature=1.0) as (_, runner):
            mgr = RolloutManager([rank], sched, None, template, max_turns=4, images=prompt,
                                 runner=runner)
            run = asyncio.ensure_future(mgr.run_group(ep.group()))
            await ep.GATE["ready"].wait()
            result = await asyncio.to_thread(check, ep.GATE["url"])
            ep.GATE["release"].set()
            (t,) = await run
    finally:
        await rank.close()
    return result, t, prefills


def _pic(url: str):
    from tiderl.envs.images import from_bytes

    return from_bytes(base64.b64decode(url.split(",", 1)[1]), ImageConfig()).pil()


# The HF variant trains a tokenizer and imports transformers' processor: ~50 s on a shared box.
@pytest.mark.parametrize("tokenizer", [pytest.param("hf", marks=pytest.mark.slow), "byte"])
def test_a_vlm_policy_reads_the_agents_images_turn_by_turn(tmp_path, tokenizer):
    """A two-turn conversation through the real openai client, one image in the first user
    message (before its text) and two in the second (around its text): the engine's prefills
    got 1 then 2 images (patch_image of the decoded images, nothing re-sent), the trajectory's
    tokens hold their expanded placeholder runs in order — with the HF tokenizer, exactly the ids
    transformers' Qwen2.5-VL processor renders for the conversation, and its pixel values — and
    `Trajectory.images` the three images; a text-only turn after them still runs; bad images
    and an image outside a user message are 400 and the task goes on."""
    from tiderl.models.rope_index import placeholder_count, sequence_positions
    from tiderl.models.vision_inputs import patch_image

    hf, tok, template, prompt = _vlm_harness(tmp_path, tokenizer)
    a, b, c = data_url(32, 48), data_url(21, 37, color=(200, 10, 10)), data_url(
        16, 16, noise=True)
    first = {"role": "user", "content": [{"type": "image_url", "image_url": {"url": a}},
                                         {"type": "text", "text": "What is on the screen?"}]}
    second = {"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": b}}, {"type": "text", "text": "Now these:"},
        {"type": "image_url", "image_url": {"url": c}}]}

    def check(base):
        client = openai.OpenAI(base_url=base, api_key="x", max_retries=0)
        msgs = [first]
        r1 = client.chat.completions.create(model="x", messages=msgs).choices[0].message
        msgs += [{"role": "assistant", "content": r1.content}]
        out = {}
        for name, bad in (("wide", user(data_url(300, 1))),
                          ("injected", {"role": "user", "content": "<|image_pad|> hi"}),
                          ("system", {"role": "system", "content": [
                              {"type": "image_url", "image_url": {"url": a}}]})):
            try:
                client.chat.completions.create(model="x", messages=[*msgs, bad])
                out[name] = (200, "")
            except openai.BadRequestError as e:
                out[name] = (e.status_code, e.body["message"], e.body["code"])
        msgs.append(second)
        r2 = client.chat.completions.create(model="x", messages=msgs).choices[0].message
        msgs += [{"role": "assistant", "content": r2.content},
                 {"role": "user", "content": "Thanks."}]
        r3 = client.chat.completions.create(model="x", messages=msgs).choices[0].message
        return out, [r1.content, r2.content, r3.content]

    (bad, replies), t, prefills = asyncio.run(_vlm_task(
        tok, template, prompt, ["A window.", "Two buttons.", "Bye."], check))
    assert replies == ["A window.", "Two buttons.", "Bye."]
    assert bad["wide"][:1] == (400,) and bad["wide"][2] == "invalid_image"
    assert "aspect ratio is over 200" in bad["wide"][1]
    assert bad["injected"][2] == "invalid_image" and "placeholder" in bad["injected"][1]
    assert bad["system"][2] == "invalid_image" and "images go in user messages" in \
        bad["system"][1]
    assert t.ok and t.turns == 3, (t.end_reason, t.error)
    # The engine got each turn's new images once, in order, as patch_image gives them.
    assert [len(images) for _, images in prefills] == [1, 2, 0]
    want = [patch_image(_pic(u), prompt.vision, prompt.processing) for u in (a, b, c)]
    sent = [im for _, images in prefills for im in images]
    for got, ref in zip(sent, want, strict=True):
        assert list(got.grid_thw) == list(ref.grid_thw)
        np.testing.assert_array_equal(got.pixels, ref.pixels)
    assert len(t.images) == 3 and all(x is y for x, y in zip(t.images, sent, strict=True))
    # The trajectory's tokens: each image's run expanded, in order; M-RoPE positions follow.
    grids = [list(p.grid_thw) for p in t.images]
    image_id = prompt.vision.image_token_id
    runs = [len(r) for r in "".join("x" if i == image_id else " " for i in t.tokens).split()]
    assert runs == placeholder_count(grids, 2) and len(set(runs)) == 3
    assert sequence_positions(t.tokens, grids, image_id, 2).shape == (len(t.tokens), 3)
    assert sum(t.loss_mask) == sum(len(tok.encode(r)) + 1 for r in replies)
    text = tok.decode(t.tokens, skip_special=False)
    assert text.count("<|vision_start|>") == 3
    first_text = text.split("What is on the screen?")[0]
    assert first_text.count("<|vision_start|>") == 1  # image parts before their text
    second_text = text.split("A window.")[1].split("Two buttons.")[0]  # in the parts' order
    assert [x.count("<|vision_start|>") for x in second_text.split("Now these:")] == [1, 1]
    if hf is not None:
        _equals_the_processor(hf, t, tok, [first, second], replies, want)


def _equals_the_processor(hf, t, tok, users, replies, patched):
    """The trajectory's ids up to the last reply equal transformers' Qwen2.5-VL processor's
    apply_chat_template of the conversation (image parts as sent), and its pixel values."""
    from test_models_vision_inputs import PROC
    from test_models_vlm import QWEN2_VL_TEMPLATE
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessorPil

    proc = object.__new__(Qwen2_5_VLProcessor)  # as test_models_vlm: no torchvision here
    proc.image_processor = Qwen2VLImageProcessorPil(**PROC)
    proc.tokenizer, proc.video_processor, proc.chat_template = hf, None, QWEN2_VL_TEMPLATE
    proc.image_token, proc.video_token = "<|image_pad|>", "<|video_pad|>"
    proc.image_token_id = hf.convert_tokens_to_ids("<|image_pad|>")
    proc.video_token_id = hf.convert_tokens_to_ids("<|video_pad|>")

    def parts(m):
        return {"role": "user", "content": [
            {"type": "image", "image": _pic(p["image_url"]["url"])} if p["type"] == "image_url"
            else p for p in m["content"]]}

    messages = [parts(users[0]), {"role": "assistant", "content": [
        {"type": "text", "text": replies[0]}]}, parts(users[1]), {"role": "assistant", "content": [
            {"type": "text", "text": replies[1]}]}, {"role": "user", "content": [
                {"type": "text", "text": "Thanks."}]}]
    ref = proc.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                   return_dict=True, return_tensors="np")
    ids = ref["input_ids"][0].tolist()
    assert t.tokens[:len(ids)] == ids
    assert t.tokens[len(ids):] == tok.encode(replies[2]) + [tok.token_to_id("<|im_end|>")]
    assert [list(p.grid_thw) for p in patched] == ref["image_grid_thw"].tolist()
    np.testing.assert_allclose(np.concatenate([p.pixels for p in patched]),
                               ref["pixel_values"], atol=1e-6, rtol=0)
