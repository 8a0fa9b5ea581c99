"""The calculator task as an environment: the policy may compute with `calc <expression>`
before it answers with `answer <number>`. Run it as `env.suite=examples.calculator.adapter:
Calculator` (in-process) or `python -m tiderl.envs serve --adapter
examples.calculator.adapter:Calculator`."""

from __future__ import annotations

import ast
import operator
from collections.abc import Mapping
from typing import Any

from tiderl.envs import Adapter, Step
from tiderl.envs.adapters.base import TaskError

_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculate(expression: str) -> float:
    """+ - * / and parentheses on numbers; anything else is a ValueError."""
    def ev(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.left), ev(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](ev(node.operand))
        raise ValueError(f"not arithmetic: {ast.dump(node)[:40]}")

    if len(expression) > 64:
        raise ValueError("expression longer than 64 characters")
    try:
        return ev(ast.parse(expression.strip(), mode="eval").body)
    except (SyntaxError, ZeroDivisionError) as e:
        raise ValueError(str(e)) from None


def number(text: str) -> float | None:
    try:
        return float(text.strip())
    except ValueError:
        return None


class Calculator(Adapter):
    """Task fields: `question` (text) and `answer` (a number). Reward 1 for the right answer."""

    def __init__(self, options: Mapping[str, str] | None = None):
        super().__init__(options)
        self.question, self.answer = "", 0.0
        self.calls, self.answered, self.correct = 0, False, False

    def reset(self, task: Mapping[str, Any]) -> str:
        if not isinstance(task.get("question"), str) or number(str(task.get("answer"))) is None:
            raise TaskError("a calculator task needs 'question' (text) and 'answer' (a number)")
        self.question, self.answer = task["question"], float(task["answer"])
        self.calls, self.answered, self.correct = 0, False, False
        return f"{self.question} (calc EXPR or answer N)"

    def step(self, action: str) -> Step:
        verb, _, rest = action.strip().partition(" ")
        if verb == "calc":
            self.calls += 1
            try:
                return Step(f"= {calculate(rest):g}", False, 0.0)
            except ValueError as e:
                return Step(f"error: {e}", False, 0.0)
        if verb == "answer":
            self.answered = True
            self.correct = number(rest) == self.answer
            return Step("correct" if self.correct else "wrong", True, float(self.correct))
        return Step("use calc EXPR or answer N", False, 0.0)

    def close(self) -> tuple[float, dict[str, Any]]:
        return float(self.correct), {"answered": self.answered, "calc_calls": self.calls}
