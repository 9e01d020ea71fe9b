"""The TypeScript client (clients/typescript/, docs/clients.md): `npm test` there, against
a real daemon the node tests start from this checkout, with this interpreter.

`npm ci` runs only when `node_modules` is not what `package-lock.json` pins (npm's own
record, `node_modules/.package-lock.json`, is compared), so a second run needs no
registry. The node test runner's report is printed; any failing node test fails this one.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

CLIENT = Path(__file__).resolve().parents[2] / "clients" / "typescript"
NPM_TIMEOUT_S = 600


def _installed(client: Path) -> bool:
    """node_modules holds exactly what the lock file pins."""
    try:
        lock = json.loads((client / "package-lock.json").read_text())
        record = json.loads((client / "node_modules" / ".package-lock.json").read_text())
    except (OSError, ValueError):
        return False
    wanted = {k: v.get("version") for k, v in lock["packages"].items() if k}
    have = {k: v.get("version") for k, v in record["packages"].items() if k}
    return wanted == have


def _npm(*args: str) -> subprocess.CompletedProcess[str]:
    npm = shutil.which("npm")
    if npm is None:
        pytest.fail("npm is not installed (scripts/setup installs nodejs and npm)")
    env = {**os.environ, "SUBSTRATE_PYTHON": sys.executable}
    env.pop("SUBSTRATE_STATE_DIR", None)
    return subprocess.run(
        [npm, *args],
        cwd=CLIENT,
        env=env,
        capture_output=True,
        text=True,
        timeout=NPM_TIMEOUT_S,
        check=False,
    )


def test_npm_test_passes_against_a_real_daemon(docker_client: Any, sandbox_image: str) -> None:
    if not _installed(CLIENT):
        done = _npm("ci", "--no-audit", "--no-fund", "--prefer-offline")
        assert done.returncode == 0, done.stdout + done.stderr
    done = _npm("test")
    print(done.stdout)
    assert done.returncode == 0, done.stdout[-20000:] + done.stderr[-5000:]
    # The report names every node test; none may have been skipped or left out.
    assert "# fail 0" in done.stdout
    assert "# skipped 0" in done.stdout
    assert "ok " in done.stdout and "proc.subscribe is an async iterator" in done.stdout
