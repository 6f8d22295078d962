"""The protocol package keeps small surfaces: no class over 450 lines anywhere in it, and no
function over 80 lines in the control plane, the coordinator and the episode runtime, each split
by concern into parts it owns (docs/protocol.md names them). Counted with `ast`, from the first
line of a definition (its decorators excluded) to its last."""

from __future__ import annotations

import ast
from pathlib import Path

import rollout_protocol

_PACKAGE = Path(rollout_protocol.__file__).parent
_MAX_CLASS_LINES = 450
_MAX_FUNCTION_LINES = 80
_SPLIT = ("_control", "_coordinator", "_episodes")
"""The modules (and their `<name>_*.py` parts) held to the function limit."""


def _definitions(path: Path) -> list[ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    kinds = (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)
    return [node for node in ast.walk(tree) if isinstance(node, kinds)]


def _lines(node: ast.AST) -> int:
    end = getattr(node, "end_lineno", None)
    assert end is not None
    return int(end) - int(getattr(node, "lineno", end)) + 1


def test_no_protocol_class_is_over_450_lines() -> None:
    modules = sorted(_PACKAGE.rglob("*.py"))
    assert len(modules) > 20, f"the package's modules were not found under {_PACKAGE}"
    too_long = [
        f"{path.relative_to(_PACKAGE)}:{node.lineno} {node.name}: {_lines(node)} lines"
        for path in modules
        for node in _definitions(path)
        if isinstance(node, ast.ClassDef) and _lines(node) > _MAX_CLASS_LINES
    ]
    assert not too_long, f"classes over {_MAX_CLASS_LINES} lines: {too_long}"


def test_no_function_of_the_split_modules_is_over_80_lines() -> None:
    modules = sorted(
        path
        for path in _PACKAGE.glob("*.py")
        if path.stem in _SPLIT or path.stem.startswith(tuple(f"{name}_" for name in _SPLIT))
    )
    assert {path.stem for path in modules} >= set(_SPLIT)
    too_long = [
        f"{path.name}:{node.lineno} {node.name}: {_lines(node)} lines"
        for path in modules
        for node in _definitions(path)
        if not isinstance(node, ast.ClassDef) and _lines(node) > _MAX_FUNCTION_LINES
    ]
    assert not too_long, f"functions over {_MAX_FUNCTION_LINES} lines: {too_long}"
