"""One terminal session's rules, sans-IO: who is attached, who may type, when it ends.

Theory of operation: a `Session` is created when an `open` frame without `session`
passes its grant; it owns the scrollback `Ring`. Clients attach as the one controller or
as observers:

=================  ====================================================================
event              rule
=================  ====================================================================
attach control     refused `controller_busy` if another controller is attached
attach observe     always allowed
input              controller only; from an observer: refused `unauthorized` (4403)
resize             controller: the PTY follows; observer: ignored
detach             the client leaves; the session lives on (a dropped connection)
close (control)    ends the session
close (observer)   detaches
process exit       ends the session; every client gets `exit`
idle               ends the session when nothing happened for `idle_timeout_s`
=================  ====================================================================

"Nothing happened" means no input, no output and no attach or detach. Time is always a
parameter (`now`, monotonic seconds), so the rules are tested without a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from substrate.errors import ControllerBusy, Unauthorized
from substrate.pty.ring import DEFAULT_CAPACITY, Ring

Mode = Literal["control", "observe"]
State = Literal["running", "ended"]


@dataclass
class Attachment:
    """One attached client (one WebSocket connection)."""

    client: int
    mode: Mode
    grant: str


@dataclass
class Session:
    """The pure state of one terminal session."""

    id: str
    workspace: str
    profile: str
    grant: str  # the grant that started it
    cols: int
    rows: int
    now: float
    idle_timeout_s: float = 1800.0
    ring_capacity: int = DEFAULT_CAPACITY
    ring: Ring = field(init=False)
    attached: dict[int, Attachment] = field(default_factory=dict)
    state: State = "running"
    exit_code: int | None = None
    end_reason: str | None = None
    last_activity: float = field(init=False)

    def __post_init__(self) -> None:
        self.ring = Ring(self.ring_capacity)
        self.last_activity = self.now

    @property
    def controller(self) -> int | None:
        for a in self.attached.values():
            if a.mode == "control":
                return a.client
        return None

    def attach(self, client: int, mode: Mode, grant: str, now: float) -> None:
        """Attach a client. Refuses a second controller (`controller_busy`)."""
        if self.state != "running":
            raise ValueError("session has ended")
        if mode == "control" and self.controller is not None:
            raise ControllerBusy("this session already has a controller", session=self.id)
        self.attached[client] = Attachment(client, mode, grant)
        self.last_activity = now

    def detach(self, client: int, now: float) -> None:
        """The client left (closed its connection); the session lives on."""
        if self.attached.pop(client, None) is not None:
            self.last_activity = now

    def check_input(self, client: int, now: float) -> None:
        """Input is allowed only from the attached controller (`unauthorized` otherwise)."""
        a = self.attached.get(client)
        if a is None or a.mode != "control":
            raise Unauthorized("observers cannot type into a terminal", session=self.id)
        self.last_activity = now

    def resize(self, client: int, cols: int, rows: int) -> bool:
        """Apply a resize from the controller; True when the PTY must follow."""
        a = self.attached.get(client)
        if a is None or a.mode != "control" or (cols, rows) == (self.cols, self.rows):
            return False
        self.cols, self.rows = cols, rows
        return True

    def close_by(self, client: int, now: float) -> bool:
        """A `close` frame: True when it ends the session (the controller sent it)."""
        a = self.attached.get(client)
        self.detach(client, now)
        return a is not None and a.mode == "control"

    def output(self, data: bytes, now: float) -> None:
        """PTY output arrived: into the ring."""
        self.ring.append(data)
        self.last_activity = now

    def idle_deadline(self) -> float:
        """The monotonic time at which the session ends if nothing happens."""
        return self.last_activity + self.idle_timeout_s

    def is_idle(self, now: float) -> bool:
        return self.state == "running" and now >= self.idle_deadline()

    def end(self, reason: str, exit_code: int | None) -> None:
        """Mark the session ended (idempotent: the first reason wins)."""
        if self.state == "ended":
            return
        self.state = "ended"
        self.end_reason = reason
        self.exit_code = exit_code
