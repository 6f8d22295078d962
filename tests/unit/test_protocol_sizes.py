"""Small surfaces everywhere: no class over 450 lines and no function over 80 in the operator
(`rollout_operator`), the protocol (`rollout_protocol`, its conformance kit included), the
reference servers (`rollout_servers`) and the NeMo Gym adapter (`rollout_gym`), with no
exception. A class or function that grows past its limit is split by concern into parts it
owns. Counted with `ast`, from the first line of a definition (its decorators excluded) to its
last."""

from __future__ import annotations

import ast
from pathlib import Path
from types import ModuleType

import rollout_gym
import rollout_operator
import rollout_protocol
import rollout_servers

_PACKAGES = (rollout_operator, rollout_protocol, rollout_servers, rollout_gym)
_MAX_CLASS_LINES = 450
_MAX_FUNCTION_LINES = 80

Definition = ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef
_KINDS = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def _lines(node: Definition) -> int:
    assert node.end_lineno is not None
    return node.end_lineno - node.lineno + 1


def _definitions(package: ModuleType) -> list[tuple[str, Definition]]:
    """Every class and function (nested ones too) of the package's modules, each named by its
    place (`<package>/<module path>:<line> <name>`)."""
    root = Path(str(package.__file__)).parent
    modules = sorted(root.rglob("*.py"))
    assert len(modules) > 1, f"the package's modules were not found under {root}"
    found: list[tuple[str, Definition]] = []
    for path in modules:
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        found.extend(
            (f"{root.name}/{path.relative_to(root)}:{node.lineno} {node.name}", node)
            for node in ast.walk(tree)
            if isinstance(node, _KINDS)
        )
    return found


def _all_definitions() -> list[tuple[str, Definition]]:
    return [found for package in _PACKAGES for found in _definitions(package)]


def test_no_class_is_over_450_lines() -> None:
    too_long = [
        f"{place}: {_lines(node)} lines"
        for place, node in _all_definitions()
        if isinstance(node, ast.ClassDef) and _lines(node) > _MAX_CLASS_LINES
    ]
    assert not too_long, f"classes over {_MAX_CLASS_LINES} lines: {too_long}"


def test_no_function_is_over_80_lines() -> None:
    too_long = [
        f"{place}: {_lines(node)} lines"
        for place, node in _all_definitions()
        if not isinstance(node, ast.ClassDef) and _lines(node) > _MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {_MAX_FUNCTION_LINES} lines: {too_long}"
