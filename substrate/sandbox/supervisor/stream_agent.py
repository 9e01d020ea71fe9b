"""substrate's stream supervisor inside a gVisor (runsc) sandbox, and the wire it shares.

Standard library only. It is started by one engine exec per sandbox as
`/usr/bin/python3 -I -S -B -c <this file's text>` (the daemon passes the program in
argv: nothing is bound into the container, and nothing in the sandbox can change what
runs), as the sandbox's uid:gid, with stdin attached and no terminal. It speaks over that
exec's own stdio — the engine's attach stream — because under runsc nothing else reaches
the host (docs/fast-exec.md "Under gVisor"). The daemon imports the same file for the
wire (`encode`, `Decoder`: sans-IO, tested in tests/sandbox/supervisor/test_stream_wire.py).

Theory of operation (the program):
1. Start: remember the environment the engine gave (`/proc/self/environ`), make the
   process non-dumpable (`PR_SET_DUMPABLE` 0: its memory is not readable by a process of
   its uid), catch every catchable signal that would end it with a handler that does
   nothing (a caught signal is reset to the default by exec, so commands get the
   defaults), point stderr at /dev/null, read the daemon's first frame, `key` (the
   start's secret, 32 random bytes), and from then on tag every frame it sends and
   check every frame it reads (`keys`, `Encoder`, `Decoder`); its first is `ready {v,
   pid}`. Why the tags: under runsc (measured, 20221219) a process of the same uid can
   open the supervisor's `/proc/<pid>/fd/1` for writing and `/proc/<pid>/fd/0` for
   reading despite non-dumpable; an injected or replayed frame breaks the wire instead
   of reaching the daemon as a command's result (docs/fast-exec.md "Under gVisor").
2. Serve, single-threaded, from one `select` loop over stdin, a SIGCHLD wake-up pipe and
   every command's stdout, stderr and stdin pipes:
   - `run {id, argv, env, cwd, stdin}`: start argv (`subprocess.Popen`: its own session
     and process group, every other descriptor closed, fresh pipes as stdio, never the
     supervisor's; the PATH of the environment given, like the engine's exec), answer
     `started {id}`, or `exited {id, code: 127, errno}` when exec itself failed.
   - `in {id}` + bytes: written to the command's stdin, then `drained {id}` (the daemon
     sends the next piece only after it: at most `MAX_STDIN` bytes wait here per
     command); `close {id}`: its stdin is closed once written (EOF).
   - `signal {id, sig}`: the signal to the command's process group.
   - Output: `out {id, fd}` + at most `CHUNK` bytes, in order, per stream.
   - The command exited: what it wrote before it exited is sent (what is readable now),
     its pipes are closed (a background child still holding them does not keep the
     command "running", as the engine's exec under runsc), and `exited {id, code}` (128
     + n for a death by signal n).
   - stdin closes (the daemon dropped the stream or went away) or breaks the wire: every
     command's process group is killed, and the supervisor exits.

Wire: frames of an 8-byte header (big-endian 4-byte length of a JSON object, 4-byte
length of a binary payload), a 16-byte tag (HMAC-SHA256 of the frame's sequence number
in its direction, the object and the payload, truncated; zero on the untagged `key`),
the JSON object, then the payload. On stdout the engine wraps these in its own
multiplexed frames; the daemon demultiplexes first.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import hmac
import json
import os
import select
import signal
import struct
import subprocess
import sys
from typing import Any

#: Wire version, in `ready`.
VERSION = 1
HEADER = struct.Struct(">II")
#: Bytes of a frame's tag (a truncated HMAC-SHA256), after the header.
TAG_BYTES = 16
FRAME_HEAD = HEADER.size + TAG_BYTES
#: The start's secret, hex, in the daemon's first frame (`key`).
SECRET_BYTES = 32
#: Largest JSON object the supervisor accepts (`run`: argv up to 1 MiB, env).
MAX_REQUEST = 4 << 20
#: Largest JSON object the daemon accepts from the supervisor (its reports are tiny).
MAX_REPORT = 64 << 10
#: Largest payload of one frame either way (stdin piece; output chunk).
MAX_STDIN = 256 << 10
CHUNK = 64 << 10
MAX_PAYLOAD = MAX_STDIN
#: Concurrent commands one supervisor runs at most (a `run` beyond: `exited` with EAGAIN).
MAX_COMMANDS = 64
#: Reads of each output pipe once its command exited (what it wrote is in the pipe: at
#: most its capacity; more is a background child's, which is not waited for).
AFTER_EXIT_READS = 64
#: A failed exec's code (the daemon turns it into the shell's: 127 or 126).
EXEC_FAILED = 127
#: Signals the supervisor survives (SIGKILL and SIGSTOP cannot be caught).
CAUGHT = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGVTALRM,
    signal.SIGPROF,
)
_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3


class ProtocolError(Exception):
    """A frame that breaks the wire (too large, not a JSON object)."""


# -- the wire (sans-IO) -------------------------------------------------------------------


def keys(secret: bytes) -> tuple[bytes, bytes]:
    """(daemon to supervisor, supervisor to daemon) frame keys of a start's secret."""
    down = hmac.new(secret, b"substrate-stream down v1", hashlib.sha256).digest()
    up = hmac.new(secret, b"substrate-stream up v1", hashlib.sha256).digest()
    return down, up


