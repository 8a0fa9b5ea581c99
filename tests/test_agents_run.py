"""An unmodified openai-client agent loop (examples/calculator/agent.py: multi-turn, with a tool
call) drives a real run: a tiny Qwen2 checkpoint written by transformers (taught beforehand, in
torch, to answer this prompt with a calc tool call and then a final answer, so the tool-call
path runs on what the model itself samples), served by the engine through the agent endpoint,
64 agent sessions at once under CTB. The trajectories the trainer receives hold exactly the
token ids the engine produced, and their behaviour logprobs equal the trainer's own recompute
(fp32, <= 1e-4). Bad requests sent during the run get their 4xx and harm nothing."""

from __future__ import annotations

import asyncio
import collections
import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import test_envs_chat_templates as tct

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("openai")

pytestmark = [pytest.mark.entry, pytest.mark.slow]

CALL = {"name": "calc", "arguments": {"expression": "2 + 3"}}
SYSTEM = "Use the calc tool, then answer."
ROOT = Path(__file__).resolve().parent.parent
ROWS = [json.loads(x) for x in (ROOT / "examples/calculator/tasks.jsonl").read_text().splitlines()]
# The docs' agent command (docs/how-to/black-box-agents.md); the test swaps in its tiny checkpoint, a wrapper of the same agent
# (it also sends bad requests), 8 fake devices, and spies on the engine and the trainer.
AGENT_RUN = ["--config", "configs/calculator.yaml", "env.suite=",
             "env.agent=examples.calculator.agent:solve", "env.group_size=8",
             "controller.groups_per_step=8", "controller.groups_per_microbatch=8",
             "controller.checkpoint_every=0", "controller.steps=1", "rollout.max_slots=64",
             "rollout.num_pages=2048", "rollout.max_action_tokens=96", "rollout.max_context=512",
             "trainer.row_len=512"]


def _ids(hf, messages, tools, gen):
    out = hf.apply_chat_template(messages, tools=tools, tokenize=True, add_generation_prompt=gen)
    return list(out if isinstance(out, list) else out["input_ids"])


