"""Tool results cut to a size limit, saying what was cut and how to get the rest.

Theory of operation: a tool result is the daemon's result as JSON. When its encoding is
over `limit` bytes, `fit` cuts it by the tool's rule (`Tool.fit`) and adds `elided`, a
sentence naming what was left out and where it still is:

- a list (`entries`, `paths`, `matches`, `lines`, `changes`): the longest prefix that
  fits, with the result's own flag saying more exists (`truncated: true`, or `eof:
  false` for `artifact.lines`, whose caller continues at `start + len(lines)`);
- `data` (`fs.read`, `artifact.read`): the text cut on a character (base64: a 4-char)
  boundary, `eof: false`; the caller continues at `offset + len(bytes of data)`;
- `proc` (a `proc.run`/`proc.wait` result): output the daemon kept inline is cut to a
  head and tail of 4 KiB (less when that does not fit) (`preview_head`, `preview_tail`, as for a spilled stream); the
  whole stream stays readable with `proc_output`;
- `changes` (`changes.get`): first each change's diff preview is dropped, then the list
  cut (`total_changes` still counts them all).

Whatever is still over the limit loses its largest lists and objects, largest first,
until it fits (`elided` names them). Pure: JSON values
in, JSON values and text out; each step costs a few encodes of at most the result.
"""

from __future__ import annotations

import base64
from collections.abc import Callable
from typing import Any

import msgspec

from substrate.mcp.tools import Fit

#: Bytes of each preview of an inline stream cut by `proc` (as the daemon's previews).
PREVIEW_BYTES = 4096
#: Room kept for the `elided` sentence.
NOTE_ROOM = 512

_encoder = msgspec.json.Encoder()


def encode(value: Any) -> bytes:
    return _encoder.encode(value)


def fit(result: Any, rule: Fit, limit: int) -> tuple[Any, bytes]:
    """`result` cut to at most `limit` bytes of JSON by `rule`, and its encoding.

    A result within the limit comes back as it is. `limit` must leave room for the
    scalars of a result (a few KiB is plenty).
    """
    text = encode(result)
    if len(text) <= limit or not isinstance(result, dict):
        return result, text
    budget = limit - NOTE_ROOM
    steps = _STEPS.get(rule, ())
    notes: list[str] = []
    current = dict(result)
    for step in steps:
        current, note = step(current, budget)
        if note:
            notes.append(note)
        text = encode(current)
        if len(text) <= budget:
            break
    else:
        current, dropped = _drop_largest(current, budget)
        if dropped:
            notes.append(f"left out: {', '.join(dropped)}")
    current["elided"] = f"result over {limit} bytes through MCP: " + "; ".join(notes)
    text = encode(current)
    return current, text


def _drop_largest(result: dict[str, Any], budget: int) -> tuple[dict[str, Any], list[str]]:
    """Leave out top-level lists and objects, largest first, until `result` fits."""
    sizes = sorted(
        ((len(encode(v)), k) for k, v in result.items() if isinstance(v, list | dict)),
        reverse=True,
    )
    out, dropped, total = dict(result), [], len(encode(result))
    for _size, key in sizes:
        if total <= budget:
            break
        del out[key]
        dropped.append(key)
        total = len(encode(out))
    return out, dropped


# -- lists ------------------------------------------------------------------------------------


def _cut_list(key: str, flag: tuple[str, Any] | None) -> Callable[[dict[str, Any], int], Any]:
    def step(result: dict[str, Any], budget: int) -> tuple[dict[str, Any], str]:
        items = result.get(key)
        if not isinstance(items, list):
            return result, ""
        shell = dict(result, **{key: []})
        if flag is not None:
            shell[flag[0]] = flag[1]
        room = budget - len(encode(shell))
        kept = 0
        for item in items:
            room -= len(encode(item)) + 1
            if room < 0:
                break
            kept += 1
        if kept == len(items):
            return result, ""
        shell[key] = items[:kept]
        return shell, f"{key}: the first {kept} of {len(items)}"

    return step


