"""A finished command's result as text a person or a model reads (docs/mcp.md, "Results").

Theory of operation. A `proc_run`/`proc_wait` result as JSON buries what a model needs
under facts and digests; its text is instead, a line each: the exit code (and a signal,
a timeout, an OOM kill), the tail of stdout and of stderr, what became of the working
layer's changes (counts and the change set), then one line per path that did not land
— blocked, pending approval, or in conflict — with its reason and rule (`blocked_lines`,
which `substrate exec` prints too). The MCP server makes it a `proc_run`'s text; the
whole result stays the tool's structured content. Bounded: `TAIL_BYTES` per stream,
`MAX_LINES` paths then "… and K more". Pure, for clients of the daemon.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: The end of each stream shown, bytes (whole characters; the rest is in the result).
TAIL_BYTES = 2048
#: Paths named, over blocked, pending and conflicts; the rest are counted.
MAX_LINES = 20
#: A result's lists of paths that did not land, in the order they are named.
_LISTS = (("blocked", "blocked"), ("pending", "pending"), ("conflicts", "conflict"))


def _path_line(word: str, entry: Mapping[str, Any]) -> str:
    op = entry.get("op")
    head = f"{word} {entry.get('path')}" + (f" ({op})" if op else "")
    why = [str(entry.get("reason") or "not applied")]
    if entry.get("rule"):
        why.append(f"rule {entry['rule']}")
    if word == "pending" and entry.get("plan_digest"):
        why.append(f"approve plan_digest {entry['plan_digest']}")
    if entry.get("artifact"):
        why.append(f"its version: artifact {entry['artifact']}")
    return f"{head}: {', '.join(why)}"


def blocked_lines(changes: Mapping[str, Any] | None, limit: int = MAX_LINES) -> list[str]:
    """One line per path of a result's `changes` that did not land — `blocked .env
    (create): path_denied, rule .env`, `pending …: approval_required, approve
    plan_digest …`, `conflict …: host_changed, its version: artifact …` — at most
    `limit`, then `… and K more` (K from `counts`, which covers what the lists cut)."""
    if not changes:
        return []
    lines: list[str] = []
    total = 0
    counts = changes.get("counts") or {}
    for key, word in _LISTS:
        entries = changes.get(key) or []
        total += max(len(entries), int(counts.get(key, 0) or 0))
        for entry in entries:
            if len(lines) < limit and isinstance(entry, Mapping):
                lines.append(_path_line(word, entry))
    if total > len(lines):
        lines.append(f"… and {total - len(lines)} more (changes.get has them all)")
    return lines


def changes_line(changes: Mapping[str, Any] | None) -> str | None:
    """`changes: 1 applied, 1 blocked (changeset cs_…)`: the counts that are not zero;
    None when the result has no `changes` (no working layer)."""
    if not changes:
        return None
    if changes.get("deferred"):
        return "changes: deferred (others still use the layer; the last to end applies them)"
    counts = changes.get("counts") or {}
    said = [f"{n} {name}" for name, n in counts.items() if n]
    text = "changes: " + (", ".join(said) if said else "none")
    if changes.get("changeset"):
        text += f" (changeset {changes['changeset']})"
    if changes.get("error"):
        text += f"; error {changes['error']}"
    return text


def _exit_line(result: Mapping[str, Any]) -> str:
    code = result.get("exit_code")
    text = f"exit code {code if code is not None else 'unknown'}"
    notes = []
    if result.get("signal"):
        notes.append(f"signal {result['signal']}")
    if result.get("timed_out"):
        notes.append("timed out")
    if result.get("oom_killed"):
        notes.append("out of memory")
    return text + (f" ({', '.join(notes)})" if notes else "")


def _last(data: bytes, size: int) -> str:
    """The last `size` bytes of `data` from a character's start, as text."""
    tail = data[-size:]
    start = 0
    while start < min(3, len(tail)) and 0x80 <= tail[start] < 0xC0:
        start += 1
    return tail[start:].decode("utf-8", "replace")


def _tail(name: str, ref: Any) -> list[str]:
    """The stream's last `TAIL_BYTES` under a header saying how much there is."""
    if not isinstance(ref, Mapping) or not ref.get("bytes"):
        return []
    size = int(ref["bytes"])
    inline = ref.get("inline")
    if isinstance(inline, str) and ref.get("encoding") == "base64":
        return [f"--- {name}: {size} bytes, not UTF-8 (structuredContent has them) ---"]
    if isinstance(inline, str):
        data = inline.encode("utf-8", "surrogatepass")
        shown = _last(data, TAIL_BYTES) if len(data) > TAIL_BYTES else inline
        where = "the rest in structuredContent"
    else:
        shown = str(ref.get("preview_tail") or ref.get("preview_head") or "")
        where = f"all of it: artifact {ref.get('artifact')}"
    shown_bytes = len(shown.encode("utf-8", "surrogatepass"))
    header = f"--- {name} ({size} bytes) ---"
    if shown_bytes < size:
        header = f"--- {name}: the last {shown_bytes} of {size} bytes ({where}) ---"
    return [header, *shown.splitlines()]


def proc_text(result: Mapping[str, Any]) -> str:
    """A finished command's result as text (see the module doc)."""
    lines = [_exit_line(result)]
    for name in ("stdout", "stderr"):
        lines += _tail(name, result.get(name))
    changes = result.get("changes")
    said = changes_line(changes)
    if said is not None:
        lines.append(said)
    lines += blocked_lines(changes)
    if result.get("elided"):
        lines.append(f"elided: {result['elided']}")
    return "\n".join(lines) + "\n"


def is_proc_result(value: Any) -> bool:
    """Is `value` a finished command's result (not `{proc, state: "running"}`)?"""
    return isinstance(value, Mapping) and "exit_code" in value and "proc" in value
