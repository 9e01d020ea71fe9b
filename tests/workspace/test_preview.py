"""substrate.workspace.preview: bounded `diff -u` previews (pure), applied back by the patcher."""

from __future__ import annotations

import difflib
from unittest import mock

from hypothesis import given, settings
from hypothesis import strategies as st

from substrate.workspace import preview
from substrate.workspace.patching import apply_unified_diff, split_lines
from substrate.workspace.preview import unified_preview

LINE_ALPHABET = st.sampled_from(["a", "b", "c", "", "  x", "dup", "é", "--- h", "+++ h", "@@ x"])


@st.composite
def texts(draw: st.DrawFn) -> str:
    lines = draw(st.lists(LINE_ALPHABET, max_size=25))
    ending = draw(st.sampled_from(["\n", "\r\n"]))
    text = "".join(line + ending for line in lines)
    if text and draw(st.booleans()):
        text = text[: -len(ending)]  # no newline at end of file
    return text


@settings(max_examples=300, deadline=None)
@given(old=texts(), new=texts())
def test_round_trip_property_preview(old: str, new: str) -> None:
    text, truncated = unified_preview(old.encode(), new.encode(), "f", max_bytes=1 << 20)
    assert not truncated
    if old == new:
        assert text == ""
        return
    assert apply_unified_diff(old.encode(), text) == new.encode()


@settings(max_examples=200, deadline=None)
@given(old=texts(), new=texts())
def test_round_trip_property_preview_coarse_and_anchored(old: str, new: str) -> None:
    # Tiny match limits force the patience anchors and the coarse replace paths.
    for limit in (0, 2, 5):
        with mock.patch.object(preview, "PREVIEW_MATCH_LINES", limit):
            text, _ = unified_preview(old.encode(), new.encode(), "f", max_bytes=1 << 20)
        if old != new:
            assert apply_unified_diff(old.encode(), text) == new.encode()


def test_preview_shape() -> None:
    text, truncated = unified_preview(b"a\nb\nc\n", b"a\nB\nc\n", "src/f.py")
    assert not truncated
    assert text == "--- a/src/f.py\n+++ b/src/f.py\n@@ -1,3 +1,3 @@\n a\n-b\n+B\n c\n"


def test_preview_of_equal_content_is_empty() -> None:
    assert unified_preview(b"same\n", b"same\n", "f") == ("", False)


def test_preview_matches_difflib_on_small_input() -> None:
    old = "".join(f"{i}\n" for i in range(30))
    new = old.replace("4\n", "four\n").replace("20\n", "").replace("29\n", "29")
    expected = "".join(
        difflib.unified_diff(split_lines(old), split_lines(new), "a/f", "b/f", lineterm="\n")
    ).replace("+29", "+29\n\\ No newline at end of file\n", 1)
    assert unified_preview(old.encode(), new.encode(), "f")[0] == expected


def test_preview_marks_missing_newline() -> None:
    text, _ = unified_preview(b"a\n", b"a", "f")
    assert text.endswith("-a\n+a\n\\ No newline at end of file\n")


def test_preview_is_cut_on_a_line_boundary() -> None:
    old = "".join(f"old line {i}\n" for i in range(2000)).encode()
    new = "".join(f"new line {i}\n" for i in range(2000)).encode()
    full, full_truncated = unified_preview(old, new, "f", max_bytes=1 << 20)
    text, truncated = unified_preview(old, new, "f", max_bytes=1000)
    assert not full_truncated
    assert truncated
    assert 0 < len(text.encode()) <= 1000
    assert text.endswith("\n")
    assert full.startswith(text)
    # The next line would not have fit.
    next_line = full[len(text) :].split("\n", 1)[0] + "\n"
    assert len(text.encode()) + len(next_line.encode()) > 1000


def test_preview_bound_counts_utf8_bytes() -> None:
    text, truncated = unified_preview("é\n".encode() * 50, "ü\n".encode() * 50, "f", 100)
    assert truncated
    assert len(text.encode()) <= 100


def test_binary_preview_is_one_summary_line() -> None:
    assert unified_preview(b"\x00\xff\x01", b"text\n", "f") == (
        "Binary files differ (3 -> 5 bytes)\n",
        False,
    )
    assert unified_preview(b"ok\n", b"\xc3", "f")[0] == "Binary files differ (3 -> 1 bytes)\n"


def test_huge_side_is_summarized_not_diffed() -> None:
    big = b"x\n" * (preview.PREVIEW_DIFF_LIMIT // 2 + 1)
    assert unified_preview(b"small\n", big, "f") == (
        f"Files differ (6 -> {len(big)} bytes; too large to diff)\n",
        True,
    )


def test_big_file_with_far_apart_changes_gets_a_minimal_preview() -> None:
    # Edits near both ends leave no common tail and a big middle: the patience anchors
    # must still find the unchanged lines between them.
    lines = [f"line {i}\n" for i in range(preview.PREVIEW_MATCH_LINES * 3)]
    changed = ["first\n", *lines[1:-1], "last\n"]
    text, truncated = unified_preview("".join(lines).encode(), "".join(changed).encode(), "f")
    assert not truncated
    assert text.count("@@ -") == 2
    assert sum(1 for line in text.splitlines() if line.startswith(("-", "+"))) == 6


def test_preview_quotes_paths_with_control_characters() -> None:
    text, _ = unified_preview(b"a\n", b"b\n", 'we"ird\nname')
    assert text.startswith('--- "a/we\\"ird\\nname"\n+++ "b/we\\"ird\\nname"\n')
