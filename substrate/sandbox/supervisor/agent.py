"""substrate's supervisor inside a sandbox container, and the wire it shares with the daemon.

Standard library only: this one file is copied into the sandbox's supervisor directory
and bound read-only into the container (docs/fast-exec.md), where it runs as
`/usr/bin/python3 -I -S -B /run/substrate/supervisor.py`, started by one engine exec as
the sandbox's own uid:gid. The daemon imports the same file for the wire (`encode`,
`Decoder`, `hello_mac`, `exit_code_of`: sans-IO, tested in
tests/sandbox/supervisor/test_fast_exec_wire.py).

Theory of operation (the program):
1. Start: remember the environment the engine gave (`/proc/self/environ`, before the
   interpreter adds anything), make the process non-dumpable (`PR_SET_DUMPABLE` 0: a
   process of the same uid can then neither ptrace it, nor read its memory, nor take its
   file descriptors), ignore every catchable signal that would end it, write `ready` on
   stdout, read the per-start secret from stdin (the daemon writes it only once it saw
   the process non-dumpable), point stdio at /dev/null, connect to the daemon's socket
   in the read-only supervisor directory and send `hello` with `hello_mac(secret)`.
2. Serve, single-threaded, from one poll loop over the control connection, each
   child's pidfd and exec-error pipe:
   - `fork` (on the control connection, with one fd: the child's own channel to the
     daemon): fork a *held child*. It starts a new session (its own process group),
     restores default signal handling, closes everything but its channel and its
     exec-error pipe, says `forked` on the channel itself (its pid and a pidfd on
     itself) and waits there. The daemon asks for the next held child as soon as a
     command took the last one, so the fork is off the next command's way
     (docs/fast-exec.md "Held children"), observes it from the host, and answers `go`
     with argv, env and cwd and three descriptors (stdin, stdout, stderr): the child
     takes them as 0/1/2, changes directory and execs argv. `abort` or the channel
     closing makes it exit 125 without exec (nothing ran). The supervisor never reads
     a child's channel: until exec the child owns it.
   - The child exits: the supervisor reaps it and answers `exited` on the channel with
     the code (128 + n for a death by signal n) and, when exec itself failed, its errno
     (from a close-on-exec pipe the child writes it to).
   - The control connection closes (the daemon went away or dropped this supervisor):
     every child's process group is killed, and the supervisor exits.

Wire: frames of a 4-byte big-endian body length, a 1-byte count of file descriptors
that travel with the frame (SCM_RIGHTS, sent with its first byte), then a JSON object.
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
import socket
import struct
import sys
from collections import deque
from collections.abc import Iterable
from typing import Any

#: Where the supervisor directory is bound inside the container.
MOUNT_POINT = "/run/substrate"
#: The daemon's listening socket and this program, inside `MOUNT_POINT`.
SOCKET_NAME = "daemon.sock"
PROGRAM_NAME = "supervisor.py"
#: The interpreter and flags: isolated (no PYTHON* variables, no user site, no script
#: directory on the path), no site module, no bytecode written.
COMMAND = ("/usr/bin/python3", "-I", "-S", "-B", f"{MOUNT_POINT}/{PROGRAM_NAME}")
#: Wire version, in `hello` (2: held children are forked ahead, `go` carries argv).
VERSION = 2
HEADER = struct.Struct(">IB")
#: Largest frame a supervisor or a held child accepts (`go`: argv up to 1 MiB, env).
MAX_REQUEST = 4 << 20
#: Largest frame the daemon accepts from a supervisor (its reports are tiny).
MAX_REPORT = 64 << 10
#: File descriptors one frame may carry.
MAX_FDS = 4
#: The exit code of a held child the daemon aborted (it never exec'd).
ABORTED = 125
#: A child whose exec failed exits with this after writing the errno.
EXEC_FAILED = 127
#: Signals the supervisor ignores (SIGKILL and SIGSTOP cannot be); its children get
#: the default disposition back before exec.
IGNORED = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGPIPE,
    signal.SIGALRM,
    signal.SIGTSTP,
    signal.SIGTTIN,
    signal.SIGTTOU,
    signal.SIGXFSZ,
    signal.SIGVTALRM,
    signal.SIGPROF,
)
_PR_SET_DUMPABLE = 4
_PR_GET_DUMPABLE = 3
_HELLO = b"substrate-supervisor hello v1"


class ProtocolError(Exception):
    """A frame that breaks the wire (too large, not JSON, missing descriptors)."""


# -- the wire (sans-IO) -------------------------------------------------------------------


def encode(message: dict[str, Any], nfds: int = 0) -> bytes:
    """One frame: `message` as compact JSON, announcing `nfds` descriptors sent with it."""
    if not 0 <= nfds <= MAX_FDS:
        raise ProtocolError(f"a frame carries at most {MAX_FDS} descriptors")
    body = json.dumps(message, separators=(",", ":")).encode("utf-8", "surrogatepass")
    return HEADER.pack(len(body), nfds) + body


class Decoder:
    """Frames from a byte stream and the descriptors received with it. Sans-IO.

    `feed(data, fds)` takes what one `recvmsg` returned and gives back every completed
    frame as (message, its descriptors). Descriptors arrive with the first byte of their
    frame, so they queue in order and each completed frame takes as many as its header
    announced. Raises ProtocolError (the stream is then unusable: close it, and
    `close_pending()`): a frame above `max_frame`, a body that is not a JSON object, or
    a frame whose descriptors never came.
    """

    def __init__(self, max_frame: int) -> None:
        self._max = max_frame
        self._buf = bytearray()
        self._fds: deque[int] = deque()

    def feed(self, data: bytes, fds: Iterable[int] = ()) -> list[tuple[dict[str, Any], list[int]]]:
        self._fds.extend(fds)
        self._buf += data
        out: list[tuple[dict[str, Any], list[int]]] = []
        while len(self._buf) >= HEADER.size:
            length, nfds = HEADER.unpack_from(self._buf)
            if length > self._max:
                raise ProtocolError(f"frame of {length} bytes (at most {self._max})")
            if nfds > MAX_FDS:
                raise ProtocolError(f"frame announces {nfds} descriptors")
            if len(self._buf) < HEADER.size + length:
                break
            body = bytes(self._buf[HEADER.size : HEADER.size + length])
            del self._buf[: HEADER.size + length]
            if len(self._fds) < nfds:
                raise ProtocolError("a frame's descriptors did not arrive with it")
            taken = [self._fds.popleft() for _ in range(nfds)]
            try:
                message = json.loads(body.decode("utf-8", "surrogatepass"))
            except ValueError:
                _close_all(taken)
                raise ProtocolError("a frame is not JSON") from None
            if not isinstance(message, dict):
                _close_all(taken)
                raise ProtocolError("a frame is not a JSON object")
            out.append((message, taken))
        return out

    @property
    def buffered(self) -> int:
        """Bytes of an incomplete frame held."""
        return len(self._buf)

    def close_pending(self) -> None:
        """Close descriptors received for frames that never completed."""
        _close_all(self._fds)
        self._fds.clear()


def hello_mac(secret: bytes) -> str:
    """What a supervisor that holds this start's `secret` says in its `hello`."""
    return hmac.new(secret, _HELLO, hashlib.sha256).hexdigest()


