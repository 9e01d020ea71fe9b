"""Which refs of a git layer are the sandbox's changes (pure: `git_refs.compare`;
docs/working-layer.md, "The git layer")."""

from __future__ import annotations

from substrate.layer.changes.git_refs import RefChange, compare, ref_lists

A, B, C = "a" * 40, "b" * 40, "c" * 40


def test_a_ref_the_sandbox_created_moved_or_deleted_is_an_entry() -> None:
    baseline = {"refs/heads/main": A, "refs/heads/old": A}
    merged = {"refs/heads/main": B, "refs/heads/agent/x": C}
    host = {"refs/heads/main": A, "refs/heads/old": A}
    assert compare(baseline, merged, host) == [
        ("refs/heads/agent/x", None, C),
        ("refs/heads/main", A, B),
        ("refs/heads/old", A, None),
    ]


def test_a_ref_the_host_moved_is_not_the_sandboxs() -> None:
    # The host moved main and made a tag; the sandbox's view shows them as they are.
    baseline = {"refs/heads/main": A}
    merged = {"refs/heads/main": B, "refs/tags/v1": C}
    assert compare(baseline, merged, dict(merged)) == []


def test_both_moving_a_ref_keeps_the_sandboxs_start_for_the_cas() -> None:
    # The sandbox moved main A→B while the host moved it A→C: old_oid A, so the CAS
    # against the host's C fails (host_changed) rather than overwriting it.
    assert compare({"refs/heads/main": A}, {"refs/heads/main": B}, {"refs/heads/main": C}) == [
        ("refs/heads/main", A, B)
    ]


def test_nothing_outside_refs_and_no_invalid_name_is_an_entry() -> None:
    merged = {"HEAD": A, "refs/heads/bad..name": A, "refs/heads/ok": A}
    assert compare({}, merged, {}) == [("refs/heads/ok", None, A)]


def test_outcomes_go_to_their_lists() -> None:
    refs = [
        RefChange(name="refs/heads/agent/a", new_oid=A, state="applied"),
        RefChange(
            name="refs/heads/main", old_oid=A, new_oid=B, state="blocked", reason="ref_denied"
        ),
        RefChange(
            name="refs/heads/agent/c",
            old_oid=A,
            new_oid=B,
            state="conflict",
            reason="host_changed",
            current=C,
        ),
    ]
    lists = ref_lists(refs)
    assert [e.path for e in lists["applied"]] == ["refs/heads/agent/a"]
    assert lists["blocked"][0].rule == "git_refs_allow"
    assert lists["conflicts"][0].current_oid == C and lists["conflicts"][0].op == "ref"
