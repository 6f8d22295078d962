"""An S3-compatible server on loopback: versitygw's posix backend over one data directory.

`make s3-server` (devcluster/build-s3.sh) builds `github.com/versity/versitygw/cmd/versitygw` from
the pinned wrapper module devcluster/go/s3, cached per machine by a digest of the pin;
`.bin/s3` links to that folder (`$DEVCLUSTER_S3` overrides). It is a real S3 server: SigV4 with a
static access key, path-style addressing, ListObjectsV2, DeleteObject(s) and conditional create
(`If-None-Match: *` answered 412 when the key exists, atomically per key), which is what a set's
records in a bucket need (docs/install.md, "Records in a bucket").

`start` runs it as one process (its own session) on a free port with a fresh random access key
and secret, given in its environment rather than on its command line, and returns once its
health endpoint answers; `S3Server.create_bucket` makes a bucket (a folder of the data
directory, which the posix backend serves as one); `S3Server.stop` ends it. The object-storage
tests (tests/testsupport/s3_server.py) use it so, on loopback.

It listens on loopback unless `start` is given another `host`: an address of a network
namespace the caller made, whose processes are to reach the server, with a `launcher` that runs
it there (`network_namespace_launcher`: `nsenter --net=<namespace> --`, which execs the server
in the same process, so stopping it stops the server). The multi-node suite runs it so inside
the kind cluster's namespace, on that namespace's end of the link to this machine: this
machine reaches it through the link and the cluster's pods through the nodes' network there
(tests/kind/conftest.py, docs/kind.md). The endpoint and the health check follow the host.
With `access_log`, the server writes one line per request there (S3's server access log
format: the bucket, the time, the caller's address, the operation, the key, the status), which
shows who reached it.

`start_for_cluster` (`python -m devcluster up --s3`, `Cluster.start(s3_bucket=...)`) starts one
for a devcluster: recorded in its state like its other processes, with a bucket created and its
credentials as the files a mounted Secret holds (`credentials_secret` makes that Secret); `down`
stops it and removes its data.
"""

from __future__ import annotations

import base64
import ipaddress
import os
import re
import secrets
import shutil
import subprocess
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from devcluster.errors import DevclusterError
from devcluster.paths import REPO_ROOT, Layout
from devcluster.ports import pick_free
from devcluster.procs import is_alive, spawn, stop_groups
from devcluster.state import (
    MARKER_ENV,
    ClusterState,
    ProcessRecord,
    S3State,
    read_state,
    write_state,
)
from devcluster.waiting import wait_for_sync

REGION: Final = "us-east-1"
LOOPBACK: Final = "127.0.0.1"
"""Where `start` listens unless given another host."""
HEALTH_PATH: Final = "/health"
_PORT_TRIES: Final = 3
"""How many ports `start` tries when the one it picked was taken before the server bound it."""
_PORT_TAKEN: Final = "address already in use"
DEFAULT_BUCKET: Final = "rollout"
"""The bucket `up --s3` creates."""
CREDENTIAL_FILES: Final = ("accessKeyId", "secretAccessKey")
"""A credentials Secret's keys, as files where it is mounted (docs/install.md)."""
_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""S3's bucket naming rules (lowercase letters, digits, dots and hyphens; 3-63 characters)."""


def s3_dir() -> Path:
    """The built server's folder (holding `versitygw`): `$DEVCLUSTER_S3` or `<repo>/.bin/s3`."""
    override = os.environ.get("DEVCLUSTER_S3")
    return Path(override) if override else REPO_ROOT / ".bin" / "s3"


def find_s3_server() -> Path:
    binary = s3_dir() / "versitygw"
    if not (binary.is_file() and os.access(binary, os.X_OK)):
        raise DevclusterError(
            f"the S3 server is not built in {binary.parent}: run `make s3-server` (the first "
            "build takes a few minutes) or point DEVCLUSTER_S3 at a folder that holds versitygw"
        )
    return binary


