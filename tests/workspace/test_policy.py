"""substrate.workspace.policy: gitignore-style globs on workspace-relative paths (pure)."""

from __future__ import annotations

import pytest

from substrate.errors import InvalidParams
from substrate.schema.workspace import Policy
from substrate.workspace.policy import (
    DENY_ALL,
    GIT_DENY,
    GlobSet,
    additions,
    beyond,
    canonical_glob,
    compile_glob,
    compile_policy,
    is_git_path,
    loosening,
    merge,
    prefixed,
    reroot,
    reroot_glob,
    subtract,
)


def matches(pattern: str, path: str) -> bool:
    return GlobSet.of([pattern]).matches(path)


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        # No slash: a name at any depth (basename semantics).
        ("*.pem", "key.pem", True),
        ("*.pem", "a/b/key.pem", True),
        ("*.pem", "key.pem.txt", False),
        ("secret", "secret", True),
        ("secret", "a/secret", True),
        ("secret", "a/secret/inner.txt", True),  # matching a directory covers its contents
        ("secret", "secrets", False),
        ("secret", "a/mysecret", False),
        # A slash before the end anchors at the root.
        ("a/secret", "a/secret", True),
        ("a/secret", "x/a/secret", False),
        ("/secret", "secret", True),
        ("/secret", "a/secret", False),
        ("/secret", "secret/x", True),
        ("src/*.py", "src/main.py", True),
        ("src/*.py", "src/pkg/main.py", False),
        ("src/*.py", "lib/src/main.py", False),
        # `*` and `?` never cross `/`.
        ("a*b", "axxb", True),
        ("a*b", "ax/xb", False),
        ("a/*", "a/x", True),
        ("a/*", "a/x/y", True),  # a/x matches, so everything beneath it does
        ("a?c", "abc", True),
        ("a?c", "ac", False),
        ("a?c", "abbc", False),
        ("x/a?c", "x/a/c", False),
        # `**` as a whole component: any number of components.
        ("**/foo", "foo", True),
        ("**/foo", "a/b/foo", True),
        ("**/foo", "a/b/foox", False),
        ("a/**/b", "a/b", True),
        ("a/**/b", "a/x/b", True),
        ("a/**/b", "a/x/y/b", True),
        ("a/**/b", "c/a/x/b", False),
        ("a/**", "a/x", True),
        ("a/**", "a/x/y/z", True),
        ("a/**", "a", True),  # `X/**` covers X itself
        ("a/**", "ab", False),
        ("a/**", "b/a/x", False),
        # `**` glued to other characters is a plain `*`.
        ("a**b", "axxb", True),
        ("a**b", "ax/xb", False),
        # Character classes.
        ("[abc].txt", "a.txt", True),
        ("[abc].txt", "d.txt", False),
        ("[a-c].txt", "b.txt", True),
        ("[!a-c].txt", "d.txt", True),
        ("[!a-c].txt", "a.txt", False),
        ("[]x].txt", "].txt", True),
        ("x[", "x[", True),  # an unclosed `[` is a literal
        # A trailing `/`: that directory and everything under it.
        ("build/", "build", True),
        ("build/", "build/out.o", True),
        ("build/", "src/build/out.o", True),  # unanchored: the slash is only a suffix
        ("build/", "builder", False),
        ("/build/", "src/build/out.o", False),
        # Regex metacharacters are literals.
        ("a+b.(c)", "a+b.(c)", True),
        ("a+b.(c)", "aab.xc", False),
        ("$HOME", "$HOME", True),
        ("file.txt", "fileXtxt", False),
    ],
)
def test_glob_semantics(pattern: str, path: str, expected: bool) -> None:
    assert matches(pattern, path) is expected


def test_glob_matches_names_with_newlines_and_dots() -> None:
    assert matches("*", "a\nb")
    assert matches("a*", "a\n")
    assert matches(".env*", "conf/.env.local")
    assert not matches(".env", "conf/x.env")


@pytest.mark.parametrize(
    "pattern",
    [
        pytest.param("!keep.txt", id="negation"),
        pytest.param("a\\b", id="backslash"),
        pytest.param("a\x00", id="nul"),
        pytest.param("/", id="slash-only"),
        pytest.param("//", id="slashes-only"),
    ],
)
def test_bad_globs_are_invalid_params(pattern: str) -> None:
    with pytest.raises(InvalidParams) as info:
        compile_glob(pattern)
    assert info.value.data["path"] == "$.policy"