def _tag(key: bytes, seq: int, body: bytes, payload: bytes) -> bytes:
    mac = hmac.new(key, seq.to_bytes(8, "big"), hashlib.sha256)
    mac.update(len(body).to_bytes(4, "big"))
    mac.update(body)
    mac.update(payload)
    return mac.digest()[:TAG_BYTES]


class Encoder:
    """Frames one side sends: each tagged with its key and its sequence number (none
    before a key is set: only the daemon's first frame, `key`)."""

    def __init__(self, key: bytes | None = None) -> None:
        self.key = key
        self._seq = 0

    def encode(self, message: dict[str, Any], payload: bytes = b"") -> bytes:
        body = json.dumps(message, separators=(",", ":")).encode("utf-8", "surrogatepass")
        if self.key is None:
            tag = bytes(TAG_BYTES)
        else:
            tag = _tag(self.key, self._seq, body, payload)
            self._seq += 1
        return HEADER.pack(len(body), len(payload)) + tag + body + payload


def encode(message: dict[str, Any], payload: bytes = b"") -> bytes:
    """One untagged frame (the daemon's `key`; tests)."""
    return Encoder().encode(message, payload)


class Decoder:
    """Frames from a byte stream. Sans-IO: `feed(data)` returns every completed frame as
    (message, payload); before `key` is set, at most one. Once `key` is set, every frame's tag must be that key's for the
    next sequence number (a frame injected, replayed, dropped or reordered breaks the
    wire). Raises ProtocolError (the stream is then unusable) for a JSON object above
    `max_message`, a payload above `max_payload`, a wrong tag, or a body that is not a
    JSON object."""

    def __init__(self, max_message: int, max_payload: int = MAX_PAYLOAD) -> None:
        self._max = max_message
        self._max_payload = max_payload
        self._buf = bytearray()
        self.key: bytes | None = None
        self._seq = 0

    def feed(self, data: bytes) -> list[tuple[dict[str, Any], bytes]]:
        self._buf += data
        out: list[tuple[dict[str, Any], bytes]] = []
        while len(self._buf) >= FRAME_HEAD:
            length, size = HEADER.unpack_from(self._buf)
            if length > self._max or size > self._max_payload:
                raise ProtocolError("frame too large")
            end = FRAME_HEAD + length + size
            if len(self._buf) < end:
                break
            tag = bytes(self._buf[HEADER.size : FRAME_HEAD])
            body = bytes(self._buf[FRAME_HEAD : FRAME_HEAD + length])
            payload = bytes(self._buf[FRAME_HEAD + length : end])
            del self._buf[:end]
            if self.key is not None:
                if not hmac.compare_digest(tag, _tag(self.key, self._seq, body, payload)):
                    raise ProtocolError("tag")
                self._seq += 1
            try:
                message = json.loads(body)
            except ValueError:
                raise ProtocolError("not JSON") from None
            if not isinstance(message, dict):
                raise ProtocolError("not an object")
            out.append((message, payload))
            if self.key is None:
                break  # the next frames are read once the key is known (`feed(b"")`)
        return out

    @property
    def buffered(self) -> int:
        return len(self._buf)


def exit_code_of(returncode: int) -> int:
    """`Popen.returncode` as the engine reports an exit: 128 + n for a death by signal n."""
    return 128 - returncode if returncode < 0 else returncode


# -- the program --------------------------------------------------------------------------


class _Command:
    def __init__(self, ident: str, proc: subprocess.Popen[bytes]) -> None:
        self.id = ident
        self.proc = proc
        self.pgid = proc.pid
        self.outs: dict[int, int] = {}  # pipe fd -> stream (1 stdout, 2 stderr)
        assert proc.stdout is not None and proc.stderr is not None
        for stream, f in ((1, proc.stdout), (2, proc.stderr)):
            fd = f.fileno()
            os.set_blocking(fd, False)
            self.outs[fd] = stream
        self.stdin_fd = proc.stdin.fileno() if proc.stdin is not None else -1
        if self.stdin_fd >= 0:
            os.set_blocking(self.stdin_fd, False)
        self.pending = b""  # stdin not written yet
        self.close_after = False


