"""A real S3 server on loopback for the object-storage tests, and a fresh bucket per test.

The fixtures are a pytest plugin, registered for every folder by `pytest_plugins` in
`tests/conftest.py` (a test just names them); the helpers are imported from here:

- `s3_server` (session): the S3 server of `make s3-server` (versitygw's posix backend,
  devcluster/s3.py) started on a free loopback port over a temporary data directory, with an
  access key and secret generated for the run; stopped and its data removed at the end. Each
  pytest-xdist worker starts its own.
- `s3_bucket`: a new empty bucket of that server for one test (`S3Bucket`), removed with
  everything in it afterwards. `s3_bucket.store(prefix)` is an `obstore` S3 store on it (path-style
  addressing, plain HTTP on loopback); `s3_bucket.write_credentials(folder)` writes the files a
  mounted credentials Secret holds and `s3_bucket.env(...)` the `ROLLOUT_STORAGE_S3_*` variables a
  participant pod gets (docs/install.md, "Records in a bucket").
- `s3_network`: a `FakeNetwork` (testsupport/fake_network.py) in front of the server for one test,
  whose faults (slow, 500, 503 SlowDown, 507 full, dropped) the test switches on and off;
  `s3_bucket.through(s3_network)` is the bucket reached through it.

`requests_logged(path)` reads the access log of a server started with `access_log` (who asked
for what: the multi-node suite checks that the cluster's pods reached its bucket).
"""

from __future__ import annotations

import dataclasses
import re
import secrets
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import pytest
from obstore.store import S3Store

from devcluster import s3
from devcluster.s3 import S3Credentials, S3Server
from testsupport.fake_network import FakeNetwork

if TYPE_CHECKING:  # obstore declares these for type checkers only
    from obstore.store import ClientConfig, RetryConfig

READY_TIMEOUT_S = 30.0
"""How long the server may take to answer its health endpoint (it starts in well under 1 s)."""
_LOGGED = re.compile(
    r"^\S+ (?P<bucket>\S+) \[[^\]]*\] (?P<remote>\S+) \S+ \S+ (?P<operation>\S+) (?P<key>\S+) "
    r"\S+ (?P<status>\d{3}) "
)
"""A line of versitygw's access log (S3's server access log format): bucket owner, bucket,
[time], remote address, requester, request id, operation, key, request URI, HTTP status, ..."""


class LoggedRequest(NamedTuple):
    """One request in the S3 server's access log."""

    bucket: str
    remote: str
    """The caller's address, as the server saw it."""
    operation: str
    """e.g. `s3_PutObject`, `s3_GetObject`, `s3_ListObjectsV2`."""
    key: str
    """`-` when the request names no key."""
    status: int


def requests_logged(access_log: Path) -> list[LoggedRequest]:
    """The requests the server logged so far (its opening line, and any that is not a request's,
    left out)."""
    if not access_log.exists():
        return []
    found = (_LOGGED.match(line) for line in access_log.read_text(errors="replace").splitlines())
    return [
        LoggedRequest(m["bucket"], m["remote"], m["operation"], m["key"], int(m["status"]))
        for m in found
        if m is not None
    ]


def s3_store(
    endpoint: str,
    bucket: str,
    credentials: S3Credentials,
    prefix: str = "",
    region: str = s3.REGION,
    *,
    client_options: ClientConfig | None = None,
    retry_config: RetryConfig | None = None,
) -> S3Store:
    """An `obstore` store on `bucket` at `endpoint` (path-style, HTTP allowed: loopback only);
    `client_options` are added to those (e.g. a `timeout`), `retry_config` replaces obstore's."""
    return S3Store(
        bucket,
        prefix=prefix or None,
        endpoint=endpoint,
        region=region,
        access_key_id=credentials.access_key_id,
        secret_access_key=credentials.secret_access_key,
        virtual_hosted_style_request=False,
        client_options={"allow_http": True, **(client_options or {})},
        retry_config=retry_config,
    )


@dataclass(frozen=True)
class S3Bucket:
    """One test's bucket on the session's S3 server."""

    server: S3Server
    name: str
    endpoint: str
    """Where clients reach it: the server itself, or a `FakeNetwork` in front (`through`)."""

    def through(self, network: FakeNetwork) -> S3Bucket:
        """The same bucket reached through `network` (its faults apply to every request)."""
        return dataclasses.replace(self, endpoint=network.url)

    @property
    def credentials(self) -> S3Credentials:
        return self.server.credentials

    def store(
        self,
        prefix: str = "",
        *,
        client_options: ClientConfig | None = None,
        retry_config: RetryConfig | None = None,
    ) -> S3Store:
        return s3_store(
            self.endpoint,
            self.name,
            self.credentials,
            prefix,
            self.server.region,
            client_options=client_options,
            retry_config=retry_config,
        )

    def write_credentials(self, folder: Path) -> Path:
        """The files of a mounted credentials Secret (`accessKeyId`, `secretAccessKey`) in
        `folder`, readable by the owner only; returns `folder`."""
        return self.credentials.write(folder)

    def env(self, credentials_dir: Path, prefix: str = "") -> dict[str, str]:
        """The `ROLLOUT_STORAGE_S3_*` environment of a participant pod on this bucket."""
        return self.server.participant_env(
            self.name, credentials_dir, prefix=prefix, endpoint=self.endpoint
        )


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    root = tmp_path_factory.mktemp("s3-server")
    data = root / "data"
    server = s3.start(data, root / "s3-server.log", timeout=READY_TIMEOUT_S)
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def s3_bucket(s3_server: S3Server) -> Iterator[S3Bucket]:
    name = f"test-{secrets.token_hex(6)}"
    s3_server.create_bucket(name)
    try:
        yield S3Bucket(s3_server, name, s3_server.endpoint)
    finally:
        s3_server.remove_bucket(name)


@pytest.fixture
def s3_network(s3_server: S3Server) -> Iterator[FakeNetwork]:
    network = FakeNetwork(s3_server.endpoint).start()
    try:
        yield network
    finally:
        network.close()