@dataclass(frozen=True)
class S3Credentials:
    """A static access key and its secret (the S3 server's root user)."""

    access_key_id: str
    secret_access_key: str

    @classmethod
    def generate(cls) -> S3Credentials:
        return cls(
            access_key_id="RO" + secrets.token_hex(9).upper(),
            secret_access_key=secrets.token_urlsafe(30),
        )

    def __repr__(self) -> str:
        return f"S3Credentials(access_key_id={self.access_key_id!r}, secret_access_key=<hidden>)"

    def secret(self, namespace: str, name: str) -> dict[str, Any]:
        """A Secret `namespace/name` holding these credentials under the keys a set's storage
        reads (`accessKeyId`, `secretAccessKey`: docs/install.md, "Records in a bucket")."""
        values = (self.access_key_id, self.secret_access_key)
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": name, "namespace": namespace},
            "type": "Opaque",
            "data": {
                key: base64.b64encode(value.encode()).decode()
                for key, value in zip(CREDENTIAL_FILES, values, strict=True)
            },
        }

    @classmethod
    def read(cls, folder: Path) -> S3Credentials:
        """The credentials `write` wrote to `folder`."""
        key, secret = ((folder / file).read_text(encoding="utf-8") for file in CREDENTIAL_FILES)
        return cls(access_key_id=key, secret_access_key=secret)

    def write(self, folder: Path) -> Path:
        """The files a mounted credentials Secret holds (`accessKeyId`, `secretAccessKey`) in
        `folder`, readable by the owner only; returns `folder`."""
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        for file, value in zip(
            CREDENTIAL_FILES, (self.access_key_id, self.secret_access_key), strict=True
        ):
            path = folder / file
            path.touch(mode=0o600)
            path.write_text(value, encoding="utf-8")
        return folder


@dataclass
class S3Server:
    """A running S3 server: its endpoint, credentials, data directory and process."""

    process: subprocess.Popen[bytes]
    port: int
    data_dir: Path
    log: Path
    credentials: S3Credentials
    region: str = REGION
    host: str = LOOPBACK
    """The address it listens on (loopback, or an address inside a network namespace)."""
    access_log: Path | None = None
    """Where it logs each request (`start(access_log=...)`), if anywhere."""

    @property
    def endpoint(self) -> str:
        return _url(self.host, self.port)

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None and is_alive(self.process.pid)

    def create_bucket(self, name: str) -> None:
        """A new empty bucket `name`; a bucket that exists already is an error."""
        if not _BUCKET_NAME.fullmatch(name) or ".." in name:
            raise DevclusterError(f"{name!r} is not a valid S3 bucket name")
        (self.data_dir / name).mkdir()

    def remove_bucket(self, name: str) -> None:
        """Removes bucket `name` with every object in it (nothing else of the data directory)."""
        if not _BUCKET_NAME.fullmatch(name) or ".." in name:
            raise DevclusterError(f"{name!r} is not a valid S3 bucket name")
        shutil.rmtree(self.data_dir / name, ignore_errors=True)

    def participant_env(
        self, bucket: str, credentials_dir: Path, *, prefix: str = "", endpoint: str = ""
    ) -> dict[str, str]:
        """The `ROLLOUT_STORAGE_S3_*` environment of a participant on `bucket` of this server
        (docs/install.md, "Records in a bucket"), its credentials the files in
        `credentials_dir` (`S3Credentials.write`); `endpoint` where it is reached some other way
        than directly (a fault proxy in front)."""
        return {
            "ROLLOUT_STORAGE_S3_ENDPOINT": endpoint or self.endpoint,
            "ROLLOUT_STORAGE_S3_BUCKET": bucket,
            "ROLLOUT_STORAGE_S3_PREFIX": prefix,
            "ROLLOUT_STORAGE_S3_REGION": self.region,
            "ROLLOUT_STORAGE_S3_ADDRESSING": "path",
            "ROLLOUT_STORAGE_S3_CREDENTIALS_DIR": str(credentials_dir),
        }

    def stop(self, grace_seconds: float = 10.0) -> None:
        """SIGTERM to its process group, SIGKILL after `grace_seconds`; reaps it."""
        stop_groups([self.process.pid], grace_seconds)
        self.process.wait(timeout=grace_seconds)


def _url(host: str, port: int) -> str:
    """`http://host:port`, an IPv6 address in brackets."""
    address = ipaddress.ip_address(host)
    return f"http://{host if address.version == 4 else f'[{host}]'}:{port}"


def _listen(host: str, port: int) -> str:
    """versitygw's `--port`: `host:port`, an IPv6 address in brackets."""
    return _url(host, port).removeprefix("http://")


def network_namespace_launcher(netns: Path) -> tuple[str, ...]:
    """The `launcher` that runs the server inside the network namespace `netns` (a path such as
    `/run/netns/<name>`): `nsenter --net=<netns> --` (not `ip netns exec`, which remounts /sys);
    nsenter enters the namespace and execs the server, so the process started is the server."""
    return ("nsenter", f"--net={netns}", "--")


def _healthy(host: str, port: int) -> bool:
    try:
        with urllib.request.urlopen(_url(host, port) + HEALTH_PATH, timeout=2) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def _log_tail(log: Path, lines: int = 25) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


