"""The working layer against the real engine: a `workspace = "layer"` profile.

A daemon runs in-process with a workspace adopted under `write_deny = ["*.lock", ".env"]`
(plus the implicit `.git/**`) and a profile `layer` (the tiny one with `workspace =
"layer"`). Commands write into the overlay; what they change reaches the checkout only
when they end, through the guarded path, and the result's `changes` says what became of
each change. Every test ends with no mount left under the state dir.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trio
import trio.lowlevel

from substrate.daemon import Daemon
from substrate.layer.mounts.overlay import mounted_under
from substrate.layer.mounts.working_layer import CTIME_SLACK_NS
from substrate.protocol.client import AsyncClient, RpcError, open_client
from tests.harness.inprocess import (
    as_layer,
    in_process_config,
    owned_project,
    profiles_dir,
    serving,
)

OWNER = 1000
LOCK = b"# lock file\n"


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ws: str
    path: Path
    state: Path

    async def sh(self, script: str, profile: str = "layer", **params: Any) -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile=profile, argv=["sh", "-c", script], **params
        )


def _mounts_under(state: Path) -> list[str]:
    return [m.mount_point for m in mounted_under(str(state))]


@pytest.fixture
async def env(tiny_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    layer = as_layer("tiny")
    passing = layer.replace("passthrough = []", 'passthrough = ["node_modules", "absent"]')
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=layer, **{"pass": passing})
    project = owned_project(
        tmp_path / "roots" / "project",
        {
            ".git/HEAD": "ref: refs/heads/main\n",
            "poetry.lock": LOCK,
            "src/app.py": "print('hi')\n",
            "old.txt": "old\n",
        },
    )
    config = in_process_config(engine_state, project.parent, profiles)
    async with serving(config) as daemon, open_client(engine_state / "substrate.sock") as client:
        ws = await client.call(
            "workspace.adopt", path=str(project), policy={"write_deny": ["*.lock", ".env"]}
        )
        yield Env(daemon, client, ws["workspace"], project, engine_state)


async def test_the_sandbox_sees_a_verified_layer_and_git_through_its_git_layer(
    env: Env,
) -> None:
    probe = await env.client.call("facts.probe", workspace=env.ws, profile="layer")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["workspace_mount"] == "layer"
    # `.git` is the git layer: writable in the sandbox, never written in the checkout.
    assert facts["readonly_dirs"] == []
    result = await env.sh("touch .git/x; echo $?; cat old.txt")
    assert result["exit_code"] == 0
    assert result["stdout"]["inline"].split("\n")[1] == "old"
    assert result["stdout"]["inline"].split("\n")[0] == "0"
    assert not (env.path / ".git" / "x").exists()
    again = await env.sh("ls .git/x")
    assert again["exit_code"] == 0  # it lasts in the git layer
    layers = env.state / "layers"
    assert any(m.startswith(f"{layers}/") for m in _mounts_under(env.state))
    await env.client.call("workspace.release", workspace=env.ws)
    # The sandbox's mounts are gone with it; the layer directory's own bind goes at stop.
    assert _mounts_under(env.state) == [str(layers)]


def _paths(changes: dict[str, Any], kind: str) -> list[tuple[str, str | None]]:
    return sorted((e["path"], e.get("op")) for e in changes[kind])


async def _marker(env: Env, name: str) -> Path:
    """Wait until the running command made `name` in its upper layer (seen from the host)."""
    with trio.fail_after(30):
        while True:
            found = sorted(env.state.glob(f"layers/*/upper/*/{name}"))
            if found:
                return found[0]
            await trio.sleep(0.02)


async def test_changes_land_only_through_the_apply_and_are_listed(env: Env) -> None:
    result = await env.sh(
        "echo new > src/new.py && echo changed > old.txt && rm src/app.py && mkdir d"
        " && echo x > d/f && cat old.txt"
    )
    assert result["exit_code"] == 0
    assert result["stdout"]["inline"] == "changed\n"
    changes = result["changes"]
    assert changes["generation"] == 0
    assert _paths(changes, "applied") == [
        ("d", "mkdir"),
        ("d/f", "create"),
        ("old.txt", "replace"),
        ("src/app.py", "delete"),
        ("src/new.py", "create"),
    ]
    assert changes["counts"]["applied"] == 5
    assert (env.path / "src" / "new.py").read_text() == "new\n"
    assert (env.path / "old.txt").read_text() == "changed\n"
    assert not (env.path / "src" / "app.py").exists()
    assert (env.path / "d" / "f").stat().st_uid == OWNER
    # The same result reads the same later, and the journal has one entry per file.
    again = await env.client.call("proc.wait", proc=result["proc"])
    assert again["changes"] == changes
    kinds = [e.kind for e in env.daemon.journal.read(limit=10000)]
    assert kinds.count("changes.apply") == 4  # files; `d` is a changes.apply_dir


async def test_a_denied_write_never_reaches_the_checkout(env: Env) -> None:
    started = await env.client.call(
        "proc.start",
        workspace=env.ws,
        profile="layer",
        argv=["sh", "-c", "echo TOKEN=x > .env && echo l > poetry.lock && touch m && sleep 60"],
    )
    await _marker(env, "m")
    # While it runs: the denied files exist only in its layer.
    assert not (env.path / ".env").exists()
    assert (env.path / "poetry.lock").read_bytes() == LOCK
    await env.client.call("proc.signal", proc=started["proc"], signal="KILL")
    result = await env.client.call("proc.wait", proc=started["proc"])
    blocked = {e["path"]: e for e in result["changes"]["blocked"]}
    assert set(blocked) == {".env", "poetry.lock"}
    assert blocked[".env"]["rule"] == ".env"
    assert blocked["poetry.lock"]["rule"] == "*.lock"
    assert blocked[".env"]["reason"] == "path_denied"
    assert _paths(result["changes"], "applied") == [("m", "create")]
    assert not (env.path / ".env").exists()
    assert (env.path / "poetry.lock").read_bytes() == LOCK
    assert result["policy_blocked"] == []  # the reactive gate does not run on a layer


async def test_a_host_edit_during_a_command_is_kept_and_reported(env: Env) -> None:
    # A command that changed nothing first: its generation stays and is begun afresh.
    assert (await env.sh("true"))["changes"]["generation"] == 0
    started = await env.client.call(
        "proc.start",
        workspace=env.ws,
        profile="layer",
        argv=["sh", "-c", "echo sandbox > old.txt && touch m && sleep 60"],
    )
    await _marker(env, "m")
    (env.path / "old.txt").write_text("person\n")
    await env.client.call("proc.signal", proc=started["proc"], signal="TERM")
    result = await env.client.call("proc.wait", proc=started["proc"])
    assert (env.path / "old.txt").read_text() == "person\n"
    (conflict,) = result["changes"]["conflicts"]
    assert conflict["path"] == "old.txt"
    assert conflict["reason"] == "host_changed"
    # The command's version is an artifact; its layer (generation 0) is gone with it.
    read = await env.client.call("artifact.read", artifact=conflict["artifact"])
    assert read["data"] == "sandbox\n" and "kept" not in conflict
    assert sorted(env.state.glob("layers/*/upper/0")) == []


async def test_two_commands_in_a_row_both_apply(env: Env) -> None:
    first = await env.sh("echo one > a.txt")
    second = await env.sh("cat a.txt && echo two >> a.txt && echo b > b.txt", facts="full")
    assert (first["changes"]["generation"], second["changes"]["generation"]) == (0, 1)
    assert second["stdout"]["inline"] == "one\n"
    assert _paths(second["changes"], "applied") == [("a.txt", "replace"), ("b.txt", "create")]
    assert (env.path / "a.txt").read_text() == "one\ntwo\n"
    assert (env.path / "b.txt").read_text() == "b\n"
    facts = {f["name"]: f["value"] for f in second["facts"]}
    assert facts["workspace_mount"] == "layer"


def _applied_paths(env: Env) -> list[str]:
    """The workspace-relative path of every `changes.apply` entry in the journal."""
    entries = env.daemon.journal.read(limit=10000)
    return [e.data["path"].split(":", 1)[1] for e in entries if e.kind == "changes.apply"]


def _deferred(result: dict[str, Any]) -> tuple[int, bool, str]:
    """(generation, deferred, mode) of a result's changes, which list and keep nothing."""
    changes = result["changes"]
    assert set(changes) <= {"generation", "deferred", "mode", "counts"}, changes
    assert not any(changes["counts"].values())
    return changes["generation"], changes.get("deferred", False), changes.get("mode", "apply")


