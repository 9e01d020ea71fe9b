"""substrate.workspace.patching: exact edits and strict unified diffs (pure)."""

from __future__ import annotations

import difflib
import shutil
import subprocess
import tracemalloc
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import msgspec
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from substrate.errors import PatchConflict, TooLarge
from substrate.workspace import patching
from substrate.workspace.patching import apply_edits, apply_unified_diff


class EditSpec(msgspec.Struct, frozen=True, kw_only=True):
    """Mirror of the wire Struct: the appliers take anything with old/new/count."""

    old: str
    new: str
    count: int | Literal["all"] = 1


@dataclass(frozen=True)
class Edit:
    old: str
    new: str
    count: int | Literal["all"] = 1


def conflict(excinfo: pytest.ExceptionInfo[PatchConflict]) -> dict[str, object]:
    assert excinfo.value.name == "patch_conflict"
    return excinfo.value.data


def split(text: str) -> list[str]:
    """Lines split on "\\n" only, ends kept (what the appliers use)."""
    return patching.split_lines(text)


def difflib_diff(old: str, new: str, context: int = 3) -> str:
    """`difflib.unified_diff`, plus the `\\ No newline` markers it does not write."""
    out: list[str] = []
    for line in difflib.unified_diff(split(old), split(new), "a/f", "b/f", n=context):
        if line.endswith("\n"):
            out.append(line)
        else:
            out.append(line + "\n\\ No newline at end of file\n")
    return "".join(out)


# --------------------------------------------------------------------------------------
# apply_edits


def test_edit_replaces_the_single_occurrence() -> None:
    assert apply_edits(b"hello world\n", [EditSpec(old="world", new="there")]) == b"hello there\n"


def test_edit_with_no_occurrence_conflicts() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"hello\n", [EditSpec(old="absent", new="x")])
    assert conflict(excinfo) == {"edit": 0, "occurrences": 0, "expected": 1}


def test_edit_with_two_occurrences_but_count_one_conflicts() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"a = 1\na = 1\n", [Edit(old="a = 1", new="a = 2")])
    assert conflict(excinfo) == {"edit": 0, "occurrences": 2, "expected": 1}


def test_edit_count_two_replaces_both() -> None:
    out = apply_edits(b"x y x\n", [EditSpec(old="x", new="zz", count=2)])
    assert out == b"zz y zz\n"


def test_edit_count_two_with_three_occurrences_conflicts() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"x x x", [EditSpec(old="x", new="y", count=2)])
    assert conflict(excinfo)["occurrences"] == 3


def test_occurrences_do_not_overlap() -> None:
    # "aa" is in "aaa" once as str.count counts it (non-overlapping).
    assert apply_edits(b"aaa", [EditSpec(old="aa", new="b")]) == b"ba"


def test_edits_apply_in_order_to_the_previous_result() -> None:
    edits = [EditSpec(old="one", new="two"), EditSpec(old="two two", new="three")]
    assert apply_edits(b"two one", edits) == b"three"


def test_second_edit_failing_names_its_index() -> None:
    # The first edit removes what the second one looks for.
    edits = [EditSpec(old="alpha", new="beta"), EditSpec(old="alpha", new="gamma")]
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"alpha\n", edits)
    assert conflict(excinfo) == {"edit": 1, "occurrences": 0, "expected": 1}


def test_conflict_message_does_not_quote_contents() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"token=hunter2\n", [EditSpec(old="token=hunter2\n" * 2, new="")])
    assert "hunter2" not in str(excinfo.value)


def test_empty_old_conflicts() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"abc", [EditSpec(old="", new="x")])
    assert conflict(excinfo) == {"edit": 0}


def test_count_below_one_conflicts() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"abc", [EditSpec(old="a", new="x"), EditSpec(old="b", new="y", count=0)])
    assert conflict(excinfo) == {"edit": 1}


def test_edit_on_non_utf8_file_conflicts() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"\xff\xfe binary", [EditSpec(old="binary", new="text")])
    assert conflict(excinfo) == {"reason": "not_text"}
    assert "not UTF-8 text" in str(excinfo.value)


def test_edit_new_with_lone_surrogate_conflicts() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"abc", [EditSpec(old="b", new="\ud800")])
    assert conflict(excinfo) == {"edit": 0}


