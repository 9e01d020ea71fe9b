"""Workspace path policy: gitignore-style globs, compiled once, matched purely.

Pattern rules (the subset of gitignore that a deny list needs; no `!` negation):
- a pattern with a `/` before its end is anchored at the workspace root; one without
  matches a name at any depth;
- `*` and `?` never cross `/`; `**` as a whole component matches any number of them;
  `[...]` is a character class (it never matches `/` either);
- a trailing `/` matches a directory and everything under it; and as in git, a pattern
  that matches a directory matches everything beneath it.

Policies combine (docs/protocol.md §2: the policy belongs to the operator): `merge` unions the deny
lists and intersects the allow lists; `loosening` says what an asked policy would drop;
`reroot` and `prefixed` carry the rules of one checkout onto a checkout nested in it or
enclosing it, so adopting a subdirectory or a parent never dodges a rule. Every `.git`
at any depth is write-denied whatever the lists say (`is_git_path`).

Decision: matching does not go through `pathspec` (evaluated with pathspec 1.1.1, whose
`gitignore` patterns are the closest). Three things keep this matcher hand-written:
1. The meaning differs where a deny list needs ours. In gitignore a trailing `/` matches
   directories only, and pathspec, given a path string, cannot know the kind: `build/`
   does not match the path `build`, nor `.git/**` the path `.git`. Here both match
   whatever the kind, so a file cannot stand in for a denied directory.
2. `reroot_glob` and `prefixed` rewrite globs component by component, matching one
   component against one segment (`_component_matches`, built on `_translate`).
   pathspec has no such operation, so we would keep this translator anyway and then
   run two glob engines whose meanings must agree exactly (escapes: pathspec reads a
   backslash as one, we refuse it; classes: ours never match `/`), or a re-rooted rule
   could mean something other than the rule it came from.
3. The write gate joins every gated glob into one regex alternation matched once per
   path (`gate.snapshot.Matcher`); pathspec's regexes each hold the same named group
   and cannot be joined, so its walk would run one match per glob per path.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

import msgspec

from substrate.errors import InvalidParams
from substrate.matching.glob_regex import NEVER, GlobRegex, compile_sources
from substrate.schema.workspace import Policy

GIT_DENY = ".git/**"
#: The name git gives its directory (or, in worktrees and submodules, its pointer file).
GIT_NAME = ".git"
#: A deny glob that covers every path.
DENY_ALL = "**"
#: The lists where more globs mean less allowed (unioned when policies combine).
DENY_LISTS = ("write_deny", "read_deny", "require_approval")


def is_git_path(rel: str) -> bool:
    """True when a component of workspace-relative `rel` is `.git`: a repository's own
    data (nested repositories, submodules and worktrees included), never written by a
    guarded write. The sandbox side can use it to find what to bind read-only."""
    return GIT_NAME in rel.split("/")


def _class_end(pattern: str, i: int) -> int:
    """Index of the `]` closing the class opened at `pattern[i]`, or -1 (a literal `[`)."""
    return pattern.find("]", i + 2 if pattern[i + 1 : i + 2] in ("!", "]") else i + 1)


def _translate_class(body: str) -> str:
    negated = body[:1] in ("!", "^")
    if negated:
        body = body[1:]
    # `/` separates components: a class never matches it (a negated one excludes it).
    chars = "".join(c if c == "-" else re.escape(c) for c in body if c != "/")
    if negated:
        return "[^/" + chars + "]"
    return "[" + chars + "]" if chars else NEVER


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
            end = _class_end(pattern, i)
            if end < 0:
                out.append(re.escape(c))
            else:
                out.append(_translate_class(pattern[i + 1 : end]))
                i = end
        else:
            out.append(re.escape(c))
        i += 1
    return "".join(out)


def _parse(pattern: str) -> tuple[bool, str]:
    """(anchored, body without leading and trailing slashes)."""
    body = pattern.rstrip("/") if pattern != "/" else pattern
    return "/" in body, body.lstrip("/")


def glob_source(pattern: str) -> str:
    """The regex (unanchored at its end) of one pattern, matched against a whole relative
    path (or prefix). Refuses `invalid_params` for a negation, a NUL or backslash, or an
    empty pattern."""
    if pattern.startswith("!"):
        raise InvalidParams(f"policy glob {pattern!r}: negation is not supported", path="$.policy")
    if "\x00" in pattern or "\\" in pattern:
        raise InvalidParams(f"policy glob {pattern!r}: NUL or backslash", path="$.policy")
    anchored, body = _parse(pattern)
    if not body:
        raise InvalidParams(f"policy glob {pattern!r} is empty", path="$.policy")
    # `X/**` covers X itself too: a denied `.git` may not be replaced by a file either.
    regex = _translate(body[:-3]) + "(?:/.*)?" if body.endswith("/**") else _translate(body)
    prefix = "" if anchored else "(?:.*/)?"
    return prefix + regex


def compile_glob(pattern: str) -> GlobRegex:
    """One pattern compiled to match a whole relative path (`glob_regex`: bounded time
    whatever the pattern). Refuses as `glob_source` does."""
    compiled = compile_sources([glob_source(pattern)])
    assert compiled is not None
    return compiled


def canonical_glob(pattern: str) -> str:
    """One spelling per meaning for comparisons: `src/**` and `/src/**` are the same rule,
    as are `dist/` and `dist`. Anchored globs get a leading `/`, unanchored ones none."""
    anchored, body = _parse(pattern)
    return "/" + body if anchored else body


@dataclass(frozen=True)
class GlobSet:
    patterns: tuple[str, ...]
    #: Every pattern as one alternation: one regex match per path prefix, however many.
    _regex: GlobRegex | None

    @classmethod
    def of(cls, patterns: Sequence[str]) -> GlobSet:
        """Refuses `invalid_params` for a bad pattern, or too many too complex to join."""
        return cls(tuple(patterns), compile_sources([glob_source(p) for p in patterns]))

    def matches(self, path: str) -> bool:
        """True when `path` or any of its parent directories matches a pattern."""
        if self._regex is None:
            return False
        regex, parts = self._regex, path.split("/")
        return any(regex.match("/".join(parts[: i + 1])) for i in range(len(parts)))

    def matches_exactly(self, path: str) -> bool:
        """True when `path` itself matches a pattern (a walk that prunes what matches
        has already kept its parents): one regex match."""
        return self._regex is not None and self._regex.match(path)

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
        if is_git_path(path) or self.write_deny.matches(path):
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
    policy = msgspec.structs.replace(policy, write_deny=deny)
    return CompiledPolicy(
        policy=policy,
        write_allow=GlobSet.of(policy.write_allow),
        write_deny=GlobSet.of(policy.write_deny),
        read_deny=GlobSet.of(policy.read_deny),
        require_approval=GlobSet.of(policy.require_approval),
    )


# --- combining policies (pure) -----------------------------------------------------------------


def denying_rule(policy: CompiledPolicy, rel: str, reserved_prefix: str) -> str:
    """The rule a denied `rel` falls under, as a blocked change or restore names it:
    `reserved` (a component starting with `reserved_prefix`, substrate's temp files),
    `.git/**`, the first `write_deny` glob that matches, `write_allow` (outside every
    allowed glob), else `filesystem`. Pure."""
    if any(part.startswith(reserved_prefix) for part in rel.split("/")):
        return "reserved"
    if is_git_path(rel):
        return ".git/**"
    for pattern in policy.write_deny.patterns:
        if GlobSet.of([pattern]).matches(rel):
            return pattern
    if policy.write_allow and not policy.write_allow.matches(rel):
        return "write_allow"
    return "filesystem"


def _dedupe(globs: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    out: list[str] = []
    for glob in globs:
        key = canonical_glob(glob)
        if key not in seen:
            seen.add(key)
            out.append(glob)
    return out


def merge(*policies: Policy) -> Policy:
    """The policy that enforces every one of `policies`.

    Deny lists are unioned. Allow lists are intersected by glob (canonical spelling): a
    path stays writable only through a glob that every non-empty allow list holds, which
    is never more than each list allows. Allow lists that share no glob leave nothing
    writable: the result denies `**`. Cost: linear in the globs.
    """
    lists = {name: _dedupe([g for p in policies for g in getattr(p, name)]) for name in DENY_LISTS}
    allows = [p.write_allow for p in policies if p.write_allow]
    write_allow: list[str] = []
    if allows:
        common = set.intersection(*({canonical_glob(g) for g in a} for a in allows))
        write_allow = _dedupe([g for g in allows[0] if canonical_glob(g) in common])
        if not write_allow:
            lists["write_deny"] = _dedupe([*lists["write_deny"], DENY_ALL])
    return Policy(write_allow=write_allow, **lists)


def subtract(policy: Policy, base: Policy) -> Policy:
    """`policy` without the deny globs `base` (or the built-in `.git/**`) already holds."""
    lists: dict[str, list[str]] = {}
    for name in DENY_LISTS:
        known = {canonical_glob(g) for g in getattr(base, name)}
        if name == "write_deny":
            known.add(canonical_glob(GIT_DENY))
        lists[name] = [g for g in _dedupe(getattr(policy, name)) if canonical_glob(g) not in known]
    return Policy(write_allow=_dedupe(policy.write_allow), **lists)


def loosening(asked: Policy, current: Policy) -> tuple[dict[str, list[str]], list[str]]:
    """What `asked`, taken as the whole policy, would loosen in `current`.

    Returns (dropped, added_allow): per deny list, the globs of `current` that `asked`
    lacks (the built-in `.git/**` aside); and the globs `asked` would add to a non-empty
    allow list. An empty allow list asked over a non-empty one drops all of it. Both
    empty: `asked` only adds restrictions.
    """
    dropped: dict[str, list[str]] = {}
    for name in DENY_LISTS:
        have = {canonical_glob(g) for g in getattr(asked, name)}
        if name == "write_deny":
            have.add(canonical_glob(GIT_DENY))
        lost = [g for g in getattr(current, name) if canonical_glob(g) not in have]
        if lost:
            dropped[name] = lost
    added: list[str] = []
    if current.write_allow:
        if not asked.write_allow:
            dropped["write_allow"] = list(current.write_allow)
        allowed = {canonical_glob(g) for g in current.write_allow}
        added = [g for g in asked.write_allow if canonical_glob(g) not in allowed]
    return dropped, added


def additions(asked: Policy, current: Policy) -> Policy:
    """The restrictions `asked` holds beyond `current` (assumed not `loosening` it): deny
    globs `current` lacks, and an allow list when it narrows `current`'s."""
    lists: dict[str, list[str]] = {}
    for name in DENY_LISTS:
        known = {canonical_glob(g) for g in getattr(current, name)}
        if name == "write_deny":
            known.add(canonical_glob(GIT_DENY))
        lists[name] = [g for g in _dedupe(getattr(asked, name)) if canonical_glob(g) not in known]
    allowed = {canonical_glob(g) for g in current.write_allow}
    narrows = bool(asked.write_allow) and {canonical_glob(g) for g in asked.write_allow} != allowed
    return Policy(write_allow=_dedupe(asked.write_allow) if narrows else [], **lists)


def _components(body: str) -> list[str]:
    """`body` split at the slashes outside character classes (as `_translate` reads it)."""
    parts: list[str] = []
    start = i = 0
    while i < len(body):
        if body[i] == "[":
            end = _class_end(body, i)
            if end > 0:
                i = end
        elif body[i] == "/":
            parts.append(body[start:i])
            start = i + 1
        i += 1
    parts.append(body[start:])
    return parts


def _component_matches(segment: str, name: str) -> bool:
    compiled = compile_sources([_translate(segment)])
    return compiled is not None and compiled.match(name)


def _closure(segments: Sequence[str], states: set[int]) -> set[int]:
    """A `**` segment may match no component: also stand past it."""
    out = set(states)
    for i in sorted(states):
        while i < len(segments) and segments[i] == "**":
            i += 1
            out.add(i)
    return out


def reroot_glob(pattern: str, prefix: Sequence[str]) -> list[str] | None:
    """`pattern`, written for a checkout, as globs for its subdirectory `prefix`.

    None when the pattern matches `prefix` itself or one of its parents, so it covers
    the whole subdirectory. Otherwise the globs that match a path `p` of the
    subdirectory exactly when `pattern` matches `prefix/p` (possibly none): an
    unanchored glob stays as it is; an anchored one loses the components `prefix`
    consumed (`**` may consume any number, so one glob can leave several).
    """
    anchored, body = _parse(pattern)
    if not anchored:
        if any(_component_matches(body, name) for name in prefix):
            return None
        return [canonical_glob(pattern)]
    segments = _components(body)
    states = _closure(segments, {0})
    for name in prefix:
        following: set[int] = set()
        for i in states:
            if i == len(segments):
                continue
            if segments[i] == "**":
                following.add(i)
            elif _component_matches(segments[i], name):
                following.add(i + 1)
        states = _closure(segments, following)
        if len(segments) in states:
            return None
        if not states:
            return []
    # A state just past a `**` the set also stands on adds nothing that one does not.
    kept = {i for i in states if not (i - 1 in states and segments[i - 1] == "**")}
    return sorted({"/" + "/".join(segments[i:]) for i in kept})


def reroot(policy: Policy, prefix: Sequence[str]) -> Policy:
    """The rules of `policy` (a checkout's) that cover its subdirectory `prefix`, written
    for that subdirectory: what adopting it as a checkout of its own inherits."""
    lists: dict[str, list[str]] = {}
    for name in DENY_LISTS:
        out: list[str] = []
        for glob in getattr(policy, name):
            found = reroot_glob(glob, prefix)
            out.extend([DENY_ALL] if found is None else found)
        lists[name] = _dedupe(out)
    write_allow: list[str] = []
    if policy.write_allow:
        found_all: list[str] | None = []
        for glob in policy.write_allow:
            found = reroot_glob(glob, prefix)
            if found is None:
                found_all = None  # one glob allows the whole subdirectory
                break
            assert found_all is not None
            found_all.extend(found)
        if found_all == []:
            lists["write_deny"] = _dedupe([*lists["write_deny"], DENY_ALL])
        elif found_all is not None:
            write_allow = _dedupe(found_all)
    return Policy(write_allow=write_allow, **lists)


def beyond(policy: Policy, cover: Policy) -> Policy:
    """`policy` without the unanchored deny globs `cover` holds too. For the rules of a
    nested checkout seen from an enclosing one whose own policy is `cover`: there an
    unanchored glob already matches its names at every depth, nested checkout included,
    so `prefixed` would only add a longer copy of it."""
    lists: dict[str, list[str]] = {}
    for name in DENY_LISTS:
        mine = {canonical_glob(g) for g in getattr(cover, name) if not _parse(g)[0]}
        lists[name] = [g for g in getattr(policy, name) if canonical_glob(g) not in mine]
    return Policy(write_allow=list(policy.write_allow), **lists)


def _literal(name: str) -> str:
    """A directory name as a glob component matching exactly it. A backslash cannot be
    escaped (globs refuse it): it becomes `?`, which matches it and more — used only in
    deny lists, where matching more is stricter."""
    out = []
    for c in name:
        if c in "*?[":
            out.append(f"[{c}]")
        elif c == "\\":
            out.append("?")
        else:
            out.append(c)
    return "".join(out)


def prefixed(policy: Policy, prefix: Sequence[str]) -> Policy:
    """The rules of `policy` (a checkout's) written for a checkout that encloses it at
    `prefix`: what adopting a parent inherits from a checkout beneath it.

    Deny lists map exactly. An allow list cannot (without negation, "only these under
    `prefix`" is not a glob list): the whole subdirectory is write-denied instead, which
    is never looser; writes there go through the nested checkout's own workspace.
    """
    head = "/" + "/".join(_literal(name) for name in prefix)
    lists: dict[str, list[str]] = {}
    for name in DENY_LISTS:
        out: list[str] = []
        for glob in getattr(policy, name):
            anchored, body = _parse(glob)
            if body == "**":
                out.append(head + "/**")
            elif anchored:
                out.append(f"{head}/{body}")
            else:
                out.append(f"{head}/**/{body}")
        lists[name] = _dedupe(out)
    if policy.write_allow:
        lists["write_deny"] = _dedupe([*lists["write_deny"], head + "/**"])
    return Policy(**lists)
