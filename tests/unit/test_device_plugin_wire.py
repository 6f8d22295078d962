"""The device plugin's hand-encoded messages (rollout_servers.deviceplugin.wire) read and written
by the protobuf library itself: message classes built here from the field numbers and types of
the kubelet's `deviceplugin/v1beta1` api.proto, so an encoding slip shows as a mismatch with the
reference implementation, not only with our own decoder. The plugin against a real kubelet:
tests/kind (docs/kind.md). A peer's malformed bytes are a `DecodeError` naming where, read in
bounded time."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import (  # type: ignore[import-untyped]
    descriptor_pb2,
    descriptor_pool,
    message_factory,
)
from rollout_servers.deviceplugin import plugin, wire
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
    "ContainerPreferredAllocationRequest": [
        ("available_deviceIDs", 1, _T.TYPE_STRING, _T.LABEL_REPEATED, ""),
        ("must_include_deviceIDs", 2, _T.TYPE_STRING, _T.LABEL_REPEATED, ""),
        ("allocation_size", 3, _T.TYPE_INT32, _T.LABEL_OPTIONAL, ""),
    ],
    "PreferredAllocationRequest": [
        (
            "container_requests",
            1,
            _T.TYPE_MESSAGE,
            _T.LABEL_REPEATED,
            ".v1beta1.ContainerPreferredAllocationRequest",
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


def _preferred(available: list[str], must_include: list[str], size: int) -> bytes:
    request = PB["PreferredAllocationRequest"]()
    container = request.container_requests.add(allocation_size=size)
    container.available_deviceIDs.extend(available)
    container.must_include_deviceIDs.extend(must_include)
    return bytes(request.SerializeToString())


def test_a_preferred_allocation_request_reads_as_protobuf_writes_it() -> None:
    # allocation_size is an int32: protobuf writes -1 as a 10-byte varint of 2**64 - 1
    assert wire.decode_preferred_request(_preferred(["a", "b"], ["b"], -1)) == [
        wire.PreferredRequest(["a", "b"], ["b"], -1)
    ]
    # a message sent in two pieces is their merge: repeated fields appended, the last size wins
    merged = _preferred(["a"], [], 1) + _preferred(["b"], ["c"], 3)
    parsed = PB["PreferredAllocationRequest"].FromString(merged)
    assert [c.allocation_size for c in parsed.container_requests] == [1, 3]
    assert wire.decode_preferred_request(merged) == [
        wire.PreferredRequest(["a"], [], 1),
        wire.PreferredRequest(["b"], ["c"], 3),
    ]
    one = PB["ContainerPreferredAllocationRequest"]
    pieces = one(allocation_size=1).SerializeToString() + one(allocation_size=3).SerializeToString()
    assert one.FromString(pieces).allocation_size == 3
    request = bytes([1 << 3 | 2, len(pieces)]) + pieces
    assert wire.decode_preferred_request(request) == [wire.PreferredRequest([], [], 3)]


def test_a_varint_longer_than_ten_bytes_is_refused_at_its_eleventh_byte() -> None:
    # Reading a long varint whole takes time quadratic in its length (its value's bits shifted
    # at every byte: 100 kB took 0.7 s, 1 MB over 200 s); a varint holds at most 10 bytes, so the
    # eleventh is refused. The 1 MB one over gRPC: tests/adversarial/test_device_plugin_input.py.
    hostile = bytes([1 << 3 | 0]) + b"\xff" * 100_000 + b"\x01"
    with pytest.raises(ValueError, match="AllocateRequest: the varint at byte 1 is longer than 10"):
        wire.decode_allocate_request(hostile)
    over_64_bits = bytes([1 << 3 | 0]) + b"\xff" * 9 + b"\x02"
    with pytest.raises(ValueError, match="over 64 bits"):
        wire.decode_allocate_request(over_64_bits)
    longest = wire._varint(2**64 - 1)
    assert len(longest) == 10
    request = bytes([1 << 3 | 2, 11, 3 << 3]) + longest
    assert wire.decode_preferred_request(request) == [wire.PreferredRequest([], [], -1)]


@pytest.mark.parametrize(
    ("frame", "reason"),
    [
        # a container request that says 100 bytes with 3 left
        (bytes([1 << 3 | 2, 100]) + b"abc", "AllocateRequest: field 1 says 100 bytes, 3 are left"),
        # a fixed64 field (an unknown one, skipped) cut off after 2 of its 8 bytes
        (
            bytes([1 << 3 | 2, 3, 7 << 3 | 1, 0, 0]),
            r"container_requests\[0\]: field 7 says 8 bytes",
        ),
        # a fixed32 field cut off
        (bytes([7 << 3 | 5, 0]), "AllocateRequest: field 7 says 4 bytes, 1 are left"),
        # wire types 3, 4 (groups), 6 and 7 are not proto3's
        (bytes([1 << 3 | 7]), "field 1 has wire type 7"),
        (bytes([0 << 3 | 2, 0]), "field number 0 is out of range"),
        (b"\x80", "the varint at byte 0 is cut off"),
        # an id that is not UTF-8 (proto3 strings must be)
        (
            bytes([1 << 3 | 2, 4, 1 << 3 | 2, 2, 0xC3, 0x28]),
            r"container_requests\[0\]\.devices_ids: not valid UTF-8",
        ),
    ],
    ids=[
        "length-past-frame",
        "fixed64-cut-off",
        "fixed32-cut-off",
        "wire-type-7",
        "field-number-0",
        "varint-cut-off",
        "id-not-utf8",
    ],
)
def test_a_malformed_frame_is_a_decode_error_naming_where(frame: bytes, reason: str) -> None:
    with pytest.raises(wire.DecodeError, match=reason):
        wire.decode_allocate_request(frame)


def test_the_preferred_allocation_is_linear_in_the_ids() -> None:
    """Counted, not timed: every id is compared by hash, never against each chosen id."""

    class Counted(str):
        compared = 0

        def __eq__(self, other: object) -> bool:
            Counted.compared += 1
            return str.__eq__(self, other)

        __hash__ = str.__hash__

    ids = 20_000
    available = [Counted(f"a{i}") for i in range(ids)]
    must_include = [Counted(f"m{i}") for i in range(ids)]
    chosen = plugin.preferred_devices(available, must_include, 2 * ids)
    assert chosen == must_include + available
    assert Counted.compared <= 2 * ids
