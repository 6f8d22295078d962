"""Two devclusters on one machine never share a pod IP range."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devcluster import ipranges
from devcluster.errors import DevclusterError


@pytest.fixture(autouse=True)
def lock_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setattr(ipranges, "LOCK_DIR", tmp_path)
    return tmp_path


def test_a_held_range_is_skipped_and_refused() -> None:
    fd = ipranges.hold_octet(42)
    try:
        assert ipranges.free_octet(42) == 43
        with pytest.raises(DevclusterError, match=r"127\.42\.x\.y is held"):
            ipranges.hold_octet(42)
    finally:
        os.close(fd)
    # The kernel drops the lock with the holder's fd: the range is free again.
    assert ipranges.free_octet(42) == 42


def test_the_search_wraps_around() -> None:
    fd = ipranges.hold_octet(ipranges.LAST_OCTET)
    try:
        assert ipranges.free_octet(ipranges.LAST_OCTET) == ipranges.FIRST_OCTET
    finally:
        os.close(fd)
