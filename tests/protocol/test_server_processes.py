"""The test servers' start-up: a port taken between its pick and the server's bind is retried.

`ServerProcess.start` picks a free port and then starts `rollout-server` on it; another process
of the same run may bind it in between. The server then exits with "address already in use",
and the start must try another port instead of failing the test that asked for a server.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from rollout_protocol import Role
from testsupport import server_processes
from testsupport.server_processes import ServerProcess

pytestmark = pytest.mark.protocol


def test_a_port_taken_before_the_bind_is_retried_on_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        picks: Iterator[int] = iter([taken_port])
        real_free_port = server_processes.free_port
        monkeypatch.setattr(server_processes, "free_port", lambda: next(picks, real_free_port()))
        server = ServerProcess.start(tmp_path, Role.RESOURCES)
        try:
            assert server.port != taken_port
            assert server.process.poll() is None
        finally:
            assert server.stop() == 0
        log = (tmp_path / f"resources-{taken_port}.log").read_text()
        assert "address already in use" in log, log


def test_a_clusters_first_start_moves_off_a_taken_port(tmp_path: Path) -> None:
    cluster = server_processes.Cluster(tmp_path)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        taken_port = taken.getsockname()[1]
        cluster.ports[Role.MODEL] = taken_port
        cluster.start(0)
        try:
            assert cluster.ports[Role.MODEL] != taken_port
            assert all(process.poll() is None for process in cluster.processes.values())
        finally:
            cluster.kill()
    assert "address already in use" in (tmp_path / "logs" / "model-a0.log").read_text()