def _shared(env: Env) -> list[Any]:
    return [e for e in env.daemon.journal.read(limit=10000) if e.kind == "changes.shared"]


async def test_overlapping_commands_share_a_generation_and_both_land_once(env: Env) -> None:
    # `one` waits for a file `two` makes: they overlap, and either may end last.
    started = await env.client.call(
        "proc.start",
        workspace=env.ws,
        profile="layer",
        argv=["sh", "-c", "echo 1 > one.txt && touch m && while [ ! -e go ]; do sleep 0.05; done"],
    )
    await _marker(env, "m")
    two = await env.sh("cat one.txt && echo 2 > two.txt && touch go")
    one = await env.client.call("proc.wait", proc=started["proc"])
    assert two["stdout"]["inline"] == "1\n"  # the same generation: it saw one's write
    results = [one["changes"], two["changes"]]
    assert [c["generation"] for c in results] == [0, 0]
    (deferred,) = [c for c in results if c.get("deferred")]
    (last,) = [c for c in results if not c.get("deferred")]
    assert "applied" not in deferred and "changeset" not in deferred
    assert _paths(last, "applied") == [
        ("go", "create"),
        ("m", "create"),
        ("one.txt", "create"),
        ("two.txt", "create"),
    ]
    assert (env.path / "one.txt").read_text() == "1\n"
    assert (env.path / "two.txt").read_text() == "2\n"
    assert sorted(_applied_paths(env)) == ["go", "m", "one.txt", "two.txt"]  # each once
    (shared,) = _shared(env)
    assert sorted(shared.data["procs"]) == sorted([started["proc"], two["proc"]])
    assert shared.data["changeset"] == last["changeset"]
    # The next command runs on the next generation, alone, and sees both.
    after = await env.sh("cat one.txt two.txt")
    assert after["stdout"]["inline"] == "1\n2\n"
    assert after["changes"]["generation"] == 1 and "deferred" not in after["changes"]


