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
from typing import TypeVar

import grpc

from rollout_servers.deviceplugin import wire

PLUGIN_DIR = Path("/var/lib/kubelet/device-plugins")
KUBELET_SOCKET = "kubelet.sock"
RESOURCE_NAME = "nvidia.com/gpu"
VISIBLE_DEVICES_ENV = "NVIDIA_VISIBLE_DEVICES"
"""Where NVIDIA's device plugin puts the allocated GPUs for its container runtime hook."""
CHECK_SECONDS = 2.0
"""How often the plugin checks that its socket is still there (a kubelet restart removes it)."""
MAX_DEVICES = 1024
"""The most devices `--count` may advertise (a real node has at most a few dozen GPUs)."""
SOCKET_NAME = "rollout-gpu.sock"
MAX_SOCKET_PATH_BYTES = 107
"""A unix socket's path fits `sun_path`: 108 bytes with the closing NUL (unix(7))."""

log = logging.getLogger("rollout.deviceplugin")

T = TypeVar("T")


class PluginError(Exception):
    """The plugin cannot run as asked; the text is the one line its CLI prints."""


def _identity(data: bytes) -> bytes:
    return data


def _decoded(decode: Callable[[bytes], T], request: bytes, context: grpc.ServicerContext) -> T:
    """`decode(request)`, or the call refused with INVALID_ARGUMENT and the decoder's one-line
    reason (grpc logs no traceback for an aborted call)."""
    try:
        return decode(request)
    except wire.DecodeError as error:
        log.warning("refused a malformed request: %s", error)
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))


def preferred_devices(
    available: Sequence[str], must_include: Sequence[str], size: int
) -> list[str]:
    """The devices to include first (each once), then the available ones in order, up to
    `size`; linear in the number of ids."""
    chosen = list(dict.fromkeys(must_include))
    taken = set(chosen)
    for device in available:
        if len(chosen) >= size:
            break
        if device not in taken:
            taken.add(device)
            chosen.append(device)
    return chosen


class GpuDevicePlugin:
    """The `v1beta1.DevicePlugin` service for a fixed set of healthy devices."""

    def __init__(self, device_ids: Sequence[str]) -> None:
        self.devices = [wire.Device(device_id) for device_id in device_ids]
        self._known = set(device_ids)
        self._streams: list[threading.Event] = []
        self._lock = threading.Lock()

    def get_device_plugin_options(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        _decoded(wire.decode_empty, request, context)
        return wire.DevicePluginOptions(get_preferred_allocation_available=True).encode()

    def list_and_watch(self, request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        """The devices once, then the stream held open until the kubelet hangs up or the plugin
        stops: they never change."""
        _decoded(wire.decode_empty, request, context)
        done = threading.Event()
        with self._lock:
            self._streams.append(done)
        context.add_callback(done.set)
        log.info("ListAndWatch: %d devices", len(self.devices))
        yield wire.encode_list_and_watch(self.devices)
        done.wait()

    def allocate(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        containers = _decoded(wire.decode_allocate_request, request, context)
        for ids in containers:
            unknown = sorted(set(ids) - self._known)
            if unknown:
                named = ", ".join(unknown[:5]) + (
                    f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
                )
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown devices: {named}")
        log.info("Allocate: %s", containers)
        return wire.encode_allocate_response(
            [{VISIBLE_DEVICES_ENV: ",".join(ids)} for ids in containers]
        )

    def get_preferred_allocation(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """The required devices first, then the available ones in order, up to the size."""
        containers = _decoded(wire.decode_preferred_request, request, context)
        return wire.encode_preferred_response(
            [preferred_devices(c.available, c.must_include, c.size) for c in containers]
        )

    def pre_start_container(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        _decoded(wire.decode_pre_start_request, request, context)
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
    """Starts the plugin's gRPC server on `socket_path` (a stale file there is removed);
    `PluginError` when it cannot."""
    try:
        socket_path.unlink(missing_ok=True)
    except OSError as error:
        raise PluginError(f"cannot remove the stale {socket_path}: {error.strerror}") from None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    server.add_generic_rpc_handlers((plugin.handler(),))
    try:
        server.add_insecure_port(f"unix://{socket_path}")
    except RuntimeError as error:  # grpc's "Failed to bind": the reason is in its own log line
        raise PluginError(f"cannot serve on {socket_path}: {error}") from None
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
    socket_path = plugin_dir / SOCKET_NAME
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


def device_count(text: str) -> int:
    """`--count` (or `$ROLLOUT_GPUS`): a whole number from 0 to `MAX_DEVICES`."""
    if not (text.isascii() and text.isdigit()):
        raise PluginError(f"--count must be a whole number (ASCII digits), not {text!r}")
    count = int(text)
    if count > MAX_DEVICES:
        raise PluginError(f"--count {count} is over the maximum of {MAX_DEVICES} devices")
    return count


def checked_plugin_dir(plugin_dir: Path) -> Path:
    """`plugin_dir` as an absolute path, checked before anything is served: an existing folder
    whose socket path fits a unix socket, with no folder where the socket belongs."""
    folder = plugin_dir.absolute()
    if not folder.exists():
        raise PluginError(
            f"--plugin-dir {folder} does not exist (the kubelet's device-plugins folder)"
        )
    if not folder.is_dir():
        raise PluginError(f"--plugin-dir {folder} is not a folder")
    socket_path = folder / SOCKET_NAME
    size = len(os.fsencode(socket_path))
    if size > MAX_SOCKET_PATH_BYTES:
        raise PluginError(
            f"--plugin-dir {folder} is too long: the socket path {socket_path} is {size} bytes, "
            f"a unix socket's path at most {MAX_SOCKET_PATH_BYTES}"
        )
    if socket_path.is_dir() and not socket_path.is_symlink():
        raise PluginError(f"{socket_path} is a folder where the plugin's socket belongs: remove it")
    return folder


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rollout-device-plugin", description=__doc__)
    parser.add_argument(
        "--count",
        default=os.environ.get("ROLLOUT_GPUS", "4"),
        help=f"devices to advertise, 0 to {MAX_DEVICES} (default: $ROLLOUT_GPUS, else 4)",
    )
    parser.add_argument("--node", default=os.environ.get("NODE_NAME", "node"))
    parser.add_argument("--resource-name", default=RESOURCE_NAME)
    parser.add_argument("--plugin-dir", type=Path, default=PLUGIN_DIR)
    args = parser.parse_args(argv)
    try:
        count = device_count(args.count)
        plugin_dir = checked_plugin_dir(args.plugin_dir)
    except PluginError as error:
        raise SystemExit(f"rollout-device-plugin: {error}") from None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    stop = threading.Event()

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        run(device_ids_for(args.node, count), plugin_dir, args.resource_name, stop)
    except PluginError as error:
        raise SystemExit(f"rollout-device-plugin: {error}") from None


if __name__ == "__main__":
    main()
