"""The one refusal taxonomy.

Every code path that says no raises a `Refusal` subclass. Each subclass carries its stable
wire name (docs/protocol.md §1); the server turns any `Refusal` into a JSON-RPC error in one place
(`substrate.protocol.rpc.refusal_error`). A refusal never changes state: raise it before touching
anything, or undo what was touched.

Names say who is at fault where it matters: most refusals are the caller's (bad input, a
stale view), `ConfinementUnmet` and `RuntimeUnavailable` are the environment's, and
`Internal` is ours.
"""

from __future__ import annotations

from typing import Any, ClassVar

#: JSON-RPC error code used for every named refusal.
REFUSAL_CODE = -32001


class Refusal(Exception):
    """Base of every named refusal. `data` is extra JSON-safe detail for the client."""

    name: ClassVar[str] = "internal"
    #: The JSON-RPC code; only `invalid_params` uses a standard one.
    code: ClassVar[int] = REFUSAL_CODE

    def __init__(self, message: str, **data: Any) -> None:
        super().__init__(message)
        self.message = message
        self.data: dict[str, Any] = data

    def to_data(self) -> dict[str, Any]:
        return {"refusal": self.name, **self.data}


class Unauthorized(Refusal):
    """The peer may not call this: uid not allowed, or an operator method on the agent socket."""

    name = "unauthorized"


class RequestTooLarge(Refusal):
    """A request line longer than `max_request_bytes`; the connection closes after it."""

    name = "request_too_large"


class RequestTooDeep(Refusal):
    """A request line nesting arrays/objects deeper than `rpc.MAX_DEPTH`; it is not parsed.

    Answered with id null (the line is never decoded); the connection stays open.
    """

    name = "request_too_deep"


class InvalidParams(Refusal):
    """Params do not match the method's schema; `data.path` names the field."""

    name = "invalid_params"
    code = -32602


class UnknownWorkspace(Refusal):
    """No adopted workspace has this handle."""

    name = "unknown_workspace"


class PathInvalid(Refusal):
    """Not a workspace-relative POSIX path: absolute, empty, NUL, backslash, `..`, too long."""

    name = "path_invalid"


class PathEscape(Refusal):
    """The path resolves outside its workspace (or adopt root)."""

    name = "path_escape"


class SymlinkRefused(Refusal):
    """A symlink stands on the path (any component); it is never followed."""

    name = "symlink_refused"


class PathDenied(Refusal):
    """The workspace policy (or the adopt roots) does not allow this path."""

    name = "path_denied"


class PolicyLocked(Refusal):
    """An agent's policy would loosen the checkout's: drop a deny glob or widen the allow
    list (`data.dropped`, `data.added`). Only the operator loosens (`workspace.set_policy`)."""

    name = "policy_locked"


class NotFound(Refusal):
    """The path does not exist."""

    name = "not_found"


class NotAFile(Refusal):
    """A regular file was needed (directories, FIFOs, devices, sockets are refused)."""

    name = "not_a_file"


class NotADirectory(Refusal):
    """A directory was needed."""

    name = "not_a_directory"


class AlreadyExists(Refusal):
    """Create was asked (`base_sha256 = null`) but the path exists, or an id is taken."""

    name = "already_exists"


class StaleBase(Refusal):
    """The file's current SHA-256 is not the base the caller bound to (`data.current_sha256`)."""

    name = "stale_base"


class PatchConflict(Refusal):
    """An edit's `old` does not occur exactly `count` times, or a hunk does not apply."""

    name = "patch_conflict"


class PlanMismatch(Refusal):
    """The given `plan_digest` is not the digest of the plan computed now."""

    name = "plan_mismatch"


class ApprovalRequired(Refusal):
    """The path needs an unused operator approval for exactly this plan digest."""

    name = "approval_required"


class TooLarge(Refusal):
    """A size bound was passed (read length, file size, content size)."""

    name = "too_large"


class ProfileUnknown(Refusal):
    """No operator profile has this name."""

    name = "profile_unknown"


class ProfileInvalid(Refusal):
    """A profile reload found a profile or seccomp file that does not load (the message
    names the file and key); the profiles in force stay as they were."""

    name = "profile_invalid"


class ArgvDenied(Refusal):
    """argv is empty, holds a NUL, or argv[0] is outside the profile's `argv_allow`."""

    name = "argv_denied"


class ConfinementUnmet(Refusal):
    """An observed confinement fact differs from the profile's (`data.required/observed`)."""

    name = "confinement_unmet"