async def test_a_long_start_does_not_block_a_short_run(env: Env) -> None:
    server = await env.client.call(
        "proc.start",
        workspace=env.ws,
        profile="layer",
        argv=["sh", "-c", "echo s > served.txt && touch m && sleep 60"],
    )
    await _marker(env, "m")
    with trio.fail_after(30):  # it used to wait for the sleeper to end
        short = await env.sh("cat served.txt && echo c > client.txt", changes="review")
    assert short["exit_code"] == 0 and short["stdout"]["inline"] == "s\n"
    assert _deferred(short) == (0, True, "review")
    # Deferred: nothing of either is in the checkout while the server runs.
    assert not (env.path / "client.txt").exists()
    assert not (env.path / "served.txt").exists()
    # A command that times out beside the server is deferred too.
    late = await env.sh("echo t > timed.txt && sleep 30", timeout_s=1)
    assert late["timed_out"] is True
    assert _deferred(late) == (0, True, "apply")
    await env.client.call("proc.signal", proc=server["proc"], signal="KILL")
    result = await env.client.call("proc.wait", proc=server["proc"])
    assert result["signal"] == "KILL"
    changes = result["changes"]
    # The killed server ended last: it concludes the generation, in "review" (one of
    # its users asked it): nothing lands until `changes.apply`.
    assert changes["mode"] == "review" and changes["generation"] == 0
    assert _paths(changes, "review") == [
        ("client.txt", "create"),
        ("m", "create"),
        ("served.txt", "create"),
        ("timed.txt", "create"),
    ]
    assert not (env.path / "client.txt").exists()
    applied = await env.client.call("changes.apply", changeset=changes["changeset"])
    assert applied["counts"]["applied"] == 4
    assert (env.path / "timed.txt").read_text() == "t\n"
    assert (env.path / "served.txt").read_text() == "s\n"
    # Settled: its layer is gone, and applying it again applies nothing twice.
    assert applied["layer"] == "removed"
    again = await env.client.call("changes.apply", changeset=changes["changeset"])
    assert again["applied"] == [] and again["counts"]["applied"] == 0
    assert sorted(_applied_paths(env)) == ["client.txt", "m", "served.txt", "timed.txt"]
    (shared,) = _shared(env)
    assert sorted(shared.data["procs"]) == sorted([server["proc"], short["proc"], late["proc"]])
    assert shared.data["mode"] == "review"


