"""`substrate status --ready` and `substrate drain` (docs/deployment.md): the readiness
answer an orchestrator gets, and what it gets when no daemon answers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from substrate.cli.main import main
from substrate.cli.node import ready


def status(**overrides: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"engine": {"reachable": True}, "draining": False, "running": 0}
    return base | overrides


def test_ready_only_with_a_reachable_engine_and_no_drain() -> None:
    assert ready(status())
    assert not ready(status(engine={"reachable": False}))
    assert not ready(status(draining=True))
    assert not ready({})


@pytest.mark.parametrize("argv", [["status", "--ready"], ["status"], ["drain", "--timeout", "0"]])
def test_no_daemon_is_not_ready(
    argv: list[str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--state-dir", str(tmp_path), *argv]) == 1
    assert "cannot reach the daemon" in capsys.readouterr().err
