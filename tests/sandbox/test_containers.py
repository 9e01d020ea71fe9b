"""`substrate.sandbox.containers` over the fake engine (no Docker): a sandbox is created
from its profile, verified, reused while its init lives; labelled containers it did not
create are never reused (a weaker one is refused); idle ones go."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import pytest
from fake_execution import IMAGE, PROFILES, ROOT, Layer, fake_layer

from substrate.errors import ConfinementUnmet, ImageMissing, RuntimeUnavailable
from substrate.sandbox import mounts, profiles
from substrate.sandbox.containers import Containers
from substrate.sandbox.facts import Fact
from substrate.sandbox.fake_engine import FakeHost
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import LABEL_CONFIG, LABEL_EPOCH, RunAs, container_spec
from substrate.workspace.policy import Policy

BOX = PROFILES["box"]


@pytest.fixture
def layer(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Layer]:
    root = make_workspace("box", {"src/a.py": "x\n", "secrets/k": "K\n", "lib/v/.git/HEAD": ""})
    with fake_layer(
        root, tmp_path / "state", adopt_root, policy=Policy(write_deny=["secrets/**"])
    ) as made:
        yield made


def request_for(layer: Layer) -> dict[str, Any]:
    """The create request the daemon would make for `box` in the layer's workspace."""
    return container_spec(
        BOX,
        who=RunAs(1000, 1000),
        workspace_source=layer.ws.host_path,
        readonly_dirs=[rel for rel, _ in mounts.readonly_paths(layer.ws, BOX)],
        security_opt=profiles.security_opts(BOX, ROOT / "seccomp"),
    )


def removed(layer: Layer) -> list[tuple[str, object]]:
    return [(str(d["container"]), d["reason"]) for d in layer.kinds("container.removed")]


async def test_a_sandbox_is_created_from_its_profile_verified_and_reused(layer: Layer) -> None:
    sandbox = await layer.containers.ensure(layer.ws, BOX)
    again = await layer.containers.ensure(layer.ws, BOX)
    assert again is sandbox and layer.engine.calls.count("create_container") == 1
    made = layer.engine.containers[sandbox.id]
    assert made.labels[LABEL_EPOCH] == str(layer.journal.epoch) and LABEL_CONFIG in made.labels
    binds = {m["Target"]: m["ReadOnly"] for m in made.request["host_config"]["mounts"]}
    assert binds == {
        "/workspace": False,
        "/workspace/lib/v/.git": True,
        "/workspace/secrets": True,
        "/etc/resolv.conf": True,
    }
    assert sorted(sandbox.readonly) == ["lib/v/.git", "secrets"]
    assert (sandbox.who.uid, sandbox.who.gid) == (1000, 1000) and sandbox.host_visible
    assert sandbox.protected == {made.pid, made.keepalive}
    (journalled,) = layer.kinds("proc.facts")
    assert journalled["ok"] is True and journalled["container"] == sandbox.id[:12]
    assert {f.name for f in sandbox.facts} >= {"workspace_identity:secrets", "readonly_dirs"}


async def test_a_container_whose_init_changed_is_replaced_and_verified_again(
    layer: Layer,
) -> None:
    first = await layer.containers.ensure(layer.ws, BOX)
    layer.engine.restart(first.id)
    second = await layer.containers.ensure(layer.ws, BOX)
    assert second.id != first.id and first.id not in layer.engine.containers
    assert removed(layer) == [(first.id[:12], "init_changed")]
    assert len(layer.kinds("proc.facts")) == 2


async def test_a_labelled_container_with_weaker_settings_is_refused_and_removed(
    layer: Layer,
) -> None:
    # Made behind the daemon's back with our labels, privileged: it must never be used.
    spec = request_for(layer)
    spec["host_config"]["privileged"] = True
    weak = await layer.engine.create_container(
        name="planted", labels=layer.containers.labels_for(layer.ws.id, "box"), **spec
    )
    await layer.engine.start(weak)
    with pytest.raises(ConfinementUnmet) as caught:
        await layer.containers.ensure(layer.ws, BOX)
    assert caught.value.data["observed"]["privileged"] is True
    assert weak not in layer.engine.containers
    assert removed(layer) == [(weak[:12], "weaker")]
    assert layer.containers.cached(layer.ws.id, "box") is None
    fresh = await layer.containers.ensure(layer.ws, BOX)  # the next call starts clean
    assert fresh.id != weak


async def test_a_labelled_container_that_looks_right_is_still_not_reused(layer: Layer) -> None:
    twin = await layer.engine.create_container(
        name="twin", labels=layer.containers.labels_for(layer.ws.id, "box"), **request_for(layer)
    )
    await layer.engine.start(twin)
    fresh = await layer.containers.ensure(layer.ws, BOX)
    assert fresh.id != twin and list(layer.engine.containers) == [fresh.id]
    assert removed(layer) == [(twin[:12], "foreign")]


