"""Fixtures of the fleet tests: a private PostgreSQL server (`tests.harness.postgres`)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.harness.postgres import PostgresServer, postgres_server


@pytest.fixture(scope="module")
def postgres() -> Iterator[PostgresServer]:
    """One private server per test module (each test uses node names of its own)."""
    with postgres_server() as server:
        yield server
