"""The protobuf wire format of the device-plugin API's messages (`deviceplugin/v1beta1`).

Only what the plugin exchanges: varints, length-delimited fields (strings, nested messages,
map entries) and the field numbers of the API's `api.proto`. Decoding skips fields it does not
know, as protobuf readers do, so a newer kubelet's additions pass through.
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


def _read_varint(data: bytes, offset: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if offset >= len(data):
            raise ValueError("truncated varint")
        byte = data[offset]
        offset += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, offset
        shift += 7


def fields(data: bytes) -> Iterator[tuple[int, int | bytes]]:
    """(field number, value) of each field in `data`: an int for varints, bytes otherwise."""
    offset = 0
    while offset < len(data):
        key, offset = _read_varint(data, offset)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            value, offset = _read_varint(data, offset)
            yield number, value
        elif wire_type == _LEN:
            length, offset = _read_varint(data, offset)
            if offset + length > len(data):
                raise ValueError("truncated field")
            yield number, data[offset : offset + length]
            offset += length
        elif wire_type in (_I64, _I32):
            size = 8 if wire_type == _I64 else 4
            yield number, data[offset : offset + size]
            offset += size
        else:
            raise ValueError(f"unsupported wire type {wire_type}")


def _strings(data: bytes, number: int) -> list[str]:
    return [v.decode() for n, v in fields(data) if n == number and isinstance(v, bytes)]


def _messages(data: bytes, number: int) -> list[bytes]:
    return [v for n, v in fields(data) if n == number and isinstance(v, bytes)]


@dataclass(frozen=True)
class DevicePluginOptions:
    pre_start_required: bool = False
    get_preferred_allocation_available: bool = False

    def encode(self) -> bytes:
        return _bool_field(1, self.pre_start_required) + _bool_field(
            2, self.get_preferred_allocation_available
        )

    @classmethod
    def decode(cls, data: bytes) -> DevicePluginOptions:
        values = dict(fields(data))
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
        text = {n: v.decode() for n, v in fields(data) if n in (1, 2, 3) and isinstance(v, bytes)}
        options = _messages(data, 4)
        return cls(
            text.get(1, ""),
            text.get(2, ""),
            text.get(3, ""),
            DevicePluginOptions.decode(options[0]) if options else DevicePluginOptions(),
        )


@dataclass(frozen=True)
class Device:
    id: str
    health: str = "Healthy"

    def encode(self) -> bytes:
        return _string_field(1, self.id) + _string_field(2, self.health)

    @classmethod
    def decode(cls, data: bytes) -> Device:
        text = {n: v.decode() for n, v in fields(data) if n in (1, 2) and isinstance(v, bytes)}
        return cls(text.get(1, ""), text.get(2, ""))


def encode_list_and_watch(devices: Sequence[Device]) -> bytes:
    """ListAndWatchResponse{devices}."""
    return b"".join(_bytes_field(1, device.encode()) for device in devices)


def decode_list_and_watch(data: bytes) -> list[Device]:
    return [Device.decode(item) for item in _messages(data, 1)]


def decode_allocate_request(data: bytes) -> list[list[str]]:
    """AllocateRequest: the device ids of each container request, in order."""
    return [_strings(item, 1) for item in _messages(data, 1)]


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
    for item in _messages(data, 1):
        envs = {}
        for entry in _messages(item, 1):
            text = {n: v.decode() for n, v in fields(entry) if isinstance(v, bytes)}
            envs[text.get(1, "")] = text.get(2, "")
        out.append(envs)
    return out


def decode_preferred_request(data: bytes) -> list[tuple[list[str], list[str], int]]:
    """PreferredAllocationRequest: (available, must include, size) per container."""
    out = []
    for item in _messages(data, 1):
        size = next((v for n, v in fields(item) if n == 3 and isinstance(v, int)), 0)
        out.append((_strings(item, 1), _strings(item, 2), size))
    return out


def encode_preferred_response(containers: Sequence[Sequence[str]]) -> bytes:
    return encode_allocate_request(containers)  # the same shape: repeated { repeated string = 1 }