class TamperedHost(FakeHost):
    """Observes one fact other than the engine was asked for."""

    def observe(
        self,
        init_pid: int,
        inspect: Mapping[str, Any],
        profile: Profile,
        readonly_dirs: Sequence[str],
    ) -> list[Fact]:
        found = super().observe(init_pid, inspect, profile, readonly_dirs)
        return [
            msgspec.structs.replace(f, value=4096) if f.name == "pids_limit" else f for f in found
        ]


async def test_a_fact_that_does_not_hold_removes_the_container(layer: Layer) -> None:
    containers = Containers(
        layer.engine,
        layer.journal,
        daemon_id="e" * 16,
        epoch=layer.journal.epoch,
        seccomp_dir=ROOT / "seccomp",
        idle_s=60.0,
        host=TamperedHost(layer.engine),
    )
    with pytest.raises(ConfinementUnmet) as caught:
        await containers.ensure(layer.ws, BOX)
    assert caught.value.data == {
        "required": {"pids_limit": BOX.pids},
        "observed": {"pids_limit": 4096},
    }
    assert layer.engine.containers == {}  # removed
    (report,) = layer.kinds("proc.facts")
    assert report["ok"] is False and report["mismatches"][0]["name"] == "pids_limit"


async def test_idle_sandboxes_are_removed_busy_ones_kept(layer: Layer) -> None:
    busy = await layer.containers.ensure(layer.ws, BOX)
    idle = await layer.containers.ensure(layer.ws, PROFILES["other"])
    busy.acquire()
    later = time.monotonic() + layer.containers.idle_s + 1
    assert await layer.containers.reap_idle(now=later) == 1
    assert list(layer.engine.containers) == [busy.id]
    assert removed(layer) == [(idle.id[:12], "idle")]
    busy.release()
    assert await layer.containers.reap_idle(now=time.monotonic()) == 0  # just used
    await layer.containers.release_workspace(layer.ws.id)
    assert layer.engine.containers == {} and layer.containers.live() == []


async def test_only_an_earlier_runs_containers_are_reaped_at_start(layer: Layer) -> None:
    mine = await layer.containers.ensure(layer.ws, BOX)
    old = await layer.engine.create_container(
        name="old",
        labels={**layer.containers.labels_for("w_old", "box"), LABEL_EPOCH: "0"},
        **layer.engine.containers[mine.id].request,
    )
    assert await layer.containers.reap_previous() == 1
    assert list(layer.engine.containers) == [mine.id] and old not in layer.engine.containers
    assert layer.kinds("container.reaped") == [{"containers": 1}]


async def test_a_missing_image_or_runtime_is_refused_before_anything_is_made(
    layer: Layer,
) -> None:
    with pytest.raises(ImageMissing):
        await layer.containers.ensure(
            layer.ws, Profile(name="x", image="absent:img", workspace="rw")
        )
    layer.engine.registered.discard("runsc")
    with pytest.raises(RuntimeUnavailable):
        await layer.containers.ensure(layer.ws, PROFILES["gv"])
    assert layer.engine.containers == {} and "create_container" not in layer.engine.calls
    assert IMAGE in layer.engine.images


async def test_a_reload_retires_busy_sandboxes_once_idle_and_idle_ones_at_once(
    layer: Layer,
) -> None:
    busy = await layer.containers.ensure(layer.ws, BOX)
    busy.acquire()  # a command runs in it
    assert await layer.containers.retire(["box", "other"]) == 1
    assert busy.id in layer.engine.containers  # its command keeps running
    assert layer.containers.cached(layer.ws.id, "box") is None
    assert busy in layer.containers.live()
    fresh = await layer.containers.ensure(layer.ws, BOX)  # a new command: a new sandbox
    assert fresh.id != busy.id
    assert await layer.containers.reap_idle() == 0  # still running: kept
    busy.release()
    assert await layer.containers.reap_idle() == 1
    assert busy.id not in layer.engine.containers and busy not in layer.containers.live()
    assert await layer.containers.retire(["box"]) == 1  # idle: removed at once
    assert fresh.id not in layer.engine.containers
    assert removed(layer) == [(busy.id[:12], "profile_changed"), (fresh.id[:12], "profile_changed")]


async def test_a_sandbox_of_a_changed_profile_takes_no_new_command(layer: Layer) -> None:
    old = await layer.containers.ensure(layer.ws, BOX)
    old.acquire()
    stricter = msgspec.structs.replace(BOX, pids=BOX.pids - 1)
    new = await layer.containers.ensure(layer.ws, stricter)
    assert new.id != old.id and new.profile == stricter
    # Labelled for the same pair, the busy old one is not removed as a foreign container.
    assert old.id in layer.engine.containers and old in layer.containers.live()
    old.release()
    await layer.containers.remove_all("shutdown")
    assert not layer.engine.containers