async def test_a_busy_generation_concludes_whole_with_the_next_command(env: Env) -> None:
    # The sandbox and its layer exist; `true` changed nothing, so generation 0 stays.
    assert (await env.sh("true"))["changes"]["generation"] == 0
    (merged,) = env.state.glob("layers/*/merged")
    # An fd on the overlay holds it as a stray process would: the swap finds it busy.
    held = os.open(merged, os.O_RDONLY | os.O_DIRECTORY)
    try:
        busy = await env.sh("echo a > a.txt", changes="review")
    finally:
        os.close(held)
    assert busy["changes"]["error"] == "layer_busy" and busy["changes"]["generation"] == 0
    assert not (env.path / "a.txt").exists()
    # The generation stayed: the next command shares it, and its conclusion carries the
    # first one's changes, in the first one's mode ("review" is the more conservative).
    after = await env.sh("cat a.txt && echo b > b.txt")
    assert after["stdout"]["inline"] == "a\n"
    changes = after["changes"]
    assert (changes["generation"], changes["mode"]) == (0, "review")
    assert _paths(changes, "review") == [("a.txt", "create"), ("b.txt", "create")]
    assert not (env.path / "a.txt").exists() and not (env.path / "b.txt").exists()
    (shared,) = _shared(env)
    assert shared.data["procs"] == [busy["proc"], after["proc"]]
    applied = await env.client.call("changes.apply", changeset=changes["changeset"])
    assert applied["counts"]["applied"] == 2
    assert sorted(_applied_paths(env)) == ["a.txt", "b.txt"]


async def test_a_generation_busy_twice_concludes_as_it_is_and_its_sandbox_goes(env: Env) -> None:
    assert (await env.sh("true"))["changes"]["generation"] == 0
    first = env.daemon.execution.containers.cached(env.ws, "layer")
    assert first is not None
    (merged,) = env.state.glob("layers/*/merged")
    # Held from the host, where no kill reaches: busy at two conclusions in a row.
    held = os.open(merged, os.O_RDONLY | os.O_DIRECTORY)
    try:
        busy = await env.sh("echo a > a.txt")
        assert busy["changes"]["error"] == "layer_busy"
        forced = await env.sh("echo b > b.txt")
    finally:
        os.close(held)
    # Not busy forever: the second conclusion removed the sandbox (nothing of it runs
    # any more) and applied what the generation held, both commands' changes.
    changes = forced["changes"]
    assert "error" not in changes and changes["generation"] == 0, changes
    assert _paths(changes, "applied") == [("a.txt", "create"), ("b.txt", "create")]
    assert (env.path / "a.txt").read_text() == "a\n" and (env.path / "b.txt").read_text() == "b\n"
    removed = [
        e.data for e in env.daemon.journal.read(limit=10000) if e.kind == "container.removed"
    ]
    assert [r["reason"] for r in removed] == ["layer_busy"]
    # The next command gets a fresh, verified sandbox on the checkout as it is now.
    after = await env.sh("cat a.txt b.txt")
    assert after["stdout"]["inline"] == "a\nb\n"
    assert env.daemon.execution.containers.cached(env.ws, "layer") is not first


