"""The terminal wire protocol (docs/protocol.md §7): JSON text frames, sans-IO.

Theory of operation: every WebSocket message is one JSON object whose `type` names the
frame. Client frames are decoded once, here, into a tagged union of frozen Structs that
forbid unknown fields; anything else (binary, bad JSON, an unknown type or field, a
message over `MAX_FRAME_BYTES`) raises `FrameRefused`, which carries the refusal name and
the WebSocket close code to end the connection with. Server frames are Structs too and
are encoded by `encode`. Nothing here touches a socket.

Close codes (the 44xx range is ours, modelled on HTTP statuses):

=====  =======================================================================
1000   normal: the client sent `close`, or the process exited after `exit`
4400   bad frame: not JSON, unknown type/field, or the first frame is not `open`
4401   grant problem: no/wrong token, expired, revoked, used up
4403   forbidden: input from an observer
4404   unknown session
4408   timeout: no `open` within the first-frame window, or pings unanswered
4409   controller busy
4413   frame too large (over 64 KiB)
4429   client too slow: a send did not complete within the send timeout
4500   the session could not start (confinement, engine, image) or ended on error
=====  =======================================================================
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

from substrate.protocol.rpc import nesting_exceeds

#: The largest client frame accepted, in bytes of UTF-8 JSON.
MAX_FRAME_BYTES = 64 * 1024

CLOSE_NORMAL = 1000
CLOSE_BAD_FRAME = 4400
CLOSE_GRANT = 4401
CLOSE_FORBIDDEN = 4403
CLOSE_UNKNOWN_SESSION = 4404
CLOSE_TIMEOUT = 4408
CLOSE_BUSY = 4409
CLOSE_TOO_LARGE = 4413
CLOSE_TOO_SLOW = 4429
CLOSE_FAILED = 4500

#: Close code for each refusal a terminal connection can end with.
REFUSAL_CLOSE_CODES: dict[str, int] = {
    "invalid_params": CLOSE_BAD_FRAME,
    "grant_invalid": CLOSE_GRANT,
    "grant_expired": CLOSE_GRANT,
    "grant_consumed": CLOSE_GRANT,
    "unauthorized": CLOSE_FORBIDDEN,
    "process_unknown": CLOSE_UNKNOWN_SESSION,
    "limit_exceeded": CLOSE_TIMEOUT,
    "controller_busy": CLOSE_BUSY,
    "too_large": CLOSE_TOO_LARGE,
}


def close_code_for(refusal: str) -> int:
    """The close code that ends a connection refused with `refusal` (4500 if not listed)."""
    return REFUSAL_CLOSE_CODES.get(refusal, CLOSE_FAILED)


Cells = Annotated[int, msgspec.Meta(ge=1, le=1000)]
Seq = Annotated[int, msgspec.Meta(ge=0)]
SessionId = Annotated[str, msgspec.Meta(pattern="^t-[0-9a-f]{16,32}$")]
Mode = Literal["control", "observe"]


class _ClientFrame(
    msgspec.Struct, tag_field="type", forbid_unknown_fields=True, frozen=True, kw_only=True
):
    """Base of client frames: unknown fields are a bad frame."""


class Open(_ClientFrame, tag="open", frozen=True):
    """Must be the first frame. Without `session` it starts one; with it, it attaches."""

    token: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    cols: Cells = 80
    rows: Cells = 24
    mode: Mode = "control"
    session: SessionId | None = None
    since: Seq | None = None  # resume point: the `seq` of the last output frame seen


class Input(_ClientFrame, tag="input", frozen=True):
    """Keystrokes (controller only). Sent to the PTY as UTF-8."""

    data: str


class Resize(_ClientFrame, tag="resize", frozen=True):
    """The controller's window size; observers' resizes are ignored."""

    cols: Cells
    rows: Cells


class Close(_ClientFrame, tag="close", frozen=True):
    """End the session (controller) or leave it (observer)."""


ClientFrame = Open | Input | Resize | Close


class _ServerFrame(msgspec.Struct, tag_field="type", frozen=True, kw_only=True):
    """Base of server frames."""


class Opened(_ServerFrame, tag="opened", frozen=True):
    """The client is attached; output frames follow from `seq` on."""

    session: str
    mode: Mode
    seq: int


class Output(_ServerFrame, tag="output", frozen=True):
    """PTY output; `seq` is the byte offset just past the bytes `data` covers."""

    seq: int
    data: str


class Exit(_ServerFrame, tag="exit", frozen=True):
    """The process ended with `code` (128+N for a signal); the connection closes next."""

    code: int


class Resync(_ServerFrame, tag="resync", frozen=True):
    """The wanted bytes fell out of the scrollback: reset the screen; output resumes at `seq`."""

    seq: int


class Error(_ServerFrame, tag="error", frozen=True):
    """A refusal; the connection closes next with the matching 44xx code."""

    refusal: str
    message: str


ServerFrame = Opened | Output | Exit | Resync | Error


class FrameRefused(Exception):
    """The peer broke the protocol; send `error` with `refusal`, then close with `code`."""

    def __init__(self, refusal: str, message: str, code: int) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.message = message
        self.code = code

    def frame(self) -> Error:
        return Error(refusal=self.refusal, message=self.message)


_decoder = msgspec.json.Decoder(ClientFrame)
_encoder = msgspec.json.Encoder()


#: Frames are flat objects; anything nesting deeper is refused before it is parsed, so a
#: crafted `[[[[…` can never reach the decoder's recursion limit.
MAX_FRAME_DEPTH = 8


def decode_client_frame(message: str | bytes) -> ClientFrame:
    """Decode one client message. Refuses binary messages, bad JSON and oversize frames."""
    if isinstance(message, bytes):
        raise FrameRefused("invalid_params", "frames are JSON text, not binary", CLOSE_BAD_FRAME)
    raw = message.encode("utf-8", errors="surrogatepass")
    if len(raw) > MAX_FRAME_BYTES:
        raise FrameRefused("too_large", f"frame exceeds {MAX_FRAME_BYTES} bytes", CLOSE_TOO_LARGE)
    if nesting_exceeds(raw, MAX_FRAME_DEPTH):
        raise FrameRefused("invalid_params", "frame nests too deep", CLOSE_BAD_FRAME)
    try:
        return _decoder.decode(raw)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise FrameRefused("invalid_params", f"bad frame: {exc}", CLOSE_BAD_FRAME) from None


def decode_first_frame(message: str | bytes) -> Open:
    """Decode the first frame of a connection, which must be `open`."""
    frame = decode_client_frame(message)
    if not isinstance(frame, Open):
        raise FrameRefused("invalid_params", "the first frame must be open", CLOSE_BAD_FRAME)
    return frame


def encode(frame: ServerFrame) -> str:
    """One server frame as the JSON text of a WebSocket message."""
    return _encoder.encode(frame).decode("utf-8")


def decode_server_frame(message: str | bytes) -> ServerFrame:
    """Decode a server frame (for clients: `substrate attach`, tests, benchmarks)."""
    return msgspec.json.decode(message, type=ServerFrame)


def encode_client(frame: ClientFrame) -> str:
    """One client frame as JSON text (for clients)."""
    return _encoder.encode(frame).decode("utf-8")
