"""A finished command's result as text (substrate.protocol.proc_text): the exit code
first, the output tails, the changes, one line per path that did not land, bounded."""

from __future__ import annotations

from typing import Any

from substrate.protocol.proc_text import (
    MAX_LINES,
    TAIL_BYTES,
    blocked_lines,
    changes_line,
    is_proc_result,
    proc_text,
)


def _ref(text: str) -> dict[str, Any]:
    return {"bytes": len(text.encode()), "sha256": "0" * 64, "truncated": False, "inline": text}


CHANGES: dict[str, Any] = {
    "generation": 0,
    "changeset": "cs_0123456789abcdef",
    "mode": "apply",
    "applied": [{"path": "allowed.txt", "op": "create"}],
    "blocked": [{"path": ".env", "op": "create", "reason": "path_denied", "rule": ".env"}],
    "pending": [
        {"path": "deploy/conf", "op": "create", "reason": "approval_required", "plan_digest": "ab"}
    ],
    "conflicts": [{"path": "old.txt", "op": "replace", "reason": "host_changed", "artifact": "a1"}],
    "counts": {"applied": 1, "unchanged": 0, "blocked": 1, "pending": 1, "conflicts": 1},
}


def test_the_exit_code_comes_first_then_the_output_then_changes_and_blocked_paths() -> None:
    result = {
        "proc": "p_1",
        "exit_code": 0,
        "signal": None,
        "timed_out": False,
        "stdout": _ref("done\n"),
        "stderr": _ref(""),
        "changes": CHANGES,
    }
    assert proc_text(result).splitlines() == [
        "exit code 0",
        "--- stdout (5 bytes) ---",
        "done",
        "changes: 1 applied, 1 blocked, 1 pending, 1 conflicts (changeset cs_0123456789abcdef)",
        "blocked .env (create): path_denied, rule .env",
        "pending deploy/conf (create): approval_required, approve plan_digest ab",
        "conflict old.txt (replace): host_changed, its version: artifact a1",
    ]
    assert is_proc_result(result) and not is_proc_result({"proc": "p_1", "state": "running"})


def test_a_long_stream_shows_its_tail_and_a_spilled_one_names_its_artifact() -> None:
    long = "".join(f"line {i}\n" for i in range(5000))
    spilled = {"bytes": 10**6, "sha256": "0" * 64, "truncated": False, "artifact": "art_1"}
    spilled["preview_tail"] = "the end\n"
    result = {"proc": "p", "exit_code": 137, "signal": "KILL", "timed_out": True}
    text = proc_text({**result, "stdout": _ref(long), "stderr": spilled})
    lines = text.splitlines()
    assert lines[0] == "exit code 137 (signal KILL, timed out)"
    assert lines[1].startswith("--- stdout: the last ") and "structuredContent" in lines[1]
    assert "line 4999" in lines and "line 0" not in lines
    assert len(text.encode()) < 2 * TAIL_BYTES + 1024
    assert "--- stderr: the last 8 of 1000000 bytes (all of it: artifact art_1) ---" in lines
    assert lines[-1] == "the end"


def test_blocked_lines_are_bounded_and_count_the_rest() -> None:
    many = [
        {"path": f"d/{i}", "op": "create", "reason": "path_denied", "rule": "d/**"}
        for i in range(1000)
    ]
    changes = {
        "blocked": many,
        "counts": {"blocked": 100_000, "pending": 0, "conflicts": 2},
        "conflicts": [{"path": "x", "reason": "stale_base"}] * 2,
    }
    lines = blocked_lines(changes)
    assert len(lines) == MAX_LINES + 1
    assert lines[-1] == f"… and {100_002 - MAX_LINES} more (changes.get has them all)"
    assert blocked_lines(None) == [] and changes_line(None) is None
    assert changes_line({"counts": {"applied": 0}}) == "changes: none"