async def test_rw_profiles_are_unchanged(env: Env) -> None:
    result = await env.sh("echo rw > rw.txt && echo x > .env", profile="tiny")
    assert "changes" not in result
    assert (env.path / "rw.txt").read_text() == "rw\n"
    assert [b["path"] for b in result["policy_blocked"]] == ["project:.env"]


# -- changes = review | discard, and changes.get/apply/discard -----------------------------

WRITES = "echo new > src/new.py && echo changed > old.txt && rm src/app.py"


def _untouched(env: Env) -> None:
    assert not (env.path / "src" / "new.py").exists()
    assert (env.path / "old.txt").read_text() == "old\n"
    assert (env.path / "src" / "app.py").exists()


async def test_review_keeps_the_set_until_changes_apply(env: Env) -> None:
    result = await env.sh(WRITES, changes="review")
    changes = result["changes"]
    assert changes["mode"] == "review" and "applied" not in changes
    assert changes["changeset"].startswith("cs_")
    assert _paths(changes, "review") == [
        ("old.txt", "replace"),
        ("src/app.py", "delete"),
        ("src/new.py", "create"),
    ]
    _untouched(env)
    kept = await env.client.call("changes.get", changeset=changes["changeset"])
    assert kept["state"] == "pending" and kept["workspace"] == env.ws
    assert sorted(c["path"] for c in kept["changes"]) == ["old.txt", "src/app.py", "src/new.py"]
    # A later command does not see the reviewed changes (they are not in the checkout).
    assert (await env.sh("cat old.txt"))["stdout"]["inline"] == "old\n"

    applied = await env.client.call("changes.apply", changeset=changes["changeset"])
    assert applied["state"] == "applied" and applied["counts"]["applied"] == 3
    assert (env.path / "src" / "new.py").read_text() == "new\n"
    assert (env.path / "old.txt").read_text() == "changed\n"
    assert not (env.path / "src" / "app.py").exists()
    # Settled: its layer is gone, and applying it again applies nothing twice.
    assert applied["layer"] == "removed"
    again = await env.client.call("changes.apply", changeset=changes["changeset"])
    assert again["applied"] == [] and again["counts"]["applied"] == 0


async def test_changes_apply_with_paths_applies_only_those(env: Env) -> None:
    result = await env.sh(WRITES, changes="review")
    cs = result["changes"]["changeset"]
    dry = await env.client.call("changes.apply", changeset=cs, paths=["src"], dry_run=True)
    assert _paths(dry, "applied") == [("src/app.py", "delete"), ("src/new.py", "create")]
    _untouched(env)
    some = await env.client.call("changes.apply", changeset=cs, paths=["src/new.py", "x"])
    assert _paths(some, "applied") == [("src/new.py", "create")]
    assert some["unmatched"] == ["x"] and some["state"] == "pending"
    assert (env.path / "src" / "new.py").read_text() == "new\n"
    assert (env.path / "old.txt").read_text() == "old\n"
    assert (env.path / "src" / "app.py").exists()


async def test_discard_lands_nothing_and_removes_the_layer(env: Env) -> None:
    result = await env.sh(WRITES, changes="discard")
    changes = result["changes"]
    assert changes["mode"] == "discard" and "changeset" not in changes
    _untouched(env)
    assert sorted(env.state.glob(f"layers/*/upper/{changes['generation']}")) == []
    assert sorted(env.state.glob(f"layers/*/work/{changes['generation']}")) == []


async def test_changes_discard_removes_a_kept_layer(env: Env) -> None:
    result = await env.sh(WRITES, changes="review")
    cs, generation = result["changes"]["changeset"], result["changes"]["generation"]
    assert sorted(env.state.glob(f"layers/*/upper/{generation}"))
    done = await env.client.call("changes.discard", changeset=cs)
    assert done == {"changeset": cs, "state": "discarded"}
    assert sorted(env.state.glob(f"layers/*/upper/{generation}")) == []
    _untouched(env)
    with pytest.raises(RpcError) as caught:
        await env.client.call("changes.apply", changeset=cs)
    assert caught.value.refusal == "changeset_unknown"
    assert caught.value.data.get("discarded") is True


