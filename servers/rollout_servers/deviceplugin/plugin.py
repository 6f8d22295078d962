"""The device plugin's gRPC server and its registration with the kubelet.

Run as `rollout-device-plugin` in a DaemonSet pod (root, the kubelet's `device-plugins` folder
mounted): it serves `v1beta1.DevicePlugin` on a socket in that folder, registers it on the
kubelet's `kubelet.sock`, and reports `--count` healthy devices named `<node>-gpu<i>`. The
kubelet then advertises them as the node's `nvidia.com/gpu` capacity and calls `Allocate` with
the ids it picked for a container; the reply puts them in the container's environment. When the
kubelet restarts it removes every socket in the folder: the plugin sees its own gone, serves a
new one and registers again (docs/kind.md, "GPUs").
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from pathlib import Path
from types import FrameType

import grpc

from rollout_servers.deviceplugin import wire

PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
RESOURCE_NAME = "nvidia.com/gpu"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
"""Where NVIDIA's device plugin puts the allocated GPUs for its container runtime hook."""
CHECK_SECONDS = 2.0
"""How often the plugin checks that its socket is still there (a kubelet restart removes it)."""

log = logging.getLogger("rollout.deviceplugin")


def _identity(data: bytes) -> bytes:
    return data


class GpuDevicePlugin:
    """The `v1beta1.DevicePlugin` service for a fixed set of healthy devices."""

    def __init__(self, device_ids: Sequence[str]) -> None:
        self.devices = [wire.Device(device_id) for device_id in device_ids]
        self._known = set(device_ids)
        self._streams: list[threading.Event] = []
        self._lock = threading.Lock()

    def get_device_plugin_options(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return wire.DevicePluginOptions(get_preferred_allocation_available=True).encode()

    def list_and_watch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The devices once, then the stream held open until the kubelet hangs up or the plugin
        stops: they never change."""
        done = threading.Event()
        with self._lock:
            self._streams.append(done)
        context.add_callback(done.set)
        log.info("ListAndWatch: %d devices", len(self.devices))
        yield wire.encode_list_and_watch(self.devices)
        done.wait()

    def allocate(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        containers = wire.decode_allocate_request(request)
        for ids in containers:
            unknown = sorted(set(ids) - self._known)
            if unknown:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices {unknown}")
        log.info("Allocate: %s", containers)
        return wire.encode_allocate_response(
            [{VISIBLE_DEVICES_ENV: ",".join(ids)} for ids in containers]
        )

    def get_preferred_allocation(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The required devices first, then the available ones in order, up to the size."""
        preferred = []
        for available, required, size in wire.decode_preferred_request(request):
            chosen = list(required)
            chosen += [d for d in available if d not in chosen][: max(0, size - len(chosen))]
            preferred.append(chosen)
        return wire.encode_preferred_response(preferred)

    def pre_start_container(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        return b""

    def close_streams(self) -> None:
        with self._lock:
            for done in self._streams:
                done.set()
            self._streams.clear()

    def handler(self) -> grpc.GenericRpcHandler:
        unary: dict[str, Callable[[bytes, grpc.ServicerContext], bytes]] = {
            "GetDevicePluginOptions": self.get_device_plugin_options,
            "Allocate": self.allocate,
            "GetPreferredAllocation": self.get_preferred_allocation,
            "PreStartContainer": self.pre_start_container,
        }
        methods: dict[str, grpc.RpcMethodHandler[bytes, bytes]] = {
            name: grpc.unary_unary_rpc_method_handler(
                call, request_deserializer=_identity, response_serializer=_identity
            )
            for name, call in unary.items()
        }
        methods["ListAndWatch"] = grpc.unary_stream_rpc_method_handler(
            self.list_and_watch, request_deserializer=_identity, response_serializer=_identity
        )
        return grpc.method_handlers_generic_handler(f"{wire.API_VERSION}.DevicePlugin", methods)


def serve(plugin: GpuDevicePlugin, socket_path: Path) -> grpc.Server:
    """Starts the plugin's gRPC server on `socket_path` (a stale file there is removed)."""
    socket_path.unlink(missing_ok=True)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((plugin.handler(),))
    server.add_insecure_port(f"unix://{socket_path}")
    server.start()
    return server


def register(
    kubelet_socket: Path, endpoint: str, resource_name: str, timeout: float = 10.0
) -> None:
    """`v1beta1.Registration/Register` on the kubelet's socket; `endpoint` is the plugin's
    socket file name in the same folder."""
    request = wire.RegisterRequest(
        version=wire.API_VERSION,
        endpoint=endpoint,
        resource_name=resource_name,
        options=wire.DevicePluginOptions(get_preferred_allocation_available=True),
    )
    with grpc.insecure_channel(f"unix://{kubelet_socket}") as channel:
        call = channel.unary_unary(
            f"/{wire.API_VERSION}.Registration/Register",
            request_serializer=_identity,
            response_deserializer=_identity,
        )
        call(request.encode(), timeout=timeout, wait_for_ready=True)


def run(
    device_ids: Sequence[str], plugin_dir: Path, resource_name: str, stop: threading.Event
) -> None:
    """Serves and registers, again whenever the socket disappears, until `stop` is set."""
    socket_path = plugin_dir / "rollout-gpu.sock"
    while not stop.is_set():
        plugin = GpuDevicePlugin(device_ids)
        server = serve(plugin, socket_path)
        try:
            register(plugin_dir / KUBELET_SOCKET, socket_path.name, resource_name)
            log.info(
                "registered %s with %d devices at %s", resource_name, len(device_ids), socket_path
            )
            while not stop.wait(CHECK_SECONDS) and socket_path.exists():
                pass
            if not stop.is_set():
                log.info("%s is gone (the kubelet restarted): registering again", socket_path)
        except grpc.RpcError as error:
            log.warning("registration failed: %s", error)
            stop.wait(CHECK_SECONDS)
        finally:
            plugin.close_streams()
            server.stop(grace=1).wait()
    socket_path.unlink(missing_ok=True)


def device_ids_for(node: str, count: int) -> list[str]:
    return [f"{node}-gpu{index}" for index in range(count)]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollout-device-plugin", description=__doc__)
    parser.add_argument("--count", type=int, default=int(os.environ.get("ROLLOUT_GPUS", "4")))
    parser.add_argument("--node", default=os.environ.get("NODE_NAME", "node"))
    parser.add_argument("--resource-name", default=RESOURCE_NAME)
    parser.add_argument("--plugin-dir", type=Path, default=PLUGIN_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    run(device_ids_for(args.node, args.count), args.plugin_dir, args.resource_name, stop)


if __name__ == "__main__":
    main()
