"""`substrate.process.intents` and `Processes` over the fake engine (no Docker): start,
wait, status, list, subscribe and signal, for commands whose process the test plays."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest
import trio
from fake_execution import PROFILES, Layer, fake_layer

from substrate.errors import LimitExceeded, ProcessUnknown, RuntimeUnavailable
from substrate.process import intents
from substrate.process.driver import Entry
from substrate.process.facts_summary import shaped
from substrate.sandbox.engine import ContainerGone
from substrate.schema.proc import OutputNotice, ProcPending, ProcResult


@pytest.fixture
async def layer(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> AsyncIterator[Layer]:
    root = make_workspace("intents", {"a.txt": "a\n"})
    with fake_layer(root, tmp_path / "state", adopt_root) as made:
        async with trio.open_nursery() as nursery:
            await nursery.start(made.processes.serve)
            yield made
            for ex in made.engine.running_execs():  # let what still runs end normally
                ex.exit(0)
            nursery.cancel_scope.cancel()


async def started(layer: Layer, argv: list[str], profile: str = "gv", **kw: Any) -> Entry:
    """`proc.start`, and the running entry."""
    proc = await layer.processes.start(layer.request(argv, profile, **kw))
    entry = layer.processes.live(proc)
    assert entry is not None
    return entry


async def test_a_started_command_is_running_until_it_exits(layer: Layer) -> None:
    entry = await started(layer, ["sleep", "300"])
    proc = entry.proc
    pending = await intents.wait(layer.processes, proc, 0.01)
    assert pending == ProcPending(proc=proc, state="running")
    status = await intents.status(layer.processes, proc)
    assert (status.state, status.argv, status.exit_code, status.facts) == (
        "running",
        ["sleep", "300"],
        None,
        None,
    )
    (listed,) = await intents.listing(layer.processes, layer.ws.id, 10)
    assert (listed.proc, listed.state) == (proc, "running")
    layer.exec_of(proc).write(b"late\n")
    layer.exec_of(proc).exit(3)
    result = await intents.wait(layer.processes, proc, None, "full")
    assert isinstance(result, ProcResult)
    assert (result.exit_code, result.stdout.inline, result.timed_out) == (3, "late\n", False)
    # Once it ended, the record answers, the same way every time.
    assert layer.processes.live(proc) is None
    assert await intents.wait(layer.processes, proc, 0, "full") == result
    done = await intents.status(layer.processes, proc, "full")
    assert (done.state, done.exit_code, done.stdout_bytes) == ("exited", 3, 5)
    assert done.facts == result.facts and done.facts
    assert (done.facts_digest, done.facts_summary) == (result.facts_digest, result.facts_summary)
    # By default a reply carries the digest and the summary, not the list.
    short = await intents.wait(layer.processes, proc, 0)
    assert isinstance(short, ProcResult) and short.facts is None
    assert short == msgspec.structs.replace(result, facts=None)


async def test_an_unknown_process_is_refused_and_signals_nothing(layer: Layer) -> None:
    with pytest.raises(ProcessUnknown):
        await intents.status(layer.processes, "p_0000000000000000")
    with pytest.raises(ProcessUnknown):
        await intents.wait(layer.processes, "p_0000000000000000", 0)
    assert await layer.processes.signal("p_0000000000000000", "TERM") is None
    finished = await layer.processes.run(layer.request(["true"], "box"))
    assert await layer.processes.signal(finished.proc, "TERM") is None  # not running


async def test_a_signal_before_the_command_has_a_process_is_held_then_answered(
    layer: Layer,
) -> None:
    # Under runc a signal goes to host processes; the fake exec has none yet (the engine
    # reports no pid), so the signal is held until the exec ends: then it finds nothing.
    entry = await started(layer, ["sleep", "300"], "box")
    answers: list[int | None] = []
    held = entry.held_added
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            answers.append(await layer.processes.signal(entry.proc, "TERM"))

        nursery.start_soon(send)
        await held.wait()
        # Held, not answered "0" while the command may still start.
        assert answers == [] and [h.name for h in entry.held] == ["TERM"]
        layer.exec_of(entry.proc).exit(0)
    assert answers == [0]
    await entry.done.wait()
    assert entry.result is not None and entry.result.exit_code == 0


async def test_under_gvisor_term_ends_the_sandbox_and_int_reaches_nothing(layer: Layer) -> None:
    entry = await started(layer, ["sleep", "300"])
    container = entry.sandbox.id
    assert await layer.processes.signal(entry.proc, "INT") == 0
    assert not entry.done.is_set()
    assert await layer.processes.signal(entry.proc, "TERM") == 1
    result = await intents.wait(layer.processes, entry.proc, None)
    assert isinstance(result, ProcResult) and result.exit_code is None
    assert container not in layer.engine.containers
    assert {"container": container[:12], "profile": "gv", "reason": "signal"} in layer.kinds(
        "container.removed"
    )


async def test_a_command_past_its_timeout_is_killed(layer: Layer) -> None:
    result = await layer.processes.run(layer.request(["sleep", "300"], "gv", timeout_s=0.05))
    assert (result.exit_code, result.signal, result.timed_out) == (137, "KILL", True)
    (exited,) = layer.kinds("proc.exited")
    assert exited["timed_out"] is True and exited["cancelled"] is False


async def test_a_program_the_engine_cannot_start_reads_like_a_shell(layer: Layer) -> None:
    result = await layer.processes.run(layer.request(["nope"], "box"))
    assert (result.exit_code, result.stdout.bytes) == (127, 0)
    assert result.stderr.inline == "substrate: nope: command not found\n"


async def test_subscribing_to_a_finished_command_sends_its_output_then_its_exit(
    layer: Layer,
) -> None:
    result = await layer.processes.run(layer.request(["echo", "hello", "there"], "box"))
    notices: list[tuple[str, Any]] = []
    ended = trio.Event()

    async def notify(method: str, params: Any) -> None:
        notices.append((method, params))
        if method == "proc.exit":
            ended.set()

    await intents.subscribe(layer.processes, result.proc, 0, notify, [])
    await ended.wait()
    outputs = [p for m, p in notices if m == "proc.output"]
    assert [(o.stream, o.offset, o.data) for o in outputs if o.data] == [
        ("stdout", 0, "hello there\n")
    ]
    assert all(isinstance(o, OutputNotice) for o in outputs)
    assert notices[-1] == ("proc.exit", shaped(result, "summary"))
    assert notices[-1][1].facts is None and notices[-1][1].facts_digest is not None


async def test_at_most_max_processes_run_at_once(layer: Layer) -> None:
    for _ in range(4):  # the layer's max_processes
        await started(layer, ["sleep", "300"])
    with pytest.raises(LimitExceeded):
        await layer.processes.start(layer.request(["true"], "gv"))


async def test_a_container_gone_before_the_exec_is_retried_once_with_a_fresh_one(
    layer: Layer,
) -> None:
    first = await layer.containers.ensure(layer.ws, PROFILES["box"])
    layer.engine.fail_next("exec_create", ContainerGone(first.id))
    result = await layer.processes.run(layer.request(["true"], "box"))
    assert result.exit_code == 0 and first.id not in layer.engine.containers
    assert [d["reason"] for d in layer.kinds("container.removed")] == ["gone"]
    layer.engine.fail_next("exec_create", ContainerGone("a"), ContainerGone("b"))
    with pytest.raises(RuntimeUnavailable):
        await layer.processes.run(layer.request(["true"], "box"))
    # Each attempt whose exec was never made is recorded lost, never left running.
    assert (len(layer.kinds("proc.started")), len(layer.kinds("proc.lost"))) == (4, 3)
