"""Benchmark of naming blocked paths in the journal: what `changes.blocked` costs a set.

    python3 bench/blocked.py [--runs 15]

On a temporary state database (SQLite WAL, `synchronous=FULL`, as the daemon runs it),
marks a recorded change set applied (`Changesets.finish`: its summary entry plus one
`changes.blocked` per path that did not land, one transaction) and reports the median
of `--runs` (interleaved) for a set where every path landed (the baseline: the summary
alone) and sets with 10, 1,000 and 100,000 denied paths (the last named up to the cap,
then counted), as ratios to the baseline measured in the same run. No engine needed.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import cast

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from substrate.layer.changes import ApplyResult, ChangeSet, Changesets, Outcomes  # noqa: E402
from substrate.store.db import Store  # noqa: E402
from substrate.store.journal import Journal  # noqa: E402
from substrate.workspace.policy import compile_policy  # noqa: E402
from substrate.workspace.registry import Workspace  # noqa: E402


@dataclass
class _Ws:
    """What `record` and `finish` read of a workspace."""

    id: str = "ws_bench"
    root_id: str = "bench"
    checkout: str = "bench-checkout"
    policy = compile_policy(None)


def _finish_once(changesets: Changesets, ws: Workspace, result: ApplyResult) -> float:
    cs = changesets.record(
        ws, 0, "/nonexistent/upper", "/nonexistent/work", ChangeSet(), "applying"
    )
    started = time.perf_counter()
    changesets.finish(cs, ws, 0, result, "changes.applied")
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "substrate.db")
        journal = Journal(store)
        changesets = Changesets(store, journal)
        ws = cast(Workspace, _Ws())

        def denied(n: int) -> ApplyResult:
            return ApplyResult(
                blocked=tuple(
                    Outcomes(
                        path=f"secrets/{i}.env",
                        op="create",
                        kind="file",
                        outcome="blocked",
                        reason="path_denied",
                        rule="secrets/**",
                    )
                    for i in range(n)
                )
            )

        landed = ApplyResult(
            applied=tuple(
                Outcomes(path=f"src/{i}.py", op="create", kind="file", outcome="applied")
                for i in range(1000)
            )
        )
        cases: dict[object, ApplyResult] = {"baseline": landed}
        cases.update({n: denied(n) for n in (10, 1000, 100_000)})
        times: dict[object, list[float]] = {key: [] for key in cases}
        entries: dict[object, int] = {}
        for _ in range(args.runs):  # interleaved: the machine's load drifts alike for all
            for key, result in cases.items():
                before = journal.count()
                times[key].append(_finish_once(changesets, ws, result))
                entries[key] = journal.count() - before
        base = statistics.median(times["baseline"])
        print(f"finish, 1000 applied, nothing blocked: median {base * 1e3:.2f} ms (baseline)")
        for key in cases:
            if key == "baseline":
                continue
            took = statistics.median(times[key])
            print(
                f"finish, {key} denied paths: median {took * 1e3:.2f} ms,"
                f" {took / base:.1f}x the baseline, {entries[key]} journal entries per set"
            )
        store.close()


if __name__ == "__main__":
    main()
