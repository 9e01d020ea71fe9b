"""The wire schema: docs/api.schema.json is generated from the Structs and must be current."""

from __future__ import annotations

from pathlib import Path

import substrate.api  # noqa: F401  (registers handlers)
from substrate.api import HANDLERS
from substrate.errors import all_refusals
from substrate.schema import METHODS, render

ROOT = Path(__file__).resolve().parent.parent

SPEC_REFUSALS = [
    "unauthorized",
    "request_too_large",
    "invalid_params",
    "unknown_workspace",
    "path_invalid",
    "path_escape",
    "symlink_refused",
    "path_denied",
    "not_found",
    "not_a_file",
    "not_a_directory",
    "already_exists",
    "stale_base",
    "patch_conflict",
    "plan_mismatch",
    "approval_required",
    "too_large",
    "profile_unknown",
    "argv_denied",
    "confinement_unmet",
    "runtime_unavailable",
    "image_missing",
    "process_unknown",
    "artifact_unknown",
    "grant_invalid",
    "grant_expired",
    "grant_consumed",
    "origin_denied",
    "controller_busy",
    "limit_exceeded",
    "internal",
]


def test_checked_in_schema_is_current() -> None:
    checked_in = (ROOT / "docs" / "api.schema.json").read_text()
    assert checked_in == render(), "run: python -m substrate.schema docs/api.schema.json"


def test_every_declared_method_has_a_handler() -> None:
    assert sorted(METHODS) == sorted(HANDLERS)


def test_every_spec_refusal_exists_with_its_stable_name() -> None:
    assert set(SPEC_REFUSALS) <= set(all_refusals())
