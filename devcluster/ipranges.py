"""Machine-wide reservation of the pods' loopback ranges (`127.<octet>.y.z`).

Every devcluster on a machine shares the loopback network, so two clusters handing out the same
pod IP would answer each other's readiness probes and control calls (a restore would reach the
wrong servers). The node agent therefore holds an exclusive `flock` on `<octet>.lock` in a
machine-wide folder for as long as it runs; the kernel drops the lock when the agent dies, so a
crashed cluster never leaks its range. `up` picks a range whose lock is free.
"""

from __future__ import annotations

import fcntl
import os
import tempfile
from pathlib import Path

from devcluster.errors import DevclusterError

FIRST_OCTET = 2
LAST_OCTET = 253
LOCK_DIR = Path(tempfile.gettempdir()) / "devcluster-pod-ip-ranges"


def _lock_path(octet: int) -> Path:
    return LOCK_DIR / f"{octet}.lock"


def _try_lock(octet: int) -> int | None:
    """An fd holding the range's lock, or None when another cluster holds it."""
    LOCK_DIR.mkdir(parents=True, exist_ok=True)
    fd = os.open(_lock_path(octet), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def free_octet(preferred: int) -> int:
    """The first range from `preferred` on (wrapping) that no running agent holds right now."""
    span = LAST_OCTET - FIRST_OCTET + 1
    for step in range(span):
        octet = FIRST_OCTET + (preferred - FIRST_OCTET + step) % span
        fd = _try_lock(octet)
        if fd is not None:
            os.close(fd)  # the agent takes it for good when it starts
            return octet
    raise DevclusterError(
        f"every pod IP range 127.{FIRST_OCTET}-{LAST_OCTET}.x.y is held by a running devcluster "
        "agent on this machine; stop some with `python -m devcluster down --dir DIR`"
    )


def hold_octet(octet: int) -> int:
    """Take the range for this process's lifetime; returns the fd to keep open."""
    fd = _try_lock(octet)
    if fd is None:
        raise DevclusterError(
            f"pod IP range 127.{octet}.x.y is held by another devcluster agent on this machine "
            f"(lock {_lock_path(octet)}); pick another with --pod-ip-octet or stop that cluster"
        )
    os.set_inheritable(fd, False)
    return fd
