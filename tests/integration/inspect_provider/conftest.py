"""The self-check table: every check of Inspect's provider conformance suite, by profile.

Each check's outcome is recorded as it is reported and printed at the end of the session
(the table in docs/integrations.md is this output).
"""

from __future__ import annotations

from typing import Any

import pytest

#: check name → profile → outcome ("passed", "refused: <why>", "FAILED").
OUTCOMES: dict[str, dict[str, str]] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if "test_inspect_self_check" not in report.nodeid or "[" not in report.nodeid:
        return
    if report.when != "call" and not (report.when == "setup" and report.outcome != "passed"):
        return
    name = report.nodeid.rsplit("::", 1)[-1]
    check, _, profile = name.partition("[")
    profile = profile.rstrip("]")
    if hasattr(report, "wasxfail"):
        outcome = f"refused: {report.wasxfail}"
    elif report.passed:
        outcome = "passed"
    else:
        outcome = "FAILED"
    OUTCOMES.setdefault(check, {})[profile] = outcome


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not OUTCOMES:
        return
    profiles = sorted({p for row in OUTCOMES.values() for p in row}, reverse=True)
    terminalreporter.section("Inspect sandbox self-check (sandbox type substrate)")
    terminalreporter.write_line("| check | " + " | ".join(f"`{p}`" for p in profiles) + " |")
    terminalreporter.write_line("|---|" + "---|" * len(profiles))
    for check in sorted(OUTCOMES):
        row = OUTCOMES[check]
        cells = " | ".join(row.get(p, "-") for p in profiles)
        terminalreporter.write_line(f"| `{check}` | {cells} |")