def test_empty_globset_matches_nothing() -> None:
    empty = GlobSet.of([])
    assert not empty
    assert not empty.matches("anything")
    assert GlobSet.of(["x"])


def test_git_is_always_write_denied() -> None:
    for policy in [None, Policy(), Policy(write_deny=[]), Policy(write_deny=["*.lock"])]:
        compiled = compile_policy(policy)
        assert GIT_DENY in compiled.policy.write_deny
        assert not compiled.may_write(".git/config")
        assert not compiled.may_write(".git/hooks/pre-commit")
        assert not compiled.may_write(".git")  # not replaceable by a file either
        assert compiled.may_write(".gitignore")
        assert compiled.may_write("src/.git-keep")
        assert compiled.may_read(".git/config")
    once = compile_policy(Policy(write_deny=[".git/**", "x"]))
    assert once.policy.write_deny.count(GIT_DENY) == 1


@pytest.mark.parametrize(
    "path",
    [
        "vendor/.git/config",  # a nested repository
        "vendor/.git",  # a submodule's or worktree's `.git` file, or the dir itself
        "a/b/c/.git/hooks/pre-commit",
        "a/b/c/.git/modules/x/hooks/post-checkout",
    ],
)
def test_every_nested_git_is_write_denied(path: str) -> None:
    """docs/protocol.md §2: every `.git` at any depth is write-denied, like the top-level one, even
    where an allow list or an empty deny list would allow it. (It was writable before.)"""
    for policy in [None, Policy(write_deny=[]), Policy(write_allow=["**"])]:
        compiled = compile_policy(policy)
        assert not compiled.may_write(path)
        assert compiled.may_read(path)
    assert is_git_path(path)


@pytest.mark.parametrize("path", ["x/.gitignore", "x/.gitmodules", "x/.git-keep", "git/x", "x.git"])
def test_names_like_git_are_not_git(path: str) -> None:
    assert not is_git_path(path)
    assert compile_policy(None).may_write(path)


def test_write_allow_and_deny() -> None:
    compiled = compile_policy(Policy(write_allow=["src/**", "*.md"], write_deny=["src/gen/"]))
    assert compiled.may_write("src/a.py")
    assert compiled.may_write("docs/readme.md")
    assert not compiled.may_write("tests/a.py")
    assert not compiled.may_write("src/gen/out.py")  # deny wins over allow
    assert not compiled.may_write(".git/x.md")


def test_read_deny_and_require_approval() -> None:
    compiled = compile_policy(Policy(read_deny=["*.pem", "/secrets/"], require_approval=["ci/**"]))
    assert not compiled.may_read("k.pem")
    assert not compiled.may_read("deep/k.pem")
    assert not compiled.may_read("secrets/token")
    assert compiled.may_read("src/secrets/token")
    assert compiled.needs_approval("ci/deploy.yml")
    assert compiled.needs_approval("ci")
    assert not compiled.needs_approval("src/ci/x")
    assert compiled.may_write("ci/deploy.yml")


def test_policy_is_reported_back_with_git_deny_first() -> None:
    compiled = compile_policy(Policy(write_deny=["dist/"], read_deny=["*.key"]))
    assert compiled.policy == Policy(
        write_allow=[], write_deny=[".git/**", "dist/"], read_deny=["*.key"], require_approval=[]
    )


def test_compile_policy_refuses_negation_anywhere() -> None:
    for field in ("write_allow", "write_deny", "read_deny", "require_approval"):
        with pytest.raises(InvalidParams):
            compile_policy(Policy(**{field: ["!x"]}))


def test_readonly_dirs() -> None:
    compiled = compile_policy(
        Policy(
            write_deny=[
                "vendor/**",
                "/node_modules/",
                "build/",
                "a/b/**",
                "*.lock",
                "gen*/**",
                "x?/",
                "[ab]/**",
                "plain",
                "**",
            ]
        )
    )
    assert compiled.readonly_dirs() == [".git", "a/b", "build", "node_modules", "vendor"]


def test_readonly_dirs_default() -> None:
    assert compile_policy(None).readonly_dirs() == [".git"]


# --- character classes never match `/` ---------------------------------------------------------


