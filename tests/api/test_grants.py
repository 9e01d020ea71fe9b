"""Grants: tokens shown once, only hashes stored, ttl/revoke/uses enforced, journaled."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.errors import GrantConsumed, GrantExpired, GrantInvalid
from substrate.pty.grants import Grants, parse_duration, token_digest
from substrate.store.db import Store
from substrate.store.journal import Journal


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[Grants, Journal, Store, Clock]]:
    store = Store(tmp_path / "db")
    journal = Journal(store)
    clock = Clock()
    yield Grants(store, journal, clock), journal, store, clock
    store.close()


def issue(g: Grants, uses: int = 1, ttl: float = 60.0) -> tuple[str, str]:
    grant, token = g.issue(
        workspace="w1", profile="interactive", ttl_s=ttl, uses=uses, actor="operator:0"
    )
    return grant.id, token


def use(g: Grants, token: str, consume: bool = True) -> str:
    if not consume:
        return g.check(token, need_use=False).id
    return g.use(token, session="t-0123456789abcdef", actor="web", mode="control").id


def test_only_the_hash_is_stored(env: tuple[Grants, Journal, Store, Clock], tmp_path: Path) -> None:
    g, journal, store, _ = env
    gid, token = issue(g)
    assert token.startswith(gid + ".")
    rows = store.query("SELECT * FROM grants")
    assert rows[0]["token_sha256"] == token_digest(token)
    secret = token.split(".", 1)[1]
    for row in rows:
        assert all(secret not in str(v) for v in tuple(row))
    for entry in journal.read():
        assert secret not in str(entry.data)
        assert token_digest(token) not in str(entry.data)
    raw = b"".join(p.read_bytes() for p in tmp_path.iterdir() if p.is_file())
    assert secret.encode() not in raw


def test_use_consumes_and_journals(env: tuple[Grants, Journal, Store, Clock]) -> None:
    g, journal, _, _ = env
    gid, token = issue(g, uses=2)
    assert use(g, token) == gid
    assert use(g, token) == gid
    with pytest.raises(GrantConsumed):
        use(g, token)
    with pytest.raises(GrantConsumed):
        g.check(token, need_use=True)
    # Rejoining what the grant already joined costs nothing, even when used up.
    assert use(g, token, consume=False) == gid
    kinds = [e.kind for e in journal.read()]
    assert kinds == ["grant.issued", "grant.used", "grant.used"]


def test_wrong_and_malformed_tokens(env: tuple[Grants, Journal, Store, Clock]) -> None:
    g, _, _, _ = env
    gid, token = issue(g)
    for bad in [
        "",
        "x",
        token + "x",
        token[:-1] + ("A" if token[-1] != "A" else "B"),
        "g-0000000000000000." + "a" * 43,
        gid,
    ]:
        with pytest.raises(GrantInvalid):
            use(g, bad)
    assert use(g, token) == gid


def test_expired(env: tuple[Grants, Journal, Store, Clock]) -> None:
    g, _, _, clock = env
    _, token = issue(g, ttl=10)
    clock.t += 10
    with pytest.raises(GrantExpired):
        use(g, token)
    with pytest.raises(GrantExpired):
        use(g, token, consume=False)


def test_revoked_reads_as_expired(env: tuple[Grants, Journal, Store, Clock]) -> None:
    g, journal, _, _ = env
    gid, token = issue(g)
    assert g.revoke(gid, "operator:0")
    assert not g.revoke(gid, "operator:0")
    with pytest.raises(GrantExpired):
        use(g, token)
    with pytest.raises(GrantInvalid):
        g.revoke("g-ffffffffffffffff", "operator:0")
    assert [e.kind for e in journal.read()] == ["grant.issued", "grant.revoked"]


def test_refusal_changes_nothing(env: tuple[Grants, Journal, Store, Clock]) -> None:
    g, journal, store, _ = env
    _, token = issue(g, uses=1)
    use(g, token)
    before = (store.query("SELECT used FROM grants")[0][0], len(journal.read()))
    with pytest.raises(GrantConsumed):
        use(g, token)
    assert (store.query("SELECT used FROM grants")[0][0], len(journal.read())) == before


def test_list_states_without_tokens(env: tuple[Grants, Journal, Store, Clock]) -> None:
    g, _, _, clock = env
    a, ta = issue(g)
    b, _ = issue(g, ttl=5)
    c, _ = issue(g)
    use(g, ta)
    g.revoke(c, "operator:0")
    clock.t += 6
    states = {i.grant: i.state for i in g.list()}
    assert states == {a: "consumed", b: "expired", c: "revoked"}
    assert all(not hasattr(i, "token") for i in g.list())


def test_parse_duration() -> None:
    assert [parse_duration(t) for t in ["600", "90s", "10m", "2h", "1d", "1.5m"]] == [
        600.0,
        90.0,
        600.0,
        7200.0,
        86400.0,
        90.0,
    ]
    for bad in ["", "0", "-5m", "10 minutes", "m", "1w"]:
        with pytest.raises(ValueError):
            parse_duration(bad)
