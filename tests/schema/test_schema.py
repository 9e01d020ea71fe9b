"""The wire schema: docs/api.schema.json is generated from the Structs and must be current."""

from __future__ import annotations

import msgspec
import pytest

import substrate.api  # noqa: F401  (registers handlers)
from substrate.api import HANDLERS
from substrate.config import Config
from substrate.errors import all_refusals
from substrate.sandbox.profiles import Profile
from substrate.schema import METHODS, common, reference, render
from substrate.schema.artifact import OutputRef
from substrate.schema.reference import render_protocol
from tests.harness import PACKAGE_ROOT

ROOT = PACKAGE_ROOT

CONTRACT_REFUSALS = [
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
    "changeset_unknown",
    "upload_unknown",
    "internal",
]


def test_checked_in_schema_is_current() -> None:
    checked_in = (ROOT / "docs" / "api.schema.json").read_text()
    assert checked_in == render(), "run: python -m substrate.schema docs/api.schema.json"


def test_every_declared_method_has_a_handler() -> None:
    assert sorted(METHODS) == sorted(HANDLERS)


def test_method_properties_are_declared_with_each_method() -> None:
    """The server reads these from the table: refusals of mutating methods are journaled,
    shielded ones finish across a shutdown, operator-only ones are refused to agents."""
    mutating = {name for name, spec in METHODS.items() if spec.mutating}
    shielded = {name for name, spec in METHODS.items() if spec.shielded}
    operator_only = {name for name, spec in METHODS.items() if spec.operator_only}
    assert mutating == {
        "fs.write",
        "fs.patch",
        "fs.delete",
        "fs.upload.commit",
        "proc.run",
        "proc.start",
        "agent.start",
        "workspace.checkpoint",
        "workspace.restore",
        "changes.apply",
        "changes.discard",
    }
    assert shielded == {
        "fs.write",
        "fs.patch",
        "fs.delete",
        "fs.upload.commit",
        "workspace.restore",
        "changes.apply",
        "changes.discard",
    }
    assert operator_only == {
        "approval.grant",
        "daemon.info",
        "daemon.drain",
        "profile.reload",
        "grant.issue",
        "grant.list",
        "grant.revoke",
        "workspace.set_policy",
    }
    published = msgspec.json.decode(render())["methods"]
    for name, spec in METHODS.items():
        flags = (spec.operator_only, spec.mutating, spec.shielded)
        entry = published[name]
        assert (entry["operator_only"], entry["mutating"], entry["shielded"]) == flags


def test_a_shielded_method_must_be_mutating() -> None:
    with pytest.raises(RuntimeError, match="shielded but not mutating"):
        common.method("x.never", common.Empty, common.Empty, shielded=True)
    assert "x.never" not in METHODS


def test_every_spec_refusal_exists_with_its_stable_name() -> None:
    assert set(CONTRACT_REFUSALS) <= set(all_refusals())


# -- docs/protocol.md: the generated regions and the section numbering -----------------------

PROTOCOL = ROOT / "docs" / "protocol.md"


def test_protocol_generated_regions_are_current() -> None:
    checked_in = PROTOCOL.read_text()
    assert checked_in == render_protocol(checked_in), "run: python -m substrate.schema"


def test_protocol_keeps_the_section_numbers_code_cites() -> None:
    # Code comments cite "docs/protocol.md §n": every number must stay a section heading.
    headings = [line for line in PROTOCOL.read_text().splitlines() if line.startswith("## ")]
    numbers = [h.split()[1] for h in headings if h.split()[1].rstrip(".").isdigit()]
    assert numbers == [f"{n}." for n in range(1, 15)]


def test_method_reference_names_every_method_and_field() -> None:
    text = reference.render_methods()
    for name, spec in METHODS.items():
        section = text.split(f"### `{name}`\n", 1)[1].split("\n### ", 1)[0]
        for cls in (spec.params, spec.result):
            for field in msgspec.structs.fields(cls):
                assert f"- `{field.encode_name}`: " in section, (name, field.name)


def test_every_refusal_and_key_is_in_its_table() -> None:
    regions = reference.regions()
    for name in all_refusals():
        assert f"| `{name}` |" in regions["refusals"]
    for field in msgspec.structs.fields(Config):
        assert f"| `{field.encode_name}` |" in regions["config"]
    for field in msgspec.structs.fields(Profile):
        assert (f"| `{field.encode_name}` |" in regions["profile"]) == (field.name != "name")


def test_fill_replaces_only_between_markers() -> None:
    text = "a\n<!-- generated:x:start -->\nold\n<!-- generated:x:end -->\nb\n"
    assert reference.fill(text, {"x": "new\n"}) == (
        "a\n<!-- generated:x:start -->\nnew\n<!-- generated:x:end -->\nb\n"
    )


@pytest.mark.parametrize(
    "text",
    [
        "no markers at all\n",
        "<!-- generated:x:start -->\n",
        "<!-- generated:x:end -->\n<!-- generated:x:start -->\n",
        "<!-- generated:x:start -->\n<!-- generated:x:start -->\n<!-- generated:x:end -->\n",
    ],
)
def test_fill_refuses_missing_repeated_or_reversed_markers(text: str) -> None:
    with pytest.raises(ValueError):
        reference.fill(text, {"x": "body\n"})


def test_defaults_do_not_depend_on_the_machine() -> None:
    config = reference.regions()["config"]
    assert str(reference.PROJECT_ROOT) not in config
    assert "(computed)" in config  # state_dir comes from the environment


def test_field_comments_come_from_the_source() -> None:
    comments = reference.field_comments(OutputRef)
    assert comments["preview_head"].startswith("At most 4096 bytes")  # a `#:` comment above
    assert reference.field_comments(Profile)["pids"] == "max tasks in the container's cgroup"


def test_prose_escapes_markup_outside_code_spans_only() -> None:
    assert reference.prose("seccomp/<name>.json, `a<b>*c`, *.toml, max_bytes") == (
        "seccomp/&lt;name&gt;.json, `a<b>*c`, \\*.toml, max_bytes"
    )


def test_every_method_points_at_the_section_that_describes_it() -> None:
    for name in METHODS:
        assert reference.section_of(name) in {f"§{n}" for n in range(1, 15)}, name
