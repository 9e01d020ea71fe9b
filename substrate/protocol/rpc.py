"""JSON-RPC 2.0 over newline-delimited JSON, sans-IO (docs/protocol.md §1).

Theory of operation: a connection feeds received bytes to a `LineSplitter`, which yields
complete request lines and refuses a line longer than the limit before buffering it.
Each line goes through `decode_call`, which returns either a `Call` (method known, params
validated against the method's Struct) or an `Outcome` that is already the error reply.
Replies are bytes made by `reply_result` / `reply_error`. Nothing here touches a socket.

Before a line is parsed, its nesting depth is measured on the bytes (strings stripped):
deeper than `MAX_DEPTH` is `request_too_deep`, so no decoder ever recurses on a client's
say-so. Integers in params must fit in 64 signed bits (what SQLite and the kernel take),
else `invalid_params`: checked once here for every method.
"""

from __future__ import annotations

import difflib
import itertools
import re
from dataclasses import dataclass, field
from typing import Any

import msgspec

from substrate.errors import InvalidParams, Refusal, RequestTooDeep, RequestTooLarge
from substrate.schema import METHODS, MethodSpec

PARSE_ERROR = -32700
INVALID_REQUEST = -32600
METHOD_NOT_FOUND = -32601
INVALID_PARAMS = -32602

RequestId = int | str | None

#: Deepest nesting of arrays and objects in a request line (the envelope is level 1).
MAX_DEPTH = 64
#: "unknown method" suggests at most this many names, those at least this close
#: (`difflib` ratio); a name longer than `SUGGEST_MAX_NAME` characters gets none.
SUGGESTIONS, SUGGEST_CUTOFF, SUGGEST_MAX_NAME = 3, 0.6, 128
#: The integers params may carry: signed 64 bits.
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1


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
    """A request that ended at decoding: `reply` is the error to send (None for a notification).

    `refusal` names why (a refusal's wire name, or `parse_error`, `invalid_request`,
    `method_not_found`) and `method` the declared method when one was named: what the
    server's debug log says, never the params.
    """

    reply: bytes | None
    refusal: str = field(default="", compare=False)
    method: str | None = field(default=None, compare=False)


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

    def finish(self) -> list[bytes]:
        """At end of input: the last line, if it lacked its newline (within the limit)."""
        line = bytes(self._buf).strip()
        self._buf.clear()
        return [line] if line else []


_envelope_decoder = msgspec.json.Decoder(_Envelope)
_encoder = msgspec.json.Encoder()

#: A JSON string (escapes included). An unterminated one runs to the end of the line, as
#: for a parser; that also keeps the search linear (it never fails and restarts inside).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"?', re.DOTALL)
#: Digits enough to be out of the 64-bit range (a fast filter; the walk decides): with
#: every digit made "0" and every other byte "x", a run of 19 is a substring search,
#: several times faster than a regex over a line of base64 (an upload chunk's).
_DIGITS_AS_ZERO = bytes(0x30 if 0x30 <= b <= 0x39 else 0x78 for b in range(256))
_LONG_DIGITS = b"0" * 19
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_BRACKET_STEP = [0] * 256
for _opener, _closer in (b"[]", b"{}"):
    _BRACKET_STEP[_opener], _BRACKET_STEP[_closer] = 1, -1


def nesting_exceeds(line: bytes, limit: int) -> bool:
    """True when arrays/objects in `line` (outside strings) nest deeper than `limit`.

    Every opener counts against every closer, whatever their kinds: a parser would reach
    at most that depth before it stopped. Costs two C-speed passes over the line, and
    a third over its brackets only when there are more than `limit` of them.
    """
    if len(line.translate(None, _NOT_BRACKETS)) <= limit:
        return False
    brackets = _STRING.sub(b'""', line).translate(None, _NOT_BRACKETS)
    if len(brackets) <= limit:
        return False
    return max(itertools.accumulate(map(_BRACKET_STEP.__getitem__, brackets))) > limit


