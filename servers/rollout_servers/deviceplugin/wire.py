"""The protobuf wire format of the device-plugin API's messages (`deviceplugin/v1beta1`).

Only what the plugin exchanges: varints, length-delimited fields (strings, nested messages,
map entries) and the field numbers of the API's `api.proto`. Decoding skips fields it does not
know, as protobuf readers do, so a newer kubelet's additions pass through. It is bounded as a
peer's input must be: a varint is at most 10 bytes, every length is checked against the bytes
left, strings must be UTF-8 (proto3's rule), and a message is read in one pass over views of
the request (no copies), so its time is linear in its size; anything else raises `DecodeError`
naming the message and field (docs/kind.md, "GPUs").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field

API_VERSION = "v1beta1"
_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _key(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def _bytes_field(number: int, data: bytes) -> bytes:
    return _key(number, _LEN) + _varint(len(data)) + data


def _string_field(number: int, text: str) -> bytes:
    return _bytes_field(number, text.encode()) if text else b""


def _bool_field(number: int, value: bool) -> bytes:
    return _key(number, _VARINT) + _varint(1) if value else b""


class DecodeError(ValueError):
    """Bytes that are not a valid message of the type read; the text says where and why."""


_MAX_VARINT_BYTES = 10
"""A varint holds at most 64 bits: 10 bytes of 7 (protobuf's encoding guide)."""
_MAX_FIELD_NUMBER = (1 << 29) - 1


def _read_varint(data: memoryview, offset: int, where: str) -> tuple[int, int]:
    """The varint at `offset` and the offset after it; at most 10 bytes are read."""
    value = 0
    for index in range(_MAX_VARINT_BYTES):
        if offset + index >= len(data):
            raise DecodeError(f"{where}: the varint at byte {offset} is cut off")
        byte = data[offset + index]
        value |= (byte & 0x7F) << (7 * index)
        if not byte & 0x80:
            if value >> 64:
                raise DecodeError(f"{where}: the varint at byte {offset} is over 64 bits")
            return value, offset + index + 1
    raise DecodeError(f"{where}: the varint at byte {offset} is longer than 10 bytes")


def _fields(data: bytes | memoryview, where: str) -> Iterator[tuple[int, int, int | memoryview]]:
    """(field number, wire type, value) of each field in `data`, in order: an int for varints
    and fixed-size fields, a view into `data` (no copy) for length-delimited ones. One pass over
    `data`; every length is checked against what is left of it."""
    view = memoryview(data)
    offset = 0
    while offset < len(view):
        key, offset = _read_varint(view, offset, where)
        number, wire_type = key >> 3, key & 7
        if not 1 <= number <= _MAX_FIELD_NUMBER:
            raise DecodeError(f"{where}: field number {number} is out of range")
        if wire_type == _VARINT:
            value, offset = _read_varint(view, offset, where)
            yield number, wire_type, value
            continue
        if wire_type == _LEN:
            length, offset = _read_varint(view, offset, where)
        elif wire_type in (_I64, _I32):
            length = 8 if wire_type == _I64 else 4
        else:
            raise DecodeError(
                f"{where}: field {number} has wire type {wire_type}, unused in proto3"
            )
        if length > len(view) - offset:
            raise DecodeError(
                f"{where}: field {number} says {length} bytes, {len(view) - offset} are left"
            )
        chunk = view[offset : offset + length]
        offset += length
        yield number, wire_type, chunk if wire_type == _LEN else int.from_bytes(chunk, "little")


def _int32(value: int) -> int:
    """A varint read as protobuf's `int32`: its low 32 bits, two's complement."""
    return ((value & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


def _text(value: memoryview, where: str, name: str) -> str:
    try:
        return str(value, "utf-8")
    except UnicodeDecodeError as error:
        raise DecodeError(f"{where}.{name}: not valid UTF-8 (byte {error.start})") from None


@dataclass
class _Read:
    """The fields of one message that its reader asked for, by number."""

    strings: dict[int, list[str]]
    """Each occurrence, in order (a singular field's value is the last)."""
    messages: dict[int, list[memoryview]]
    """Each occurrence, in order (a singular field's value is all of them merged)."""
    varints: dict[int, int]
    """The last occurrence of each, as protobuf keeps it."""

    def text(self, number: int) -> str:
        """A singular string field: its last occurrence, "" when absent."""
        values = self.strings[number]
        return values[-1] if values else ""


def _read(
    data: bytes | memoryview,
    where: str,
    *,
    strings: Mapping[int, str] | None = None,
    messages: Sequence[int] = (),
    varints: Sequence[int] = (),
) -> _Read:
    """One message's fields: `strings` (number to name, for the error) decoded as UTF-8, as
    proto3 requires; any other field, and a known one with another wire type, skipped as an
    unknown field (protobuf's rule), so a newer kubelet's additions pass through."""
    names = strings or {}
    read = _Read({n: [] for n in names}, {n: [] for n in messages}, {})
    for number, wire_type, value in _fields(data, where):
        if isinstance(value, int):
            if wire_type == _VARINT and number in varints:
                read.varints[number] = value
        elif number in names:
            read.strings[number].append(_text(value, where, names[number]))
        elif number in read.messages:
            read.messages[number].append(value)
    return read


def decode_empty(data: bytes) -> None:
    """`Empty` (the request of `GetDevicePluginOptions` and `ListAndWatch`): checked to be
    well-formed, any field in it skipped."""
    for _ in _fields(data, "Empty"):
        pass


def decode_pre_start_request(data: bytes) -> list[str]:
    """PreStartContainerRequest: the device ids."""
    return _read(data, "PreStartContainerRequest", strings={1: "devices_ids"}).strings[1]


@dataclass(frozen=True)
class DevicePluginOptions:
    pre_start_required: bool = False
    get_preferred_allocation_available: bool = False

    def encode(self) -> bytes:
        return _bool_field(1, self.pre_start_required) + _bool_field(
            2, self.get_preferred_allocation_available
        )

    @classmethod
    def decode(cls, data: bytes | memoryview) -> DevicePluginOptions:
        values = _read(data, "DevicePluginOptions", varints=(1, 2)).varints
        return cls(bool(values.get(1, 0)), bool(values.get(2, 0)))


@dataclass(frozen=True)
class RegisterRequest:
    version: str
    endpoint: str
    resource_name: str
    options: DevicePluginOptions = field(default_factory=DevicePluginOptions)

    def encode(self) -> bytes:
        return (
            _string_field(1, self.version)
            + _string_field(2, self.endpoint)
            + _string_field(3, self.resource_name)
            + _bytes_field(4, self.options.encode())
        )

    @classmethod
    def decode(cls, data: bytes) -> RegisterRequest:
        read = _read(
            data,
            "RegisterRequest",
            strings={1: "version", 2: "endpoint", 3: "resource_name"},
            messages=(4,),
        )
        return cls(
            read.text(1),
            read.text(2),
            read.text(3),
            DevicePluginOptions.decode(b"".join(read.messages[4])),
        )


@dataclass(frozen=True)
class Device:
    id: str
    health: str = "Healthy"

    def encode(self) -> bytes:
        return _string_field(1, self.id) + _string_field(2, self.health)

    @classmethod
    def decode(cls, data: bytes | memoryview) -> Device:
        read = _read(data, "Device", strings={1: "ID", 2: "health"})
        return cls(read.text(1), read.text(2))


def encode_list_and_watch(devices: Sequence[Device]) -> bytes:
    """ListAndWatchResponse{devices}."""
    return b"".join(_bytes_field(1, device.encode()) for device in devices)


def decode_allocate_request(data: bytes) -> list[list[str]]:
    """AllocateRequest: the device ids of each container request, in order."""
    containers = _read(data, "AllocateRequest", messages=(1,)).messages[1]
    return [
        _read(
            item, f"AllocateRequest.container_requests[{index}]", strings={1: "devices_ids"}
        ).strings[1]
        for index, item in enumerate(containers)
    ]


def encode_allocate_request(containers: Sequence[Sequence[str]]) -> bytes:
    return b"".join(
        _bytes_field(1, b"".join(_string_field(1, i) for i in ids)) for ids in containers
    )


def _map_entry(number: int, key: str, value: str) -> bytes:
    return _bytes_field(number, _string_field(1, key) + _string_field(2, value))


def encode_allocate_response(containers: Sequence[Mapping[str, str]]) -> bytes:
    """AllocateResponse: one ContainerAllocateResponse per request, with `envs` only."""
    return b"".join(
        _bytes_field(1, b"".join(_map_entry(1, k, v) for k, v in sorted(envs.items())))
        for envs in containers
    )


def decode_allocate_response(data: bytes) -> list[dict[str, str]]:
    out = []
    containers = _read(data, "AllocateResponse", messages=(1,)).messages[1]
    for index, item in enumerate(containers):
        where = f"AllocateResponse.container_responses[{index}]"
        envs = {}
        for entry in _read(item, where, messages=(1,)).messages[1]:
            read = _read(entry, f"{where}.envs", strings={1: "key", 2: "value"})
            envs[read.text(1)] = read.text(2)
        out.append(envs)
    return out


@dataclass(frozen=True)
class PreferredRequest:
    """One ContainerPreferredAllocationRequest."""

    available: list[str]
    must_include: list[str]
    size: int
    """`allocation_size`, an `int32`: negative when a peer sent it so."""


def decode_preferred_request(data: bytes) -> list[PreferredRequest]:
    """PreferredAllocationRequest: one request per container, in order."""
    containers = _read(data, "PreferredAllocationRequest", messages=(1,)).messages[1]
    out = []
    for index, item in enumerate(containers):
        read = _read(
            item,
            f"PreferredAllocationRequest.container_requests[{index}]",
            strings={1: "available_deviceIDs", 2: "must_include_deviceIDs"},
            varints=(3,),
        )
        out.append(
            PreferredRequest(read.strings[1], read.strings[2], _int32(read.varints.get(3, 0)))
        )
    return out


def encode_preferred_response(containers: Sequence[Sequence[str]]) -> bytes:
    return encode_allocate_request(containers)  # the same shape: repeated { repeated string = 1 }