class _Supervisor:
    def __init__(self, environ: dict[str, str], wake_r: int, null: int) -> None:
        self._environ = environ
        self._wake_r = wake_r
        self._null = null  # /dev/null: the stdin of a command given none
        self._decoder = Decoder(MAX_REQUEST)
        self._encoder = Encoder()
        self._commands: dict[str, _Command] = {}
        self._by_fd: dict[int, _Command] = {}

    def send(self, message: dict[str, Any], payload: bytes = b"") -> None:
        view = memoryview(self._encoder.encode(message, payload))
        while view:
            try:
                view = view[os.write(1, view) :]
            except BlockingIOError:
                select.select([], [1], [])

    def handshake(self) -> bool:
        """Read the daemon's `key` (the start's secret: the first frame on stdin), then
        tag every frame from now on; False when it did not come."""
        while True:
            try:
                data = os.read(0, 4096)
            except OSError:
                return False
            if not data:
                return False
            try:
                frames = self._decoder.feed(data)
            except ProtocolError:
                return False
            if frames:
                break
            if self._decoder.buffered > 4096:
                return False
        message, _ = frames[0]
        try:
            secret = bytes.fromhex(str(message.get("key")))
        except ValueError:
            return False
        if message.get("op") != "key" or len(secret) != SECRET_BYTES:
            return False
        self._decoder.key, self._encoder.key = keys(secret)
        return True

    def run(self) -> None:
        if self._decoder.buffered and not self._feed(b""):
            self._shutdown()
            return
        try:
            while True:
                readers = [0, self._wake_r, *self._by_fd]
                writers = [c.stdin_fd for c in self._commands.values() if c.pending]
                readable, writable, _ = select.select(readers, writers, [])
                for fd in writable:
                    command = self._by_fd.get(fd)
                    if command is not None:
                        self._write_stdin(command)
                for fd in readable:
                    if fd == 0:
                        if not self._on_request():
                            return
                    elif fd == self._wake_r:
                        _drain(self._wake_r)
                        self._reap()
                    else:
                        command = self._by_fd.get(fd)
                        if command is not None and fd in command.outs:
                            self._read_output(command, fd)
        finally:
            self._shutdown()

    def _on_request(self) -> bool:
        try:
            data = os.read(0, MAX_PAYLOAD + HEADER.size)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            return False  # the daemon let go of this stream
        return self._feed(data)

    def _feed(self, data: bytes) -> bool:
        try:
            frames = self._decoder.feed(data)
        except ProtocolError:
            return False
        return all(self._handle(message, payload) for message, payload in frames)

    def _handle(self, message: dict[str, Any], payload: bytes) -> bool:
        op, ident = message.get("op"), message.get("id")
        if not isinstance(ident, str):
            return False
        if op == "run":
            self._start(ident, message)
            return True
        command = self._commands.get(ident)
        if command is None:
            return True  # it ended already: nothing to do
        if op == "in":
            if len(command.pending) + len(payload) > MAX_STDIN:
                return False
            if command.stdin_fd < 0:
                self.send({"op": "drained", "id": ident})
                return True
            command.pending += payload
            self._write_stdin(command)
        elif op == "close":
            command.close_after = True
            self._write_stdin(command)
        elif op == "signal":
            sig = message.get("sig")
            if isinstance(sig, int) and 0 < sig < 65:
                with contextlib.suppress(OSError):
                    os.killpg(command.pgid, sig)
        else:
            return False
        return True

    def _start(self, ident: str, request: dict[str, Any]) -> None:
        try:
            argv, env, cwd, stdin = _checked(request)
        except ValueError:
            self.send({"op": "exited", "id": ident, "code": EXEC_FAILED, "errno": errno.EINVAL})
            return
        if ident in self._commands or len(self._commands) >= MAX_COMMANDS:
            self.send({"op": "exited", "id": ident, "code": EXEC_FAILED, "errno": errno.EAGAIN})
            return
        try:
            # `close_fds=False` (0.8 ms less per command in the Sentry): every descriptor
            # of this process but 0-2 is close-on-exec (`main` closed what the engine's
            # exec passed beyond them; Python makes its own non-inheritable), and the
            # command's 0-2 are its own pipes.
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE if stdin else self._null,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env={**self._environ, **env},
                cwd=cwd,
                close_fds=False,
                start_new_session=True,
                restore_signals=True,
            )
        except OSError as exc:
            code = exc.errno or errno.EINVAL
            self.send({"op": "exited", "id": ident, "code": EXEC_FAILED, "errno": code})
            return
        command = _Command(ident, proc)
        self._commands[ident] = command
        for fd in command.outs:
            self._by_fd[fd] = command
        if command.stdin_fd >= 0:
            self._by_fd[command.stdin_fd] = command
        self.send({"op": "started", "id": ident})
        self._reap()  # it may have exited already (its SIGCHLD came before it was known)

    def _write_stdin(self, command: _Command) -> None:
        fd = command.stdin_fd
        if fd < 0:
            return
        had = bool(command.pending)
        try:
            while command.pending:
                written = os.write(fd, command.pending)
                command.pending = command.pending[written:]
        except BlockingIOError:
            return  # the rest when it is writable
        except OSError:
            command.pending = b""  # it closed its stdin: the rest is dropped, as on a pipe
            command.close_after = True
        if had:
            self.send({"op": "drained", "id": command.id})
        if command.close_after:
            self._close_stdin(command)

    def _close_stdin(self, command: _Command) -> None:
        fd, command.stdin_fd = command.stdin_fd, -1
        if fd >= 0:
            self._by_fd.pop(fd, None)
            command.proc.stdin.close()  # type: ignore[union-attr]

    def _read_output(self, command: _Command, fd: int) -> int:
        """One read of a ready output pipe: the bytes sent, 0 when none were ready, -1
        once it ended (then it is closed)."""
        try:
            data = os.read(fd, CHUNK)
        except BlockingIOError:
            return 0
        except OSError:
            data = b""
        if not data:
            self._close_output(command, fd)
            return -1
        self.send({"op": "out", "id": command.id, "fd": command.outs[fd]}, data)
        return len(data)

    def _close_output(self, command: _Command, fd: int) -> None:
        stream = command.outs.pop(fd, None)
        self._by_fd.pop(fd, None)
        if stream is not None:
            f = command.proc.stdout if stream == 1 else command.proc.stderr
            assert f is not None
            f.close()

    def _reap(self) -> None:
        for command in list(self._commands.values()):
            code = command.proc.poll()
            if code is None:
                continue
            for fd in list(command.outs):  # what it wrote before it exited (a pipe's worth)
                for _ in range(AFTER_EXIT_READS):
                    if self._read_output(command, fd) <= 0:
                        break
                if fd in command.outs:  # a background child holds it: not waited for
                    self._close_output(command, fd)
            command.pending, command.close_after = b"", True
            self._close_stdin(command)
            del self._commands[command.id]
            self.send({"op": "exited", "id": command.id, "code": exit_code_of(code)})

    def _shutdown(self) -> None:
        for command in self._commands.values():
            with contextlib.suppress(OSError):
                os.killpg(command.pgid, signal.SIGKILL)


