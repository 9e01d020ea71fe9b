"""What a connection may do and when it ends, sans-IO (h11 style).

`ConnectionState` holds one connection's framing and clocks. The socket loop in
`substrate.protocol.server` feeds it events — bytes received (`received`), end of input
(`end_of_input`), a call started or finished (`call_started`, `call_finished`) — with the
current time, and asks it when to stop waiting (`deadline`) and whether a wait that ran
out closes the connection (`expired`). Nothing here touches a socket or a clock, so
every deadline is tested with plain numbers (tests/protocol/test_connection_state.py).

The rules:
- A started line must end within `line_timeout_s` of the chunk that began it (a client
  dripping one byte at a time is cut off), and be at most `max_request_bytes` long
  (`request_too_large`; the connection then closes).
- A connection with nothing in flight and nothing held open (subscriptions) closes
  `idle_timeout_s` after its last activity: bytes received or a call finished.
- While the daemon does not read by its own choice (`pause` to `resume`: its in-flight
  cap is reached, or its unsent bytes are over budget) neither clock runs: a client is
  never cut off for bytes the daemon left unread.
- Replies and notifications made and not yet sent are counted (`queued`, `dequeued`);
  `UnsentBytes` sums them per peer uid of one socket and says when either budget,
  `max_unsent_bytes` per connection or `max_unsent_bytes_per_uid`, is passed.
- After end of input the connection drains: calls in flight and subscriptions finish,
  then it closes (`drained`).

`Admission` counts one socket's live connections in total and per peer uid, and refuses
a peer uid not allowed. `call_refusal` says whether this socket may call a method.
"""

from __future__ import annotations

import math
from typing import Protocol

from substrate.errors import LimitExceeded, Refusal, Unauthorized
from substrate.protocol.caller import Actor
from substrate.protocol.rpc import LineSplitter
from substrate.schema import MethodSpec


class Limits(Protocol):
    """The caps a connection is held to: `substrate.config.Config` has them (the daemon's
    configuration sits above this layer, so it is described, not imported)."""

    @property
    def max_request_bytes(self) -> int: ...
    @property
    def line_timeout_s(self) -> float: ...
    @property
    def idle_timeout_s(self) -> float: ...
    @property
    def max_in_flight(self) -> int: ...
    @property
    def max_connections(self) -> int: ...
    @property
    def max_connections_per_uid(self) -> int: ...
    @property
    def max_unsent_bytes(self) -> int: ...
    @property
    def max_unsent_bytes_per_uid(self) -> int: ...
    def effective_uids(self) -> frozenset[int]: ...


class ConnectionState:
    """Framing, in-flight count and deadlines of one connection. Times are seconds on
    any monotonic clock (the server uses Trio's)."""

    def __init__(self, config: Limits, now: float) -> None:
        self._splitter = LineSplitter(config.max_request_bytes)
        self._line_timeout = config.line_timeout_s
        self._idle_timeout = config.idle_timeout_s
        #: When the pending (unterminated) line began, or None when there is none.
        self.line_started: float | None = None
        #: The last time bytes arrived or a call finished.
        self.last_activity = now
        #: Calls started and not finished.
        self.in_flight = 0
        #: The peer ended its input (EOF): no more lines will come.
        self.input_ended = False
        #: Since when the daemon has not been reading by its own choice, or None.
        self.paused_since: float | None = None
        #: Bytes of replies and notifications made and not yet sent (or dropped).
        self.unsent_bytes = 0

    # -- events ------------------------------------------------------------------------------

    def received(self, data: bytes, now: float) -> list[bytes]:
        """Bytes arrived: the complete lines they end, in order.

        Raises `RequestTooLarge` (before buffering past the cap) for a line over
        `max_request_bytes`; the connection must then close. Costs O(len(data)).
        """
        self.last_activity = now
        lines = self._splitter.feed(data)
        if not self._splitter.pending:
            self.line_started = None
        elif self.line_started is None or b"\n" in data:
            # The pending line began in this chunk (a newline ended the one before).
            self.line_started = now
        return lines

    def end_of_input(self) -> list[bytes]:
        """The peer ended its input: the last line, if it lacked its newline."""
        self.input_ended = True
        self.line_started = None
        return self._splitter.finish()

    def call_started(self) -> None:
        self.in_flight += 1

    def call_finished(self, now: float) -> None:
        self.in_flight -= 1
        self.last_activity = now

    def pause(self, now: float) -> None:
        """The daemon stops reading by its own choice (a cap or a budget reached)."""
        self.paused_since = now

    def resume(self, now: float) -> None:
        """The daemon reads again: the pause is not held against the client. A pending
        line's deadline moves by the pause; so does the idle clock, which restarts now
        when a call finished during the pause."""
        if self.paused_since is None:
            return
        paused = now - self.paused_since
        if self.line_started is not None:
            self.line_started += paused
        if self.last_activity >= self.paused_since:
            self.last_activity = now
        else:
            self.last_activity += paused
        self.paused_since = None

    def queued(self, n: int) -> None:
        """A reply or notification of `n` bytes was made; it waits to be sent."""
        self.unsent_bytes += n

    def dequeued(self, n: int) -> None:
        """A reply or notification of `n` bytes was sent, or dropped with the connection."""
        self.unsent_bytes -= n

    # -- questions -----------------------------------------------------------------------------

    def deadline(self, now: float, *, held: bool) -> float:
        """When the reader stops waiting for bytes (`math.inf`: not before an event).

        `held`: subscriptions keep the connection open. They end without an event here,
        so while held the reader looks again every `idle_timeout_s`.
        """
        if self.line_started is not None:
            return self.line_started + self._line_timeout
        if self.in_flight:
            return math.inf  # `call_finished` moves the deadline
        if held:
            return now + self._idle_timeout
        return self.last_activity + self._idle_timeout

    def expired(self, now: float, *, held: bool) -> bool:
        """After a wait ended at its deadline: does the connection close (a line that never
        ends, or an idle connection)? False when the wait was only a look again."""
        if self.line_started is not None:
            return now >= self.line_started + self._line_timeout
        if self.in_flight or held:
            return False
        return now >= self.last_activity + self._idle_timeout

    def drained(self, *, held: bool) -> bool:
        """After end of input: nothing in flight and nothing held, the connection may close."""
        return self.input_ended and not self.in_flight and not held