@pytest.mark.parametrize(
    ("pattern", "path", "expected"),
    [
        ("a[/]b", "a/b", False),
        ("a[!x]b", "a/b", False),
        ("a[^x]b", "a/b", False),
        ("a[!x]b", "ayb", True),
        ("[[]x", "[x", True),  # escaped inside the class: no "nested set" warning
        ("[*]", "*", True),
        ("[*]", "a", False),
        ("[?]x", "?x", True),
        ("[?]x", "ax", False),
    ],
)
def test_classes(pattern: str, path: str, expected: bool) -> None:
    assert matches(pattern, path) is expected


# --- combining policies -------------------------------------------------------------------------


def test_canonical_glob() -> None:
    assert canonical_glob("src/**") == canonical_glob("/src/**") == "/src/**"
    assert canonical_glob("dist/") == canonical_glob("dist") == "dist"
    assert canonical_glob("/dist/") == "/dist"


def test_merge_unions_deny_lists_and_intersects_allow_lists() -> None:
    merged = merge(
        Policy(write_deny=["a/**"], read_deny=["*.pem"], write_allow=["src/**", "docs/**"]),
        Policy(write_deny=["/a/**", "b"], require_approval=["ci/**"], write_allow=["/src/**"]),
        Policy(write_deny=[]),
    )
    assert merged == Policy(
        write_allow=["src/**"],
        write_deny=["a/**", "b"],
        read_deny=["*.pem"],
        require_approval=["ci/**"],
    )


def test_merge_of_disjoint_allow_lists_allows_nothing() -> None:
    merged = merge(Policy(write_allow=["src/**"]), Policy(write_allow=["docs/**"]))
    assert merged.write_allow == []
    assert DENY_ALL in merged.write_deny
    compiled = compile_policy(merged)
    assert not compiled.may_write("src/a.py") and not compiled.may_write("docs/x")


def test_loosening() -> None:
    current = Policy(write_deny=["dist/"], read_deny=["*.pem"], write_allow=["src/**", "docs/**"])
    # Restating (in other spellings) and adding is not loosening; `.git/**` may be left out.
    same = Policy(write_deny=["dist", "x"], read_deny=["*.pem"], write_allow=["/src/**"])
    assert loosening(same, current) == ({}, [])
    dropped, added = loosening(Policy(write_allow=["src/**", "lib/**"]), current)
    assert dropped == {"write_deny": ["dist/"], "read_deny": ["*.pem"]}
    assert added == ["lib/**"]
    # An empty allow list allows everything: it drops the whole list.
    dropped, added = loosening(Policy(write_deny=["dist/"], read_deny=["*.pem"]), current)
    assert dropped == {"write_allow": ["src/**", "docs/**"]} and added == []
    # Nothing to drop from an empty allow list: any allow list narrows it.
    assert loosening(Policy(write_allow=["x/**"]), Policy()) == ({}, [])


def test_additions_and_subtract() -> None:
    current = Policy(write_deny=[GIT_DENY, "dist/"], write_allow=["src/**", "docs/**"])
    asked = Policy(write_deny=["dist", "x"], read_deny=["*.pem"], write_allow=["src/**"])
    assert additions(asked, current) == Policy(
        write_allow=["src/**"], write_deny=["x"], read_deny=["*.pem"]
    )
    restated = Policy(write_deny=["dist"], write_allow=["docs/**", "src/**"])
    assert additions(restated, current) == Policy(write_deny=[])
    assert subtract(asked, Policy(write_deny=["x"])) == Policy(
        write_allow=["src/**"], write_deny=["dist"], read_deny=["*.pem"]
    )


# --- carrying rules between nested checkouts ------------------------------------------------------

#: Globs of every shape: unanchored, anchored, `**` at each place, classes, trailing `/`.
SHAPES = [
    "*.pem",
    "secret",
    "build/",
    "a*",
    "/top",
    "a/b",
    "a/b/**",
    "a/**",
    "/a/*/c",
    "**/c",
    "a/**/c",
    "a/**/b/**",
    "**",
    "/**",
    "[ab]/x",
    "a/[!x]*/c/",
    "?/b",
]
PREFIXES = [
    ("a",),
    ("a", "b"),
    ("a", "a"),
    ("x", "a"),
    ("a", "x", "b"),
    ("secret",),
    ("b",),
    ("top",),
]
PATHS = [
    "c",
    "x",
    "b",
    "b/c",
    "c/d",
    "c/c",
    "a/c",
    "x.pem",
    "secret",
    "q/secret/z",
    "a/b/c",
    "b/x",
    "x/c/y",
    "b/b/c",
]