def test_edit_does_not_match_lf_against_crlf() -> None:
    with pytest.raises(PatchConflict):
        apply_edits(b"a\r\nb\r\n", [EditSpec(old="a\nb", new="c")])
    assert apply_edits(b"a\r\nb\r\n", [EditSpec(old="a\r\nb", new="c")]) == b"c\r\n"


def test_untouched_bytes_survive_including_bom_and_non_ascii() -> None:
    data = "\ufeffcafé ☕\nx\n".encode()
    assert apply_edits(data, [EditSpec(old="x", new="y")]) == "\ufeffcafé ☕\ny\n".encode()


def test_no_edits_returns_content_unchanged() -> None:
    assert apply_edits(b"same\n", []) == b"same\n"


def test_an_amplifying_edit_is_refused_before_its_result_is_built() -> None:
    """A 100 kB file and a tiny request asking for a 100 MB result: no memory is spent on it."""
    data = b"ab" * 50_000
    edits = [Edit(old="b", new="bb", count=50_000), Edit(old="b", new="b" * 1000, count=100_000)]
    tracemalloc.start()
    try:
        with pytest.raises(TooLarge) as excinfo:
            apply_edits(data, edits)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert excinfo.value.name == "too_large"
    assert excinfo.value.data == {"limit": patching.MAX_RESULT_BYTES}
    assert "edit 1" in excinfo.value.message
    assert peak < 4 << 20


@pytest.mark.parametrize(
    ("data", "edits", "size"),
    [
        (b"aaaa", [Edit(old="a", new="bb", count=4)], 8),
        (b"aaaa", [Edit(old="a", new="\u00e9", count=4)], 8),  # bytes, not characters
        (b"aaaa-", [Edit(old="a", new="", count=4), Edit(old="-", new="x" * 8)], 8),
        (b"aaaa-", [Edit(old="aaaa", new="\U0001f600\U0001f600")], 9),
    ],
)
def test_edit_results_are_bounded_in_utf8_bytes(data: bytes, edits: list[Edit], size: int) -> None:
    assert len(apply_edits(data, edits, max_bytes=size)) == size
    with pytest.raises(TooLarge):
        apply_edits(data, edits, max_bytes=size - 1)


def test_count_all_replaces_every_occurrence() -> None:
    out = apply_edits(b"x y x\nx\n", [EditSpec(old="x", new="zz", count="all")])
    assert out == b"zz y zz\nzz\n"
    # Each edit sees the previous one's result; "all" counts there too.
    edits = [EditSpec(old="a", new="ab", count="all"), EditSpec(old="b", new="c", count="all")]
    assert apply_edits(b"aba", edits) == b"accac"


def test_count_all_needs_at_least_one_occurrence() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_edits(b"abc", [EditSpec(old="a", new="x"), EditSpec(old="q", new="y", count="all")])
    assert conflict(excinfo) == {"edit": 1, "occurrences": 0, "expected": "all"}
    assert "at least once" in excinfo.value.message


def test_count_all_is_wire_valid_and_nothing_else_is() -> None:
    from substrate.schema.fs import Edit as WireEdit

    assert msgspec.convert({"old": "a", "new": "b", "count": "all"}, WireEdit).count == "all"
    for bad in ("some", 0, "1"):
        with pytest.raises(msgspec.ValidationError):
            msgspec.convert({"old": "a", "new": "b", "count": bad}, WireEdit, strict=True)


def test_an_amplifying_count_all_is_refused_before_its_result_is_built() -> None:
    data = b"b" * 100_000
    tracemalloc.start()
    try:
        with pytest.raises(TooLarge) as excinfo:
            apply_edits(data, [Edit(old="b", new="b" * 1000, count="all")])
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert excinfo.value.data == {"limit": patching.MAX_RESULT_BYTES}
    assert peak < 4 << 20


def test_a_growing_edit_is_refused_at_the_step_that_passes_the_bound() -> None:
    """Every step is bounded, not only the last: a later shrinking edit does not excuse it."""
    edits = [Edit(old="a", new="a" * 100, count=4), Edit(old="a" * 400, new="z")]
    with pytest.raises(TooLarge) as excinfo:
        apply_edits(b"aaaa", edits, max_bytes=100)
    assert "edit 0" in excinfo.value.message


# --------------------------------------------------------------------------------------
# apply_unified_diff: round trips


