"""Encode/decode of stream payloads (MessagePack via msgspec), with size limits; tensor metadata only."""
from __future__ import annotations

from typing import Any, TypeVar

import msgspec

T = TypeVar("T")

MAX_PAYLOAD_BYTES = 4 * 1024 * 1024  # a stream entry bigger than this is poison, never decoded


class DecodeError(ValueError):
    """The payload is not a valid message of the expected types (truncated, wrong schema, too big, ...)."""


_encoder = msgspec.msgpack.Encoder()
_decoders: dict[Any, msgspec.msgpack.Decoder] = {}


def encode(msg: msgspec.Struct) -> bytes:
    return _encoder.encode(msg)


def decoder_for(types: Any) -> msgspec.msgpack.Decoder:
    dec = _decoders.get(types)
    if dec is None:
        dec = _decoders[types] = msgspec.msgpack.Decoder(types)
    return dec


def decode(data: bytes, types: Any) -> Any:
    """Decode ``data`` as one of ``types`` (a Struct type or a Union); raise DecodeError on anything wrong."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"payload is {type(data).__name__}, not bytes")
    if len(data) > MAX_PAYLOAD_BYTES:
        raise DecodeError(f"payload of {len(data)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        return decoder_for(types).decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as e:
        raise DecodeError(str(e)) from None
