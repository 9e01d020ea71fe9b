"""`substrate.sandbox.environment` through `Containers`, the runner and the terminal backend,
over the fake engine (no Docker): a secret's value reaches each exec's environment and
never the container's configuration; a missing one refuses before anything is made; a
value set again is used by the next command; the persistent home is bound, required by
its identity, and outlives its sandboxes."""

from __future__ import annotations

import dataclasses
import os
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fake_execution import IMAGE, PROFILES, Layer, fake_layer

from substrate.errors import ConfinementUnmet, LimitExceeded, SecretUnknown
from substrate.process.argv import exec_env
from substrate.pty.docker import DockerPtys
from substrate.sandbox.fake_engine import FakeExec
from substrate.sandbox.profiles import Profile
from substrate.sandbox.spec import HOME_TARGET
from substrate.secrets import SecretStore
from substrate.workspace.homes import Home, Homes, home_key, secret_set

# The fake engine keeps no working layers: plain-bind ("rw") profiles.
SECRET = Profile(name="secret", image=IMAGE, workspace="rw", secrets={"API_TOKEN": "api-token"})
TERM = Profile(
    name="term", image=IMAGE, workspace="rw", interactive=True, secrets={"API_TOKEN": "api-token"}
)
BOX = PROFILES["box"]


@pytest.fixture
def layer(adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]) -> Iterator[Layer]:
    root = make_workspace("envs", {"a.txt": "a\n"})
    profiles = {**PROFILES, "secret": SECRET, "term": TERM}
    with fake_layer(
        root, tmp_path / "state", adopt_root, profiles=profiles, environment=True
    ) as made:
        made.engine.program = print_token
        yield made


def print_token(ex: FakeExec) -> None:
    """A program printing its `API_TOKEN` (or `<none>`)."""
    ex.write(ex.environment.get("API_TOKEN", "<none>").encode())
    ex.exit(0)


def store(layer: Layer) -> SecretStore:
    return SecretStore(layer.state)


async def output(layer: Layer, profile: str) -> str:
    result = await layer.processes.run(layer.request(["printenv"], profile))
    assert result.exit_code == 0
    assert result.stdout.inline is not None
    return result.stdout.inline


def journal_text(layer: Layer) -> str:
    return repr([(e.kind, e.data) for e in layer.journal.read(limit=10_000)])


async def test_a_secret_is_in_each_exec_env_never_in_the_container_config(layer: Layer) -> None:
    value = "sk-" + secrets.token_hex(16)
    store(layer).set("api-token", value.encode())
    assert await output(layer, "secret") == value
    assert await output(layer, "box") == "<none>"  # another profile of the workspace
    made = {c.labels["substrate.profile"]: c for c in layer.engine.containers.values()}
    assert made["secret"].request["environment"] == SECRET.env  # the declared env only
    assert "API_TOKEN" not in repr(made["secret"].request)
    assert value not in journal_text(layer)
    # The sandbox's profile carries the value for the execs; the loaded one never does.
    sandbox = layer.containers.cached(layer.ws.id, "secret")
    assert sandbox is not None and exec_env(sandbox.profile, "p")["API_TOKEN"] == value
    assert "API_TOKEN" not in SECRET.env


async def test_a_missing_secret_refuses_before_anything_is_made(layer: Layer) -> None:
    with pytest.raises(SecretUnknown) as caught:
        await layer.processes.run(layer.request(["printenv"], "secret"))
    assert caught.value.data == {"secrets": ["api-token"]}
    assert layer.engine.calls == [] and not (layer.state / "homes").exists()


async def test_a_value_set_again_is_used_next_and_a_removed_one_refuses(layer: Layer) -> None:
    store(layer).set("api-token", b"first")
    assert await output(layer, "secret") == "first"
    sandbox = layer.containers.cached(layer.ws.id, "secret")
    store(layer).set("api-token", b"second")
    assert await output(layer, "secret") == "second"
    assert layer.containers.cached(layer.ws.id, "secret") is sandbox  # no new container
    assert layer.engine.calls.count("create_container") == 1
    store(layer).remove("api-token")
    with pytest.raises(SecretUnknown):
        await layer.processes.run(layer.request(["printenv"], "secret"))


async def test_a_daemon_without_a_secret_store_refuses_a_profile_naming_one(
    adopt_root: Path, tmp_path: Path, make_workspace: Callable[..., Path]
) -> None:
    root = make_workspace("nostore")
    with fake_layer(root, tmp_path / "state", adopt_root) as plain:
        with pytest.raises(SecretUnknown):
            await plain.containers.ensure(plain.ws, SECRET)
        # ... and binds no home: HOME is whatever the image has there.
        sandbox = await plain.containers.ensure(plain.ws, BOX)
        targets = {
            m["Target"]
            for m in plain.engine.containers[sandbox.id].request["host_config"]["mounts"]
        }
        assert HOME_TARGET not in targets
        assert "home_identity" not in {f.name for f in sandbox.facts}


