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
        self.bounds: list[int] = []  # max_entries of each walk

    def measure(self, checkout: str, home: str, *, max_entries: int = 100_000) -> HomeUsage | None:
        self.bounds.append(max_entries)
        self.walks += 1
        if self.usage is not None and self.usage.files > max_entries:
            return HomeUsage(bytes=self.usage.bytes, files=max_entries, truncated=True)
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


def test_a_small_home_is_walked_on_the_event_loop_within_a_bound(home: FakeHome) -> None:
    quota = HomeQuota(home.measure, 100, clock=home.clock)
    assert not quota.check_here("c", "1000")  # never walked: the whole walk, in a thread
    home.cost = 0.0001
    quota.check("c", "1000")
    assert quota.check_here("c", "1000")  # handed since: walked again, here, bounded
    assert home.bounds[-1] == home_quota.INLINE_ENTRIES
    home.usage = HomeUsage(bytes=150, files=3)
    with pytest.raises(LimitExceeded):
        quota.check_here("c", "1000")
    home.usage = HomeUsage(bytes=10, files=1)
    assert quota.check_here("c", "1000")
    # Grown past the bound since its last walk: no answer here, the thread walks it all.
    home.usage = HomeUsage(bytes=10, files=home_quota.INLINE_ENTRIES * 4)
    walks = home.walks
    assert not quota.check_here("c", "1000")
    assert home.walks == walks + 1
    quota.check("c", "1000")
    assert home.bounds[-1] == 100_000
    # Now known to be big: never walked on the event loop again.
    walks = home.walks
    assert not quota.check_here("c", "1000") and home.walks == walks


def test_a_slow_small_home_is_not_walked_on_the_event_loop(home: FakeHome) -> None:
    quota = HomeQuota(home.measure, 100, clock=home.clock)
    home.cost = 0.002  # a few files, but slow to walk (a cold disk)
    quota.check("c", "1000")
    walks = home.walks
    assert not quota.check_here("c", "1000") and home.walks == walks
