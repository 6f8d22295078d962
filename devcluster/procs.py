"""Process groups: start, find and stop every process devcluster is responsible for.

Each process gets its own session (hence process group), so a signal to the group reaches the
children it spawned too. Liveness is read from /proc, treating zombies as gone, because `up` run
in-process (the pytest fixture) stays the parent of the control plane and may not have reaped it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from devcluster.errors import DevclusterError
from devcluster.state import MARKER_ENV


def spawn(
    argv: Sequence[str | Path], log: Path, env: Mapping[str, str], cwd: Path | None = None
) -> subprocess.Popen[bytes]:
    """Starts a daemon in its own session with stdout and stderr appended to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as out:
        return subprocess.Popen(
            [str(arg) for arg in argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )


def _stat_fields(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) may contain spaces and parentheses; split after its last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def is_alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] not in ("Z", "X")


def _all_pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def live_groups() -> dict[int, list[int]]:
    """Process group id -> live member pids, from one scan of /proc."""
    groups: dict[int, list[int]] = {}
    for pid in _all_pids():
        fields = _stat_fields(pid)
        if fields is not None and fields[0] not in ("Z", "X"):
            groups.setdefault(int(fields[2]), []).append(pid)
    return groups


def group_members(pgid: int) -> list[int]:
    return live_groups().get(pgid, [])


def has_marker(pid: int, cluster_id: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return False
    return f"{MARKER_ENV}={cluster_id}".encode() in environ.split(b"\0")


def marked_processes(cluster_id: str) -> list[int]:
    """Every live process carrying this cluster's marker: the ground truth for 'nothing left'."""
    me = os.getpid()
    return [
        pid for pid in _all_pids() if pid != me and is_alive(pid) and has_marker(pid, cluster_id)
    ]


def _reap(pids: Iterable[int]) -> None:
    for pid in pids:
        with contextlib.suppress(ChildProcessError, OSError):
            os.waitpid(pid, os.WNOHANG)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def stop_groups(pgids: Sequence[int], grace_seconds: float, kill_wait_seconds: float = 5.0) -> None:
    """SIGTERM each group, wait up to the grace period, SIGKILL what is left, wait until gone."""
    for pgid in pgids:
        _signal_group(pgid, signal.SIGTERM)
    if _wait_groups_gone(pgids, grace_seconds):
        return
    for pgid in pgids:
        _signal_group(pgid, signal.SIGKILL)
    if not _wait_groups_gone(pgids, kill_wait_seconds):
        groups = live_groups()
        left = sorted({pid for pgid in pgids for pid in groups.get(pgid, [])})
        raise DevclusterError(
            f"processes {left} survived SIGKILL for {kill_wait_seconds} s (uninterruptible I/O?); "
            "check them with `ps -o pid,stat,cmd -p ...`"
        )


def _wait_groups_gone(pgids: Sequence[int], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while True:
        _reap(pgids)
        groups = live_groups()
        if not any(is_alive(pgid) or pgid in groups for pgid in pgids):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)


def kill_marked(cluster_id: str, timeout: float = 5.0) -> list[int]:
    """SIGKILLs every straggler carrying the marker; returns their pids."""
    found = marked_processes(cluster_id)
    for pid in found:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while any(is_alive(pid) for pid in found):
        _reap(found)
        if time.monotonic() >= deadline:
            raise DevclusterError(f"processes {found} survived SIGKILL for {timeout} s")
        time.sleep(0.05)
    return found