# -- data -------------------------------------------------------------------------------------


def _cut_data(result: dict[str, Any], budget: int) -> tuple[dict[str, Any], str]:
    data = result.get("data")
    if not isinstance(data, str):
        return result, ""
    shell = dict(result, data="", eof=False)
    room = budget - len(encode(shell))
    step = 4 if result.get("encoding") == "base64" else 1
    lo, hi = 0, len(data) // step  # units of `step` characters that fit: at least lo
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if len(encode(data[: mid * step])) - 2 <= room:
            lo = mid
        else:
            hi = mid - 1
    shell["data"] = data[: lo * step]
    return shell, "data cut short (eof false): continue at offset + its length in bytes"


# -- proc results -----------------------------------------------------------------------------


def _stream_bytes(ref: dict[str, Any]) -> bytes:
    inline = ref.get("inline")
    if not isinstance(inline, str):
        return b""
    if ref.get("encoding") == "base64":
        return base64.b64decode(inline)
    return inline.encode("utf-8", "surrogatepass")


def previews(data: bytes, size: int = PREVIEW_BYTES) -> tuple[str, str]:
    """A head and a tail of at most `size` bytes each, whole characters only."""
    head = data[:size].decode("utf-8", "ignore")
    tail_bytes = data[-size:] if len(data) > size else b""
    # Skip continuation bytes at the cut so the tail starts on a character.
    start = 0
    while start < min(3, len(tail_bytes)) and 0x80 <= tail_bytes[start] < 0xC0:
        start += 1
    return head, tail_bytes[start:].decode("utf-8", "ignore")


def _with_previews(result: dict[str, Any], size: int) -> tuple[dict[str, Any], list[str]]:
    out = dict(result)
    cut = []
    for name in ("stdout", "stderr"):
        ref = out.get(name)
        if not isinstance(ref, dict) or "inline" not in ref:
            continue
        head, tail = previews(_stream_bytes(ref), size)
        slim = {k: v for k, v in ref.items() if k not in ("inline", "encoding")}
        slim["preview_head"] = head
        if tail:
            slim["preview_tail"] = tail
        out[name] = slim
        cut.append(name)
    return out, cut


def _preview_outputs(result: dict[str, Any], budget: int) -> tuple[dict[str, Any], str]:
    """Inline streams as previews: `PREVIEW_BYTES` each, halved until the result fits
    (down to 128 bytes; what still does not fit is left to the last step)."""
    size = PREVIEW_BYTES
    while True:
        out, cut = _with_previews(result, size)
        if not cut:
            return result, ""
        if size <= 128 or len(encode(out)) <= budget:
            break
        size //= 2
    return out, (
        f"{' and '.join(cut)} cut to a head and tail of {size} bytes; "
        "read the whole stream with proc_output {proc, since: 0}"
    )


# -- change sets ------------------------------------------------------------------------------


def _drop_diffs(result: dict[str, Any], budget: int) -> tuple[dict[str, Any], str]:
    changes = result.get("changes")
    if not isinstance(changes, list):
        return result, ""
    slim = [
        {**c, "diff": "", "diff_truncated": True} if isinstance(c, dict) and c.get("diff") else c
        for c in changes
    ]
    return dict(result, changes=slim), "diff previews dropped (read the files to compare)"


_STEPS: dict[str, tuple[Callable[[dict[str, Any], int], tuple[dict[str, Any], str]], ...]] = {
    "entries": (_cut_list("entries", ("truncated", True)),),
    "paths": (_cut_list("paths", ("truncated", True)),),
    "matches": (_cut_list("matches", ("truncated", True)),),
    "lines": (_cut_list("lines", ("eof", False)),),
    "data": (_cut_data,),
    "proc": (_preview_outputs,),
    "changes": (_drop_diffs, _cut_list("changes", None), _cut_list("blocked", None)),
    # `counts` keeps the totals of each list.
    "applied": tuple(
        _cut_list(key, None) for key in ("applied", "blocked", "pending", "conflicts")
    ),
}