PAIRS = [
    ("a\nb\nc\n", "a\nB\nc\n"),
    ("a\nb\nc", "a\nb\nc\n"),  # gains the final newline
    ("a\nb\nc\n", "a\nb\nc"),  # loses it
    ("a\nb\nc", "a\nB\nc"),  # neither has one
    ("a\nb", "a\nb\nc\nd"),  # lines appended after a no-newline line
    ("", "new\nfile\n"),  # create from empty
    ("old\nfile\n", ""),  # delete all
    ("only", ""),  # delete all of a no-newline file
    (
        "\n".join(f"line {i}" for i in range(40)) + "\n",
        "\n".join(f"line {i}" for i in range(40) if i % 9) + "\nend\n",
    ),
    ("a\r\nb\r\nc\r\n", "a\r\nB\r\nc\r\n"),  # CRLF
    ("x\fy\n\u2028z\n", "x\fy\n\u2028Z\n"),  # only "\n" ends a line
]


@pytest.mark.parametrize(("old", "new"), PAIRS)
def test_difflib_diff_round_trips(old: str, new: str) -> None:
    for context in (0, 1, 3):
        diff = difflib_diff(old, new, context)
        assert apply_unified_diff(old.encode(), diff) == new.encode()


@pytest.mark.skipif(shutil.which("diff") is None, reason="GNU diff not installed")
@pytest.mark.parametrize(("old", "new"), PAIRS)
def test_real_diff_u_output_round_trips(tmp_path: Path, old: str, new: str) -> None:
    (tmp_path / "old").write_bytes(old.encode())
    (tmp_path / "new").write_bytes(new.encode())
    for flag in ("-u", "-U0", "-U5"):
        result = subprocess.run(
            ["diff", flag, str(tmp_path / "old"), str(tmp_path / "new")],
            capture_output=True,
            check=False,
        )
        assert result.returncode == 1, result.stderr
        assert apply_unified_diff(old.encode(), result.stdout.decode()) == new.encode()


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
@given(old=texts(), new=texts(), context=st.integers(0, 4))
def test_round_trip_property_difflib(old: str, new: str, context: int) -> None:
    diff = difflib_diff(old, new, context)
    if old == new:
        assert diff == ""
        return
    assert apply_unified_diff(old.encode(), diff) == new.encode()


def test_git_style_diff_with_headers_and_section_heading() -> None:
    diff = (
        "diff --git a/src/m.py b/src/m.py\n"
        "index 3b18e51..a4c2b3f 100644\n"
        "--- a/src/m.py\n"
        "+++ b/src/m.py\n"
        "@@ -1,3 +1,3 @@ def f():\n"
        " def f():\n"
        "-    return 1\n"
        "+    return 2\n"
        " \n"
    )
    assert apply_unified_diff(b"def f():\n    return 1\n\n", diff) == b"def f():\n    return 2\n\n"


def test_create_from_empty_with_dev_null_and_new_file_mode() -> None:
    diff = (
        "diff --git a/n.txt b/n.txt\n"
        "new file mode 100644\n"
        "--- /dev/null\n"
        "+++ b/n.txt\n"
        "@@ -0,0 +1,2 @@\n"
        "+one\n"
        "+two\n"
    )
    assert apply_unified_diff(b"", diff) == b"one\ntwo\n"


def test_zero_old_start_inserts_at_the_top_of_a_non_empty_file() -> None:
    # -0,0 means "before line 1", which exists in every file.
    assert apply_unified_diff(b"b\n", "@@ -0,0 +1 @@\n+a\n") == b"a\nb\n"


def test_delete_all_lines() -> None:
    diff = "--- a/f\n+++ /dev/null\n@@ -1,2 +0,0 @@\n-x\n-y\n"
    assert apply_unified_diff(b"x\ny\n", diff) == b""


def test_multiple_hunks_apply() -> None:
    old = "".join(f"{i}\n" for i in range(1, 21))
    diff = "@@ -2,1 +2,1 @@\n-2\n+two\n@@ -15,2 +15,3 @@\n 15\n-16\n+sixteen\n+extra\n"
    new = old.replace("2\n", "two\n", 1).replace("16\n", "sixteen\nextra\n")
    assert apply_unified_diff(old.encode(), diff) == new.encode()


def test_diff_without_trailing_newline_and_with_blank_context_line() -> None:
    # Editors strip the lone space of an empty context line; the diff's last "\n" may go.
    diff = "@@ -1,3 +1,3 @@\n a\n\n-c\n+C"
    assert apply_unified_diff(b"a\n\nc\n", diff) == b"a\n\nC\n"


