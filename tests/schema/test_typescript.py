"""`substrate.schema.typescript`: the TypeScript client's generated.ts from `rpc.discover`."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from substrate.errors import all_refusals
from substrate.schema import METHODS, openrpc
from substrate.schema.typescript import class_name, render_typescript, ts_type, type_name

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ROOT / "clients" / "typescript" / "src" / "generated.ts"


def test_checked_in_client_is_current() -> None:
    assert GENERATED.read_text() == render_typescript(openrpc.document()), (
        "run: python -m substrate.schema"
    )


def test_stale_client_fails_the_check(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    for name in ("api.schema.json", "protocol.md", "architecture.md"):
        (docs / name).write_text((ROOT / "docs" / name).read_text())
    stale = tmp_path / "generated.ts"
    stale.write_text(GENERATED.read_text().replace("export interface ProcResult", "interface X"))
    argv = [sys.executable, "-m", "substrate.schema", str(docs / "api.schema.json")]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    check = subprocess.run(
        [*argv, "--typescript", str(stale), "--check"], capture_output=True, env=env
    )
    assert check.returncode == 1
    assert b"stale: " + str(stale).encode() in check.stdout
    subprocess.run([*argv, "--typescript", str(stale)], check=True, capture_output=True, env=env)
    assert stale.read_text() == GENERATED.read_text()


def test_every_method_and_refusal_is_in_the_client() -> None:
    text = GENERATED.read_text()
    for name in METHODS:
        assert f'  "{name}": {{ params: ' in text, name
        assert f'  "{name}": {{ sockets: ' in text, name
    for name in all_refusals():
        assert f"  {name}: {class_name(name)},\n" in text, name
    assert '"proc.output": OutputNotice;' in text
    assert '"proc.exit": WaitResult;' in text


@pytest.mark.parametrize(
    ("schema", "expected"),
    [
        ({"type": "string"}, "string"),
        ({"type": "integer", "minimum": 0}, "number"),
        ({"anyOf": [{"type": "string"}, {"type": "null"}]}, "string | null"),
        ({"enum": ["a", "b"]}, '"a" | "b"'),
        ({"type": "array", "items": {"$ref": "#/components/schemas/Fact"}}, "Fact[]"),
        (
            {"type": "array", "items": {"anyOf": [{"type": "string"}, {"type": "null"}]}},
            "Array<string | null>",
        ),
        ({"type": "object", "additionalProperties": {"type": "string"}}, "Record<string, string>"),
        ({"type": "object"}, "Record<string, unknown>"),
        ({"type": ["string", "null"]}, "string | null"),
        ({}, "unknown"),
        (
            {"type": "array", "prefixItems": [{"type": "string"}, {"type": "integer"}]},
            "[string, number]",
        ),
    ],
)
def test_json_schema_to_typescript(schema: dict[str, object], expected: str) -> None:
    assert ts_type(schema) == expected


def test_names() -> None:
    assert type_name("substrate.schema.fs.ReadParams") == "FsReadParams"
    assert type_name("ProcResult") == "ProcResult"
    assert class_name("stale_base") == "StaleBaseError"
    assert class_name("method_not_found") == "MethodNotFoundError"


def test_an_optional_field_is_one_not_required() -> None:
    schema = {
        "type": "object",
        "properties": {"a": {"type": "string"}, "b-c": {"type": "integer"}},
        "required": ["a"],
    }
    assert ts_type(schema) == '{\n  a: string;\n  "b-c"?: number;\n}'


def test_only_local_refs() -> None:
    with pytest.raises(ValueError, match="unsupported"):
        ts_type({"$ref": "http://example.com/x"})
