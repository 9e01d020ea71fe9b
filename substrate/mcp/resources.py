"""Artifacts as MCP resources: `substrate://artifact/<id>[?offset=N&length=M]` (pure).

A resource read is `artifact.read` of one bounded range (at most the server's result
limit, from `offset`, default 0). `Seen` remembers the artifacts this session's tool
results pointed at, newest first, so `resources/list` has something to offer (the
daemon lists no artifacts); any id is readable through the template whether seen or not.
"""

from __future__ import annotations

import collections
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, quote, unquote, urlsplit

SCHEME = "substrate"
HOST = "artifact"
#: RFC 6570 template of an artifact resource.
TEMPLATE = "substrate://artifact/{artifact}{?offset,length}"
#: Artifacts remembered for `resources/list`.
MAX_SEEN = 100
#: The longest artifact id accepted (as `schema.artifact.ArtifactId`).
MAX_ID = 128


class BadUri(ValueError):
    """Not an artifact URI of this server (the message says why)."""


@dataclass(frozen=True)
class ArtifactRange:
    artifact: str
    offset: int
    length: int | None


def artifact_uri(artifact: str) -> str:
    return f"{SCHEME}://{HOST}/{quote(artifact, safe='')}"


def _number(query: Mapping[str, list[str]], key: str) -> int | None:
    values = query.get(key)
    if not values:
        return None
    if len(values) > 1 or not values[0].isdigit() or len(values[0]) > 18:
        raise BadUri(f"{key} must be one non-negative integer")
    return int(values[0])


def parse_artifact_uri(uri: str) -> ArtifactRange:
    """The artifact and byte range a URI names. Raises `BadUri`."""
    parts = urlsplit(uri)
    if parts.scheme != SCHEME or parts.netloc != HOST:
        raise BadUri(f"not a {SCHEME}://{HOST}/ URI")
    artifact = unquote(parts.path.removeprefix("/"))
    if not artifact or "/" in artifact or len(artifact) > MAX_ID:
        raise BadUri("expected substrate://artifact/<id>")
    try:
        query = parse_qs(parts.query, strict_parsing=bool(parts.query))
    except ValueError:
        raise BadUri("malformed query") from None
    if set(query) - {"offset", "length"}:
        raise BadUri("only offset and length may be given")
    return ArtifactRange(artifact, _number(query, "offset") or 0, _number(query, "length"))


@dataclass(frozen=True)
class SeenArtifact:
    artifact: str
    label: str  # e.g. "stdout of proc_1a2b"
    size: int


def artifacts_in(result: Any) -> Iterator[SeenArtifact]:
    """The spilled output streams a `proc.run`/`proc.wait` result points at."""
    if not isinstance(result, dict):
        return
    for stream in ("stdout", "stderr"):
        ref = result.get(stream)
        if isinstance(ref, dict) and isinstance(ref.get("artifact"), str):
            size = ref.get("bytes")
            yield SeenArtifact(
                ref["artifact"],
                f"{stream} of {result.get('proc', '?')}",
                size if isinstance(size, int) else 0,
            )


class Seen:
    """The last `MAX_SEEN` artifacts seen, newest first."""

    def __init__(self) -> None:
        self._items: collections.OrderedDict[str, SeenArtifact] = collections.OrderedDict()

    def add(self, item: SeenArtifact) -> None:
        self._items.pop(item.artifact, None)
        self._items[item.artifact] = item
        while len(self._items) > MAX_SEEN:
            self._items.popitem(last=False)

    def newest_first(self) -> list[SeenArtifact]:
        return list(reversed(self._items.values()))
