"""Workspace path policy: gitignore-style globs, compiled once, matched purely.

Pattern rules (the subset of gitignore that a deny list needs; no `!` negation):
- a pattern with a `/` before its end is anchored at the workspace root; one without
  matches a name at any depth;
- `*` and `?` never cross `/`; `**` as a whole component matches any number of them;
  `[...]` is a character class;
- a trailing `/` matches a directory and everything under it; and as in git, a pattern
  that matches a directory matches everything beneath it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from substrate.errors import InvalidParams
from substrate.schema.workspace import Policy

GIT_DENY = ".git/**"


def _translate(pattern: str) -> str:
    out: list[str] = []
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "*":
            if pattern.startswith("**", i):
                before_ok = i == 0 or pattern[i - 1] == "/"
                after = i + 2
                if before_ok and (after == n or pattern[after] == "/"):
                    if after == n:
                        out.append(".*")
                        i = after
                    else:
                        out.append("(?:.*/)?")
                        i = after + 1
                    continue
            out.append("[^/]*")
        elif c == "?":
            out.append("[^/]")
        elif c == "[":
            end = pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("!", "]") else i + 1)
            if end < 0:
                out.append(re.escape(c))
            else:
                body = pattern[i + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body.replace("\\", "\\\\") + "]")
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def compile_glob(pattern: str) -> re.Pattern[str]:
    """Compile one pattern to a regex matched against a whole relative path (or prefix)."""
    if pattern.startswith("!"):
        raise InvalidParams(f"policy glob {pattern!r}: negation is not supported", path="$.policy")
    if "\x00" in pattern or "\\" in pattern:
        raise InvalidParams(f"policy glob {pattern!r}: NUL or backslash", path="$.policy")
    body = pattern.rstrip("/") if pattern != "/" else pattern
    anchored = "/" in body
    body = body.lstrip("/")
    if not body:
        raise InvalidParams(f"policy glob {pattern!r} is empty", path="$.policy")
    # `X/**` covers X itself too: a denied `.git` may not be replaced by a file either.
    regex = _translate(body[:-3]) + "(?:/.*)?" if body.endswith("/**") else _translate(body)
    prefix = "" if anchored else "(?:.*/)?"
    return re.compile(prefix + regex + r"\Z", re.DOTALL)


@dataclass(frozen=True)
class GlobSet:
    patterns: tuple[str, ...]
    _compiled: tuple[re.Pattern[str], ...]

    @classmethod
    def of(cls, patterns: Sequence[str]) -> GlobSet:
        return cls(tuple(patterns), tuple(compile_glob(p) for p in patterns))

    def matches(self, path: str) -> bool:
        """True when `path` or any of its parent directories matches a pattern."""
        if not self._compiled:
            return False
        parts = path.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        return any(rx.match(p) for rx in self._compiled for p in prefixes)

    def __bool__(self) -> bool:
        return bool(self.patterns)


@dataclass(frozen=True)
class CompiledPolicy:
    """A `Policy` ready to match. `policy` is what is reported back to clients."""

    policy: Policy
    write_allow: GlobSet
    write_deny: GlobSet
    read_deny: GlobSet
    require_approval: GlobSet

    def may_write(self, path: str) -> bool:
        if self.write_deny.matches(path):
            return False
        return not self.write_allow or self.write_allow.matches(path)

    def may_read(self, path: str) -> bool:
        return not self.read_deny.matches(path)

    def needs_approval(self, path: str) -> bool:
        return self.require_approval.matches(path)

    def readonly_dirs(self) -> list[str]:
        """Literal directories denied whole (`X/**`, `X/`): mounted read-only in sandboxes."""
        found: list[str] = []
        for pattern in self.policy.write_deny:
            stem = pattern[:-3] if pattern.endswith("/**") else pattern.rstrip("/")
            if stem == pattern or not stem or any(c in stem for c in "*?["):
                continue
            found.append(stem.lstrip("/"))
        return sorted(set(found))


def compile_policy(policy: Policy | None) -> CompiledPolicy:
    """Compile a policy; `.git/**` is always denied for writes. Refuses bad globs."""
    policy = policy or Policy()
    deny = list(policy.write_deny)
    if GIT_DENY not in deny:
        deny.insert(0, GIT_DENY)
    policy = Policy(
        write_allow=list(policy.write_allow),
        write_deny=deny,
        read_deny=list(policy.read_deny),
        require_approval=list(policy.require_approval),
    )
    return CompiledPolicy(
        policy=policy,
        write_allow=GlobSet.of(policy.write_allow),
        write_deny=GlobSet.of(policy.write_deny),
        read_deny=GlobSet.of(policy.read_deny),
        require_approval=GlobSet.of(policy.require_approval),
    )
