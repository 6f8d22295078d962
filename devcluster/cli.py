"""`python -m devcluster ...`: up, down, status, the test hooks, and the node agent alone."""

from __future__ import annotations

import argparse
import os
import secrets
import sys
from pathlib import Path

from devcluster import controlplane, pki
from devcluster.admin import AgentAdmin
from devcluster.config import DEFAULT_NODES, AgentConfig, parse_node
from devcluster.errors import DevclusterError
from devcluster.ipranges import free_octet
from devcluster.paths import Layout
from devcluster.state import read_state


def _default_dir() -> Path:
    return Path(os.environ.get("DEVCLUSTER_DIR", ".devcluster"))


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m devcluster",
        description="A real local Kubernetes control plane plus a node agent running pods as "
        "processes, or a real kubelet node with containerd (--node-runtime containerd).",
    )
    sub = parser.add_subparsers(dest="command", required=True)

    def with_dir(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--dir",
            type=Path,
            default=None,
            help="cluster directory (default: $DEVCLUSTER_DIR or .devcluster)",
        )

    up = sub.add_parser("up", help="start a cluster and print the KUBECONFIG line")
    with_dir(up)
    up.add_argument(
        "--node",
        action="append",
        default=[],
        metavar="NAME[:k=v,...]",
        help="a node to register (repeatable; default gpu-0 with 8 GPUs and cpu-0); "
        "keys: cpu, memory, pods, gpus, label.<key>",
    )
    up.add_argument(
        "--apiserver-port",
        type=int,
        default=None,
        help="port for kube-apiserver on 127.0.0.1 (default: a free one)",
    )
    up.add_argument(
        "--timeout",
        type=float,
        default=90.0,
        help="seconds to wait for the cluster to become ready (default 90)",
    )
    up.add_argument(
        "--node-runtime",
        choices=("process", "containerd"),
        default="process",
        help="process: pods run as local processes by the node agent (default, fast); "
        "containerd: one real kubelet node with containerd, runc, kube-proxy and a CNI bridge "
        "(needs root and `make node-binaries`)",
    )
    up.add_argument(
        "--image",
        action="append",
        default=[],
        type=Path,
        metavar="ARCHIVE",
        help="an OCI or Docker image archive to import into the container node's containerd "
        "(repeatable; --node-runtime containerd only)",
    )

    up.add_argument(
        "--kueue",
        action="store_true",
        help="also start Kueue's controller (`make kueue-binaries`) with its CRDs and webhooks, "
        "RolloutSet registered as an external framework (devcluster/kueue.py)",
    )

    up.add_argument(
        "--s3",
        action="store_true",
        help="also start an S3 server on loopback (`make s3-server`) with a bucket, its "
        "credentials as files in DIR/s3/credentials/ (devcluster/s3.py); `down` removes its data",
    )
    up.add_argument(
        "--s3-bucket",
        default=None,
        metavar="NAME",
        help="the bucket `--s3` creates (default: rollout)",
    )

    down = sub.add_parser("down", help="stop every process of a cluster")
    with_dir(down)

    status = sub.add_parser("status", help="show a cluster's processes and ports")
    with_dir(status)

    image = sub.add_parser(
        "import-image",
        help="import an OCI or Docker image archive into a container node's containerd",
    )
    image.add_argument("archive", type=Path)
    with_dir(image)

    kill = sub.add_parser("kill-pod", help="SIGKILL a pod's processes (test hook)")
    kill.add_argument("namespace")
    kill.add_argument("name")
    kill.add_argument("--container", default=None)
    with_dir(kill)

    lose = sub.add_parser("lose-node", help="kill a node's processes and mark it NotReady")
    lose.add_argument("name")
    with_dir(lose)

    restore = sub.add_parser("restore-node", help="bring a lost node back")
    restore.add_argument("name")
    with_dir(restore)

    agent = sub.add_parser("agent", help="run the node agent alone (`up` starts one for you)")
    agent.add_argument(
        "--config",
        type=Path,
        default=None,
        help="an agent.json written by `up`; the other flags are then ignored",
    )
    agent.add_argument("--kubeconfig", type=Path, default=None)
    with_dir(agent)
    agent.add_argument("--node", action="append", default=[], metavar="NAME[:k=v,...]")
    agent.add_argument("--port", type=int, default=0, help="agent endpoint port (default: free)")
    agent.add_argument(
        "--pod-ip-octet",
        type=int,
        default=None,
        help="pods get 127.<octet>.x.y (default: random within 2..253)",
    )
    agent.add_argument("-v", "--verbose", action="store_true")
    return parser


def _admin(root: Path) -> AgentAdmin:
    layout = Layout(root.resolve())
    state = read_state(layout.state_file)
    if state is None:
        raise DevclusterError(f"no devcluster in {layout.root}; pass --dir or start one with `up`")
    return AgentAdmin(state.agent_url, layout.pki / "ca.crt")


