"""The device plugin's hand-encoded messages (rollout_servers.deviceplugin.wire) read and written
by the protobuf library itself: message classes built here from the field numbers and types of
the kubelet's `deviceplugin/v1beta1` api.proto, so an encoding slip shows as a mismatch with the
reference implementation, not only with our own decoder. The plugin against a real kubelet:
tests/kind (docs/kind.md)."""

from __future__ import annotations

from typing import Any

from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)
from rollout_servers.deviceplugin import wire
from rollout_servers.deviceplugin.plugin import GpuDevicePlugin, device_ids_for

_T = descriptor_pb2.FieldDescriptorProto
_MESSAGES: dict[str, list[tuple[str, int, int, int, str]]] = {
    # name: (field, number, type, label, message type)
    "DevicePluginOptions": [
        ("pre_start_required", 1, _T.TYPE_BOOL, _T.LABEL_OPTIONAL, ""),
        ("get_preferred_allocation_available", 2, _T.TYPE_BOOL, _T.LABEL_OPTIONAL, ""),
    ],
    "RegisterRequest": [
        ("version", 1, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
        ("endpoint", 2, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
        ("resource_name", 3, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
        ("options", 4, _T.TYPE_MESSAGE, _T.LABEL_OPTIONAL, ".v1beta1.DevicePluginOptions"),
    ],
    "Device": [
        ("ID", 1, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
        ("health", 2, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
    ],
    "ListAndWatchResponse": [
        ("devices", 1, _T.TYPE_MESSAGE, _T.LABEL_REPEATED, ".v1beta1.Device"),
    ],
    "ContainerAllocateRequest": [
        ("devices_ids", 1, _T.TYPE_STRING, _T.LABEL_REPEATED, ""),
    ],
    "AllocateRequest": [
        (
            "container_requests",
            1,
            _T.TYPE_MESSAGE,
            _T.LABEL_REPEATED,
            ".v1beta1.ContainerAllocateRequest",
        ),
    ],
    "EnvsEntry": [
        ("key", 1, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
        ("value", 2, _T.TYPE_STRING, _T.LABEL_OPTIONAL, ""),
    ],
    "ContainerAllocateResponse": [
        ("envs", 1, _T.TYPE_MESSAGE, _T.LABEL_REPEATED, ".v1beta1.EnvsEntry"),
    ],
    "AllocateResponse": [
        (
            "container_responses",
            1,
            _T.TYPE_MESSAGE,
            _T.LABEL_REPEATED,
            ".v1beta1.ContainerAllocateResponse",
        ),
    ],
}


def _classes() -> dict[str, Any]:
    proto = descriptor_pb2.FileDescriptorProto(
        name="deviceplugin_test.proto", package="v1beta1", syntax="proto3"
    )
    for name, items in _MESSAGES.items():
        message = proto.message_type.add(name=name)
        for field, number, type_, label, type_name in items:
            added = message.field.add(name=field, number=number, type=type_, label=label)
            if type_name:
                added.type_name = type_name
    pool = descriptor_pool.DescriptorPool()
    pool.Add(proto)
    return {
        name: message_factory.GetMessageClass(pool.FindMessageTypeByName(f"v1beta1.{name}"))
        for name in _MESSAGES
    }


PB = _classes()


def test_a_register_request_reads_as_the_kubelet_reads_it() -> None:
    request = wire.RegisterRequest(
        version="v1beta1",
        endpoint="rollout-gpu.sock",
        resource_name="nvidia.com/gpu",
        options=wire.DevicePluginOptions(get_preferred_allocation_available=True),
    )
    parsed = PB["RegisterRequest"].FromString(request.encode())
    assert (parsed.version, parsed.endpoint, parsed.resource_name) == (
        "v1beta1",
        "rollout-gpu.sock",
        "nvidia.com/gpu",
    )
    assert parsed.options.get_preferred_allocation_available is True
    assert parsed.options.pre_start_required is False
    assert wire.RegisterRequest.decode(parsed.SerializeToString()) == request


def test_the_device_list_and_an_allocation_round_trip_through_protobuf() -> None:
    ids = device_ids_for("rollout-worker", 4)
    listed = PB["ListAndWatchResponse"].FromString(
        wire.encode_list_and_watch([wire.Device(i) for i in ids])
    )
    assert [(d.ID, d.health) for d in listed.devices] == [(i, "Healthy") for i in ids]

    # The kubelet's AllocateRequest, written by protobuf; the plugin's reply read by it.
    request = PB["AllocateRequest"]()
    request.container_requests.add().devices_ids.extend(ids[2:])
    request.container_requests.add().devices_ids.extend(ids[:1])
    assert wire.decode_allocate_request(request.SerializeToString()) == [ids[2:], ids[:1]]

    reply = GpuDevicePlugin(ids).allocate(request.SerializeToString(), context=None)  # type: ignore[arg-type]
    parsed = PB["AllocateResponse"].FromString(reply)
    envs = [{e.key: e.value for e in c.envs} for c in parsed.container_responses]
    assert envs == [
        {"NVIDIA_VISIBLE_DEVICES": "rollout-worker-gpu2,rollout-worker-gpu3"},
        {"NVIDIA_VISIBLE_DEVICES": "rollout-worker-gpu0"},
    ]
    assert wire.decode_allocate_response(reply) == envs


def test_unknown_fields_from_a_newer_kubelet_are_skipped() -> None:
    newer = PB["Device"](ID="gpu0", health="Healthy").SerializeToString()
    newer += bytes([3 << 3 | 2, 2, 8, 1])  # a TopologyInfo {nodes: [{ID: 1}]}-like field 3
    assert wire.Device.decode(newer) == wire.Device("gpu0", "Healthy")
