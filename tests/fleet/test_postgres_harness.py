"""tests/harness/postgres.py: without PostgreSQL, a run that requires the real services
fails loudly (as a missing engine does) and any other run skips."""

from __future__ import annotations

import pytest

from tests.harness import postgres


def test_a_missing_server_fails_loudly_when_required(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres, "find_bindir", lambda: None)
    monkeypatch.setenv("SUBSTRATE_REQUIRE_DOCKER", "1")
    with (
        pytest.raises(pytest.fail.Exception, match="no PostgreSQL server"),
        postgres.postgres_server(),
    ):
        pass
    monkeypatch.setenv("SUBSTRATE_REQUIRE_DOCKER", "0")
    with pytest.raises(pytest.skip.Exception), postgres.postgres_server():
        pass