def _checked(request: dict[str, Any]) -> tuple[list[str], dict[str, str], str, bool]:
    argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("env")
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        raise ValueError("cwd")
    return argv, env, cwd, bool(request.get("stdin"))


def _drain(fd: int) -> None:
    try:
        while os.read(fd, 4096):
            pass
    except OSError:
        pass


def _initial_environ() -> dict[str, str]:
    """The environment the engine gave this process, before the interpreter's additions.
    (`agent._initial_environ`'s twin: this program runs from argv alone, importing
    nothing of substrate's.)"""
    with open("/proc/self/environ", "rb") as f:
        raw = f.read()
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[os.fsdecode(key)] = os.fsdecode(value)
    return env


def _ignore(signum: int, frame: object) -> None:
    return None


def main() -> int:
    """The supervisor's start-up (see the module doc); returns an exit code on failure."""
    for name in os.listdir("/proc/self/fd"):  # nothing but stdio is kept from the exec
        if int(name) > 2:
            with contextlib.suppress(OSError):
                os.close(int(name))
    environ = _initial_environ()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0):
        return 4
    for sig in CAUGHT:
        signal.signal(sig, _ignore)  # caught, not ignored: exec gives commands the default
    wake_r, wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
    signal.set_wakeup_fd(wake_w, warn_on_full_buffer=False)
    signal.signal(signal.SIGCHLD, _ignore)
    null = os.open("/dev/null", os.O_RDWR | os.O_CLOEXEC)
    os.dup2(null, 2)  # stderr is no channel: nothing but frames leaves this process
    supervisor = _Supervisor(environ, wake_r, null)
    if not supervisor.handshake():
        return 5
    supervisor.send({"op": "ready", "v": VERSION, "pid": os.getpid()})
    supervisor.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