@pytest.mark.parametrize("pattern", SHAPES)
def test_reroot_is_exact(pattern: str) -> None:
    """A path `p` of the subdirectory at `prefix` is matched by the re-rooted globs exactly
    when the original glob matches `prefix/p` in the enclosing checkout."""
    for prefix in PREFIXES:
        found = reroot_glob(pattern, prefix)
        for path in PATHS:
            outer = matches(pattern, "/".join([*prefix, path]))
            inner = True if found is None else GlobSet.of(found).matches(path)
            assert inner is outer, (pattern, prefix, path, found)


@pytest.mark.parametrize(
    ("pattern", "prefix", "expected"),
    [
        ("*.pem", ("a",), ["*.pem"]),
        ("secrets/", ("secrets",), None),  # adopting a denied directory: all of it denied
        ("secrets/", ("a", "secrets", "b"), None),
        ("/keys/**", ("keys", "sub"), None),
        ("/keys/**", ("other",), []),
        ("a/b/**", ("a",), ["/b/**"]),
        ("**/c", ("a", "b"), ["/**/c"]),
        ("a/**/c", ("a", "b"), ["/**/c"]),
        ("a/*/c/d", ("a", "b"), ["/c/d"]),
        (".git/**", ("sub",), []),
    ],
)
def test_reroot_glob(pattern: str, prefix: tuple[str, ...], expected: list[str] | None) -> None:
    assert reroot_glob(pattern, prefix) == expected


def test_reroot_policy() -> None:
    outer = Policy(
        write_deny=[GIT_DENY, "sub/gen/**"],
        read_deny=["*.pem", "/sub/secret"],
        require_approval=["sub/"],
        write_allow=["sub/src/**", "docs/**"],
    )
    assert reroot(outer, ("sub",)) == Policy(
        write_allow=["/src/**"],
        write_deny=["/gen/**"],
        read_deny=["*.pem", "/secret"],
        require_approval=[DENY_ALL],
    )
    # No allow glob reaches inside: nothing there is writable.
    assert reroot(Policy(write_allow=["docs/**"]), ("sub",)).write_deny == [DENY_ALL]
    # One allow glob covers all of it: no allow restriction inside.
    assert reroot(Policy(write_allow=["su*"]), ("sub",)).write_allow == []


@pytest.mark.parametrize("pattern", SHAPES)
def test_prefixed_is_exact(pattern: str) -> None:
    """The enclosing checkout matches `prefix/p` with the prefixed globs exactly when the
    nested checkout's glob matches `p`, and matches nothing outside `prefix`."""
    for prefix in PREFIXES:
        found = GlobSet.of(prefixed(Policy(read_deny=[pattern]), prefix).read_deny)
        for path in PATHS:
            assert found.matches("/".join([*prefix, path])) is matches(pattern, path)
        for outside in ["c", "zz/c", prefix[0] + "x/c"]:
            assert not found.matches(outside)


def test_prefixed_escapes_names_and_closes_allow_lists() -> None:
    odd = ("a*b", "[x]", "!bang", "q?")
    out = prefixed(Policy(write_deny=["/f"], write_allow=["src/**"]), odd)
    deny = GlobSet.of(out.write_deny)
    assert deny.matches("a*b/[x]/!bang/q?/f")
    assert not deny.matches("aXb/x/!bang/qq/f")
    # An allow list is not a glob list in the enclosing checkout: the whole subdir is shut.
    assert deny.matches("a*b/[x]/!bang/q?/src/x.py")
    assert out.write_allow == []


def test_beyond_drops_what_an_unanchored_glob_already_covers() -> None:
    nested = Policy(write_deny=["*.lock", "/gen"], read_deny=["*.pem", "/x"], write_allow=["a"])
    cover = Policy(write_deny=["/*.lock", "gen"], read_deny=["*.pem"])
    assert beyond(nested, cover) == Policy(
        write_deny=["*.lock", "/gen"], read_deny=["/x"], write_allow=["a"]
    )
