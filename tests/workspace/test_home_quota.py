"""substrate.workspace.home_quota: refuse while over, look again when a command may have
changed the home, amortise a dear walk (a fake walk and a fake clock: no disk, no time)."""

from __future__ import annotations

import pytest

from substrate.errors import LimitExceeded
from substrate.schema.workspace import HomeUsage
from substrate.workspace import home_quota
from substrate.workspace.home_quota import HomeQuota


class FakeHome:
    def __init__(self) -> None:
        self.usage: HomeUsage | None = HomeUsage(bytes=10, files=1)
        self.walks = 0
        self.now = 100.0
        self.cost = 0.001  # seconds each walk takes on the fake clock

    def measure(self, checkout: str, home: str) -> HomeUsage | None:
        self.walks += 1
        self.now += self.cost
        return self.usage

    def clock(self) -> float:
        return self.now


@pytest.fixture
def home() -> FakeHome:
    return FakeHome()


def test_over_the_quota_is_refused_until_it_shrinks(home: FakeHome) -> None:
    quota = HomeQuota(home.measure, 100, clock=home.clock)
    quota.check("c", "1000")
    home.usage = HomeUsage(bytes=150, files=2)
    with pytest.raises(LimitExceeded) as info:
        quota.check("c", "1000")
    assert info.value.to_data() == {
        "refusal": "limit_exceeded",
        "scope": "home",
        "bytes": 150,
        "files": 2,
        "quota_bytes": 100,
        "truncated": False,
    }
    walks = home.walks
    with pytest.raises(LimitExceeded):
        quota.check("c", "1000")  # looked at again each time while over
    assert home.walks == walks + 1
    home.usage = None  # released: gone
    quota.check("c", "1000")


def test_a_truncated_walk_counts_as_over(home: FakeHome) -> None:
    quota = HomeQuota(home.measure, 1 << 30, clock=home.clock)
    home.usage = HomeUsage(bytes=5, files=100_000, truncated=True)
    with pytest.raises(LimitExceeded) as info:
        quota.check("c", "1000")
    assert info.value.to_data()["truncated"] is True


def test_a_cheap_walk_is_redone_after_each_command_a_dear_one_amortised(home: FakeHome) -> None:
    quota = HomeQuota(home.measure, 100, clock=home.clock)
    quota.check("c", "1000")
    quota.check("c", "1000")
    assert home.walks == 2  # cheap: the command between may have written
    home.cost = 1.0  # a dear walk
    quota.check("c", "1000")
    assert home.walks == 3
    home.now += home_quota.AMORTISE * 1.0 / 2
    assert not quota.due("c", "1000")
    quota.check("c", "1000")
    assert home.walks == 3  # too soon: the last figure stands
    home.now += home_quota.AMORTISE * 1.0
    assert quota.due("c", "1000")
    home.usage = HomeUsage(bytes=500, files=1)
    with pytest.raises(LimitExceeded):
        quota.check("c", "1000")
    assert home.walks == 4


def test_each_home_is_its_own_and_no_quota_walks_nothing(home: FakeHome) -> None:
    quota = HomeQuota(home.measure, 100, clock=home.clock)
    home.usage = HomeUsage(bytes=500, files=1)
    with pytest.raises(LimitExceeded):
        quota.check("c", "1000")
    home.usage = HomeUsage(bytes=5, files=1)
    quota.check("c", "1000-abc")  # another secret set's home of the checkout
    unbounded = HomeQuota(home.measure, 0, clock=home.clock)
    walks = home.walks
    unbounded.check("c", "1000")
    assert home.walks == walks