async def test_apply_mode_names_its_changeset_and_unknown_ids_are_refused(env: Env) -> None:
    result = await env.sh("echo a > a.txt")
    cs = result["changes"]["changeset"]
    kept = await env.client.call("changes.get", changeset=cs)
    assert kept["state"] == "applied" and [c["path"] for c in kept["changes"]] == ["a.txt"]
    assert kept["layer"] == "removed"  # settled when it ended: nothing left to apply
    again = await env.client.call("changes.apply", changeset=cs)
    assert again["applied"] == [] and again["counts"]["applied"] == 0
    for method in ("changes.get", "changes.apply", "changes.discard"):
        with pytest.raises(RpcError) as caught:
            await env.client.call(method, changeset="cs_0000000000000000")
        assert caught.value.refusal == "changeset_unknown"


async def test_review_is_refused_for_a_profile_without_a_layer(env: Env) -> None:
    with pytest.raises(RpcError) as caught:
        await env.sh("echo rw > rw.txt", profile="tiny", changes="review")
    assert caught.value.refusal == "invalid_params"
    assert not (env.path / "rw.txt").exists()


async def _adopt_with_node_modules(env: Env, name: str, write_deny: list[str]) -> tuple[str, Path]:
    """A second checkout beside the fixture's, with `src/` and `node_modules/`."""
    path = env.path.parent / name
    (path / "src").mkdir(parents=True)
    (path / "node_modules").mkdir()
    for made in (path, path / "src", path / "node_modules"):
        os.chown(made, OWNER, OWNER)
    ws = await env.client.call("workspace.adopt", path=str(path), policy={"write_deny": write_deny})
    return ws["workspace"], path


async def test_passthrough_writes_land_at_once_and_stay_out_of_the_change_set(env: Env) -> None:
    ws, path = await _adopt_with_node_modules(env, "web", ["/.env", "/src/*.lock"])
    probe = await env.client.call("facts.probe", workspace=ws, profile="pass")
    facts = {f["name"]: f["value"] for f in probe["facts"]}
    assert facts["passthrough"] == ["node_modules"]  # "absent" does not exist: not bound
    results: list[Any] = []

    async def sh(script: str) -> Any:
        return await env.client.call(
            "proc.run", workspace=ws, profile="pass", argv=["sh", "-c", script]
        )

    async def run() -> None:
        results.append(
            await sh(
                "echo y > src/y && echo x > node_modules/x"
                " && while [ ! -e node_modules/go ]; do sleep 0.05; done"
            )
        )

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        with trio.fail_after(30):
            while True:
                if (path / "node_modules" / "x").exists():
                    break
                await trio.sleep(0.02)
        # During the command: the passthrough write is in the checkout, the other is not.
        assert (path / "node_modules" / "x").read_text() == "x\n"
        assert not (path / "src" / "y").exists()
        (path / "node_modules" / "go").write_text("")  # seen inside, through the bind
    result = results[0]
    assert result["exit_code"] == 0
    assert _paths(result["changes"], "applied") == [("src/y", "create")]
    assert (path / "src" / "y").read_text() == "y\n"
    # The next generation binds it again.
    again = await sh("cat node_modules/x && echo z > node_modules/z")
    assert again["stdout"]["inline"] == "x\n"
    assert (path / "node_modules" / "z").read_text() == "z\n"
    assert again["changes"].get("applied", []) == []  # nothing for the change set
    await env.client.call("workspace.release", workspace=ws)


async def test_a_passthrough_the_policy_may_deny_beneath_is_refused(env: Env) -> None:
    # The fixture's `*.lock` denies node_modules/x.lock too: a bind would skip that rule.
    (env.path / "node_modules").mkdir()
    with pytest.raises(RpcError) as caught:
        await env.sh("true", profile="pass")
    assert caught.value.refusal == "path_denied"