def _start_once(
    binary: Path,
    data_dir: Path,
    log: Path,
    host: str,
    port: int,
    launcher: Sequence[str],
    access_log: Path | None,
    credentials: S3Credentials,
    extra_env: Mapping[str, str],
    timeout: float,
) -> S3Server:
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        **extra_env,
        "ROOT_ACCESS_KEY_ID": credentials.access_key_id,
        "ROOT_SECRET_ACCESS_KEY": credentials.secret_access_key,
    }
    argv: list[str | Path] = [
        *launcher,
        binary,
        "--port",
        _listen(host, port),
        "--region",
        REGION,
        "--health",
        HEALTH_PATH,
        "--quiet",
        *(("--access-log", access_log) if access_log is not None else ()),
        "posix",
        data_dir,
    ]
    child = spawn(argv, log, env, cwd=data_dir)
    server = S3Server(child, port, data_dir, log, credentials, host=host, access_log=access_log)

    def serving() -> bool:
        if child.poll() is not None:
            raise DevclusterError(
                f"the S3 server exited with code {child.returncode}:\n{_log_tail(log)}"
            )
        return _healthy(host, port)

    try:
        wait_for_sync(serving, timeout, f"the S3 server on {server.endpoint}", interval=0.05)
    except BaseException:
        server.stop(grace_seconds=2.0)
        raise
    return server


def start(
    data_dir: Path,
    log: Path,
    *,
    host: str = LOOPBACK,
    launcher: Sequence[str] = (),
    access_log: Path | None = None,
    extra_env: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> S3Server:
    """Starts the S3 server over `data_dir` (created if missing) on a free port of `host` with
    fresh credentials, its output appended to `log`, `extra_env` added to its (otherwise minimal)
    environment; returns once it answers on `host`.

    `host` is an IP address: loopback (the default), or an address of a network namespace the
    caller created, with `launcher` the argv prefix that runs the server there
    (`network_namespace_launcher`); the launcher must exec the server, not fork it, so that
    `S3Server.stop` ends it. The port is one free on this machine's loopback; taken in the
    namespace (the server then exits with "address already in use"), another is tried.
    `access_log`: a file the server appends one line per request to (`S3Server.access_log`)."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        raise DevclusterError(
            f"the S3 server's host must be an IP address (its endpoint names it), not {host!r}"
        ) from None
    binary = find_s3_server()
    data_dir.mkdir(parents=True, exist_ok=True)
    credentials = S3Credentials.generate()
    taken: set[int] = set()
    tries = 0
    while True:
        port = pick_free(taken)
        try:
            return _start_once(
                binary,
                data_dir,
                log,
                host,
                port,
                launcher,
                access_log,
                credentials,
                extra_env or {},
                timeout,
            )
        except DevclusterError as error:
            tries += 1
            if tries >= _PORT_TRIES or _PORT_TAKEN not in str(error):
                raise


def start_for_cluster(
    root: Path, bucket: str = DEFAULT_BUCKET, *, timeout: float = 30.0
) -> S3State:
    """Starts an S3 server for the devcluster in `root` (`up --s3`): its data and credential
    files under `<root>/s3/`, its log with the cluster's, the process recorded in the cluster's
    state (so `down` stops it and removes `<root>/s3/`), `bucket` created."""
    layout = Layout(root.resolve())
    state = read_state(layout.state_file)
    if state is None:
        raise DevclusterError(f"no devcluster state in {layout.root}; start the cluster first")
    if state.s3 is not None:
        raise DevclusterError(f"the devcluster in {layout.root} has an S3 server already")
    folder = layout.root / "s3"
    server = start(
        folder / "data",
        layout.log("s3-server"),
        extra_env={MARKER_ENV: state.cluster_id},
        timeout=timeout,
    )
    record = ProcessRecord(name="s3-server", pid=server.pid, log=server.log)
    s3 = S3State(endpoint=server.endpoint, bucket=bucket, region=server.region, dir=folder)
    write_state(
        layout.state_file,
        state.model_copy(update={"processes": [*state.processes, record], "s3": s3}),
    )
    server.credentials.write(s3.credentials_dir)
    server.create_bucket(bucket)
    return s3


def remove_data(state: ClusterState) -> None:
    """`down`, once every process is stopped: the S3 server's buckets and credential files."""
    if state.s3 is not None:
        shutil.rmtree(state.s3.dir, ignore_errors=True)


def credentials_secret(s3: S3State, namespace: str, name: str) -> dict[str, Any]:
    """A Secret holding the credentials of the cluster's S3 server, for a set's storage."""
    return S3Credentials.read(s3.credentials_dir).secret(namespace, name)