def _kill_pod(root: Path, namespace: str, name: str, container: str | None) -> list[int]:
    """The agent's hook on the process node; containerd's `tasks kill` on the container node."""
    state = read_state(Layout(root.resolve()).state_file)
    if state is not None and state.container_node is not None:
        from devcluster.cluster import Cluster

        return Cluster(state).kill_pod(namespace, name, container)
    return _admin(root).kill_pod(namespace, name, container)


def _agent_config(args: argparse.Namespace) -> AgentConfig:
    if args.config is not None:
        from devcluster.agent.main import load_config

        return load_config(args.config)
    if args.kubeconfig is None:
        raise DevclusterError("agent: pass --config (from `up`) or --kubeconfig and --dir")
    root = (args.dir or _default_dir()).resolve()
    root.mkdir(parents=True, exist_ok=True)
    # Alone, the agent has no cluster CA to sign its endpoint with: it makes its own, so
    # `kubectl logs` will not verify against it, but the test hooks work.
    certs = pki.generate(root / "agent-pki")
    cluster_id = secrets.token_hex(6)
    return AgentConfig(
        dir=root,
        kubeconfig=args.kubeconfig,
        nodes=[parse_node(n) for n in args.node] or list(DEFAULT_NODES),
        admin_port=args.port,
        cluster_id=cluster_id,
        pod_ip_octet=args.pod_ip_octet or free_octet(2 + int(cluster_id, 16) % 252),
        tls_cert=certs.serving.cert,
        tls_key=certs.serving.key,
        path_prefix=[str(Path(sys.executable).parent)],
    )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    root: Path = args.dir or _default_dir()
    try:
        if args.command == "up":
            nodes = [parse_node(n) for n in args.node] or list(DEFAULT_NODES)
            controlplane.up(
                root,
                nodes,
                args.apiserver_port,
                args.timeout,
                node_runtime=args.node_runtime,
                images=args.image,
            )
            if args.kueue:
                from devcluster import kueue
                from devcluster.cluster import Cluster

                kueue.start(Cluster.attach(root), progress=_progress)
            if args.s3 or args.s3_bucket:
                from devcluster import s3

                started = s3.start_for_cluster(root, args.s3_bucket or s3.DEFAULT_BUCKET)
                _progress(
                    f"S3 server at {started.endpoint} (path-style, region {started.region}), "
                    f"bucket {started.bucket}, credentials in {started.credentials_dir}"
                )
            print(f"export KUBECONFIG={Layout(root.resolve()).kubeconfig}")
        elif args.command == "down":
            controlplane.down(root)
        elif args.command == "status":
            _status(root)
        elif args.command == "import-image":
            from devcluster.cluster import Cluster

            Cluster.attach(root).import_image(args.archive)
            print(f"imported {args.archive} into the node's containerd (namespace k8s.io)")
        elif args.command == "kill-pod":
            pids = _kill_pod(root, args.namespace, args.name, args.container)
            print(f"killed {args.namespace}/{args.name}: pids {pids}")
        elif args.command == "lose-node":
            _admin(root).lose_node(args.name)
            print(f"node {args.name} lost: its processes were killed and it is NotReady")
        elif args.command == "restore-node":
            _admin(root).restore_node(args.name)
            print(f"node {args.name} restored")
        elif args.command == "agent":
            from devcluster.agent.main import run

            run(_agent_config(args), verbose=args.verbose)
    except DevclusterError as error:
        print(f"devcluster: error: {error}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("devcluster: interrupted", file=sys.stderr)
        return 130
    return 0


def _progress(message: str) -> None:
    print(f"[devcluster] {message}", file=sys.stderr, flush=True)


def _status(root: Path) -> None:
    layout = Layout(root.resolve())
    state = read_state(layout.state_file)
    if state is None:
        raise DevclusterError(f"no devcluster in {layout.root}")
    alive = set(controlplane.running_pids(state))
    print(f"cluster {state.cluster_id} in {layout.root}: {state.phase}")
    print(f"  apiserver  {state.apiserver_url}")
    print(f"  kubeconfig {layout.kubeconfig}")
    if state.container_node is not None:
        node = state.container_node
        print(f"  node       {node.name} (containerd) at {node.node_ip}, pods {node.pod_cidr}")
        print(f"  containerd {node.containerd_socket} (namespace k8s.io)")
        print(f"  netns      {node.netns} (nsenter --net={node.netns} ...)")
    if state.s3 is not None:
        print(f"  s3         {state.s3.endpoint} bucket {state.s3.bucket}")
        print(f"  s3 keys    {state.s3.credentials_dir}")
    for record in state.processes:
        mark = "running" if record.pid in alive else "stopped"
        print(f"  {record.name:<24} pid {record.pid:<8} {mark:<8} {record.log}")