def taught_checkpoint(folder):
    """A tiny random Qwen2 with a ChatML tokenizer (its BPE also trained on the tool prompt, so
    prompts stay short), then taught in torch to write the calc tool call after the prompt and
    'The answer is 5.' after the tool's reply (two conversations, ~100 Adam steps)."""
    from examples.calculator.agent import TOOLS
    from tiderl.envs.chat_templates import compile_chat_template

    sample = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": ROWS[0]["question"]},
              {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                                   "function": CALL}]},
              {"role": "tool", "content": "5"}, {"role": "assistant", "content": "The answer is 5."}]
    text = compile_chat_template(tct.QWEN25).render(messages=sample, tools=TOOLS,
                                                    add_generation_prompt=False)
    corpus = tct.CORPUS
    tct.CORPUS = corpus + ([text] + [r["question"] for r in ROWS]) * 3
    try:
        hf = tct.qwen25(folder)
    finally:
        tct.CORPUS = corpus
    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        vocab_size=640, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
        tie_word_embeddings=True))
    seqs, masks = [], []
    for r in ROWS[:2]:
        msgs = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["question"]}]
        first = len(_ids(hf, msgs, TOOLS, True))
        msgs += sample[2:4]
        call_end = len(_ids(hf, msgs[:3], TOOLS, False)) - 1  # through its <|im_end|>
        second = len(_ids(hf, msgs, TOOLS, True))
        full = _ids(hf, msgs + sample[4:], TOOLS, False)[:-1]  # the final "\n" is not sampled
        mask = [first <= i < call_end or i >= second for i in range(len(full))]
        seqs.append(full)
        masks.append(mask)
    n = max(map(len, seqs))  # right-padded: causal attention never sees the padding
    x = torch.tensor([q + [0] * (n - len(q)) for q in seqs])
    w = torch.tensor([m + [False] * (n - len(m)) for m in masks], dtype=torch.float32)[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    for _ in range(300):
        lp = torch.log_softmax(model(x).logits[:, :-1], -1).gather(-1, x[:, 1:, None])[..., 0]
        loss = -(lp * w).sum() / w.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
        if loss.item() < 1.5e-3:
            break
    model.save_pretrained(folder)
    return hf


BAD: dict = {}
_FIRST = threading.Lock()


def agent(task, base_url, api_key):
    """examples.calculator.agent.solve as written; the first task to start sends bad requests
    instead, each of which must get its 4xx without harming its task or the run."""
    from examples.calculator.agent import solve

    if _FIRST.acquire(blocking=False):  # once per test run (never released)
        def post(url, raw):
            req = urllib.request.Request(url, data=raw, method="POST",
                                         headers={"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=600) as r:
                    return r.status, json.loads(r.read())
            except urllib.error.HTTPError as e:
                return e.code, json.loads(e.read())

        user = {"role": "user", "content": task["question"]}
        chat = base_url + "/chat/completions"
        BAD["malformed"] = post(chat, b'{"messages": [')
        task_url, secret, _ = base_url.rsplit("/", 2)  # .../tasks/{task_id}/{secret}/v1
        BAD["unknown"] = post(f"{task_url}%2Fnope/{secret}/v1/chat/completions",
                              json.dumps({"messages": [user]}).encode())
        # The task's own reward route without its secret, or with another one, is refused.
        BAD["no_secret"] = post(task_url + "/reward", b'{"reward": 1.0}')
        BAD["wrong_secret"] = post(f"{task_url}/x{secret}/reward", b'{"reward": 1.0}')
        status, first = post(chat, json.dumps({"messages": [user]}).encode())
        BAD["first"] = status
        BAD["mismatch"] = post(chat, json.dumps({"messages": [
            user, {"role": "assistant", "content": "something else"}, user]}).encode())
        # This task's history now holds that first turn; the agent proper goes on from it.
        return _continue(base_url, api_key, [user, first["choices"][0]["message"]])
    return solve(task, base_url, api_key)


def _continue(base_url, api_key, messages):
    import openai

    client = openai.OpenAI(base_url=base_url, api_key=api_key)
    messages = [*messages, {"role": "user", "content": "Go on."}]
    client.chat.completions.create(model="policy", messages=messages, max_tokens=16)
    return None


def test_openai_agent_loop_drives_a_run_token_in_token_out(tmp_path, monkeypatch):
    import time

    from tiderl.agents.endpoint import AgentEndpoint
    from tiderl.config import load_config
    from tiderl.runtime.job import run_job
    from tiderl.serving.rollout import RolloutManager
    from tiderl.train.backend import TrainerBackend

    t0 = time.monotonic()
    ckpt = tmp_path / "ckpt"
    hf = taught_checkpoint(ckpt)
    print(f"taught the checkpoint in {time.monotonic() - t0:.1f}s")

    produced: dict[str, list[int]] = collections.defaultdict(list)
    real_turn = RolloutManager.agent_turn

    async def agent_turn(self, ep, new_tokens, context, **kw):
        result = await real_turn(self, ep, new_tokens, context, **kw)
        produced[ep.task.task_id] += result.action_tokens  # what the engine returned
        return result

    live, peak = set(), [0]
    real_open, real_close = AgentEndpoint.open, AgentEndpoint.close

    def open_(self, task_id):
        live.add(task_id)
        peak[0] = max(peak[0], len(live))
        return real_open(self, task_id)

    def close_(self, task_id, why):
        live.discard(task_id)
        return real_close(self, task_id, why)

    submitted = []
    real_submit = TrainerBackend.submit

    def submit(self, mb):
        # Queued on the trainer's worker ahead of the micro-batch itself: the logprobs of the
        # weights that sampled it (version 0), computed the way the trainer computes them.
        submitted.append((mb, self.call(lambda: self.logprobs(mb))))
        return real_submit(self, mb)

    replies = collections.Counter()
    from tiderl.agents.conversation import Conversation

    real_reply = Conversation.reply

    def reply(self, *a, **kw):
        r = real_reply(self, *a, **kw)
        replies[r.finish_reason] += 1
        return r

    for cls, name, fn in [(RolloutManager, "agent_turn", agent_turn), (AgentEndpoint, "open", open_),
                          (AgentEndpoint, "close", close_), (TrainerBackend, "submit", submit),
                          (Conversation, "reply", reply)]:
        monkeypatch.setattr(cls, name, fn)
    monkeypatch.chdir(ROOT)
    overrides = [o for o in AGENT_RUN[2:] if not o.startswith("env.agent=")]
    cfg = load_config(AGENT_RUN[1], [*overrides, "env.agent=test_agents_run:agent",
                                     f"model.checkpoint={ckpt}", f"run_dir={tmp_path / 'run'}",
                                     "cluster.fake_cpu_devices=8"])
    t0 = time.monotonic()
    summary = asyncio.run(run_job(cfg))
    print(f"run: {time.monotonic() - t0:.1f}s (its own wall_s {summary['wall_s']:.1f}); "
          f"replies {dict(replies)}")
    assert summary["steps"] == 1, summary
    roll = summary["rollout"]
    assert roll["tasks_ended"] == 64 and roll["end_reasons"] == {"done": 64}, roll
    assert peak[0] == 64  # every agent session open at once
    # The model's own tool calls, parsed (measured: 29 of the 64 first turns at temperature 1);
    # the rest are the documented fallback (plain content), and the agent answers.
    assert replies["tool_calls"] >= 8, replies

    # Bad requests during the run: each its 4xx, and the run above went on unharmed.
    assert BAD["malformed"][0] == 400 and "malformed JSON" in BAD["malformed"][1]["error"][
        "message"]
    assert BAD["unknown"][0] == 404 and BAD["first"] == 200
    assert BAD["no_secret"][0] == 401 and BAD["wrong_secret"][0] == 403
    assert BAD["mismatch"][0] == 400 and BAD["mismatch"][1]["error"]["code"] == "history_mismatch"

    # The trainer's trajectories: exactly the engine's tokens, logprobs = trainer recompute.
    seen, worst = [], 0.0
    for mb, fut in submitted:
        a = mb.arrays() if hasattr(mb, "arrays") else mb
        mask = np.asarray(a["loss_mask_bt"]) > 0
        lp = fut.result()
        worst = max(worst, float(np.abs(lp - np.asarray(a["behaviour_logprobs_bt"]))[mask].max()))
        tok, seg = np.asarray(a["tokens_bt"]), np.asarray(a["segment_ids_bt"])
        for r in range(tok.shape[0]):
            for s in set(seg[r].tolist()) - {0}:
                sel = (seg[r] == s) & mask[r]
                seen.append(tuple(tok[r][sel].tolist()))
    print(f"max |behaviour - trainer logprob| = {worst:.2e} over {len(seen)} sequences")
    assert worst <= 1e-4, worst
    assert sorted(seen) == sorted(tuple(v) for v in produced.values()) and len(seen) == 64
    im_end = hf.convert_tokens_to_ids("<|im_end|>")
    assert sum(v.count(im_end) for v in produced.values()) >= 64  # actions end at the stop id
