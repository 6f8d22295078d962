"""The operator as a child process: `OperatorProcess` runs `rollout-operator run` in its own
process group (its output in a log file, a liveness wait, a clean stop and a crash kill),
`free_port` picks a loopback port for its liveness endpoint (and for anything else that listens),
and `sigterm_as_interrupt` makes a run killed with SIGTERM clean up like Ctrl-C does.

The demo, the e2e tests and the benches all start the operator this way; it lives in its own
module so that none of them has to import the `make demo` script for it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from devcluster.waiting import wait_for_sync


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


class OperatorProcess:
    """`rollout-operator run --namespace NS` as a child process in its own process group.

    Its output goes to a log file (tests print the tail when they fail). `stop` is the clean
    end (SIGTERM, then SIGKILL after a deadline); `kill` is a crash (SIGKILL to the group), for
    tests that restart the operator in the middle of a checkpoint or a recovery.

    `args` are appended to `rollout-operator run` (`--all-namespaces` with no `namespaces`,
    `--metrics-port N`, `--standalone`, ...). `environment` replaces this process's environment
    for the child (the RBAC test leaves out every `KUBE*` variable so that no credentials but
    its token kubeconfig reach the operator); `KUBECONFIG` is set to `kubeconfig` either way.
    `module` is what `python -m` runs: the package's entry point, or `rollout_operator.cli`
    for a commit from before it had one (a bench's baseline).
    """

    def __init__(
        self,
        kubeconfig: Path,
        namespaces: Sequence[str],
        log: Path,
        *,
        args: Sequence[str] = (),
        environment: Mapping[str, str] | None = None,
        module: str = "rollout_operator",
    ) -> None:
        self.kubeconfig = kubeconfig
        self.module = module
        self.namespaces = list(namespaces)
        self.log = log
        self.args = list(args)
        self.environment = dict(environment) if environment is not None else None
        self.liveness = ""
        self.process: subprocess.Popen[bytes] | None = None
        self.starts = 0

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    def start(self) -> None:
        if self.running:
            raise RuntimeError("the operator is running already")
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        argv = [sys.executable, "-m", self.module, "run", "--liveness", self.liveness]
        for namespace in self.namespaces:
            argv += ["--namespace", namespace]
        argv += self.args
        base = os.environ if self.environment is None else self.environment
        env = {**base, "KUBECONFIG": str(self.kubeconfig)}
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.starts += 1
        with self.log.open("ab") as out:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S")
            out.write(f"\n===== operator start #{self.starts} at {stamp} =====\n".encode())
            out.flush()
            self.process = subprocess.Popen(
                argv,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_live(self, timeout: float = 30.0) -> None:
        """Until the liveness endpoint answers (Kopf started its watches and handlers)."""

        def live() -> bool:
            if not self.running:
                raise RuntimeError(f"the operator exited; log:\n{self.tail()}")
            try:
                return httpx.get(self.liveness, timeout=1.0).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for_sync(live, timeout, "the operator's liveness endpoint", interval=0.2)

    def _signal(self, sig: signal.Signals) -> None:
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL: the operator dies wherever it is (a crash, an OOM kill, a node loss)."""
        if self.process is None:
            return
        self._signal(signal.SIGKILL)
        self.process.wait(timeout=30)
        self.process = None

    def stop(self, timeout: float = 20.0) -> None:
        if self.process is None:
            return
        if self.process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.process.wait(timeout=30)
        self._signal(signal.SIGKILL)  # anything it left in its group
        self.process = None

    def terminate(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, as a pod deletion or `helm upgrade` stops the operator: its exit status,
        or None when it had not exited within `timeout` and was killed."""
        if self.process is None:
            return None
        process = self.process
        if process.poll() is None:
            self._signal(signal.SIGTERM)
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop(timeout=0.1)
                return None
        self.stop()
        return process.returncode

    def tail(self, lines: int = 60) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else "(no log)"
        return "\n".join(text.splitlines()[-lines:])


@contextlib.contextmanager
def sigterm_as_interrupt() -> Iterator[None]:
    """A run (`make demo`, a bench) killed with SIGTERM cleans up like Ctrl-C does."""

    def handler(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