async def test_a_terminal_shell_gets_the_secret_too(layer: Layer) -> None:
    store(layer).set("api-token", b"for-the-shell")
    execution: Any = SimpleNamespace(
        containers=layer.containers,
        engine=layer.engine,
        profile={"term": TERM}.__getitem__,
        # An rw profile joins no generation; the daemon is not draining.
        processes=SimpleNamespace(layer_users=None, refuse_if_draining=lambda: None),
    )
    pty = await DockerPtys(execution, lambda _: layer.ws)(
        workspace=layer.ws.id, profile="term", cols=80, rows=24, session="s1", actor="agent"
    )
    try:
        (shell,) = [e for e in layer.engine.execs.values() if e.tty]
        assert shell.environment["API_TOKEN"] == "for-the-shell"
        assert shell.environment["TERM"] == "xterm-256color"
        assert await pty.read(100) == b"for-the-shell"
    finally:
        await pty.terminate()
    made = layer.engine.containers[layer.containers.cached(layer.ws.id, "term").id]  # type: ignore[union-attr]
    assert "API_TOKEN" not in repr(made.request)


async def test_the_home_is_bound_read_write_and_required_by_identity(layer: Layer) -> None:
    sandbox = await layer.containers.ensure(layer.ws, BOX)
    binds = {
        m["Target"]: m for m in layer.engine.containers[sandbox.id].request["host_config"]["mounts"]
    }
    home = binds[HOME_TARGET]
    expected = layer.state / "homes" / home_key(layer.ws.checkout) / "1000"
    assert home["Source"] == str(expected) and home["ReadOnly"] is False
    st = os.stat(expected)
    assert (st.st_uid, st.st_gid, st.st_mode & 0o7777) == (1000, 1000, 0o700)
    facts = {f.name: f.value for f in sandbox.facts}
    assert facts["home_identity"] == f"{st.st_dev}:{st.st_ino}"
    (expected / "note").write_text("kept\n")
    await layer.containers.release_workspace(layer.ws.id)
    assert layer.engine.containers == {}
    assert (expected / "note").read_text() == "kept\n"  # the home outlives its sandbox
    again = await layer.containers.ensure(layer.ws, PROFILES["other"])  # another profile
    assert again.home == sandbox.home


class SwappedHomes(Homes):
    """Prepares the real home but hands the engine another directory to bind."""

    def __init__(self, state: Path, elsewhere: Path) -> None:
        super().__init__(state)
        self.elsewhere = elsewhere

    def prepare(self, checkout: str, uid: int, gid: int, secrets: str | None = None) -> Home:
        real = super().prepare(checkout, uid, gid, secrets)
        return dataclasses.replace(real, source=str(self.elsewhere))


async def test_a_home_that_is_not_the_prepared_directory_is_refused(
    layer: Layer, tmp_path: Path
) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    layer.containers.environment.homes = SwappedHomes(layer.state, elsewhere)
    with pytest.raises(ConfinementUnmet) as caught:
        await layer.containers.ensure(layer.ws, BOX)
    assert "home_identity" in caught.value.data["required"]
    assert layer.engine.containers == {}


async def test_a_profile_holding_secrets_gets_the_home_of_its_secret_set(layer: Layer) -> None:
    store(layer).set("api-token", b"t")
    plain = await layer.containers.ensure(layer.ws, BOX)
    secret = await layer.containers.ensure(layer.ws, SECRET)
    assert plain.home is not None and secret.home is not None
    assert secret.home.name == f"1000-{secret_set(SECRET.secrets)}" and plain.home.name == "1000"
    assert Path(secret.home.source).parent == Path(plain.home.source).parent
    binds = {
        m["Target"]: m for m in layer.engine.containers[secret.id].request["host_config"]["mounts"]
    }
    assert binds[HOME_TARGET]["Source"] == secret.home.source
    st = os.stat(secret.home.source)
    assert {f.name: f.value for f in secret.facts}["home_identity"] == f"{st.st_dev}:{st.st_ino}"


async def test_a_home_over_its_quota_refuses_the_next_command(layer: Layer) -> None:
    homes = layer.containers.environment.homes
    assert homes is not None
    homes.quota.quota_bytes = 100
    sandbox = await layer.containers.ensure(layer.ws, BOX)
    assert sandbox.home is not None
    big = Path(sandbox.home.source) / "big"
    big.write_bytes(b"x" * 200)
    with pytest.raises(LimitExceeded) as caught:
        await layer.processes.run(layer.request(["printenv"], "box"))
    assert caught.value.data["scope"] == "home" and caught.value.data["bytes"] == 200
    big.unlink()
    await output(layer, "box")