def test_trailing_blank_lines_after_last_hunk_are_ignored() -> None:
    assert apply_unified_diff(b"a\n", "@@ -1 +1 @@\n-a\n+b\n\n\n") == b"b\n"


def test_removed_line_that_looks_like_a_header_is_a_body_line() -> None:
    # "--- x" removes "-- x", "+++ z" adds "++ z": counts, not looks, end a hunk.
    diff = "--- a/f\n+++ b/f\n@@ -1,2 +1,2 @@\n--- x\n+++ z\n keep\n"
    assert apply_unified_diff(b"-- x\nkeep\n", diff) == b"++ z\nkeep\n"


# --------------------------------------------------------------------------------------
# apply_unified_diff: conflicts


def test_wrong_context_conflicts_with_hunk_and_line() -> None:
    diff = "@@ -1,3 +1,3 @@\n a\n-b\n+B\n secret-context\n"
    with pytest.raises(PatchConflict) as excinfo:
        apply_unified_diff(b"a\nb\nc\n", diff)
    assert conflict(excinfo) == {"hunk": 0, "line": 3}
    assert "secret" not in str(excinfo.value)


def test_offset_hunk_is_not_searched_for() -> None:
    old, new = "a\nb\nc\nd\n", "a\nb\nC\nd\n"
    diff = difflib_diff(old, new, 1)
    # The same lines, one line lower: `patch` would apply with an offset; we refuse.
    with pytest.raises(PatchConflict) as excinfo:
        apply_unified_diff(("top\n" + old).encode(), diff)
    assert conflict(excinfo)["hunk"] == 0


def test_second_hunk_mismatch_names_hunk_one() -> None:
    diff = "@@ -1 +1 @@\n-a\n+A\n@@ -3 +3 @@\n-x\n+X\n"
    with pytest.raises(PatchConflict) as excinfo:
        apply_unified_diff(b"a\nb\nc\n", diff)
    assert conflict(excinfo) == {"hunk": 1, "line": 3}


def test_diff_saying_no_newline_on_file_that_has_one_conflicts() -> None:
    diff = "@@ -1 +1 @@\n-a\n\\ No newline at end of file\n+b\n"
    with pytest.raises(PatchConflict):
        apply_unified_diff(b"a\n", diff)
    assert apply_unified_diff(b"a", diff) == b"b\n"


def test_diff_with_newline_on_file_without_one_conflicts() -> None:
    with pytest.raises(PatchConflict):
        apply_unified_diff(b"a", "@@ -1 +1 @@\n-a\n+b\n")


def test_lines_after_a_no_newline_line_conflict() -> None:
    # Inserting after the last line of a file lacking its final newline would glue lines.
    with pytest.raises(PatchConflict):
        apply_unified_diff(b"a", "@@ -1,0 +2 @@\n+b\n")
    with pytest.raises(PatchConflict):
        apply_unified_diff(b"a\nb\n", "@@ -1 +1 @@\n-a\n+A\n\\ No newline at end of file\n")


def test_marker_in_the_middle_of_a_side_is_malformed() -> None:
    diff = "@@ -1,2 +1 @@\n-a\n\\ No newline at end of file\n-b\n+c\n"
    with pytest.raises(PatchConflict) as excinfo:
        apply_unified_diff(b"a\nb\n", diff)
    assert "malformed" in str(excinfo.value)


def test_marker_without_a_line_is_malformed() -> None:
    with pytest.raises(PatchConflict):
        apply_unified_diff(b"a", "@@ -1 +1 @@\n\\ No newline at end of file\n-a\n+b\n")


def test_lf_diff_on_crlf_file_conflicts() -> None:
    diff = difflib_diff("a\nb\n", "a\nB\n")
    with pytest.raises(PatchConflict):
        apply_unified_diff(b"a\r\nb\r\n", diff)


def test_crlf_diff_keeps_crlf() -> None:
    diff = difflib_diff("a\r\nb\r\n", "a\r\nB\r\nc\r\n")
    assert apply_unified_diff(b"a\r\nb\r\n", diff) == b"a\r\nB\r\nc\r\n"


