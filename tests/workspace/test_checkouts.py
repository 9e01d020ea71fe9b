"""substrate.workspace.checkouts: remembered checkout policies over a real store (no daemon)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from substrate.errors import PolicyLocked
from substrate.schema.workspace import Policy
from substrate.store.db import Store
from substrate.workspace.checkouts import NOTHING, CheckoutPolicies, nested


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    s = Store(tmp_path / "substrate.db")
    try:
        yield s
    finally:
        s.close()


def remember(checkouts: CheckoutPolicies, store: Store, key: str, path: str, p: Policy) -> None:
    with store.transaction() as db:
        checkouts.save(db, key, path, p)


def test_nesting() -> None:
    assert nested("/r/a/b", "/r/a") and nested("/r/a/b", "/r/a/")
    assert not nested("/r/ab", "/r/a") and not nested("/r/a", "/r/a")


def test_own_merges_a_replaced_directory_at_the_same_path(store: Store) -> None:
    checkouts = CheckoutPolicies(store, NOTHING)
    remember(checkouts, store, "1:10", "/r/a", Policy(write_deny=[], read_deny=["*.pem"]))
    assert checkouts.own("1:11", "/r/a") == Policy(write_deny=[], read_deny=["*.pem"])
    remember(checkouts, store, "1:11", "/r/a", Policy(write_deny=[], read_deny=["*.pem", "*.key"]))
    rows = store.query("SELECT checkout FROM checkout_policies")
    assert [r["checkout"] for r in rows] == ["1:11"]  # the old row was merged, then dropped
    assert checkouts.known("1:11", "/elsewhere") and not checkouts.known("1:12", "/r/b")


def test_effective_inherits_both_ways_and_only_from_nesting(store: Store) -> None:
    checkouts = CheckoutPolicies(store, Policy(write_deny=["*.lock"]))
    remember(checkouts, store, "1:1", "/r/p", Policy(write_deny=[], read_deny=["sub/secret"]))
    remember(checkouts, store, "1:2", "/r/p/sub/in", Policy(write_deny=[], read_deny=["/x"]))
    remember(checkouts, store, "1:3", "/r/px", Policy(write_deny=[], read_deny=["nope"]))
    sub = checkouts.effective("1:9", "/r/p/sub")
    assert sub.read_deny == ["/secret", "/in/x"]
    assert sub.write_deny == ["*.lock"]
    outer = checkouts.effective("1:1", "/r/p")
    assert outer.read_deny == ["sub/secret", "/sub/in/x"]


def test_additions_refuse_loosening_and_skip_the_default(store: Store) -> None:
    checkouts = CheckoutPolicies(store, Policy(write_deny=[], read_deny=["*.key"]))
    own = Policy(write_deny=["dist/"])
    with pytest.raises(PolicyLocked) as info:
        checkouts.additions(own, Policy(read_deny=["*.key"]))
    assert info.value.to_data() == {
        "refusal": "policy_locked",
        "dropped": {"write_deny": ["dist/"]},
        "added": {},
    }
    added = checkouts.additions(own, Policy(write_deny=["dist"], read_deny=["*.key", "*.pem"]))
    assert added == Policy(write_deny=[], read_deny=["*.pem"])
