"""`substrate.egress.allow` (pure): parsing, normalising and matching host allow-lists."""

from __future__ import annotations

import pytest

from substrate.egress.allow import MAX_ENTRIES, AllowList, normalise_host, parse_entry


@pytest.mark.parametrize(
    ("entry", "normal"),
    [
        ("pkg.example.org", "pkg.example.org"),
        ("PKG.Example.ORG.", "pkg.example.org"),
        ("*.Example.org", "*.example.org"),
        ("localhost", "localhost"),
        ("xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("127.0.0.1", "127.0.0.1"),
        ("a-b.c-d.example", "a-b.c-d.example"),
    ],
)
def test_entries_normalise(entry: str, normal: str) -> None:
    assert parse_entry(entry) == normal


@pytest.mark.parametrize(
    ("entry", "why"),
    [
        ("", "not a host name"),
        ("*", "only be the whole first label"),
        ("a.*.example", "only be the whole first label"),
        ("*example.org", "only be the whole first label"),
        ("*.org", "two labels"),
        ("*.10.0.0.1", "names, not addresses"),
        ("exa mple.org", "not a host name"),
        ("-lead.example", "not a host name"),
        ("trail-.example", "not a host name"),
        ("under_score.example", "not a host name"),
        ("bücher.example", "not a host name"),
        ("a..b", "not a host name"),
        ("1.2.3", "not a host name"),
        ("http://pkg.example.org", "not a host name"),
        ("pkg.example.org:443", "not a host name"),
        ("a" * 64 + ".example", "not a host name"),
        ("[::1]", "not a host name"),
    ],
)
def test_bad_entries_are_refused_saying_why(entry: str, why: str) -> None:
    with pytest.raises(ValueError) as caught:
        parse_entry(entry)
    assert why in str(caught.value)


def test_a_name_longer_than_dns_allows_is_no_host() -> None:
    assert normalise_host(".".join(["a" * 60] * 5)) is None
    assert normalise_host("a" * 63 + ".example") == "a" * 63 + ".example"


def test_exact_names_match_exactly_and_only_on_80_and_443() -> None:
    allow = AllowList.of(["pkg.example.org"])
    assert allow.allows("pkg.example.org", 443)
    assert allow.allows("PKG.example.org.", 80)
    assert not allow.allows("pkg.example.org", 8080)
    assert not allow.allows("pkg.example.org", 22)
    assert not allow.allows("example.org", 443)
    assert not allow.allows("evil.pkg.example.org", 443)
    assert not allow.allows("pkg.example.org.evil.example", 443)
    assert not allow.allows("pkg.example.orgx", 443)


def test_a_wildcard_covers_names_beneath_but_not_the_name_itself() -> None:
    allow = AllowList.of(["*.example.org"])
    assert allow.allows("a.example.org", 443)
    assert allow.allows("a.b.example.org", 443)
    assert not allow.allows("example.org", 443)
    assert not allow.allows("badexample.org", 443)
    assert not allow.allows("a.example.org.evil.example", 443)


def test_what_is_not_a_host_name_is_never_allowed() -> None:
    allow = AllowList.of(["*.example.org", "127.0.0.1"])
    assert allow.allows("127.0.0.1", 80)
    assert not allow.allows("127.0.0.2", 80)
    assert not allow.allows("", 443)
    assert not allow.allows("a example.org", 443)
    assert not allow.allows("::1", 443)
    # An address is matched as written, never by a wildcard.
    assert not AllowList.of(["*.0.0.1.example"]).allows("10.0.0.1", 443)


def test_the_empty_list_allows_nothing() -> None:
    assert not AllowList.of([]).allows("localhost", 80)


def test_the_digest_is_of_the_normalised_sorted_distinct_entries() -> None:
    one = AllowList.of(["B.example", "a.example", "*.c.example", "a.example."])
    two = AllowList.of(["*.C.example", "b.example", "a.example"])
    assert one.entries == ("*.c.example", "a.example", "b.example")
    assert one.digest == two.digest
    assert one.digest.startswith("sha256:")
    assert AllowList.of(["a.example"]).digest != one.digest


def test_a_list_is_bounded() -> None:
    AllowList.of([f"h{i}.example" for i in range(MAX_ENTRIES)])
    with pytest.raises(ValueError, match="more than"):
        AllowList.of([f"h{i}.example" for i in range(MAX_ENTRIES + 1)])
