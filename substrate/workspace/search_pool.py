"""`fs.search` shared with a second process: the parent side (docs/performance.md,
"fs.search with a second process").

One process reads and matches at most one interpreter's worth of files: RE2's binding
keeps the GIL between calls, so threads only contend. `SearchPool` keeps one worker
process (`search_worker`), started by a daemon's first search (which does not wait for
it: no search pays Python's start-up; a daemon that never searches never starts it),
and hands it part of a search's files: the parent walks alone, as the serial path does,
and past `search_split.HAND_OFF_FILES` files or `HAND_OFF_BYTES` bytes sends the next
batch of files it meets to the worker whenever the worker has read every batch sent
(`_idle`: nothing left in the socket's send queue, `TIOCOUTQ`), with the held fds of
their directories (SCM_RIGHTS); the worker reads and matches those while the parent
reads and matches its own, and the parent merges the halves into walk order
(`search_split.merge`).
A search is not shared while both CPUs are busy (`spare_cpu`, asked at its hand-off and
again every `search_split.HAND_OFF_FILES` files while it says no: the two processes
would only take turns). The result is the serial path's, always: when the
worker is busy (another search has it), not ready, dead, slow past its bound, or over its reply bound, the search is the
serial one (`search.serially`), with one log line for a failure. A failed worker is
killed, reaped, and started again at most `MAX_RESTARTS` times, each after a pause
twice the last. Only RE2 patterns are shared (the budgeted backtracking engine's
searches run on threads of their own, serially).
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import subprocess
import sys
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from substrate.matching.agent_regex import Matcher
from substrate.schema.fs import SearchParams, SearchResult
from substrate.workspace import search_worker
from substrate.workspace.registry import Workspace
from substrate.workspace.search import Plan, nothing, serially
from substrate.workspace.search_split import (
    MAX_REQUEST_BYTES,
    Abandoned,
    Batch,
    Reply,
    SplitScan,
    max_reply_bytes,
    merge,
)

log = logging.getLogger(__name__)

#: Restarts of a failed worker in one daemon's life; then every search is serial.
MAX_RESTARTS = 5
#: The pause before the first restart, doubled after each.
RESTART_PAUSE_S = 1.0
#: The worker's answer is waited for this long past the parent's own half, plus
#: `WAIT_FACTOR` times what that half took; then it is killed and the search is serial.
WAIT_S = 5.0
WAIT_FACTOR = 4.0
CLOSE_WAIT_S = 10.0
_ENCODER = msgspec.msgpack.Encoder()
_ZERO = bytes(4)
_REPLY = msgspec.msgpack.Decoder(Reply)
#: The directory holding the `substrate` package, for the worker's `sys.path`.
_PACKAGE_ROOT = str(Path(__file__).resolve().parent.parent.parent)


class _Failed(Exception):
    """The worker failed this search (the message says how): it is killed."""


def spare_cpu() -> bool:
    """Whether a CPU is free now: fewer runnable tasks (this one included) than CPUs,
    by the kernel's `procs_running` (/proc/stat). Costs ~20 us."""
    try:
        with open("/proc/stat", "rb") as f:
            data = f.read()
        at = data.index(b"procs_running ") + len(b"procs_running ")
        running = int(data[at : data.index(b"\n", at)])
    except (OSError, ValueError):
        return True
    return running < (os.cpu_count() or 1)


