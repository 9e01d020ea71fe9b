"""`substrate.egress.ledger` (pure): refused connections filed per command, bounded."""

from __future__ import annotations

from substrate.egress.ledger import MAX_HOSTS, MAX_JOURNALLED, MAX_STRAY, SandboxLedger
from substrate.schema.proc import EgressBlocked


def test_a_commands_refusals_are_counted_and_listed_once_each() -> None:
    ledger = SandboxLedger()
    ledger.open_run("p_1")
    assert ledger.record("p_1", "blocked.invalid", 80) is True
    assert ledger.record("p_1", "blocked.invalid", 80) is False  # counted, not journalled again
    assert ledger.record("p_1", "other.invalid", 443) is True
    assert ledger.record("p_1", "::1", 443) is True
    assert ledger.close_run("p_1") == EgressBlocked(
        count=4, hosts=["blocked.invalid:80", "other.invalid:443", "[::1]:443"]
    )
    # Closed: nothing is left for it.
    assert ledger.close_run("p_1") is None


def test_a_command_refused_nothing_reports_nothing() -> None:
    ledger = SandboxLedger()
    ledger.open_run("p_1")
    ledger.open_run("p_2")
    ledger.record("p_2", "blocked.invalid", 80)
    assert ledger.close_run("p_1") is None
    assert ledger.close_run("p_2") == EgressBlocked(count=1, hosts=["blocked.invalid:80"])


def test_an_unknown_process_is_charged_to_every_open_run() -> None:
    ledger = SandboxLedger()
    ledger.open_run("p_1")
    ledger.open_run("p_2")
    assert ledger.record(None, "blocked.invalid", 80) is True
    assert ledger.record(None, "blocked.invalid", 80) is False
    assert ledger.close_run("p_1") == EgressBlocked(count=2, hosts=["blocked.invalid:80"])
    assert ledger.close_run("p_2") == EgressBlocked(count=2, hosts=["blocked.invalid:80"])


def test_a_refusal_before_its_run_opened_reaches_its_result() -> None:
    ledger = SandboxLedger()
    assert ledger.record("p_1", "blocked.invalid", 80) is True
    ledger.open_run("p_1")
    ledger.record("p_1", "blocked.invalid", 443)
    assert ledger.close_run("p_1") == EgressBlocked(
        count=2, hosts=["blocked.invalid:80", "blocked.invalid:443"]
    )
    # And one that never opens one (a terminal's shell) is still collected by its id.
    ledger.record("s_term", "x.invalid", 80)
    assert ledger.close_run("s_term") == EgressBlocked(count=1, hosts=["x.invalid:80"])


def test_the_result_lists_a_bounded_number_of_hosts_with_the_whole_count() -> None:
    ledger = SandboxLedger()
    ledger.open_run("p_1")
    for i in range(MAX_HOSTS + 10):
        ledger.record("p_1", f"h{i}.invalid", 80)
    blocked = ledger.close_run("p_1")
    assert blocked is not None
    assert blocked.count == MAX_HOSTS + 10
    assert blocked.hosts == [f"h{i}.invalid:80" for i in range(MAX_HOSTS)]


def test_journalling_is_bounded_per_command_and_for_strays() -> None:
    ledger = SandboxLedger()
    ledger.open_run("p_1")
    fresh = [ledger.record("p_1", f"h{i}.invalid", 80) for i in range(MAX_JOURNALLED + 5)]
    assert fresh.count(True) == MAX_JOURNALLED
    # No open run: unknown processes share one bound.
    idle = SandboxLedger()
    fresh = [idle.record(None, f"h{i}.invalid", 80) for i in range(MAX_JOURNALLED + 5)]
    assert fresh.count(True) == MAX_JOURNALLED
    # Commands without a run: at most MAX_STRAY are kept, the rest share one bound.
    many = SandboxLedger()
    for i in range(MAX_STRAY + 3):
        assert many.record(f"p_{i}", "h.invalid", 80) is True
    assert len(many.strays) == MAX_STRAY
    assert many.record(f"p_{MAX_STRAY}", "h.invalid", 80) is False
