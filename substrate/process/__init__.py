"""Processes: argv-only commands run in verified sandboxes, and what is known of them.

`argv` holds the pure rules a request must pass; `processes.Processes` runs a `RunRequest`
(records it, drives its exec, gates what it wrote); `fastexec.Launcher` starts it through
the sandbox's own supervisor or as an engine exec; `driver` drives it (pumps, timeout,
signals, the kill) through its `channels.ExecChannel` (the engine's `stream`, or a
supervisor's pipes); `records` is the `processes`
table and its journal entries; `intents` answers wait/status/list/subscribe from a
running command or its record, `subscriptions` streams output; `stdin_stream` holds a
streamed stdin (`proc.write`), `usage` reads a command's CPU and peak memory from its
cgroup, `facts_summary` shapes the facts of a reply; `service.Execution` wires the whole
execution layer of a daemon.
"""

from substrate.process.argv import (
    effective_timeout,
    exec_env,
    signal_of,
    start_failure,
    validate_argv,
    workdir_for,
)
from substrate.process.driver import Entry, ExecDriver
from substrate.process.processes import Processes, RunRequest, WriteGate
from substrate.process.records import Outcome, ProcessRecords, ProcRow
from substrate.process.service import Execution
from substrate.process.subscriptions import Subscriptions

__all__ = [
    "Entry",
    "ExecDriver",
    "Execution",
    "Outcome",
    "ProcRow",
    "ProcessRecords",
    "Processes",
    "RunRequest",
    "Subscriptions",
    "WriteGate",
    "effective_timeout",
    "exec_env",
    "signal_of",
    "start_failure",
    "validate_argv",
    "workdir_for",
]