class RuntimeUnavailable(Refusal):
    """The container engine (or the asked runtime) does not answer."""

    name = "runtime_unavailable"


class ImageMissing(Refusal):
    """The profile's image is not present in the engine (no registry pull is attempted)."""

    name = "image_missing"


class EgressDenied(Refusal):
    """An egress sandbox asked its proxy for a host or port its profile's `egress_allow`
    does not list (or a name that resolves to the host's own addresses); answered by the
    proxy as HTTP 403 before any resolution, reported as `egress_blocked`."""

    name = "egress_denied"


class ProcessUnknown(Refusal):
    """No process has this handle."""

    name = "process_unknown"


class TurnUnknown(Refusal):
    """No agent turn of this daemon run has this id (`agent.wait`; turns are kept in
    memory: after a restart, the journal's `agent.turn` entry is the record)."""

    name = "turn_unknown"


class StdinClosed(Refusal):
    """`proc.write` to a command whose stdin takes no more bytes; `data.reason`: `eof`
    (an earlier write sent EOF), `closed` (the command closed its stdin or the pipe
    broke), `ended` (the command ended), or `not_streamed` (it was not started with
    `stdin: "stream"`). Nothing of the call was taken."""

    name = "stdin_closed"


class ArtifactUnknown(Refusal):
    """No artifact has this id."""

    name = "artifact_unknown"


class GrantInvalid(Refusal):
    """The grant or token does not exist, or does not fit this use."""

    name = "grant_invalid"


class GrantExpired(Refusal):
    """The grant's time-to-live has passed (or it was revoked)."""

    name = "grant_expired"


class GrantConsumed(Refusal):
    """The grant has no uses left."""

    name = "grant_consumed"


class OriginDenied(Refusal):
    """The WebSocket upgrade came from an origin not in `allowed_origins`."""

    name = "origin_denied"


class ControllerBusy(Refusal):
    """A terminal session already has a controller."""

    name = "controller_busy"


class CheckpointUnknown(Refusal):
    """No checkpoint of this workspace has this id; `data.expired` is true when it had one
    whose pre-images the quota (or the count of live checkpoints) let go."""

    name = "checkpoint_unknown"


class ChangesetUnknown(Refusal):
    """No change set has this id (`changes.get/apply/discard`); `data.discarded` is true
    when it had one that was discarded (its layer is gone)."""

    name = "changeset_unknown"


class UploadUnknown(Refusal):
    """No open upload has this id for this caller: never begun, committed, aborted, expired
    (idle past `upload_idle_s`), begun by another caller, or lost with a daemon restart."""

    name = "upload_unknown"


class UploadConflict(Refusal):
    """A chunk does not continue its upload: its offset is past the bytes received
    (`data.received`), it runs past the declared `size`, or it re-sends a received range
    with other bytes."""

    name = "upload_conflict"


class UploadIncomplete(Refusal):
    """`fs.upload.commit` before every declared byte arrived (`data.received`, `data.size`)."""

    name = "upload_incomplete"


class UploadMismatch(Refusal):
    """The uploaded bytes' SHA-256 is not the one declared at `fs.upload.begin`
    (`data.sha256`, `data.received_sha256`); nothing is written."""

    name = "upload_mismatch"


class SecretUnknown(Refusal):
    """A profile names an operator secret that is not set (`substrate secret set NAME`), or
    `secret rm` names one that is not there; `data.secrets` lists the missing names (never
    a value). Raised when the profile's secrets are loaded for its sandbox."""

    name = "secret_unknown"


class LimitExceeded(Refusal):
    """A configured cap (connections, processes, quota) would be passed."""

    name = "limit_exceeded"


class Draining(Refusal):
    """The daemon is draining (`daemon.drain`, docs/deployment.md "Draining a node"): it
    starts no new command or terminal session; those running finish. Try another node."""

    name = "draining"


class Internal(Refusal):
    """Our fault: an unexpected error. The message carries no file bytes or secrets."""

    name = "internal"


def all_refusals() -> dict[str, type[Refusal]]:
    """Wire name → class, for docs and tests."""
    found: dict[str, type[Refusal]] = {}
    stack: list[type[Refusal]] = [Refusal]
    while stack:
        cls = stack.pop()
        found[cls.name] = cls
        stack.extend(cls.__subclasses__())
    return found


class StartupError(Exception):
    """The daemon cannot start safely; the message says why. Not a refusal: no client is
    there to answer, the command line prints it and exits 2."""