def exit_code_of(status: int) -> int:
    """A wait status as the engine reports an exit: the code, or 128 + n for signal n."""
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    if os.WIFEXITED(status):
        return os.WEXITSTATUS(status)
    return 128 + signal.SIGKILL  # stopped/continued are never asked for (no WUNTRACED)


def _close_all(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def recv_frames(
    sock: socket.socket, decoder: Decoder, bufsize: int = 1 << 18
) -> tuple[list[tuple[dict[str, Any], list[int]]], bool]:
    """One `recvmsg` into `decoder` (descriptors close-on-exec); (frames, end of stream).
    Raises ProtocolError when descriptors were cut off (MSG_CTRUNC)."""
    space = socket.CMSG_SPACE(MAX_FDS * 4)
    data, ancdata, flags, _ = sock.recvmsg(bufsize, space, socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(payload) - len(payload) % 4
            fds.extend(struct.unpack(f"{usable // 4}i", payload[:usable]))
    if flags & socket.MSG_CTRUNC:
        _close_all(fds)
        raise ProtocolError("descriptors were cut off")
    return decoder.feed(data, fds), not data


# -- the program (inside the container) ---------------------------------------------------


class _Child:
    """One command: held (forked, talking to the daemon itself), then running, then reaped.
    The supervisor never reads the child's channel: until exec the child owns it."""

    def __init__(self, pid: int, pidfd: int, chan: socket.socket, err_r: int) -> None:
        self.pid = pid
        self.pidfd = pidfd
        self.chan: socket.socket | None = chan
        self.err_r: int | None = err_r
        self.errno: int | None = None


class _Supervisor:
    """The poll loop (see the module doc). One instance per process."""

    def __init__(self, control: socket.socket, environ: dict[str, str]) -> None:
        self.control = control
        self.decoder = Decoder(MAX_REQUEST)
        self.environ = environ
        self.poll = select.poll()
        self.poll.register(control.fileno(), select.POLLIN)
        # fd → (what, child): "pidfd" or "err".
        self.watch: dict[int, tuple[str, _Child]] = {}
        self.children: dict[int, _Child] = {}

    def run(self) -> None:
        while True:
            for fd, _ in self.poll.poll():
                if fd == self.control.fileno():
                    if not self._on_control():
                        self._shutdown()
                        return
                    continue
                found = self.watch.get(fd)
                if found is None:
                    continue
                what, child = found
                if what == "err":
                    self._on_err(child)
                else:
                    self._on_exit(child)

    # -- control ----------------------------------------------------------------------

    def _on_control(self) -> bool:
        try:
            frames, eof = recv_frames(self.control, self.decoder)
        except (OSError, ProtocolError):
            return False
        for message, fds in frames:
            if message.get("op") == "fork" and len(fds) == 1:
                self._fork(socket.socket(fileno=fds[0]))
            else:
                _close_all(fds)
        return not eof

    def _fork(self, chan: socket.socket) -> None:
        err_r, err_w = os.pipe()
        try:
            pid = os.fork()
        except OSError as exc:
            _close_all([err_r, err_w])
            with contextlib.suppress(OSError):
                chan.settimeout(5)
                chan.sendall(encode({"op": "failed", "errno": exc.errno or errno.EAGAIN}))
            chan.close()
            return
        if pid == 0:
            _child(self.environ, chan, err_w)
        # The child reports itself and takes `go` from its channel: nothing more of the
        # supervisor is on the command's way to exec.
        os.close(err_w)
        pidfd = os.pidfd_open(pid)
        child = _Child(pid, pidfd, chan, err_r)
        self.children[pid] = child
        for fd, what in ((pidfd, "pidfd"), (err_r, "err")):
            self.watch[fd] = (what, child)
            self.poll.register(fd, select.POLLIN)

    # -- one command ------------------------------------------------------------------

    def _on_err(self, child: _Child) -> None:
        assert child.err_r is not None
        data = _read_some(child.err_r)
        if data:
            child.errno = _errno_of(data)
        self._forget(child.err_r)
        os.close(child.err_r)
        child.err_r = None

    def _on_exit(self, child: _Child) -> None:
        try:
            pid, status = os.waitpid(child.pid, os.WNOHANG)
        except ChildProcessError:
            pid, status = child.pid, 0
        if pid == 0:
            return
        if child.err_r is not None:  # written before the child exited: readable now
            self._on_err(child)
        chan = child.chan
        if chan is not None:
            report = encode({"op": "exited", "code": exit_code_of(status), "errno": child.errno})
            with contextlib.suppress(OSError):  # the daemon may have let go of it
                chan.settimeout(5)
                chan.sendall(report)
            chan.close()
            child.chan = None
        self._forget(child.pidfd)
        os.close(child.pidfd)
        self.children.pop(child.pid, None)

    # -- plumbing ---------------------------------------------------------------------

    def _forget(self, fd: int) -> None:
        if self.watch.pop(fd, None) is not None:
            self.poll.unregister(fd)

    def _shutdown(self) -> None:
        """The daemon is gone: nothing it started may run on (a held child also sees its
        channel close and exits without exec)."""
        for child in list(self.children.values()):
            with contextlib.suppress(OSError):
                os.killpg(child.pid, signal.SIGKILL)


def _checked(request: dict[str, Any]) -> tuple[list[str], dict[str, str], str]:
    argv, env, cwd = request.get("argv"), request.get("env"), request.get("cwd")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("argv")
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("env")
    if not isinstance(cwd, str) or not cwd.startswith("/"):
        raise ValueError("cwd")
    return argv, env, cwd


def _child(environ: dict[str, str], chan: socket.socket, err_w: int) -> None:
    """In the forked child: report itself on `chan` (its pid, a pidfd on itself), wait
    for `go` (argv, env, cwd, and stdin, stdout, stderr as descriptors), then exec.
    Never returns (exec, or `_exit`)."""
    code = errno.EINVAL
    try:
        os.setsid()
        keep = sorted({chan.fileno(), err_w})
        low = 3
        for fd in keep:  # everything of the supervisor's goes: other commands' pipes too
            os.closerange(low, fd)
            low = fd + 1
        os.closerange(low, 1 << 20)
        for sig in IGNORED:
            signal.signal(sig, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_SETMASK, [])
        chan.settimeout(None)
        me = os.pidfd_open(os.getpid())
        frame = encode({"op": "forked", "pid": os.getpid()}, 1)
        sent = chan.sendmsg([frame], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, struct.pack("i", me))])
        if sent < len(frame):
            chan.sendall(frame[sent:])
        os.close(me)
        decoder = Decoder(MAX_REQUEST)
        while True:
            frames, eof = recv_frames(chan, decoder)
            if frames or eof:
                break
        if not frames:
            os._exit(ABORTED)  # the daemon let go of it: nothing runs
        request, stdio = frames[0]
        if request.get("op") != "go" or len(stdio) != 3:
            os._exit(ABORTED)
        argv, env, cwd = _checked(request)
        for target, fd in enumerate(stdio):
            os.dup2(fd, target)  # the copies at 0/1/2 are not close-on-exec
        _close_all(stdio)
        chan.close()  # the supervisor reports the end on its own copy
        os.chdir(cwd)
        os.execvpe(argv[0], argv, {**environ, **env})
    except OSError as exc:
        code = exc.errno or errno.EINVAL
    except BaseException:
        code = errno.EINVAL
    try:
        os.write(err_w, str(code).encode())
    finally:
        os._exit(EXEC_FAILED)