def test_two_file_git_diff_is_refused() -> None:
    diff = (
        "diff --git a/x b/x\n--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n"
        "diff --git a/y b/y\n--- a/y\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n"
    )
    with pytest.raises(PatchConflict) as excinfo:
        apply_unified_diff(b"a\n", diff)
    assert "more than one file" in str(excinfo.value)
    assert conflict(excinfo) == {"hunk": None, "diff_line": 7}


def test_two_file_plain_diff_is_refused() -> None:
    diff = "--- a/x\n+++ b/x\n@@ -1 +1 @@\n-a\n+b\n--- a/y\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(PatchConflict, match="more than one file"):
        apply_unified_diff(b"a\n", diff)


def test_second_file_header_before_any_hunk_is_refused() -> None:
    diff = "diff --git a/x b/x\nold mode 100644\ndiff --git a/y b/y\n@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(PatchConflict):
        apply_unified_diff(b"a\n", diff)
    diff = "diff --git a/x b/x\ndiff --git a/y b/y\n--- a/y\n+++ b/y\n@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(PatchConflict, match="more than one file"):
        apply_unified_diff(b"a\n", diff)


@pytest.mark.parametrize(
    "diff",
    [
        "@@ -1,2 +1,2\n a\n-b\n+c\n",  # header not closed
        "@@ -x +1 @@\n-a\n+b\n",  # not numbers
        "@@ -1 +1 @@@\n-a\n+b\n",
        "@@ -1,0 +1,0 @@\n",  # empty hunk
        "@@ -0,1 +1 @@\n-a\n+b\n",  # line 0 with a count
        "@@ -1" + "9" * 20 + " +1 @@\n-a\n+b\n",  # absurd number
        "--- a/f\n@@ -1 +1 @@\n-a\n+b\n",  # --- without +++
        "+++ b/f\n@@ -1 +1 @@\n-a\n+b\n",  # +++ without ---
        "garbage\n@@ -1 +1 @@\n-a\n+b\n",  # unknown preamble line
        "@@ -1 +1 @@\n-a\n+b\ngarbage\n",  # unknown line after a hunk
    ],
)
def test_malformed_diff_is_refused(diff: str) -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_unified_diff(b"a\n", diff)
    assert "malformed" in str(excinfo.value)
    assert "diff_line" in conflict(excinfo)


def test_hunk_shorter_than_header_is_refused() -> None:
    with pytest.raises(PatchConflict, match="shorter than its header"):
        apply_unified_diff(b"a\nb\n", "@@ -1,2 +1,2 @@\n-a\n+A\n")
    with pytest.raises(PatchConflict, match="shorter than its header"):
        apply_unified_diff(b"a\nb\n", "@@ -1,2 +1,2 @@\n-a\n+A\n@@ -2 +2 @@\n b\n")


def test_hunk_longer_than_header_is_refused() -> None:
    with pytest.raises(PatchConflict, match="longer than its header") as excinfo:
        apply_unified_diff(b"a\nb\n", "@@ -1 +1 @@\n-a\n+A\n b\n")
    assert conflict(excinfo)["hunk"] == 0
    with pytest.raises(PatchConflict, match="more removed lines"):
        apply_unified_diff(b"a\nb\n", "@@ -1 +1,2 @@\n-a\n-b\n+A\n")


def test_hunks_out_of_order_or_overlapping_are_refused() -> None:
    old = b"1\n2\n3\n4\n5\n"
    with pytest.raises(PatchConflict, match="overlaps or precedes") as excinfo:
        apply_unified_diff(old, "@@ -4 +4 @@\n-4\n+four\n@@ -1 +1 @@\n-1\n+one\n")
    assert conflict(excinfo) == {"hunk": 1}
    with pytest.raises(PatchConflict, match="overlaps or precedes"):
        apply_unified_diff(old, "@@ -1,2 +1,2 @@\n 1\n-2\n+b\n@@ -2 +2 @@\n-2\n+c\n")


def test_hunk_past_end_of_file_is_refused() -> None:
    with pytest.raises(PatchConflict, match="past the end"):
        apply_unified_diff(b"a\n", "@@ -1,2 +1,2 @@\n a\n-b\n+c\n")
    with pytest.raises(PatchConflict, match="past the end"):
        apply_unified_diff(b"", "@@ -1,0 +1 @@\n+a\n")