class Admission:
    """The live connections of one socket, in total and per peer uid; who may connect."""

    def __init__(self, config: Limits) -> None:
        self._allowed = config.effective_uids()
        self._max = config.max_connections
        self._max_per_uid = config.max_connections_per_uid
        self.count = 0
        self.by_uid: dict[int, int] = {}

    def admit(self, uid: int) -> Refusal | None:
        """Count a new connection of `uid`, or say why not: `unauthorized` for a uid not
        allowed, `limit_exceeded` (`scope` socket or uid) past a cap. A refused
        connection is not counted (and must not be released)."""
        if uid not in self._allowed:
            return Unauthorized("peer uid is not allowed")
        if self.count >= self._max:
            return LimitExceeded("too many connections", limit=self._max, scope="socket")
        held = self.by_uid.get(uid, 0)
        if held >= self._max_per_uid:
            return LimitExceeded(
                f"too many connections from uid {uid}", limit=self._max_per_uid, scope="uid"
            )
        self.count += 1
        self.by_uid[uid] = held + 1
        return None

    def release(self, uid: int) -> None:
        """An admitted connection of `uid` closed."""
        self.count -= 1
        left = self.by_uid[uid] - 1
        if left:
            self.by_uid[uid] = left
        else:
            del self.by_uid[uid]


class UnsentBytes:
    """The bytes of replies and notifications one socket's connections made and have not
    yet sent, per peer uid, and the budgets they are held to (docs/protocol.md §1)."""

    def __init__(self, config: Limits) -> None:
        self.per_connection = config.max_unsent_bytes
        self.per_uid = config.max_unsent_bytes_per_uid
        self.by_uid: dict[int, int] = {}

    def over(self, uid: int, connection_bytes: int) -> bool:
        """Is a connection of `uid` holding `connection_bytes` unsent at or past a budget?
        Then it takes no more work and makes no more replies until bytes are sent."""
        return connection_bytes >= self.per_connection or self.by_uid.get(uid, 0) >= self.per_uid

    def add(self, uid: int, n: int) -> None:
        self.by_uid[uid] = self.by_uid.get(uid, 0) + n

    def remove(self, uid: int, n: int) -> None:
        left = self.by_uid[uid] - n
        if left:
            self.by_uid[uid] = left
        else:
            del self.by_uid[uid]


def call_refusal(spec: MethodSpec, actor: Actor) -> Refusal | None:
    """Why a connection on `actor`'s socket may not call `spec`, or None when it may."""
    if spec.operator_only and actor != "operator":
        return Unauthorized(f"{spec.name} is an operator method")
    return None
