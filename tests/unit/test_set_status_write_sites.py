"""Where the operator sends a RolloutSet's status, counted with `ast`
(docs/design.md#6-the-operator, "one pass, one snapshot, one write").

A call sends the set's status when it calls a sending method of the set's writer
(`cluster.statuswriter.SetStatusWriter.write_pass`) on a writer:
`SetStatusWriter(...)` itself, or a name or attribute called `writer`/`_writer` in a module
that imports `SetStatusWriter` (a module that imports the RolloutCheckpoint's writer as well
would be ambiguous, and fails here); or the API call underneath (`patch_set_status`, the
writer's own). Both per-set loops (the repairs, the recovery's steps, the set pass, the queue
and the policy) send from exactly one call site: their stages add deltas to the pass's draft
and the pass writes them once. Any new site fails here.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

OPERATOR = Path(__file__).resolve().parents[2] / "operator" / "rollout_operator"
SENDING = frozenset({"write_pass"})
RECOVERY = OPERATOR / "flows" / "recovery"
SET_LOOP = (
    "flows/reconciler.py",
    "flows/setpass.py",
    *sorted(p.relative_to(OPERATOR).as_posix() for p in RECOVERY.glob("*.py")),
)
"""The modules of the set's loop: the reconciler, the set pass, the recovery (its repairs and
its steps)."""
POLICY_LOOP = ("flows/policypass.py", "flows/queuepass.py")
"""The modules of the policy loop."""
PASS = ("flows/stagedpass.py", "run_stages")
"""The one call site of both loops: the staged pass's write."""

SET_STATUS_SENDERS = {
    # Both per-set loops: their stages' deltas in one write per pass.
    ("flows/stagedpass.py", "run_stages"): 1,
}
"""Every call site in operator/ that sends a set's status, by module and function."""


def _is_writer(node: ast.expr, named_writers: bool) -> bool:
    if isinstance(node, ast.Call):
        return isinstance(node.func, ast.Name) and node.func.id == "SetStatusWriter"
    if isinstance(node, ast.Name):
        return named_writers and node.id.lstrip("_") == "writer"
    if isinstance(node, ast.Attribute):
        return named_writers and node.attr.lstrip("_") == "writer"
    return False


def _imported(tree: ast.Module) -> set[str]:
    return {
        alias.name
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom)
        for alias in node.names
    }


class _Senders(ast.NodeVisitor):
    """Counts the sending calls by the function that holds them (the innermost one)."""

    def __init__(self, module: str, named_writers: bool) -> None:
        self.module = module
        self.named_writers = named_writers
        self.functions: list[str] = ["<module>"]
        self.found: dict[tuple[str, str], int] = {}

    def _function(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = _function
    visit_AsyncFunctionDef = _function

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        if (
            isinstance(func, ast.Attribute)
            and func.attr in SENDING
            and _is_writer(func.value, self.named_writers)
        ):
            site = (self.module, self.functions[-1])
            self.found[site] = self.found.get(site, 0) + 1
        self.generic_visit(node)


def senders() -> dict[tuple[str, str], int]:
    """(module, enclosing function) -> how many calls there send the set's status, outside
    the writer's own module."""
    found: dict[tuple[str, str], int] = {}
    for path in sorted(OPERATOR.rglob("*.py")):
        module = path.relative_to(OPERATOR).as_posix()
        if module == "cluster/statuswriter.py":
            continue
        tree = ast.parse(path.read_text())
        imported = _imported(tree)
        sets = "SetStatusWriter" in imported
        assert not (sets and "CheckpointStatusWriter" in imported), f"{module}: which writer?"
        visitor = _Senders(module, named_writers=sets)
        visitor.visit(tree)
        found.update(visitor.found)
    return found


def test_both_loops_send_the_sets_status_from_exactly_one_call_site() -> None:
    found = senders()
    in_loops = {site: n for site, n in found.items() if site[0] in SET_LOOP + POLICY_LOOP}
    assert in_loops == {}, f"the loops' stages return deltas, they send nothing: {in_loops}"
    assert found.get(PASS) == 1, found


def test_no_new_call_site_sends_a_sets_status() -> None:
    assert senders() == SET_STATUS_SENDERS


def test_the_recovery_neither_holds_nor_imports_a_writer_of_the_sets_status() -> None:
    """The recovery's steps add their changes to the pass's draft; no module of the recovery
    makes a `SetStatusWriter`, nor can it name one."""
    assert len(SET_LOOP) > 3, "the recovery's modules are counted"
    for path in sorted(RECOVERY.glob("*.py")):
        imported = _imported(ast.parse(path.read_text()))
        assert "SetStatusWriter" not in imported, path.name


def test_only_the_writer_calls_the_api_that_sends_the_sets_status() -> None:
    callers = [
        path.relative_to(OPERATOR).as_posix()
        for path in sorted(OPERATOR.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "patch_set_status"
    ]
    assert callers == ["cluster/statuswriter.py"]
