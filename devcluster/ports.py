"""Loopback ports: pick free ones, and refuse a requested one that is taken with a clear message."""

from __future__ import annotations

import errno
import socket

from devcluster.errors import DevclusterError


def _bind(port: int) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        # SO_REUSEADDR: only a listening socket makes the port unusable, not TIME_WAIT leftovers,
        # which is also how the Go servers bind.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        bound: int = sock.getsockname()[1]
        return bound


def ensure_free(port: int, what: str) -> None:
    try:
        _bind(port)
    except OSError as error:
        if error.errno == errno.EADDRINUSE:
            raise DevclusterError(
                f"port {port} on 127.0.0.1 (requested for {what}) is already in use; "
                f"pick another port or stop what listens there (`ss -ltnp 'sport = :{port}'`)"
            ) from error
        raise DevclusterError(f"cannot use port {port} for {what}: {error}") from error


def pick_free(taken: set[int]) -> int:
    """A free port not already handed out in this run (the kernel may repeat itself)."""
    for _ in range(100):
        port = _bind(0)
        if port not in taken:
            taken.add(port)
            return port
    raise DevclusterError("could not find a free loopback port after 100 tries")