def test_a_diff_whose_result_passes_the_bound_is_refused() -> None:
    diff = "@@ -1 +1,3 @@\n-a\n+bbbb\n+cccc\n+dddd\n"
    assert len(apply_unified_diff(b"a\n", diff, max_bytes=15)) == 15
    with pytest.raises(TooLarge) as excinfo:
        apply_unified_diff(b"a\n", diff, max_bytes=14)
    assert excinfo.value.data == {"limit": 14}


@pytest.mark.parametrize("diff", ["", "\n", "--- a/f\n+++ b/f\n", "diff --git a/f b/f\n"])
def test_diff_without_hunks_is_refused(diff: str) -> None:
    with pytest.raises(PatchConflict, match="no hunks"):
        apply_unified_diff(b"a\n", diff)


@pytest.mark.parametrize(
    ("header", "reason"),
    [
        ("old mode 100644\nnew mode 100755\n", "mode changes"),
        ("similarity index 90%\nrename from f\nrename to g\n", "renames"),
        ("copy from f\ncopy to g\n", "renames and copies"),
        ("Binary files a/f and b/f differ\n", "binary"),
        ("GIT binary patch\n", "binary"),
    ],
)
def test_unsupported_git_headers_are_refused(header: str, reason: str) -> None:
    diff = "diff --git a/f b/g\n" + header + "@@ -1 +1 @@\n-a\n+b\n"
    with pytest.raises(PatchConflict, match=reason):
        apply_unified_diff(b"a\n", diff)


DIFF_PIECES = st.sampled_from(
    [
        "@@ -1 +1 @@",
        "@@ -0,0 +1,2 @@",
        "@@ -2,3 +1 @@",
        "@@ -1,2 +0,0 @@",
        "--- a/f",
        "+++ b/f",
        "diff --git a/f b/f",
        "index 1..2",
        "\\ No newline at end of file",
        "-a",
        "+a",
        " a",
        "-b",
        "+b",
        " ",
        "",
        "\r",
        "x",
    ]
)


@st.composite
def old_and_diff(draw: st.DrawFn) -> tuple[str, list[str]]:
    """A file and diff lines for it: arbitrary pieces, or a real diff of it with a few
    lines inserted, replaced or deleted (so that some of them still apply)."""
    old = draw(texts())
    if draw(st.booleans()):
        return old, draw(st.lists(DIFF_PIECES, max_size=12))
    lines = difflib_diff(old, draw(texts()), draw(st.integers(0, 3))).split("\n")
    for _ in range(draw(st.integers(0, 3))):
        at = draw(st.integers(0, len(lines)))
        action = draw(st.sampled_from(["insert", "replace", "delete"]))
        if action == "insert":
            lines.insert(at, draw(DIFF_PIECES))
        elif at < len(lines):
            if action == "replace":
                lines[at] = draw(DIFF_PIECES)
            else:
                del lines[at]
    return old, lines


@settings(max_examples=500, deadline=None)
@given(case=old_and_diff())
@example(case=("a\nb\n", ["@@ -1 +1 @@", "-a", "+b"]))
def test_arbitrary_diff_text_only_ever_conflicts(case: tuple[str, list[str]]) -> None:
    # Whatever the diff text, the applier either applies it or says patch_conflict; what
    # it applies is UTF-8 in which every line is a line of `old` or an added (`+`) one, and
    # every line of `old` is still there unless a `-` line removed it.
    old, pieces = case
    try:
        out = apply_unified_diff(old.encode(), "\n".join(pieces))
    except PatchConflict:
        return
    new = _line_texts(out.decode("utf-8"))
    before = _line_texts(old)
    added = Counter(piece[1:] for piece in pieces if piece.startswith("+"))
    removed = Counter(piece[1:] for piece in pieces if piece.startswith("-"))
    assert new <= before + added
    assert before <= new + removed


def _line_texts(text: str) -> Counter[str]:
    """How often each line occurs, its `\\n` left off (a no-newline marker strips it)."""
    return Counter(line.removesuffix("\n") for line in patching.split_lines(text))


def test_diff_on_non_utf8_file_conflicts() -> None:
    with pytest.raises(PatchConflict) as excinfo:
        apply_unified_diff(b"\x80\n", "@@ -1 +1 @@\n-a\n+b\n")
    assert conflict(excinfo) == {"reason": "not_text"}


def test_diff_adding_lone_surrogate_conflicts() -> None:
    with pytest.raises(PatchConflict, match="not valid Unicode"):
        apply_unified_diff(b"a\n", "@@ -1 +1 @@\n-a\n+\ud800\n")
