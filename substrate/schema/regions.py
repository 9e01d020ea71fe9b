"""Generated regions of a hand-written page: their markers, and `fill` to replace them.

A page (docs/protocol.md, docs/architecture.md) is written by hand except between
`<!-- generated:NAME:start -->` and `<!-- generated:NAME:end -->` lines, which
`python -m substrate.schema` rewrites from the code (docs/protocol.md's regions:
`substrate.schema.reference`; docs/architecture.md's tree: `substrate.schema.tree`).
"""

from __future__ import annotations

from collections.abc import Mapping

#: A region's markers, each on a line of its own.
MARKER = "<!-- generated:{name}:{edge} -->"


def fill(text: str, bodies: Mapping[str, str]) -> str:
    """`text` with each named region's content replaced by its body.

    Raises ValueError when a region's start or end marker is missing, repeated, or out
    of order (the document is then left for a person to repair, never guessed at).
    """
    for name, body in bodies.items():
        start = MARKER.format(name=name, edge="start")
        end = MARKER.format(name=name, edge="end")
        if text.count(start) != 1 or text.count(end) != 1:
            raise ValueError(f"region {name!r}: need exactly one {start} and one {end}")
        head, rest = text.split(start)
        if end not in rest:
            raise ValueError(f"region {name!r}: {end} comes before {start}")
        _old, tail = rest.split(end)
        text = f"{head}{start}\n{body}{end}{tail}"
    return text
