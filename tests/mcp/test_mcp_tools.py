"""`substrate.mcp.tools` and `.resources`: the tool table, schemas from the Structs,
arguments as sent to the daemon, artifact URIs (pure)."""

from __future__ import annotations

import jsonschema
import msgspec
import pytest

from substrate.mcp.output import OutputParams
from substrate.mcp.resources import (
    MAX_SEEN,
    BadUri,
    Seen,
    SeenArtifact,
    artifact_uri,
    artifacts_in,
    parse_artifact_uri,
)
from substrate.mcp.tools import (
    BY_NAME,
    MAX_WAIT_S,
    TOOLS,
    input_schema,
    prepare_arguments,
    struct_schema,
    unknown_fields,
)
from substrate.schema import METHODS
from substrate.schema.fs import PatchParams, ReadParams


def test_every_tool_calls_an_agent_method_and_is_named_for_it() -> None:
    for tool in TOOLS:
        spec = METHODS[tool.method]
        assert not spec.operator_only, tool.name
        if tool.own_params is None:
            assert tool.name == tool.method.replace(".", "_"), tool.name
        # A tool that changes state is never hinted read-only.
        assert not (spec.mutating and tool.read_only), tool.name
        if tool.read_only:
            assert not tool.destructive, tool.name
    assert BY_NAME["proc_output"].params is OutputParams


def test_schemas_are_the_structs_with_an_object_root() -> None:
    for tool in TOOLS:
        schema = struct_schema(tool.params)
        assert schema["type"] == "object", tool.name
        jsonschema.Draft202012Validator.check_schema(schema)
    patch = struct_schema(PatchParams)
    generated = msgspec.json.schema(PatchParams)["$defs"]
    assert patch["properties"].keys() == generated["PatchParams"]["properties"].keys()
    assert patch["$defs"]["Edit"]["required"] == generated["Edit"]["required"]
    # The schema accepts what the Struct accepts and refuses what it refuses.
    good = {
        "workspace": "w",
        "path": "a",
        "base_sha256": "0" * 64,
        "edits": [{"old": "a", "new": "b"}],
    }
    jsonschema.validate(good, patch)
    msgspec.convert(good, PatchParams)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "edits": [{"old": "", "new": "b"}]}, patch)


def test_field_comments_become_descriptions_and_bounds_are_stated() -> None:
    schema = input_schema(BY_NAME["proc_run"], default_workspace=None, result_bytes=65536)
    assert "lower" in schema["properties"]["timeout_s"]["description"]
    read = input_schema(BY_NAME["fs_read"], default_workspace="ws_1", result_bytes=65536)
    assert "65536" in read["properties"]["length"]["description"]
    assert "workspace" not in read["required"]
    assert "ws_1" in read["properties"]["workspace"]["description"]


def test_arguments_get_the_default_workspace_and_clamps() -> None:
    read = BY_NAME["fs_read"]
    assert ReadParams(workspace="w", path="a").length > 4096
    sent = prepare_arguments(read, {"path": "a"}, default_workspace="ws_1", result_bytes=4096)
    assert sent == {"path": "a", "workspace": "ws_1", "length": 4096}  # default 262144 lowered
    small = prepare_arguments(
        read, {"path": "a", "length": 10}, default_workspace=None, result_bytes=4096
    )
    assert small == {"path": "a", "length": 10}
    mine = prepare_arguments(
        read, {"path": "a", "workspace": "ws_2"}, default_workspace="ws_1", result_bytes=4096
    )
    assert mine["workspace"] == "ws_2"
    wait = prepare_arguments(
        BY_NAME["proc_wait"], {"proc": "p"}, default_workspace="w", result_bytes=1
    )
    assert wait == {"proc": "p", "timeout_s": MAX_WAIT_S}  # None (forever) is bounded too
    assert unknown_fields(read, {"path": "a", "method": 1, "zz": 2}) == ["method", "zz"]
    assert unknown_fields(read, None) == []
    # Wrong types are left for the daemon to refuse by path.
    odd = prepare_arguments(read, {"length": "x"}, default_workspace=None, result_bytes=4096)
    assert odd == {"length": "x"}


def test_artifact_uris() -> None:
    assert artifact_uri("art_1") == "substrate://artifact/art_1"
    assert parse_artifact_uri("substrate://artifact/art_1").offset == 0
    r = parse_artifact_uri("substrate://artifact/art_1?offset=5&length=9")
    assert (r.artifact, r.offset, r.length) == ("art_1", 5, 9)
    for bad in (
        "file:///etc/passwd",
        "substrate://proc/p_1",
        "substrate://artifact/",
        "substrate://artifact/a/b",
        "substrate://artifact/a?offset=-1",
        "substrate://artifact/a?offset=1&offset=2",
        "substrate://artifact/a?path=x",
        "substrate://artifact/" + "a" * 200,
    ):
        with pytest.raises(BadUri):
            parse_artifact_uri(bad)


def test_seen_artifacts_newest_first_and_bounded() -> None:
    result = {
        "proc": "p_1",
        "stdout": {"bytes": 9, "artifact": "art_a"},
        "stderr": {"bytes": 1, "inline": "x"},
    }
    assert list(artifacts_in(result)) == [SeenArtifact("art_a", "stdout of p_1", 9)]
    seen = Seen()
    for i in range(MAX_SEEN + 5):
        seen.add(SeenArtifact(f"art_{i}", "x", 1))
    seen.add(SeenArtifact("art_10", "x", 1))
    ids = [s.artifact for s in seen.newest_first()]
    assert len(ids) == MAX_SEEN and ids[0] == "art_10" and "art_0" not in ids
