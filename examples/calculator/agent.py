"""An agent for the calculator task, written against the openai client as any agent would be:
`env.agent=examples.calculator.agent:solve`. tiderl calls it once per task with the task and
the base URL of that task's OpenAI-compatible endpoint; the conversation it drives is the
trajectory tiderl trains on, and env.reward (or a POST to .../reward) scores it."""

from __future__ import annotations

import json
from typing import Any

import openai

from examples.calculator.adapter import calculate

TOOLS = [{"type": "function", "function": {
    "name": "calc", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                   "required": ["expression"]}}}]


def solve(task: dict[str, Any], base_url: str, api_key: str, *, max_steps: int = 3) -> None:
    client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=2)
    messages: list[Any] = [{"role": "system", "content": "Use the calc tool, then answer."},
                           {"role": "user", "content": task["question"]}]
    for _ in range(max_steps):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS,
                                               max_tokens=128)
        message = reply.choices[0].message
        messages.append(message)
        if not message.tool_calls:
            return None  # a final answer: env.reward scores the conversation
        for call in message.tool_calls:
            try:
                result = f"{calculate(json.loads(call.function.arguments)['expression']):g}"
            except (ValueError, KeyError, TypeError) as e:
                result = f"error: {e}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return None