def _read_some(fd: int) -> bytes:
    try:
        return os.read(fd, 64)
    except OSError:
        return b""


def _errno_of(data: bytes) -> int:
    try:
        return int(data.decode("ascii"))
    except ValueError:
        return errno.EINVAL


def _initial_environ() -> dict[str, str]:
    """The environment the engine gave this process, before the interpreter's additions."""
    with open("/proc/self/environ", "rb") as f:
        raw = f.read()
    env: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            env[os.fsdecode(key)] = os.fsdecode(value)
    return env


def main() -> int:
    """The supervisor's start-up (see the module doc); returns an exit code on failure."""
    if not hasattr(os, "pidfd_open"):
        return 3
    environ = _initial_environ()
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_DUMPABLE, 0, 0, 0, 0) != 0 or libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0):
        return 4
    for sig in IGNORED:
        signal.signal(sig, signal.SIG_IGN)
    os.write(1, b"ready\n")
    line = b""
    while not line.endswith(b"\n") and len(line) < 256:
        chunk = os.read(0, 256 - len(line))
        if not chunk:
            return 5
        line += chunk
    secret = bytes.fromhex(line.decode("ascii").strip())
    null = os.open("/dev/null", os.O_RDWR)
    for target in (0, 1, 2):
        os.dup2(null, target)
    os.close(null)
    control = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    control.connect(f"{MOUNT_POINT}/{SOCKET_NAME}")
    control.sendall(encode({"op": "hello", "v": VERSION, "mac": hello_mac(secret)}))
    del secret, line
    serve(control, environ)
    return 0


def serve(control: socket.socket, environ: dict[str, str]) -> None:
    """Serve the daemon on `control` until it closes (then every child's process group is
    killed). `environ`: the base environment of every command."""
    control.setblocking(False)
    _Supervisor(control, environ).run()


if __name__ == "__main__":
    sys.exit(main())
