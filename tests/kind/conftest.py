"""Fixtures of the multi-node suite (`tests/kind`, marker `kind`): one kind cluster for the module.

- `kind_cluster` (session): `kind/up.sh` (what `make kind` runs without Docker: podman in a
  network namespace of its own, one control plane and three workers (`ROLLOUT_KIND_WORKERS`
  for another number), the device plugin DaemonSet, docs/kind.md) started once, without its
  cluster-wide operator (each test installs its own by Helm into its namespace); `kind/down.sh`
  at the end, which fails the session if any container, mount, namespace, link, process or
  kernel tunable of the cluster is left. With `ROLLOUT_KIND_STATE=DIR` the tests use the
  cluster `KIND_STATE=DIR KIND_NO_OPERATOR=1 make kind` started there and leave it up (its lost
  workers started again at the end).
- `kind_provider`: the cluster as a `harness.providers.PodmanKindProvider`.
- `kind_namespace`: a fresh namespace per test, deleted afterwards (not waited for); pods left
  on a lost node (their kubelet gone) are deleted by force first, as an administrator does.
- `shared_storage`: a folder of the host folder every node mounts at `/rollout-shared` (a
  cluster filesystem, as GPU nodes share one), writable by the image's user: (path on this
  machine, path in the nodes).
- `kind_s3_server` (module): the S3 server of `make s3-server` (versitygw, devcluster/s3.py)
  run inside the cluster's network namespace (`nsenter --net=`), listening on that namespace's
  end of the link to this machine (`KIND_LINK_NETNS` of kind/env.sh, 10.215.0.2): this machine
  reaches it through the link, the pods through the nodes' network in the namespace, and no
  node has its data (a bucket is the only place records put there live). Its access log
  (`S3Server.access_log`) names the caller of every request. Stopped, and its data removed, at
  the module's end.
- `kind_bucket`: a new empty bucket of that server for one test and its credentials as the
  Secret `BUCKET_SECRET` in the test's namespace: (the bucket, the Secret's name); the bucket is
  removed with everything in it afterwards.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from testsupport.s3_server import S3Bucket

from devcluster import s3
from devcluster.image import ProjectImage, build_project_image
from devcluster.paths import REPO_ROOT
from devcluster.testing import namespace_name
from harness.objects import create_namespace
from harness.providers import PodmanKindProvider

SHARED_IN_NODE = Path("/rollout-shared")
WORKERS = os.environ.get("ROLLOUT_KIND_WORKERS", "3")
"""Three workers: the three scenarios that lose a worker take different ones, so of the three
restarts (20 to 130 s each) only one is left (tests/kind/test_multinode.py's `worker_pair`,
docs/kind.md); two work too, a lost worker then started again before each scenario needing it.
Not `KIND_WORKERS`: the Makefile exports that (2) for `make kind`."""
UP_TIMEOUT = 1800
"""A cold `kind/up.sh` builds kind's tools and the node image first (minutes on two cores)."""
BUCKET_SECRET = "bucket-credentials"
S3_READY_TIMEOUT = 30.0
"""How long the S3 server may take to answer its health endpoint (well under 1 s here)."""


