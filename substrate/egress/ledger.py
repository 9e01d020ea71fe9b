"""Who was refused what: the egress denials of one sandbox, per command (pure, bounded).

The proxy reports each refused connection of a sandbox with the process id of the
command that made it (or None when no command's process could be found holding the
socket: it exited, or it scrubbed its environment and left its command's process tree).
`SandboxLedger.record` files it under that command (whether or not its run is open yet:
`close_run` collects both), or under every run open in the sandbox when the command is
unknown (never lost: counted more than once, rather than not at all), and says whether
to journal it.

Bounds: each command keeps its count, at most `MAX_HOSTS` distinct `host:port` for the
result and at most `MAX_JOURNALLED` distinct targets it has journalled (a repeat of a
journalled target is counted, not journalled again); at most `MAX_STRAY` commands with
no open run are kept, and what is past that is journalled within one more such bound.
So a command that hammers a blocked name costs one journal entry per distinct target,
and memory stays fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from substrate.schema.proc import EgressBlocked

#: Distinct `host:port` listed in one result (the count has the total).
MAX_HOSTS = 32
#: Distinct targets journalled per run (and per sandbox, for denials of no open run).
MAX_JOURNALLED = 256
#: Commands with denials but no open run kept per sandbox.
MAX_STRAY = 64


@dataclass
class _Run:
    count: int = 0
    hosts: list[str] = field(default_factory=list)
    journalled: set[str] = field(default_factory=set)

    def add(self, target: str) -> bool:
        """Count one denial of `target`; True when it is new to this run's journal."""
        self.count += 1
        if target not in self.hosts and len(self.hosts) < MAX_HOSTS:
            self.hosts.append(target)
        if target in self.journalled or len(self.journalled) >= MAX_JOURNALLED:
            return False
        self.journalled.add(target)
        return True


@dataclass
class SandboxLedger:
    """The open runs of one sandbox and what was refused to each. Not thread-safe: used
    from the daemon's Trio thread only."""

    runs: dict[str, _Run] = field(default_factory=dict)
    #: Denials of a known command with no open run (its first instant; a terminal's
    #: shell), by command, at most `MAX_STRAY` of them; `close_run` adds them in.
    strays: dict[str, _Run] = field(default_factory=dict)
    #: The journal's bound for denials of no command, or of commands past `MAX_STRAY`.
    _rest: _Run = field(default_factory=_Run)

    def open_run(self, proc: str) -> None:
        """A command starts in the sandbox: denials no process can be found for are
        charged to it too, while it runs."""
        if proc not in self.runs:
            stray = self.strays.pop(proc, None)
            self.runs[proc] = stray if stray is not None else _Run()

    def close_run(self, proc: str) -> EgressBlocked | None:
        """The command ended: what was refused to it, or None when nothing was."""
        run = self.runs.pop(proc, None)
        stray = self.strays.pop(proc, None)
        if run is None or stray is not None:
            run = _merge(run, stray)
        if run.count == 0:
            return None
        return EgressBlocked(count=run.count, hosts=list(run.hosts))

    def record(self, proc: str | None, host: str, port: int) -> bool:
        """File one refused connection to `host`:`port` made by `proc` (None: unknown).

        Returns True when it should be journalled (the first time this target is refused
        to that command, within the bounds). Cost: a few dict and list operations.
        """
        target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        if proc is not None:
            run = self.runs.get(proc) or self.strays.get(proc)
            if run is None and len(self.strays) < MAX_STRAY:
                run = self.strays[proc] = _Run()
            return run.add(target) if run is not None else self._rest.add(f"{proc} {target}")
        fresh = False
        for each in self.runs.values():  # unknown command: charged to every open run
            fresh = each.add(target) or fresh
        return fresh if self.runs else self._rest.add(f" {target}")


def _merge(a: _Run | None, b: _Run | None) -> _Run:
    out = _Run()
    for part in (a, b):
        if part is None:
            continue
        out.count += part.count
        out.hosts += [h for h in part.hosts if h not in out.hosts][: MAX_HOSTS - len(out.hosts)]
    return out
