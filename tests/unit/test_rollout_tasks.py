"""The shipped task set, the calculator and the built-in model's deterministic completions."""

from __future__ import annotations

import pytest
from rollout_servers.servers.backends import builtin_completion
from rollout_servers.tasks import CalculatorError, calculate, sample_tasks, shipped_tasks


def test_shipped_tasks_are_solvable_by_their_steps() -> None:
    tasks = shipped_tasks()
    assert len(tasks) >= 50
    assert len({t.id for t in tasks}) == len(tasks)
    assert {t.verify for t in tasks} == {"wait", "replay"}
    for task in tasks:
        values = [calculate(step) for step in task.steps]
        assert values[-1] == task.answer, task.id
        for earlier, later in zip(values, task.steps[1:], strict=False):
            assert str(earlier) in later, f"{task.id}: a later step must use the earlier result"


@pytest.mark.parametrize(
    ("expression", "value"),
    [("3*19", 57), ("57 - 5 + 5", 57), ("48/8", 6), ("-(2+3)*4", -20), ("17 // 5", 3), ("17%5", 2)],
)
def test_calculator(expression: str, value: int) -> None:
    assert calculate(expression) == value


@pytest.mark.parametrize(
    "expression", ["7/2", "1/0", "2**10", "__import__('os')", "x+1", "1.5*2", "9" * 20 + "*1"]
)
def test_calculator_refuses(expression: str) -> None:
    with pytest.raises(CalculatorError):
        calculate(expression)


def test_sample_is_a_function_of_count_and_seed() -> None:
    assert sample_tasks(20, 4) == sample_tasks(20, 4)
    assert sample_tasks(20, 4) != sample_tasks(20, 5)
    assert len({t.seed for t in sample_tasks(50, 1)}) == 50


def test_builtin_model_follows_the_calculator_steps() -> None:
    task = next(t for t in shipped_tasks() if len(t.steps) == 2)
    first, reason = builtin_completion(task.question, 3, 128, mistake_rate=0.0)
    assert reason == "stop"
    assert "".join(first).endswith(f"CALC: {task.steps[0]}")
    prompt = f"{task.question}\nRESULT: {calculate(task.steps[0])}"
    second, _ = builtin_completion(prompt, 3, 128, mistake_rate=0.0)
    assert "".join(second).endswith(f"CALC: {task.steps[1]}")
    prompt += f"\nRESULT: {task.answer}"
    final, _ = builtin_completion(prompt, 3, 128, mistake_rate=0.0)
    assert "".join(final).endswith(f"ANSWER: {task.answer}")
    wrong, _ = builtin_completion(prompt, 3, 128, mistake_rate=1.0)
    assert "".join(wrong).endswith((f"ANSWER: {task.answer + 1}", f"ANSWER: {task.answer - 1}"))


def test_builtin_model_is_deterministic_and_cut_points_agree() -> None:
    prompt = shipped_tasks()[0].question
    tokens, _ = builtin_completion(prompt, 11, 128, mistake_rate=0.25)
    assert builtin_completion(prompt, 11, 128, mistake_rate=0.25)[0] == tokens
    assert builtin_completion(prompt, 12, 128, mistake_rate=0.25)[0] != tokens or len(tokens) < 5
    truncated, reason = builtin_completion(prompt, 11, 4, mistake_rate=0.25)
    assert (truncated, reason) == (tokens[:4], "length")
