"""substrate.policy: gitignore-style globs on workspace-relative paths (pure)."""

from __future__ import annotations

import pytest

from substrate.errors import InvalidParams
from substrate.policy import GIT_DENY, GlobSet, compile_glob, compile_policy
from substrate.schema.workspace import Policy


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


def test_nested_git_dirs_are_not_denied_by_the_anchored_default() -> None:
    """`.git/**` contains a slash, so it is anchored: only the workspace's own `.git`."""
    compiled = compile_policy(None)
    assert compiled.may_write("vendor/.git/config")


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