def _too_deep() -> Outcome:
    refusal = RequestTooDeep(
        f"request nests arrays/objects deeper than {MAX_DEPTH} levels", limit=MAX_DEPTH
    )
    return Outcome(refusal_error(None, refusal), refusal.name)


def out_of_range_int(value: Any) -> str | None:
    """The path (`$.a[2].b`) of the first integer in `value` outside 64 signed bits, or None.

    Iterative: `value` comes from a line whose depth is already bounded, but the walk
    does not rely on it.
    """
    stack: list[tuple[str, Any]] = [("$", value)]
    while stack:
        path, item = stack.pop()
        if isinstance(item, dict):
            stack.extend((f"{path}.{key}", v) for key, v in reversed(item.items()))
        elif isinstance(item, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(item))))
        elif isinstance(item, int) and not INT_MIN <= item <= INT_MAX:
            return path
    return None


def suggest(name: str) -> list[str]:
    """Up to `SUGGESTIONS` declared method names closest to `name`, best first (difflib's
    ratio, at least `SUGGEST_CUTOFF`), or none. Also names a method whose last part is
    `name`'s (`discover` → `rpc.discover`). A name over `SUGGEST_MAX_NAME` characters gets
    none, so the cost stays bounded: at most a few thousand character comparisons per
    declared method."""
    if len(name) > SUGGEST_MAX_NAME:
        return []
    close = difflib.get_close_matches(name, METHODS, n=SUGGESTIONS, cutoff=SUGGEST_CUTOFF)
    tail = [m for m in sorted(METHODS) if m.rsplit(".", 1)[-1] == name.rsplit(".", 1)[-1]]
    return list(dict.fromkeys([*close, *tail]))[:SUGGESTIONS]


def decode_call(line: bytes) -> Call | Outcome:
    """Decode one request line into a validated `Call`, or the error `Outcome` to send."""
    if nesting_exceeds(line, MAX_DEPTH):
        return _too_deep()
    try:
        envelope = _envelope_decoder.decode(line)
    except RecursionError:
        return _too_deep()  # unreachable after the byte check; never let it escape
    except msgspec.ValidationError as exc:
        invalid = reply_error(_salvage_id(line), INVALID_REQUEST, f"invalid request: {exc}")
        return Outcome(invalid, "invalid_request")
    except msgspec.DecodeError as exc:
        return Outcome(reply_error(None, PARSE_ERROR, f"parse error: {exc}"), "parse_error")
    notification = envelope.id is msgspec.UNSET
    request_id = None if isinstance(envelope.id, msgspec.UnsetType) else envelope.id
    if envelope.jsonrpc != "2.0":
        not_two = reply_error(request_id, INVALID_REQUEST, 'jsonrpc must be "2.0"')
        return Outcome(not_two, "invalid_request")
    spec = METHODS.get(envelope.method)
    if spec is None:
        if notification:
            return Outcome(None, "method_not_found")
        suggestions = suggest(envelope.method)
        hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
        return Outcome(
            reply_error(
                request_id,
                METHOD_NOT_FOUND,
                f"unknown method {envelope.method[:SUGGEST_MAX_NAME]!r}{hint}",
                {"suggestions": suggestions},
            ),
            "method_not_found",
        )
    raw = {} if isinstance(envelope.params, msgspec.UnsetType) else envelope.params
    if _LONG_DIGITS in line.translate(_DIGITS_AS_ZERO):
        bad = out_of_range_int(raw)
        if bad is not None:
            refusal = InvalidParams(
                f"integer out of range [-2**63, 2**63 - 1] - at `{bad}`", path=bad
            )
            reply = None if notification else refusal_error(request_id, refusal)
            return Outcome(reply, refusal.name, spec.name)
    try:
        params = msgspec.convert(raw, spec.params, strict=True)
    except msgspec.ValidationError as exc:
        refusal = InvalidParams(str(exc), path=_error_path(str(exc)))
        reply = None if notification else refusal_error(request_id, refusal)
        return Outcome(reply, refusal.name, spec.name)
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
    except (msgspec.DecodeError, RecursionError):
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