def _uppers(env: Env) -> list[str]:
    """The upper dirs of every generation on disk (`layers/<sandbox>/upper/<n>`)."""
    return sorted(str(p.relative_to(env.state)) for p in env.state.glob("layers/*/upper/*"))


async def test_a_command_that_changes_nothing_keeps_the_generation_and_no_set(env: Env) -> None:
    first = await env.sh("true", changes="review")
    changes = first["changes"]
    # Nothing to review: no set is kept, no swap happened (the same generation serves
    # the next command), nothing is journaled about changes.
    assert changes["generation"] == 0 and changes.get("changeset") is None
    assert not any(changes["counts"].values())
    uppers = _uppers(env)
    again = await env.sh("cat old.txt")
    assert again["changes"]["generation"] == 0 and again["stdout"]["inline"] == "old\n"
    assert _uppers(env) == uppers
    kinds = {e.kind for e in env.daemon.journal.read(limit=10000)}
    assert not kinds & {"changes.kept", "changes.applied", "changes.apply"}
    # A command that writes concludes as always: a swap to the next generation.
    wrote = await env.sh("echo n > new.txt")
    assert wrote["changes"]["generation"] == 0
    assert [e["path"] for e in wrote["changes"]["applied"]] == ["new.txt"]
    assert (await env.sh("true"))["changes"]["generation"] == 1


async def test_a_host_save_between_commands_is_seen_and_built_on(env: Env) -> None:
    # The generation stays after `cat` (nothing changed), its overlay having looked the
    # file up. The person then saves it by rename (a new inode, which that overlay would
    # not show): the checkout changed, so the next command gets the generation mounted
    # again, sees the save, and its change of it is built on it: applied, no conflict
    # (docs/working-layer.md, "The fresh view").
    assert (await env.sh("cat old.txt"))["changes"]["generation"] == 0
    (env.path / ".old.txt.save").write_text("edited on the host\n")
    os.chown(env.path / ".old.txt.save", OWNER, OWNER)
    os.rename(env.path / ".old.txt.save", env.path / "old.txt")
    await trio.sleep(2 * CTIME_SLACK_NS / 1e9)  # clearly before the next command
    result = await env.sh("cat old.txt; echo mine >> old.txt")
    assert result["stdout"]["inline"] == "edited on the host\n"
    changes = result["changes"]
    assert changes["generation"] == 0 and not changes.get("conflicts")
    assert [e["path"] for e in changes["applied"]] == ["old.txt"]
    assert (env.path / "old.txt").read_text() == "edited on the host\nmine\n"


async def _while_it_runs(env: Env, script: str) -> str:
    """Start `script` (which ends by touching `m` and sleeping), wait for `m` in its layer;
    return the process id."""
    started = await env.client.call(
        "proc.start",
        workspace=env.ws,
        profile="layer",
        argv=["sh", "-c", f"{script} && touch m && sleep 60"],
    )
    await _marker(env, "m")
    return str(started["proc"])


async def _end(env: Env, proc: str) -> dict[str, Any]:
    await env.client.call("proc.signal", proc=proc, signal="TERM")
    result: dict[str, Any] = await env.client.call("proc.wait", proc=proc)
    return result


