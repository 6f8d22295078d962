"""No operator module holds mutable state: the process's state is one `OperatorState`
(`rollout_operator/flows/state.py`, docs/design.md#611-the-operators-in-process-state), made at
startup and passed down.

The check imports every module of `rollout_operator` and looks at every module attribute: it
must be immutable (a constant, a frozen dataclass, a read-only mapping, an enum member, a type,
a function, a module, a typing construct, a logger) or be named in the allow-lists below, each
entry with its reason. It also refuses `global` statements. A registry that comes back fails
here with its module and name; put it into `OperatorState` instead (or, for a true constant,
make it immutable: `MappingProxyType`, `frozenset`, `tuple`, a frozen dataclass).
"""

from __future__ import annotations

import ast
import dataclasses
import datetime
import enum
import importlib
import inspect
import logging
import pkgutil
import re
import types
import typing
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import pytest
import rollout_operator
from prometheus_client.metrics import MetricWrapperBase

ALLOWED: Final[Mapping[tuple[str, str], str]] = types.MappingProxyType(
    {
        ("rollout_operator.model.api", "_CONDITIONS_LIST"): (
            "a JSON-schema fragment handed to pydantic's `json_schema_extra`, which takes a dict; "
            "read only, never mutated"
        ),
        ("rollout_operator.model.api", "_SECONDS_BY_PHASE"): (
            "a JSON-schema fragment handed to pydantic's `json_schema_extra`, which takes a dict; "
            "read only, never mutated"
        ),
    }
)
"""(module, attribute) -> why this mutable object at module level is not state."""

ALLOWED_TYPES: Final[Mapping[str, tuple[tuple[type, ...], str]]] = types.MappingProxyType(
    {
        "rollout_operator.metrics": (
            (MetricWrapperBase,),
            "Prometheus metrics: prometheus_client registers each metric once per process in "
            "its default registry, which the /metrics endpoint serves; that registry is "
            "process-wide by design (docs/operations.md, metrics)",
        ),
    }
)
"""module -> (types, why) of module attributes that are process-wide by a library's design."""

IMMUTABLE: Final = (
    type(None),
    bool,
    int,
    float,
    complex,
    str,
    bytes,
    range,
    re.Pattern,
    datetime.tzinfo,
    enum.Enum,
    types.ModuleType,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    type,
    types.GenericAlias,
    typing.TypeVar,
    logging.Logger,
    logging.LoggerAdapter,
)
"""Values that hold no state of this process (a logger's state is logging's own)."""


def _operator_modules() -> list[types.ModuleType]:
    names = [rollout_operator.__name__] + [
        info.name
        for info in pkgutil.walk_packages(
            rollout_operator.__path__, f"{rollout_operator.__name__}."
        )
    ]
    return [importlib.import_module(name) for name in sorted(names)]


def _mutable_parts(value: object, seen: set[int] | None = None) -> Iterator[str]:
    """Why `value` can hold state (nothing when it cannot): the types of its mutable parts."""
    seen = set() if seen is None else seen
    if id(value) in seen:
        return
    seen.add(id(value))
    if isinstance(value, IMMUTABLE) or _is_typing_construct(value):
        return
    if isinstance(value, (tuple, frozenset)):
        for item in value:
            yield from _mutable_parts(item, seen)
        return
    if isinstance(value, types.MappingProxyType):
        for key, item in value.items():
            yield from _mutable_parts(key, seen)
            yield from _mutable_parts(item, seen)
        return
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        if not type(value).__dataclass_params__.frozen:  # type: ignore[attr-defined]
            yield f"a mutable dataclass {type(value).__qualname__}"
            return
        for field in dataclasses.fields(value):
            yield from _mutable_parts(getattr(value, field.name), seen)
        return
    yield f"a {type(value).__module__}.{type(value).__qualname__}"


def _is_typing_construct(value: object) -> bool:
    """`Callable[...]`, `Final`, `X | None` and their kind: annotations, not values."""
    module = type(value).__module__
    return module in ("typing", "typing_extensions") or (
        module == "collections.abc" and hasattr(value, "__origin__")
    )


def _module_state(module: types.ModuleType) -> list[str]:
    found: list[str] = []
    allowed_types, _why = ALLOWED_TYPES.get(module.__name__, ((), ""))
    for name, value in vars(module).items():
        if name.startswith("__") and name.endswith("__"):
            continue  # the module's own machinery (__all__ is a list by convention)
        if (module.__name__, name) in ALLOWED or isinstance(value, allowed_types):
            continue
        if name == "annotations" and type(value).__name__ == "_Feature":
            continue  # from __future__ import annotations
        for why in _mutable_parts(value):
            found.append(f"{module.__name__}.{name}: {why}")
    return found


def _global_statements(module: types.ModuleType) -> list[str]:
    source = inspect.getsource(module)
    return [
        f"{module.__name__}:{node.lineno}: global {', '.join(node.names)}"
        for node in ast.walk(ast.parse(source))
        if isinstance(node, ast.Global)
    ]


def test_no_operator_module_holds_mutable_state() -> None:
    found = [entry for module in _operator_modules() for entry in _module_state(module)]
    assert found == [], (
        "module-level mutable state (docs/design.md#611-the-operators-in-process-state): put it "
        "into flows/state.py's OperatorState, make it immutable, or allow-list it here with "
        "its reason:\n" + "\n".join(found)
    )


def test_no_operator_module_rebinds_a_global() -> None:
    found = [entry for module in _operator_modules() for entry in _global_statements(module)]
    assert found == [], "\n".join(found)


def test_every_allow_listed_name_still_exists() -> None:
    """An allow-list entry whose attribute went must go too (it would allow a new one)."""
    modules = {module.__name__: module for module in _operator_modules()}
    for module_name, name in ALLOWED:
        assert hasattr(modules[module_name], name), f"{module_name}.{name} is gone"
    for module_name in ALLOWED_TYPES:
        assert module_name in modules


@pytest.mark.parametrize(
    ("value", "mutable"),
    [
        ({}, True),
        ([], True),
        (set(), True),
        (bytearray(), True),
        (logging.getLogger("x").handlers, True),
        (types.MappingProxyType({"a": []}), True),
        ((1, [2]), True),
        (types.SimpleNamespace(), True),
        (types.MappingProxyType({"a": (1, 2)}), False),
        (frozenset({1, 2}), False),
        ((1, "two", None), False),
        (re.compile("x"), False),
        (datetime.UTC, False),
        (logging.getLogger("x"), False),
        (typing.Final, False),
        (dict[str, int], False),
    ],
)
def test_the_check_tells_mutable_values_from_constants(value: object, mutable: bool) -> None:
    assert bool(list(_mutable_parts(value))) is mutable


def test_the_check_finds_a_registry_in_a_module(tmp_path: Path) -> None:
    @dataclasses.dataclass
    class Open:
        seen: dict[str, int]

    @dataclasses.dataclass(frozen=True)
    class Closed:
        names: tuple[str, ...]

    module = types.ModuleType("rollout_operator.fake")
    registry: dict[tuple[str, str], Any] = {}
    module.__dict__.update(
        _registry=registry, OPEN=Open({}), CLOSED=Closed(("a",)), LIMIT=3, Kind=Open
    )
    assert _module_state(module) == [
        "rollout_operator.fake._registry: a builtins.dict",
        f"rollout_operator.fake.OPEN: a mutable dataclass {Open.__qualname__}",
    ]
