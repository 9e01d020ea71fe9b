"""Facts in results (docs/protocol.md §5): the digest is the record's fact-set key, the
summary reads the facts an honest engine shows, and a reply carries the list only when
asked (`facts: "full"`)."""

from __future__ import annotations

import hashlib
import sqlite3
from pathlib import Path

import msgspec

from substrate.process.facts_summary import facts_digest, shaped, summarize
from substrate.process.records import ProcessRecords
from substrate.sandbox.facts import make_fact
from substrate.schema.artifact import OutputRef
from substrate.schema.facts import Fact, FactValue
from substrate.schema.proc import FactsSummary, ProcResult, ProcStatus
from substrate.store.db import Store
from substrate.store.journal import Journal


def facts(values: dict[str, FactValue]) -> list[Fact]:
    return [
        make_fact(n, v, source="kernel:proc-status", observed_at=1.5) for n, v in values.items()
    ]


RUNC = facts(
    {
        "runtime": "runc",
        "uid": 1000,
        "gid": 1000,
        "seccomp_mode": 2,
        "cap_bnd": [],
        "no_new_privs": True,
        "rootfs_readonly": True,
        "net_links": ["lo"],
        "net_routes": [],
        "workspace_mount": "layer",
        "memory_limit": 1 << 30,
    }
)
EMPTY = OutputRef(bytes=0, sha256=hashlib.sha256(b"").hexdigest(), truncated=False, inline="")


def result(fact_list: list[Fact]) -> ProcResult:
    return ProcResult(
        proc="p_1",
        exit_code=0,
        signal=None,
        timed_out=False,
        oom_killed=False,
        duration_ms=1.0,
        stdout=EMPTY,
        stderr=EMPTY,
        policy_blocked=[],
        facts=fact_list,
    )


def test_the_summary_says_what_the_facts_say() -> None:
    assert summarize(RUNC) == FactsSummary(
        verified=True,
        count=11,
        runtime="runc",
        uid=1000,
        gid=1000,
        seccomp="filter",
        capabilities=0,
        no_new_privs=True,
        rootfs_readonly=True,
        network="none",
        workspace="layer",
    )
    gvisor = facts({"runtime": "runsc", "sandbox_oci_seccomp": False, "net_links": ["lo"]})
    assert summarize(gvisor).seccomp == "sentry"
    egress = facts({"runtime": "runc", "egress_allow_digest": "x", "cap_bnd": ["NET_BIND_SERVICE"]})
    assert (summarize(egress).network, summarize(egress).capabilities) == ("egress", 1)
    opened = facts({"net_links": ["eth0", "lo"], "net_routes": ["default"], "seccomp_mode": 0})
    assert (summarize(opened).network, summarize(opened).seccomp) == ("open", "none")
    # A record older than kept facts: nothing is claimed.
    assert summarize([]) == FactsSummary(verified=False, count=0)


def test_the_digest_is_the_key_the_record_keeps_the_set_under(tmp_path: Path) -> None:
    store = Store(tmp_path / "substrate.db")
    try:
        ProcessRecords(store, Journal(store)).started(
            workspace="w",
            proc="p_1",
            profile="tiny",
            argv=["true"],
            cwd=".",
            container="c" * 64,
            actor="test",
            facts=RUNC,
        )
        with sqlite3.connect(store.path) as db:
            ((key, stored),) = db.execute("SELECT digest, facts FROM fact_sets").fetchall()
    finally:
        store.close()
    assert facts_digest(RUNC) == key
    # A client can check it: SHA-256 of the list's compact JSON encoding.
    assert hashlib.sha256(stored.encode()).hexdigest() == key
    assert msgspec.json.decode(stored, type=list[Fact]) == RUNC


def test_a_reply_carries_the_list_only_when_asked() -> None:
    whole = result(RUNC)
    short = shaped(whole, "summary")
    assert short.facts is None
    assert short.facts_digest == facts_digest(RUNC)
    assert short.facts_summary == summarize(RUNC)
    full = shaped(whole, "full")
    assert full.facts == RUNC and full.facts_digest == short.facts_digest
    assert b"memory_limit" not in msgspec.json.encode(short)  # no fact is sent
    # The command's own process (fast exec): in full only when asked, noted otherwise.
    own = facts({"parent": "supervisor", "uid": 1000})
    fast = msgspec.structs.replace(whole, exec_facts=own)
    assert shaped(fast, "full").exec_facts == own
    brief = shaped(fast, "summary")
    assert brief.exec_facts == [] and brief.facts_summary is not None
    assert brief.facts_summary.exec_checked is True
    assert b"supervisor" not in msgspec.json.encode(brief)
    assert short.facts_summary is not None and short.facts_summary.exec_checked is False
    # A running command's status has no facts: nothing to shape.
    running = ProcStatus(
        proc="p_1",
        workspace="w",
        profile="tiny",
        argv=["sleep"],
        state="running",
        started=1.0,
        stdout_bytes=0,
        stderr_bytes=0,
    )
    assert shaped(running, "summary") == running
