"""Shared pytest configuration: tests are marked by the folder they live in."""

from __future__ import annotations

from pathlib import Path

import pytest

_MARK_BY_FOLDER = {
    "unit": pytest.mark.unit,
    "protocol": pytest.mark.protocol,
    "e2e": pytest.mark.e2e,
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        mark = _MARK_BY_FOLDER.get(folder)
        if mark is not None:
            item.add_marker(mark)
