"""docs/quickstart.md's agent loop, run as the page says against a real daemon and engine.

`python docs/examples/agent_loop.py --init <checkout>` creates the demo project through
guarded writes, sees its tests fail in the `default` sandbox, finds `add`, tries a wrong
fix (patch bound to the digest it read), reads the failures (from the artifact when the
daemon's inline limit is low), restores the checkpoint, tries the right fix and keeps
it. The checkout must end with exactly the demo files and the right fix, and the
journal must show the writes, the checkpoints and the restore.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable

import pytest

from substrate.config import PROJECT_ROOT
from tests.harness import DaemonProcess, daemon_env

EXAMPLE = PROJECT_ROOT / "docs" / "examples" / "agent_loop.py"


@pytest.fixture
def make_daemon(
    engine_daemons: Callable[..., DaemonProcess], sandbox_image: str
) -> Callable[..., DaemonProcess]:
    return engine_daemons


def run_example(d: DaemonProcess, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLE), "--state-dir", str(d.state_dir), *args],
        capture_output=True,
        text=True,
        env=daemon_env(),
        cwd="/",
        timeout=600,
        check=False,
    )


@pytest.mark.parametrize("inline_output_bytes", [256, 64 << 10], ids=["artifact", "inline"])
def test_the_quickstart_loop_fixes_the_demo_and_reverts_the_wrong_fix(
    make_daemon: Callable[..., DaemonProcess], inline_output_bytes: int
) -> None:
    d = make_daemon(inline_output_bytes=inline_output_bytes)
    checkout = d.make_workspace(files={})
    done = run_example(d, "--init", str(checkout))
    out = done.stdout
    assert done.returncode == 0, out + done.stderr
    steps = [line for line in out.splitlines() if not line.startswith("  ")]
    assert steps[1:] == [
        "created calc.py",
        "created test_calc.py",
        "tests fail (12 line(s)):",
        "found calc.py:1: def add(a: int, b: int) -> int:",
        "attempt 1:",
        "attempt 2:",
        "fixed",
    ]
    assert "  | FAILED test_calc.py::test_add - assert -1 == 5" in out  # before any fix
    assert "  | FAILED test_calc.py::test_add - assert 1 == 5" in out  # after the wrong one
    assert "  tests still fail: restored 1 file(s) from checkpoint " in out
    assert "  tests pass: keeping the fix" in out
    from_artifact = "failure line(s) from artifact art_" in out
    assert from_artifact is (inline_output_bytes == 256)

    # Exactly the demo files, with the right fix: the tests' own writes were discarded.
    assert sorted(p.name for p in checkout.iterdir()) == ["calc.py", "test_calc.py"]
    assert (checkout / "calc.py").read_text().endswith("    return a + b\n")
    kinds = [e["kind"] for e in d.journal()]
    assert kinds.count("fs.write") == 2 and kinds.count("fs.patch") == 2
    assert kinds.count("workspace.checkpoint") == 2 and kinds.count("workspace.restore") == 1
    assert "changes.apply" not in kinds

    again = run_example(d, str(checkout))
    assert again.returncode == 0 and "tests pass already" in again.stdout, again.stderr
