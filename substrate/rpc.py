"""JSON-RPC 2.0 over newline-delimited JSON, sans-IO (SPEC §1).

Theory of operation: a connection feeds received bytes to a `LineSplitter`, which yields
complete request lines and refuses a line longer than the limit before buffering it.
Each line goes through `decode_call`, which returns either a `Call` (method known, params
validated against the method's Struct) or an `Outcome` that is already the error reply.
Replies are bytes made by `reply_result` / `reply_error`. Nothing here touches a socket.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgspec

from substrate.errors import InvalidParams, Refusal, RequestTooLarge
from substrate.schema import METHODS, MethodSpec

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602

RequestId = int | str | None


class _Envelope(msgspec.Struct, forbid_unknown_fields=True):
    jsonrpc: str
    method: str
    id: RequestId | msgspec.UnsetType = msgspec.UNSET
    params: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


@dataclass(frozen=True)
class Call:
    """A valid request: `params` is an instance of `spec.params`."""

    id: RequestId
    is_notification: bool
    spec: MethodSpec
    params: Any


@dataclass(frozen=True)
class Outcome:
    """A request that ended at decoding: `reply` is the error to send (None for a notification)."""

    reply: bytes | None


class LineSplitter:
    """Splits a byte stream into lines, refusing any line over `max_line` bytes.

    After `RequestTooLarge` the splitter is done: the connection must close.
    """

    def __init__(self, max_line: int) -> None:
        self._max = max_line
        self._buf = bytearray()

    @property
    def pending(self) -> bool:
        """True while a line has started but not ended."""
        return bool(self._buf)

    def feed(self, data: bytes) -> list[bytes]:
        lines: list[bytes] = []
        start = 0
        while True:
            end = data.find(b"\n", start)
            if end < 0:
                break
            if len(self._buf) + (end - start) > self._max:
                raise RequestTooLarge(f"request line exceeds {self._max} bytes", limit=self._max)
            self._buf += data[start:end]
            line = bytes(self._buf).strip()
            self._buf.clear()
            if line:
                lines.append(line)
            start = end + 1
        if len(self._buf) + (len(data) - start) > self._max:
            raise RequestTooLarge(f"request line exceeds {self._max} bytes", limit=self._max)
        self._buf += data[start:]
        return lines


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_encoder = msgspec.json.Encoder()


def decode_call(line: bytes) -> Call | Outcome:
    """Decode one request line into a validated `Call`, or the error `Outcome` to send."""
    try:
        envelope = _envelope_decoder.decode(line)
    except msgspec.ValidationError as exc:
        return Outcome(reply_error(_salvage_id(line), INVALID_REQUEST, f"invalid request: {exc}"))
    except msgspec.DecodeError as exc:
        return Outcome(reply_error(None, PARSE_ERROR, f"parse error: {exc}"))
    notification = envelope.id is msgspec.UNSET
    request_id = None if isinstance(envelope.id, msgspec.UnsetType) else envelope.id
    if envelope.jsonrpc != "2.0":
        return Outcome(reply_error(request_id, INVALID_REQUEST, 'jsonrpc must be "2.0"'))
    spec = METHODS.get(envelope.method)
    if spec is None:
        if notification:
            return Outcome(None)
        return Outcome(
            reply_error(request_id, METHOD_NOT_FOUND, f"unknown method {envelope.method!r}")
        )
    raw = {} if isinstance(envelope.params, msgspec.UnsetType) else envelope.params
    try:
        params = msgspec.convert(raw, spec.params, strict=True)
    except msgspec.ValidationError as exc:
        refusal = InvalidParams(str(exc), path=_error_path(str(exc)))
        return Outcome(None if notification else refusal_error(request_id, refusal))
    return Call(request_id, notification, spec, params)


_FIELD_RE = re.compile(r"^Object (?:contains unknown|missing required) field `([^`]*)`")


def _error_path(message: str) -> str:
    """The field path of a msgspec message (`... - at `$.field[2]``), or `$`.

    An unknown or missing field is named in the message only: append it to the path.
    """
    marker = "- at `"
    at = message.rfind(marker)
    path = "$" if at < 0 else message[at + len(marker) :].rstrip("`")
    field = _FIELD_RE.match(message)
    return f"{path}.{field.group(1)}" if field else path


def _salvage_id(line: bytes) -> RequestId:
    try:
        value = msgspec.json.decode(line)
    except msgspec.DecodeError:
        return None
    if isinstance(value, dict):
        found = value.get("id")
        if isinstance(found, (int, str)) and not isinstance(found, bool):
            return found
    return None


def reply_result(request_id: RequestId, result: Any) -> bytes:
    return _encoder.encode({"jsonrpc": "2.0", "id": request_id, "result": result}) + b"\n"


def reply_error(
    request_id: RequestId, code: int, message: str, data: dict[str, Any] | None = None
) -> bytes:
    error: dict[str, Any] = {"code": code, "message": message}
    if data is not None:
        error["data"] = data
    return _encoder.encode({"jsonrpc": "2.0", "id": request_id, "error": error}) + b"\n"


def refusal_error(request_id: RequestId, refusal: Refusal) -> bytes:
    """The one place a `Refusal` becomes a JSON-RPC error."""
    return reply_error(request_id, refusal.code, refusal.message, refusal.to_data())


def notification(method: str, params: Any) -> bytes:
    return _encoder.encode({"jsonrpc": "2.0", "method": method, "params": params}) + b"\n"
