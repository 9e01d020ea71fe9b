"""`changes.blocked` entries (substrate.layer.changes.blocked): one per path that did not
land, bounded, never a digest of the command's bytes; a denied path keeps no preview."""

from __future__ import annotations

from substrate.layer.changes.apply import ApplyResult, Outcomes
from substrate.layer.changes.blocked import KIND, MAX_NAMED, drafts, without_denied_previews
from substrate.layer.changes.changeset import Blocked, Change, ChangeSet
from substrate.schema.workspace import Policy
from substrate.workspace.policy import compile_policy

SECRET_DIGEST = "ab" * 32


def _out(path: str, outcome: str, **kw: str) -> Outcomes:
    return Outcomes(path=path, op="create", kind="file", outcome=outcome, **kw)  # type: ignore[arg-type]


def test_each_path_that_did_not_land_is_one_entry_in_the_results_order() -> None:
    result = ApplyResult(
        applied=(_out("ok.txt", "applied", plan_digest="11" * 32),),
        blocked=(_out(".env", "blocked", reason="path_denied", rule=".env"),),
        pending=(
            _out("deploy/conf", "pending", reason="approval_required", plan_digest="cd" * 32),
        ),
        conflicts=(_out("a.txt", "conflict", reason="stale_base", current_sha256=SECRET_DIGEST),),
    )
    scanned = [
        Blocked(path="link", kind="symlink", reason="symlink"),
        Blocked(path="old.txt", kind="file", reason="host_changed"),
    ]
    made = drafts("proj", "ws_1", "agent:1000", "cs_1", 3, result, scanned)
    assert {d.kind for d in made} == {KIND}
    assert {(d.workspace, d.actor) for d in made} == {("ws_1", "agent:1000")}
    got = [(d.data["path"], d.data["outcome"], d.data["reason"], d.data["rule"]) for d in made]
    assert got == [
        ("proj:.env", "blocked", "path_denied", ".env"),
        ("proj:link", "blocked", "symlink", None),
        ("proj:deploy/conf", "pending", "approval_required", None),
        ("proj:a.txt", "conflict", "stale_base", None),
        ("proj:old.txt", "conflict", "host_changed", None),
    ]
    assert made[0].data == {
        "changeset": "cs_1",
        "generation": 3,
        "path": "proj:.env",
        "op": "create",
        "kind": "file",
        "outcome": "blocked",
        "reason": "path_denied",
        "rule": ".env",
        "plan_digest": None,
    }
    assert made[2].data["plan_digest"] == "cd" * 32
    assert SECRET_DIGEST not in repr([d.data for d in made])  # no digest of any bytes
    assert drafts("proj", "ws_1", "daemon", "cs_1", 3, ApplyResult(applied=result.applied)) == []


def test_past_the_cap_one_entry_counts_the_rest() -> None:
    many = tuple(
        _out(f"d/{i}", "blocked", reason="path_denied", rule="d/**") for i in range(100_000)
    )
    result = ApplyResult(blocked=many, pending=(_out("p", "pending", reason="approval_required"),))
    made = drafts(
        "proj", "ws_1", "daemon", "cs_1", 0, result, [Blocked(path="s", kind="fifo", reason="fifo")]
    )
    assert len(made) == MAX_NAMED + 1
    assert [d.data["path"] for d in made[:2]] == ["proj:d/0", "proj:d/1"]
    assert made[-1].data == {
        "changeset": "cs_1",
        "generation": 0,
        "more": 100_002 - MAX_NAMED,
        "blocked": 100_001 - MAX_NAMED,
        "pending": 1,
        "conflict": 0,
    }


def test_a_name_that_is_not_utf8_is_journaled_escaped() -> None:
    name = b"caf\xe9".decode("utf-8", "surrogateescape")
    made = drafts(
        "p",
        "ws",
        "daemon",
        "cs",
        0,
        ApplyResult(),
        [Blocked(path=name, kind="fifo", reason="fifo")],
    )
    assert made[0].data["path"] == "p:caf\\xe9"


def test_a_denied_path_keeps_no_preview_of_its_bytes() -> None:
    policy = compile_policy(Policy(write_deny=[".env", ".git/**"]))
    env = Change(path=".env", op="create", new_sha256="ab" * 32, size=6, diff="+SECRET\n")
    ok = Change(path="ok.txt", op="create", new_sha256="cd" * 32, size=3, diff="+ok\n")
    kept = without_denied_previews(ChangeSet(changes=(env, ok)), policy)
    assert kept.changes[0].diff == "" and kept.changes[0].diff_truncated
    assert kept.changes[0].new_sha256 == env.new_sha256  # still appliable if allowed later
    assert kept.changes[1] is ok
    clean = ChangeSet(changes=(ok,))
    assert without_denied_previews(clean, policy) is clean


def test_what_the_passthrough_walk_found_is_named_with_its_rule() -> None:
    found = [("node_modules/run", "setid"), ("node_modules/pipe", "fifo")]
    made = drafts("p", "ws", "agent:1", None, 2, ApplyResult(), found=found)
    assert [(d.data["path"], d.data["reason"], d.data["rule"]) for d in made] == [
        ("p:node_modules/run", "setid", "passthrough"),
        ("p:node_modules/pipe", "fifo", "passthrough"),
    ]
    assert {(d.data["changeset"], d.data["op"], d.data["outcome"]) for d in made} == {
        (None, None, "blocked")
    }