async def test_a_host_delete_or_rename_during_a_command_is_never_undone(env: Env) -> None:
    docs = env.path / "docs"
    docs.mkdir()
    (docs / "b.txt").write_text("b\n")
    (docs / "c.txt").write_text("c\n")
    for path in (docs, docs / "b.txt", docs / "c.txt"):
        os.chown(path, OWNER, OWNER)
    # In place (a copy-up) and by rename (an editor's save, `sed -i`): both changed.
    proc = await _while_it_runs(
        env, "echo sandbox >> docs/b.txt && sed -i s/c/sandbox/ docs/c.txt && echo n > new.txt"
    )
    (docs / "b.txt").unlink()  # the person deletes one, renames the other away
    os.rename(docs / "c.txt", docs / "moved.txt")
    result = await _end(env, proc)
    changes = result["changes"]
    conflicts = {e["path"]: e for e in changes.get("conflicts", [])}
    assert sorted(conflicts) == ["docs/b.txt", "docs/c.txt"]
    assert {e["reason"] for e in conflicts.values()} == {"host_changed"}
    assert sorted(p.name for p in docs.iterdir()) == ["moved.txt"]
    assert (docs / "moved.txt").read_text() == "c\n"
    # The command's versions are kept; the rest of its work landed.
    read = await env.client.call("artifact.read", artifact=conflicts["docs/b.txt"]["artifact"])
    assert read["data"] == "b\nsandbox\n"
    assert _paths(changes, "applied") == [("m", "create"), ("new.txt", "create")]
    assert (env.path / "new.txt").read_text() == "n\n"
    # A later apply of the kept set never re-creates them either.
    again = await env.client.call("changes.apply", changeset=changes["changeset"])
    assert not again.get("applied")
    assert sorted(p.name for p in docs.iterdir()) == ["moved.txt"]


async def test_a_tree_past_the_depth_bound_is_blocked_and_the_rest_lands(env: Env) -> None:
    script = (
        "p=deep; i=0; while [ $i -lt 300 ]; do p=$p/d; i=$((i+1)); done;"
        " mkdir -p $p && echo x > $p/f && echo top > top.txt"
    )
    result = await env.sh(script)
    assert result["exit_code"] == 0
    changes = result["changes"]
    assert changes.get("error") is None
    assert (env.path / "top.txt").read_text() == "top\n"
    assert ("top.txt", "create") in _paths(changes, "applied")
    # The shallowest path past the bound (256 directories) is blocked by name; the
    # directories above it land; what it holds stays in the kept layer.
    past = "deep" + "/d" * 256
    assert [(e["path"], e["reason"]) for e in changes["blocked"]] == [(past, "too_deep")]
    assert (env.path / ("deep" + "/d" * 255)).is_dir()
    assert not (env.path / past).exists()
    got = await env.client.call("changes.get", changeset=changes["changeset"])
    assert got.get("layer", "kept") == "kept"
    (upper,) = env.state.glob("layers/*/upper/0")
    assert (upper / ("deep" + "/d" * 300) / "f").is_file()  # still on disk
    assert [(b["path"], b["reason"]) for b in got["blocked"]] == [(past, "too_deep")]


async def test_a_swap_that_does_not_verify_drops_the_sandbox(
    env: Env, monkeypatch: pytest.MonkeyPatch
) -> None:
    containers = env.daemon.execution.containers
    await env.sh("true")
    before = containers.cached(env.ws, "layer")
    assert before is not None
    real = containers.layer_mounts.identities

    async def elsewhere(layer: Any) -> dict[str, Any]:
        # The generation mounted now is required to be another overlay than the one the
        # container shows: what a mount that did not propagate would look like.
        return {**await real(layer), "workspace_identity": "0:0"}

    monkeypatch.setattr(containers.layer_mounts, "identities", elsewhere)
    result = await env.sh("echo x > x.txt")
    # The command ran on a verified generation: its change lands; the sandbox is gone.
    assert result["changes"]["error"] == "layer_unverified"
    assert [e["path"] for e in result["changes"]["applied"]] == ["x.txt"]
    assert containers.cached(env.ws, "layer") is None
    (unmet,) = [
        e.data
        for e in env.daemon.journal.read(limit=10000)
        if e.kind == "proc.facts" and not e.data["ok"]
    ]
    assert [m["name"] for m in unmet["mismatches"]] == ["workspace_identity"]
    monkeypatch.undo()
    after = await env.sh("cat x.txt")
    assert after["stdout"]["inline"] == "x\n"
    fresh = containers.cached(env.ws, "layer")
    assert fresh is not None and fresh.id != before.id
