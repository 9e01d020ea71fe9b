"""What a layer command's change set leaves behind, against the real engine: a
conflict's version kept as an artifact (the checkout keeps the host's bytes), a settled
set's layer removed, the cap on kept sets per workspace refusing before anything runs,
kept sets surviving `workspace.release` and following a re-adoption of the checkout,
and entries carrying `size`/`mode` (a `diff` only in `changes.get`).

A daemon runs in-process with `max_kept_changesets = 2` and a profile `layer` (the tiny
one with `workspace = "layer"`). Every test ends with no mount left under the state dir.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from substrate.daemon import Daemon
from substrate.protocol.client import AsyncClient, RpcError, open_client
from tests.harness import wait_until_async
from tests.harness.inprocess import (
    as_layer,
    in_process_config,
    owned_project,
    profiles_dir,
    serving,
)

OWNER = 1000
CAP = 2


@dataclass
class Env:
    daemon: Daemon
    client: AsyncClient
    ws: str
    path: Path
    state: Path

    async def sh(self, script: str, **params: Any) -> Any:
        return await self.client.call(
            "proc.run", workspace=self.ws, profile="layer", argv=["sh", "-c", script], **params
        )

    def uppers(self) -> list[Path]:
        return sorted(self.state.glob("layers/*/upper/*"))


@pytest.fixture
async def env(tiny_image: str, engine_state: Path, tmp_path: Path) -> AsyncIterator[Env]:
    profiles = profiles_dir(tmp_path / "profiles", ["tiny"], layer=as_layer("tiny"))
    project = owned_project(
        tmp_path / "roots" / "project", {"old.txt": "old\n", "src/app.py": "print('hi')\n"}
    )
    config = in_process_config(engine_state, project.parent, profiles, max_kept_changesets=CAP)
    async with serving(config) as daemon, open_client(engine_state / "substrate.sock") as client:
        ws = await client.call("workspace.adopt", path=str(project))
        yield Env(daemon, client, ws["workspace"], project, engine_state)


async def _marker(env: Env, name: str) -> None:
    """Wait until the running command made `name` in its upper layer (seen from the host)."""
    await wait_until_async(lambda: sorted(env.state.glob(f"layers/*/upper/*/{name}")))


async def test_a_host_edit_wins_and_the_commands_version_is_an_artifact(env: Env) -> None:
    started = await env.client.call(
        "proc.start",
        workspace=env.ws,
        profile="layer",
        argv=["sh", "-c", "echo sandbox > old.txt && echo n > new.txt && touch m && sleep 60"],
    )
    await _marker(env, "m")
    (env.path / "old.txt").write_text("person\n")  # the host edits it meanwhile
    await env.client.call("proc.signal", proc=started["proc"], signal="KILL")
    result = await env.client.call("proc.wait", proc=started["proc"])
    changes = result["changes"]

    assert (env.path / "old.txt").read_text() == "person\n"
    assert (env.path / "new.txt").read_text() == "n\n"
    (conflict,) = changes["conflicts"]
    assert (conflict["path"], conflict["op"], conflict["reason"]) == (
        "old.txt",
        "replace",
        "host_changed",
    )
    assert conflict["size"] == len(b"sandbox\n") and isinstance(conflict["mode"], int)
    assert "kept" not in conflict  # not left in a layer: it is an artifact
    read = await env.client.call("artifact.read", artifact=conflict["artifact"])
    assert read["data"] == "sandbox\n" and read["eof"] is True
    stat = await env.client.call("artifact.stat", artifact=conflict["artifact"])
    assert (stat["proc"], stat["stream"]) == (changes["changeset"], "conflict")
    applied = {e["path"]: e for e in changes["applied"]}
    assert applied["new.txt"]["size"] == 2 and "diff" not in applied["new.txt"]

    # Settled: the set's layer is gone, the set still answers and names the version.
    kept = await env.client.call("changes.get", changeset=changes["changeset"])
    assert kept["layer"] == "removed"
    assert [(v["path"], v["artifact"]) for v in kept["versions"]] == [
        ("old.txt", conflict["artifact"])
    ]
    assert not sorted(env.state.glob(f"layers/*/upper/{changes['generation']}"))
    # The journal holds digests and counts, never the bytes.
    for entry in env.daemon.journal.read(limit=10000):
        assert "sandbox" not in repr(entry.data)


async def test_an_applied_set_leaves_no_layer_and_review_keeps_one(env: Env) -> None:
    applied = await env.sh("echo a > a.txt")
    generation = applied["changes"]["generation"]
    assert not sorted(env.state.glob(f"layers/*/upper/{generation}"))

    review = await env.sh("echo changed > old.txt && rm src/app.py", changes="review")
    changes = review["changes"]
    entries = {e["path"]: e for e in changes["review"]}
    assert entries["old.txt"]["size"] == len(b"changed\n") and "diff" not in entries["old.txt"]
    assert "size" not in entries["src/app.py"]  # a delete leaves no bytes
    upper = sorted(env.state.glob(f"layers/*/upper/{changes['generation']}"))
    assert upper and (upper[0] / "old.txt").read_text() == "changed\n"
    kept = await env.client.call("changes.get", changeset=changes["changeset"])
    assert kept.get("layer", "kept") == "kept"
    by_path = {c["path"]: c for c in kept["changes"]}
    assert "+changed" in by_path["old.txt"]["diff"] and by_path["old.txt"]["size"] == 8

    done = await env.client.call("changes.apply", changeset=changes["changeset"])
    assert done["layer"] == "removed" and done["counts"]["applied"] == 2
    assert not upper[0].exists()
    assert (env.path / "old.txt").read_text() == "changed\n"


async def test_past_the_cap_of_kept_sets_a_command_is_refused_before_it_runs(env: Env) -> None:
    kept = [(await env.sh(f"echo {i} > r{i}.txt", changes="review"))["changes"] for i in range(CAP)]
    listed = await env.client.call("proc.list", workspace=env.ws)
    for mode in ("review", "apply"):
        with pytest.raises(RpcError) as caught:
            await env.sh("echo x > third.txt", changes=mode)
        assert caught.value.refusal == "limit_exceeded"
        assert caught.value.data["scope"] == "kept_changesets"
        assert (caught.value.data["limit"], caught.value.data["kept"]) == (CAP, CAP)
    # Nothing ran: no process, nothing written anywhere.
    assert await env.client.call("proc.list", workspace=env.ws) == listed
    assert not sorted(env.state.glob("layers/*/upper/*/third.txt"))
    assert not (env.path / "third.txt").exists()
    # "discard" keeps nothing: it always runs.
    assert (await env.sh("echo d > d.txt", changes="discard"))["exit_code"] == 0
    # Each kept set is still whole; settling one makes room again.
    await env.client.call("changes.discard", changeset=kept[0]["changeset"])
    again = await env.sh("echo x > third.txt", changes="review")
    assert again["changes"]["changeset"].startswith("cs_")
    applied = await env.client.call("changes.apply", changeset=kept[1]["changeset"])
    assert applied["layer"] == "removed" and (env.path / "r1.txt").read_text() == "1\n"


async def test_kept_sets_outlive_a_release_and_follow_the_checkout(env: Env) -> None:
    result = await env.sh("echo later > old.txt", changes="review")
    cs = result["changes"]["changeset"]
    await env.client.call("workspace.release", workspace=env.ws)

    kept = await env.client.call("changes.get", changeset=cs)
    assert kept["state"] == "pending" and kept["workspace"] == env.ws
    assert any((u / "old.txt").exists() for u in env.uppers())
    with pytest.raises(RpcError) as caught:
        await env.client.call("changes.apply", changeset=cs)
    assert caught.value.refusal == "unknown_workspace"
    assert (env.path / "old.txt").read_text() == "old\n"

    again = await env.client.call("workspace.adopt", path=str(env.path))
    assert again["workspace"] != env.ws
    kept = await env.client.call("changes.get", changeset=cs)
    assert kept["workspace"] == again["workspace"]
    applied = await env.client.call("changes.apply", changeset=cs)
    assert applied["counts"]["applied"] == 1 and applied["layer"] == "removed"
    assert (env.path / "old.txt").read_text() == "later\n"
    await env.client.call("workspace.release", workspace=again["workspace"])
