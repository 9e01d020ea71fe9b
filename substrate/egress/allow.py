"""Allow-lists of host names for the egress proxy (pure: no I/O, no resolution).

An entry is a host name (`pkg.example.org`), a wildcard `*.example.org` (any name strictly
beneath `example.org`, at any depth, but not `example.org` itself), or an IPv4 literal
(`127.0.0.1`, matched as written: tests and local mirrors). Names are compared in lower
case without a trailing dot; labels are ASCII letters, digits and hyphens (an
internationalised name is written in its `xn--` form). Only ports 80 and 443 pass
(`PORTS`). Matching is on the name the client asked for, before anything is resolved: a
name that is not allowed is never looked up.

`AllowList.digest` is the SHA-256 of the sorted, normalised entries, one a line: the
`egress_allow_digest` confinement fact proves the proxy of a sandbox enforces exactly its
profile's list.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable
from dataclasses import dataclass

#: The only ports an egress sandbox reaches (HTTP and HTTPS).
PORTS = frozenset({80, 443})
#: At most this many entries in one list (a profile is a policy, not a hosts file).
MAX_ENTRIES = 256
#: The longest host name DNS allows.
MAX_NAME = 253

_LABEL_RE = re.compile(r"[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?")
_IPV4_RE = re.compile(
    r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])(?:\.(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}"
)


def normalise_host(host: str) -> str | None:
    """`host` in lower case without one trailing dot, or None when it is not a host name
    of ASCII letter-digit-hyphen labels (at most 253 characters) nor an IPv4 literal.
    Pure; linear in the name."""
    name = host.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > MAX_NAME:
        return None
    if _IPV4_RE.fullmatch(name):
        return name
    labels = name.split(".")
    if all(_LABEL_RE.fullmatch(label) for label in labels) and not labels[-1].isdigit():
        return name
    return None


def parse_entry(entry: str) -> str:
    """One allow-list entry, normalised (`*.Example.org.` → `*.example.org`).

    Raises ValueError saying why: not a host name, a wildcard anywhere but as the whole
    first label, a wildcard over an IP literal or over a single label (`*.org` would let
    a whole top-level domain out).
    """
    if entry.startswith("*."):
        base = normalise_host(entry[2:])
        if base is None:
            raise ValueError(f"{entry!r} is not '*.' followed by a host name")
        if _IPV4_RE.fullmatch(base):
            raise ValueError(f"{entry!r}: a wildcard covers names, not addresses")
        if "." not in base:
            raise ValueError(f"{entry!r}: a wildcard needs at least two labels under it")
        return "*." + base
    if "*" in entry:
        raise ValueError(f"{entry!r}: '*' may only be the whole first label ('*.example.org')")
    name = normalise_host(entry)
    if name is None:
        raise ValueError(f"{entry!r} is not a host name (ASCII letters, digits, '-' and '.')")
    return name


@dataclass(frozen=True)
class AllowList:
    """A parsed allow-list. Build it with `AllowList.of`; match with `allows`."""

    entries: tuple[str, ...]  # normalised, sorted, distinct
    exact: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.org" for each "*.example.org"

    @classmethod
    def of(cls, entries: Iterable[str]) -> AllowList:
        """Parse and normalise `entries`. Raises ValueError (`parse_entry`'s reasons, or
        more than `MAX_ENTRIES`). Cost: linear in the entries."""
        parsed = sorted({parse_entry(e) for e in entries})
        if len(parsed) > MAX_ENTRIES:
            raise ValueError(f"more than {MAX_ENTRIES} egress_allow entries")
        return cls(
            entries=tuple(parsed),
            exact=frozenset(e for e in parsed if not e.startswith("*.")),
            suffixes=tuple(e[1:] for e in parsed if e.startswith("*.")),
        )

    def allows(self, host: str, port: int) -> bool:
        """Is a connection to `host`:`port` allowed? `host` as the client wrote it (it is
        normalised here; one that is not a host name is never allowed). Pure; no
        resolution. Cost: one set lookup and one pass over the wildcards."""
        if port not in PORTS:
            return False
        name = normalise_host(host)
        if name is None:
            return False
        if name in self.exact:
            return True
        return not _IPV4_RE.fullmatch(name) and any(name.endswith(s) for s in self.suffixes)

    @property
    def digest(self) -> str:
        """`sha256:<hex>` of the sorted entries, one a line (the `egress_allow_digest` fact)."""
        return digest_of(self.entries)


def digest_of(entries: Iterable[str]) -> str:
    """`sha256:<hex>` of already normalised `entries`, sorted, one a line."""
    text = "".join(e + "\n" for e in sorted(entries))
    return "sha256:" + hashlib.sha256(text.encode("ascii")).hexdigest()
