"""Fixtures for tests against the real Docker engine.

Every test under tests/integration/ is marked `docker`. The `docker_client` fixture
connects to the engine; when none answers it fails loudly if SUBSTRATE_REQUIRE_DOCKER=1
(CI, where a missing engine is a broken machine) and skips otherwise (a laptop without
Docker). `tiny_image` and `sandbox_image` build the images if they are missing (the
sandbox needs network to deb.debian.org the first time, about a minute; `scripts/setup`
normally made them already) and return their tags. They stay after the session: they
are the product's images, not test leftovers.

Containers a test creates carry the `test_labels` fixture's labels (`substrate.test=1`
and this session's id); whatever still carries them when the session ends is removed, so
a failed test leaves nothing running. A `substrate.test=1` container without a session id
is removed too if it was created during this session; another session's are left alone
(several test sessions may share one engine).
"""

from __future__ import annotations

import calendar
import gc
import os
import time
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import docker
import docker.errors
import pytest

from substrate.sandbox.images import build as imagebuild

#: Labels every container made by a test carries; `remove_test_containers` finds them.
TEST_LABELS = {"substrate.test": "1", "substrate.test.session": uuid.uuid4().hex}
_SESSION_STARTED = time.time()

_HERE = Path(__file__).resolve().parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # This hook sees the whole session's items; mark only the ones collected from here.
    for item in items:
        if _HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.docker)


def remove_test_containers(client: Any) -> list[str]:
    """Force-remove this session's test containers (see module doc); return short ids."""
    removed = []
    session = TEST_LABELS["substrate.test.session"]
    for container in client.containers.list(all=True, filters={"label": "substrate.test=1"}):
        labels = container.labels or {}
        ours = labels.get("substrate.test.session") == session
        unclaimed = "substrate.test.session" not in labels and _created_after(
            container, _SESSION_STARTED
        )
        if not (ours or unclaimed):
            continue
        try:
            container.remove(force=True, v=True)
        except docker.errors.NotFound:
            continue  # gone already (auto-remove)
        removed.append(container.short_id)
    return removed


def _created_after(container: Any, started: float) -> bool:
    created = container.attrs.get("Created")
    if isinstance(created, int):  # the list endpoint's form
        return created >= int(started) - 1
    # The inspect form is RFC 3339 UTC with nanoseconds; seconds are precise enough here.
    try:
        stamp = calendar.timegm(time.strptime(str(created)[:19], "%Y-%m-%dT%H:%M:%S"))
    except ValueError:
        return False
    return stamp >= int(started) - 1


def _connect() -> tuple[Any, str]:
    """(client, "") when an engine answers, else (None, why)."""
    try:
        client = docker.from_env()
    except docker.errors.DockerException as exc:
        return None, str(exc)
    try:
        client.ping()
    except docker.errors.DockerException as exc:
        client.close()
        return None, str(exc)
    return client, ""


@pytest.fixture(scope="session")
def docker_client() -> Iterator[Any]:
    """A docker SDK client; fails or skips (see module doc) when no engine answers."""
    # docker-py leaks the socket of a failed connection; collect it here, where its
    # ResourceWarning is expected, instead of in some later test (filterwarnings=error).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)
        client, why = _connect()
        gc.collect()
    if client is None:
        if os.environ.get("SUBSTRATE_REQUIRE_DOCKER") == "1":
            pytest.fail(f"SUBSTRATE_REQUIRE_DOCKER=1 but no Docker engine answers: {why}")
        pytest.skip("no Docker engine")
    try:
        yield client
    finally:
        remove_test_containers(client)
        client.close()


@pytest.fixture(scope="session")
def test_labels() -> dict[str, str]:
    """Labels to put on every container a test creates (a copy: tests may add to it)."""
    return dict(TEST_LABELS)


@pytest.fixture(scope="session")
def tiny_image(docker_client: Any) -> str:
    """`substrate-tiny:latest`, built (seconds, no network) if missing or stale."""
    return imagebuild.build_tiny()


@pytest.fixture(scope="session")
def sandbox_image(docker_client: Any) -> str:
    """`substrate-sandbox:bookworm`, built from the cached rootfs if missing or stale."""
    return imagebuild.build_default()