def link_address_in_netns() -> str:
    """The cluster namespace's end of its link to this machine (`KIND_LINK_NETNS`, kind/env.sh):
    an address inside a network namespace the run created, reachable from here and from the
    nodes' network."""
    env_sh = (REPO_ROOT / "kind" / "env.sh").read_text(encoding="utf-8")
    found = re.search(r'^KIND_LINK_NETNS="([0-9.]+)"$', env_sh, re.MULTILINE)
    assert found, "kind/env.sh sets no KIND_LINK_NETNS"
    return found.group(1)


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="session")
def kind_state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    reuse = os.environ.get("ROLLOUT_KIND_STATE")
    if reuse:
        yield Path(reuse)
        return
    if Path("/run/netns/rollout-kind").exists() or Path("/run/rollout-kind").exists():
        pytest.fail(
            "a kind cluster is up on this machine: `make kind-down` first, or run the suite on "
            "it with ROLLOUT_KIND_STATE=<its KIND_STATE> (started with KIND_NO_OPERATOR=1)"
        )
    state = tmp_path_factory.mktemp("kind")
    env = {**os.environ, "KIND_STATE": str(state), "KIND_NO_OPERATOR": "1", "KIND_WORKERS": WORKERS}
    up = subprocess.run(
        [str(REPO_ROOT / "kind" / "up.sh")],
        env=env,
        capture_output=True,
        text=True,
        timeout=UP_TIMEOUT,
        check=False,
    )
    try:
        assert up.returncode == 0, f"kind/up.sh failed:\n{up.stderr[-6000:]}"
        print(up.stderr[-3000:])
        yield state
    finally:
        down = subprocess.run(
            [str(REPO_ROOT / "kind" / "down.sh")],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        assert down.returncode == 0, f"kind/down.sh left something:\n{down.stderr[-4000:]}"


@pytest.fixture(scope="session")
def kind_provider(
    kind_state: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[PodmanKindProvider]:
    provider = PodmanKindProvider(
        os.environ.get("KIND_CLUSTER", "rollout"),
        tmp_path_factory.mktemp("kind-provider"),
        kind_state / "kubeconfig",
    )
    yield provider
    if os.environ.get("ROLLOUT_KIND_STATE"):
        # A cluster the suite did not start is left as it was found: every worker up.
        for node in provider.workers():
            if node not in provider.running_nodes():
                provider.start_node(node)


@pytest.fixture(scope="session")
def kind_image(kind_provider: PodmanKindProvider) -> ProjectImage:
    """The project's image `kind/up.sh` loaded on every worker (`image/build.sh`'s cache: the
    checkout's inputs unchanged since, this finds the same build)."""
    return build_project_image(REPO_ROOT).image


@pytest.fixture
def kind_namespace(
    kind_provider: PodmanKindProvider, request: pytest.FixtureRequest
) -> Iterator[str]:
    name = namespace_name(request.node.name)
    create_namespace(kind_provider, name)
    yield name
    if os.environ.get("ROLLOUT_E2E_KEEP_NAMESPACES"):
        return
    kind_provider.kubectl(
        "delete",
        "rolloutsets,rolloutcheckpoints",
        "--all",
        "-n",
        name,
        "--timeout=120s",
        check=False,
        timeout=150,
    )
    # Pods whose node is gone never finish terminating: deleted by force, as an admin does.
    kind_provider.kubectl(
        "delete", "pods", "--all", "-n", name, "--force", "--grace-period=0", check=False
    )
    # Not waited for (about 6 s a test): its pods are gone already and the rest goes in the
    # background; the next scenarios use other namespaces, and kind/down.sh removes the cluster.
    kind_provider.kubectl("delete", "namespace", name, "--wait=false", check=False)


@pytest.fixture
def shared_storage(kind_state: Path, kind_namespace: str) -> tuple[Path, Path]:
    host = kind_state / "shared" / kind_namespace
    host.mkdir(parents=True)
    host.chmod(0o1777)
    return host, SHARED_IN_NODE / kind_namespace


@pytest.fixture(scope="module")
def kind_s3_server(
    kind_provider: PodmanKindProvider, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[s3.S3Server]:
    root = tmp_path_factory.mktemp("kind-s3")
    data = root / "data"
    server = s3.start(
        data,
        root / "s3-server.log",
        host=link_address_in_netns(),
        launcher=s3.network_namespace_launcher(Path("/run/netns") / kind_provider.netns),
        access_log=root / "access.log",
        timeout=S3_READY_TIMEOUT,
    )
    try:
        yield server
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)


@pytest.fixture
def kind_bucket(
    kind_s3_server: s3.S3Server, kind_provider: PodmanKindProvider, kind_namespace: str
) -> Iterator[tuple[S3Bucket, str]]:
    name = f"kind-{secrets.token_hex(6)}"
    kind_s3_server.create_bucket(name)
    try:
        secret = kind_s3_server.credentials.secret(kind_namespace, BUCKET_SECRET)
        kind_provider.kubectl("apply", "-f", "-", input=json.dumps(secret))
        yield S3Bucket(kind_s3_server, name, kind_s3_server.endpoint), BUCKET_SECRET
    finally:
        kind_s3_server.remove_bucket(name)
