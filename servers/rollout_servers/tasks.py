"""The shipped task set: arithmetic word problems with checkable integer answers.

Episodes need real content for checkpoint tests to mean something: a continued episode must
reach the same answer and the same reward as an uninterrupted one. Each task carries the
calculator expressions a correct solver would use (`steps`); the built-in model backend follows
them, the resources server's calculator evaluates them, and its verifier compares the final
answer with `answer`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import operator
import random
from collections.abc import Callable
from functools import cache
from importlib import resources
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

VerifyMode = Literal["wait", "replay"]


class Task(BaseModel):
    """One episode's task, as sent in `/run` (the environment keeps it verbatim)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    id: str = Field(min_length=1, max_length=128)
    question: str = Field(min_length=1, max_length=4096)
    steps: list[str] = Field(default_factory=list, max_length=16)
    answer: int
    verify: VerifyMode = "replay"
    """How the resources server verifies this task: `wait` means a checkpoint waits for it."""
    seed: int = 0
    """The sampling seed the agent passes to the model; same seed, same episode."""
    max_turns: int = Field(default=8, ge=1, le=64)

    def wire(self) -> dict[str, Any]:
        return self.model_dump()


@cache
def shipped_tasks() -> tuple[Task, ...]:
    """The task set in `rollout_servers/data/tasks.jsonl`."""
    text = resources.files("rollout_servers").joinpath("data/tasks.jsonl").read_text("utf-8")
    return tuple(Task.model_validate(json.loads(line)) for line in text.splitlines() if line)


def sample_tasks(count: int, seed: int) -> list[Task]:
    """`count` tasks drawn from the shipped set, each with its own seed derived from `seed`.

    Deterministic: the same (count, seed) gives the same tasks with the same seeds.
    """
    rng = random.Random(seed)
    pool = shipped_tasks()
    return [
        rng.choice(pool).model_copy(update={"seed": rng.randrange(2**31)}) for _ in range(count)
    ]


def task_by_question(text: str) -> Task | None:
    """The shipped task whose question appears in `text` (a prompt), if any."""
    for task in shipped_tasks():
        if task.question in text:
            return task
    return None


def stable_fraction(*parts: object) -> float:
    """A number in [0, 1) that depends only on `parts`: seeded choices that survive restarts."""
    digest = hashlib.sha256("\x00".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


# --- the calculator ---------------------------------------------------------------------------

_MAX_EXPRESSION = 200
_MAX_MAGNITUDE = 10**15

_BINARY: dict[type[ast.operator], Callable[[int, int], int]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
}


class CalculatorError(ValueError):
    """The expression is not integer arithmetic the calculator accepts."""


def calculate(expression: str) -> int:
    """Evaluate integer arithmetic (`+ - * / // %`, parentheses, unary minus) safely.

    `/` must divide exactly: the tasks have integer answers, and a silent rounding would turn a
    solver's mistake into a correct-looking number.
    """
    if len(expression) > _MAX_EXPRESSION:
        raise CalculatorError(f"expression longer than {_MAX_EXPRESSION} characters")
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as error:
        raise CalculatorError(f"not an arithmetic expression: {expression!r}") from error
    return _evaluate(tree.body)


def _evaluate(node: ast.expr) -> int:
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _evaluate(node.left), _evaluate(node.right)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise CalculatorError("division by zero")
            quotient, remainder = divmod(left, right)
            if remainder:
                raise CalculatorError(f"{left} / {right} is not an integer")
            return quotient
        op = _BINARY.get(type(node.op))
        if op is None:
            raise CalculatorError(f"operator {type(node.op).__name__} is not supported")
        if isinstance(node.op, ast.FloorDiv | ast.Mod) and right == 0:
            raise CalculatorError("division by zero")
        return _bounded(op(left, right))
    raise CalculatorError(f"unsupported element {type(node).__name__}")


def _bounded(value: int) -> int:
    if abs(value) > _MAX_MAGNITUDE:
        raise CalculatorError("number too large")
    return value
