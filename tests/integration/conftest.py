"""Fixtures for tests against the real Docker engine.

Every test under tests/integration/ is marked `docker`. The `docker_client` fixture
connects to the engine; when none answers it fails loudly if SUBSTRATE_REQUIRE_DOCKER=1
(CI, where a missing engine is a broken machine) and skips otherwise (a laptop without
Docker). `tiny_image` and `sandbox_image` build the images if they are missing (the
sandbox needs network to deb.debian.org the first time, about a minute; `scripts/setup`
normally made them already) and return their tags. They stay after the session: they
are the product's images, not test leftovers.

Containers a test creates carry the `test_labels` fixture's labels; whatever still
carries them when the session ends is removed, so a failed test leaves nothing running
(see `tests.harness.engine`).
"""

from __future__ import annotations

import gc
import os
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from substrate.sandbox.images import build as imagebuild
from tests.harness import DaemonProcess, engine

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items; mark only the ones collected from here.
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.docker)


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A docker SDK client; fails or skips (see module doc) when no engine answers."""
    # docker-py leaks the socket of a failed connection; collect it here, where its
    # ResourceWarning is expected, instead of in some later test (filterwarnings=error).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        client, why = engine.connect()
        gc.collect()
    if client is None:
        if os.environ.get("SUBSTRATE_REQUIRE_DOCKER") == "1":
            pytest.fail(f"SUBSTRATE_REQUIRE_DOCKER=1 but no Docker engine answers: {why}")
        pytest.skip("no Docker engine")
    try:
        yield client
    finally:
        engine.remove_test_containers(client)
        client.close()


@pytest.fixture(scope="session")
def test_labels() -> dict[str, str]:
    """Labels to put on every container a test creates (a copy: tests may add to it)."""
    return dict(engine.TEST_LABELS)


@pytest.fixture(scope="session")
def tiny_image(docker_client: Any) -> str:
    """`substrate-tiny:latest`, built (seconds, no network) if missing or stale."""
    return imagebuild.build_tiny()


@pytest.fixture(scope="session")
def sandbox_image(docker_client: Any) -> str:
    """`substrate-sandbox:bookworm`, built from the cached rootfs if missing or stale."""
    return imagebuild.build_default()


@pytest.fixture
def engine_state(
    docker_client: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Path]:
    """A state dir (0700) for one test's in-process daemon (`tests.harness.inprocess`),
    which talks to the engine's real socket. After the test: every container of that
    daemon is removed, and a mount left under the state dir is unmounted and fails the
    test (a daemon must take its working layers down)."""
    monkeypatch.setenv("DOCKER_HOST", "unix:///var/run/docker.sock")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    yield state
    engine.remove_daemon_containers(docker_client, state)
    assert engine.sweep_mounts(state) == []


@pytest.fixture
def engine_daemons(
    daemon_factory: Callable[..., DaemonProcess], docker_client: Any
) -> Iterator[Callable[..., DaemonProcess]]:
    """`engine_daemons(**substrate_toml_keys)`: `daemon_factory`'s daemons, each stopped
    at teardown (a graceful stop takes its sandboxes and working layers down), then every
    container labelled with its daemon id removed (a daemon killed with -9 cannot remove
    its own), and a mount left under its state dir unmounted and failing the test."""
    made: list[DaemonProcess] = []

    def make(**config: Any) -> DaemonProcess:
        made.append(daemon_factory(**config))
        return made[-1]

    try:
        yield make
    finally:
        left: list[str] = []
        for d in made:
            if d.running:
                d.stop()
            engine.remove_daemon_containers(docker_client, d.state_dir)
            left += engine.sweep_mounts(d.state_dir)
        assert left == []  # never leave a test's mount behind