class SearchPool:
    """One search worker process of a daemon. `search` is thread-safe; `close` kills
    and reaps the worker. Blocking: call `search` from a worker thread."""

    def __init__(
        self,
        *,
        wait_s: float = WAIT_S,
        restart_pause_s: float = RESTART_PAUSE_S,
        spare: Callable[[], bool] = spare_cpu,
    ) -> None:
        self._busy = threading.Lock()
        self._spare = spare
        self._wait_s = wait_s
        self._pause_s = restart_pause_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._ready = False
        self._closed = False
        self._failures = 0
        self._next_start = 0.0
        #: Searches the worker shared, searches it failed, and searches kept serial
        #: because no CPU was free at the hand-off (for tests and benches).
        self.shared = 0
        self.failed = 0
        self.declined = 0

    @classmethod
    def for_machine(cls) -> SearchPool | None:
        """A pool when this machine has a second CPU for it, else None."""
        return cls() if (os.cpu_count() or 1) >= 2 else None

    @property
    def pid(self) -> int | None:
        """The worker's pid while one runs."""
        return None if self._proc is None else self._proc.pid

    def start(self) -> None:
        """Start the worker now (not waiting for its start-up); a no-op when one runs.
        Without it, the first search starts it (and is serial)."""
        with self._busy:
            if self._proc is None and not self._closed:
                self._spawn()

    def wait_ready(self, timeout_s: float) -> bool:
        """Start the worker if none runs, and wait up to `timeout_s` for its start-up
        (benches and tests; a search never waits). True: it takes the next search."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._busy:
                if self._usable():
                    return True
            if time.monotonic() >= deadline or self._closed:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        """Kill and reap the worker; later searches are serial. Waits up to
        `CLOSE_WAIT_S` for a search in flight (it sees the worker gone, reaps it, and
        finishes serially)."""
        self._closed = True
        proc = self._proc
        if proc is not None:
            proc.kill()
        # A search in flight sees the worker gone, reaps it and finishes serially.
        if self._busy.acquire(timeout=CLOSE_WAIT_S):
            try:
                self._stop()
            finally:
                self._busy.release()

    def search(
        self, ws: Workspace, p: SearchParams, found_by: Matcher | None = None
    ) -> SearchResult:
        """`search.search`, with half its files searched by the worker when it is free."""
        plan = Plan.of(p, found_by)
        if plan.matching.exact is None or not self._busy.acquire(blocking=False):
            return serially(ws, plan)
        try:
            if not self._usable():
                return serially(ws, plan)
            return self._shared(ws, plan)
        finally:
            self._busy.release()

    # --- with `_busy` held ---------------------------------------------------------------

    def _shared(self, ws: Workspace, plan: Plan) -> SearchResult:
        opened = plan.start(ws)
        if opened is None:
            return nothing()
        top, prune = opened
        scan = SplitScan(plan, ws.policy.read_deny, prune, self._send, self._spare, self._idle)
        started = time.monotonic()
        try:
            scan.run(top, plan.base)
            if scan.sent:
                scan.flush(last=True)
        except _Failed as exc:
            self._fail(str(exc))
            return serially(ws, plan)
        except Abandoned as exc:
            log.warning("search worker: a file not handed off (%s); this search is serial", exc)
            if scan.sent:
                self._discard(scan, started)
            return serially(ws, plan)
        except BaseException:
            if scan.sent:  # the worker waits for its last batch: end it, read its reply away
                self._discard(scan, started)
            raise
        if not scan.sent:
            self.declined += scan.declined
            return scan.result()
        try:
            reply = self._reply(plan.p, self._wait_s + WAIT_FACTOR * (time.monotonic() - started))
        except _Failed as exc:
            self._fail(str(exc))
            return serially(ws, plan)
        if reply.error is not None:
            log.warning("search worker: %s; this search is serial", reply.error)
            self.failed += 1
            return serially(ws, plan)
        merged = merge(scan, reply, plan.p.max_matches)
        if merged is None:
            self._fail("a reply not of the files it was sent")
            return serially(ws, plan)
        self.shared += 1
        return merged

    def _usable(self) -> bool:
        """Whether the worker can take a search now; starts one when due (that search
        is serial: the worker's start-up is never waited for)."""
        if self._closed:
            return False
        if self._proc is None:
            if self._failures <= MAX_RESTARTS and time.monotonic() >= self._next_start:
                self._spawn()
            return False
        if self._ready:
            return True
        assert self._sock is not None
        try:
            got = self._sock.recv(1, socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False  # still starting
        except OSError as exc:
            self._fail(f"unreadable at start ({exc.strerror})")
            return False
        if got != search_worker.READY:
            self._fail("it exited at start" if not got else "a bad start")
            return False
        self._ready = True
        return True

    def _spawn(self) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            argv = [
                sys.executable,
                "-m",
                "substrate.workspace.search_worker",
                str(theirs.fileno()),
            ]
            path = os.environ.get("PYTHONPATH")
            env = {"PYTHONPATH": _PACKAGE_ROOT + (os.pathsep + path if path else "")}
            if "PATH" in os.environ:
                env["PATH"] = os.environ["PATH"]
            self._proc = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                pass_fds=(theirs.fileno(),),
                env=env,
            )
        except OSError as exc:
            ours.close()
            log.warning("search worker: not started (%s); searches are serial", exc.strerror)
            self._proc = None
            return
        finally:
            theirs.close()
        self._sock = ours
        self._ready = False

    def _send(self, batch: Batch, fds: list[int]) -> None:
        """Hand `batch` to the worker with the fds of its directories; raises `_Failed`
        when the worker does not take it in time."""
        payload = _ENCODER.encode(batch)
        if len(payload) > MAX_REQUEST_BYTES:
            raise _Failed(f"a batch of {len(payload)} bytes, over its bound")
        data = search_worker.frame(payload)
        sock = self._sock
        assert sock is not None
        try:
            sock.settimeout(self._wait_s)
            sent = socket.send_fds(sock, [data], fds)
            if sent < len(data):
                sock.sendall(data[sent:])
        except OSError as exc:
            raise _Failed(f"a batch not taken ({exc})") from None

    def _idle(self) -> bool:
        """Whether the worker has read every byte sent to it (the kernel's count of what
        waits unread in the socket, `TIOCOUTQ`); True when that cannot be told (the
        batches then go out as fast as they fill). Costs one ioctl (~1 us)."""
        sock = self._sock
        assert sock is not None
        try:
            return fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, _ZERO) == _ZERO
        except OSError:
            return True

    def _reply(self, p: SearchParams, wait_s: float) -> Reply:
        sock = self._sock
        assert sock is not None
        deadline = time.monotonic() + wait_s
        header = self._read(sock, search_worker.HEADER.size, deadline)
        (size,) = search_worker.HEADER.unpack(header)
        if size > max_reply_bytes(p):
            raise _Failed(f"a reply of {size} bytes, over its bound")
        try:
            return _REPLY.decode(self._read(sock, size, deadline))
        except msgspec.DecodeError:
            raise _Failed("a reply that does not decode") from None

    @staticmethod
    def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
        buf = bytearray(n)
        view = memoryview(buf)
        got = 0
        while got < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _Failed("no answer in time")
            sock.settimeout(left)
            try:
                k = sock.recv_into(view[got:], n - got)
            except TimeoutError:
                raise _Failed("no answer in time") from None
            except OSError as exc:
                raise _Failed(f"unreadable ({exc.strerror})") from None
            if k == 0:
                raise _Failed("it exited")
            got += k
        return bytes(buf)

    def _discard(self, scan: SplitScan, started: float) -> None:
        """The parent's half raised: end the worker's half and read its answer away, or
        kill it."""
        try:
            scan.flush(last=True)
            self._reply(scan.p, self._wait_s + WAIT_FACTOR * (time.monotonic() - started))
        except _Failed as exc:
            self._fail(str(exc))

    def _fail(self, reason: str) -> None:
        """Kill and reap the worker; the next start waits its pause."""
        log.warning("search worker: %s; killed, this search is serial", reason)
        self.failed += 1
        self._failures += 1
        self._stop()
        self._next_start = time.monotonic() + self._pause_s * 2 ** (self._failures - 1)

    def _stop(self) -> None:
        proc, sock = self._proc, self._sock
        self._proc = self._sock = None
        self._ready = False
        if proc is not None:
            proc.kill()
            proc.wait()
        if sock is not None:
            sock.close()
