"""`substrate.mcp.bounds`: results cut to the size limit, saying what was cut (pure)."""

from __future__ import annotations

import base64
import json
from typing import Any

from substrate.mcp.bounds import PREVIEW_BYTES, encode, fit, previews

LIMIT = 4096


def test_a_result_within_the_limit_is_untouched() -> None:
    result = {"matches": [{"path": "a", "line": 1}], "truncated": False}
    out, text = fit(result, "matches", LIMIT)
    assert out == result and json.loads(text) == result and "elided" not in out


def test_a_list_keeps_its_longest_fitting_prefix_and_says_so() -> None:
    matches = [{"path": f"f{i}.py", "line": i, "column": 1, "text": "x" * 40} for i in range(500)]
    out, text = fit({"matches": matches, "truncated": False, "files_scanned": 9}, "matches", LIMIT)
    assert len(text) <= LIMIT and json.loads(text) == out
    assert 0 < len(out["matches"]) < 500
    assert out["matches"] == matches[: len(out["matches"])]  # a prefix, in order
    assert out["truncated"] is True and out["files_scanned"] == 9
    assert f"the first {len(out['matches'])} of 500" in out["elided"]


def test_artifact_lines_cut_say_not_eof() -> None:
    out, text = fit({"start": 1, "lines": ["y" * 100] * 100, "eof": True}, "lines", LIMIT)
    assert len(text) <= LIMIT and out["eof"] is False and 0 < len(out["lines"]) < 100


def test_text_data_is_cut_on_a_character_and_continues_exactly() -> None:
    data = ('é"\\\n' * 3000)[:9000]
    result = {"path": "f", "size": 99, "offset": 0, "eof": True, "encoding": "utf-8", "data": data}
    out, text = fit(result, "data", LIMIT)
    assert len(text) <= LIMIT and out["eof"] is False
    assert data.startswith(out["data"]) and len(out["data"]) > 100  # escapes count, chars kept


def test_base64_data_is_cut_on_a_whole_group() -> None:
    raw = bytes(range(256)) * 40
    data = base64.b64encode(raw).decode()
    out, text = fit({"offset": 0, "eof": True, "encoding": "base64", "data": data}, "data", LIMIT)
    assert len(text) <= LIMIT and len(out["data"]) % 4 == 0
    assert raw.startswith(base64.b64decode(out["data"]))


def proc_result(stdout: bytes, *, encoding: str = "utf-8") -> dict[str, Any]:
    inline = stdout.decode() if encoding == "utf-8" else base64.b64encode(stdout).decode()
    ref = {"bytes": len(stdout), "sha256": "0" * 64, "truncated": False}
    return {
        "proc": "p_1",
        "exit_code": 0,
        "stdout": {**ref, "encoding": encoding, "inline": inline},
        "stderr": {**ref, "bytes": 0, "encoding": "utf-8", "inline": ""},
        "facts": [],
    }


def test_inline_output_becomes_a_head_and_tail_pointing_at_proc_output() -> None:
    stdout = "".join(f"{i}\n" for i in range(20000)).encode()
    out, text = fit(proc_result(stdout), "proc", 16 << 10)
    assert len(text) <= 16 << 10
    ref = out["stdout"]
    assert "inline" not in ref and "encoding" not in ref and ref["bytes"] == len(stdout)
    assert stdout.startswith(ref["preview_head"].encode())
    assert stdout.endswith(ref["preview_tail"].encode())
    assert len(ref["preview_head"]) == PREVIEW_BYTES
    assert "proc_output" in out["elided"] and out["exit_code"] == 0


def test_previews_shrink_until_the_result_fits() -> None:
    stdout = b"z" * 50000
    out, text = fit(proc_result(stdout, encoding="base64"), "proc", LIMIT)
    assert len(text) <= LIMIT
    assert 0 < len(out["stdout"]["preview_head"]) < PREVIEW_BYTES


def test_previews_are_whole_characters() -> None:
    data = "ä".encode() * 5000  # 2 bytes each: an odd cut lands inside one
    head, tail = previews(data, 101)
    assert head == "ä" * 50 and tail == "ä" * 50


def test_change_sets_lose_their_diffs_first() -> None:
    changes = [{"path": f"f{i}", "op": "replace", "diff": "-a\n+b\n" * 200} for i in range(20)]
    result = {"changeset": "c", "changes": changes, "blocked": [], "total_changes": 20}
    out, text = fit(result, "changes", 16 << 10)
    assert len(text) <= 16 << 10 and len(out["changes"]) == 20
    assert all(c["diff"] == "" and c["diff_truncated"] for c in out["changes"])


def test_what_has_no_rule_loses_its_largest_parts_first() -> None:
    result = {"proc": "p", "big": ["x" * 100] * 100, "small": {"a": 1}}
    out, text = fit(result, "none", LIMIT)
    assert len(text) <= LIMIT and "big" not in out and out["small"] == {"a": 1}
    assert "big" in out["elided"] and encode(out) == text
