"""Fast exec: substrate's own supervisor inside each sandbox (docs/fast-exec.md).

The map of fast exec, in the order a command meets it:

- `supervisors.Supervisors` (the sandbox's side, one per daemon): `supervised(profile)`
  says which sandboxes get one (runc, read-only root filesystem); `prepare` makes a
  sandbox's supervisor directory (`slot.Slot`) before its container is created
  (`sandbox.containers` binds it in) and `attach` keeps it once the sandbox is verified;
  `spawn` hands out a held child checked from the host (or None: use the engine's exec),
  `prefork` asks for the next one (`Pending`), `serving` tells (and journals) a lost or
  tampered supervisor, `detach` removes it all with the sandbox.
- `startup`: the start of one supervisor (exec, pid and pidfd, `ready`, the host's
  check, the secret, the authenticated `hello`), `StartFailed` and its journal words.
- `link.Link`: the daemon's side of one running supervisor (its control connection,
  `problem`, `fork`); `link.Spawned`: one held child, then the command it became (`go`,
  the exit report).
- `ahead`: the spare moved ahead, while held, into the cgroup of the command that will
  take it (`Reserve`; `Supervisors.claim` gives that command its id).
- `checks`: what the host reads of a supervisor and of each held child (procfs, its
  cgroup, namespaces) and the comparison with the sandbox's confinement facts.
- `agent`: the program that runs inside the container (standard library only; the
  daemon imports its sans-IO wire codec and constants).

Under gVisor (runsc) the same role is played over the attach stream of the engine exec
that started the supervisor (docs/fast-exec.md "Under gVisor"):
- `stream_supervisors.Streams` (`Supervisors.streams`): `streamed(profile)` says which
  sandboxes get one (runsc, read-only root filesystem); `ready` gives the running
  `StreamLink` or starts one with the sandbox's first command; a lost one is journalled
  and its sandbox keeps the engine's exec.
- `stream_link.StreamLink`: the daemon's side of one stream (the reader that
  demultiplexes every command's output into its sinks, tagged requests, stdin pieces);
  `StreamCommand`: one command on it.
- `stream_agent`: the program (standard library only, passed in argv) and its tagged
  sans-IO wire.

The runner's side is `substrate.process.fastexec` (`Launcher`: which path a command
takes; `FastChannel`: a supervisor-started command as the driver drives it) and
`substrate.process.stream_exec` (`StreamChannel`: the same over a stream). It stays in
the process layer because it is the process layer's use of this package: it implements
the process layer's `ExecChannel` and stdin pipes (`process.channels`,
`process.stdin_stream`) and the shell's start-failure codes (`process.argv`), which
nothing in `substrate.sandbox` may import.
"""
