"""substrate.schema.openrpc and `rpc.discover`: an OpenRPC document valid against the
published meta-schema (vendored in tests/openrpc/), naming every method, its socket, its
fields with their docs, and every refusal."""

from __future__ import annotations

import copy
import json
from typing import TYPE_CHECKING, Any

import jsonschema
import msgspec
import pytest
import referencing
from referencing.jsonschema import DRAFT7

from substrate.errors import all_refusals
from substrate.protocol.client import Client
from substrate.schema import METHODS, openrpc, reference
from substrate.schema.discover import DiscoverResult
from substrate.schema.proc import OutputRef
from substrate.schema.upload import UploadBeginParams
from tests.harness import PACKAGE_ROOT

if TYPE_CHECKING:
    from tests.harness import DaemonProcess

VENDORED = PACKAGE_ROOT / "tests" / "openrpc"


@pytest.fixture(scope="module")
def validator() -> jsonschema.Draft7Validator:
    """The OpenRPC 1.3 meta-schema, its JSON Schema dialect resolved from the vendored copy
    (never fetched)."""
    meta = json.loads((VENDORED / "openrpc-1.3.schema.json").read_text())
    dialect = json.loads((VENDORED / "json-schema-tools.schema.json").read_text())
    resource = referencing.Resource(dialect, specification=DRAFT7)

    def offline(uri: str) -> referencing.Resource[Any]:
        raise referencing.exceptions.NoSuchResource(uri)

    registry = referencing.Registry(retrieve=offline).with_resources(
        [
            ("https://meta.json-schema.tools", resource),
            ("https://meta.json-schema.tools/", resource),
        ]
    )
    return jsonschema.Draft7Validator(meta, registry=registry)


@pytest.fixture(scope="module")
def doc() -> dict[str, Any]:
    decoded: dict[str, Any] = json.loads(openrpc.encoded())
    return decoded


def method_of(doc: dict[str, Any], name: str) -> dict[str, Any]:
    (found,) = [m for m in doc["methods"] if m["name"] == name]
    return found


def test_document_is_valid_openrpc(
    validator: jsonschema.Draft7Validator, doc: dict[str, Any]
) -> None:
    errors = [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(doc)]
    assert errors == []
    assert doc["openrpc"] == "1.3.2"


@pytest.mark.parametrize(
    "break_it",
    [
        lambda d: d["methods"][0].pop("name"),
        lambda d: d.update(openrpc="9.9.9"),
        lambda d: d["methods"][0]["params"][0].pop("schema"),
        lambda d: d["components"]["schemas"]["Plan"].update(type=5),
        lambda d: d["components"]["errors"]["stale_base"].update(code="x"),
    ],
    ids=["method-name", "version", "param-schema", "json-schema", "error-code"],
)
def test_the_validation_is_not_vacuous(
    validator: jsonschema.Draft7Validator, doc: dict[str, Any], break_it: Any
) -> None:
    broken = copy.deepcopy(doc)
    break_it(broken)
    assert not validator.is_valid(broken)


def test_every_method_once_with_its_socket(doc: dict[str, Any]) -> None:
    names = [m["name"] for m in doc["methods"]]
    assert names == sorted(METHODS)
    for name, spec in METHODS.items():
        entry = method_of(doc, name)
        sockets = ["operator"] if spec.operator_only else ["agent", "operator"]
        assert entry["x-substrate-sockets"] == sockets, name
        assert entry["x-substrate-mutating"] is spec.mutating
        assert entry["x-substrate-section"] == reference.section_of(name)
        assert entry["paramStructure"] == "by-name"
    assert method_of(doc, "workspace.set_policy")["x-substrate-sockets"] == ["operator"]
    assert "rpc.discover" in names and "fs.upload.commit" in names


def test_params_are_the_struct_fields_with_their_docs(doc: dict[str, Any]) -> None:
    for name, spec in METHODS.items():
        fields = msgspec.structs.fields(spec.params)
        params = method_of(doc, name)["params"]
        assert [p["name"] for p in params] == [f.encode_name for f in fields], name
        for param, field in zip(params, fields, strict=True):
            required = (
                field.default is msgspec.NODEFAULT and field.default_factory is msgspec.NODEFAULT
            )
            assert param["required"] is required, (name, field.name)
    begin = {p["name"]: p for p in method_of(doc, "fs.upload.begin")["params"]}
    comments = reference.field_comments(UploadBeginParams)
    assert begin["base_sha256"]["description"] == comments["base_sha256"]
    assert "null: it must not exist" in begin["base_sha256"]["description"]
    assert begin["size"]["schema"]["minimum"] == 0
    assert begin["sha256"]["schema"]["pattern"] == "^[0-9a-f]{64}$"
    # The params Struct's docstring is the method's description.
    assert "Checked at once" in method_of(doc, "fs.upload.begin")["description"]


def test_component_schemas_carry_docstrings_and_field_comments(doc: dict[str, Any]) -> None:
    schemas = doc["components"]["schemas"]
    head = schemas["OutputRef"]["properties"]["preview_head"]["description"]
    assert head == reference.field_comments(OutputRef)["preview_head"]
    assert head.startswith("At most 4096 bytes")
    assert schemas["DiscoverResult"]["description"].startswith("An OpenRPC 1.3 document")
    # Two Structs share a name: both are there, qualified as msgspec names them.
    assert "substrate.schema.fs.ReadParams" in schemas
    assert "substrate.schema.artifact.ReadParams" in schemas


def test_refusals_are_errors_and_every_reference_resolves(doc: dict[str, Any]) -> None:
    errors = doc["components"]["errors"]
    for name, cls in all_refusals().items():
        assert errors[name]["code"] == cls.code
        assert errors[name]["data"] == {"refusal": name}
        assert errors[name]["message"]
    assert errors["upload_unknown"]["code"] == -32001
    assert errors["invalid_params"]["code"] == -32602
    assert errors["method_not_found"]["code"] == -32601
    text = json.dumps(doc)
    for ref in {part.split('"', 1)[0] for part in text.split('"$ref": "')[1:]}:
        assert ref.startswith("#/components/"), ref
        node: Any = doc
        for key in ref[2:].split("/"):
            node = node[key]
    stale = method_of(doc, "fs.write")["errors"]
    assert {"$ref": "#/components/errors/stale_base"} in stale
    # Answers to a line or a WebSocket are not a method's.
    assert {"$ref": "#/components/errors/request_too_large"} not in stale


def test_the_result_struct_describes_the_document(doc: dict[str, Any]) -> None:
    result = msgspec.convert(doc, DiscoverResult)
    assert result.info.title == "substrate"
    assert len(result.methods) == len(METHODS)


def test_rendered_once() -> None:
    assert openrpc.encoded() is openrpc.encoded()


def test_rpc_discover_on_both_sockets(daemon: DaemonProcess) -> None:
    expected = json.loads(openrpc.encoded())
    with Client(daemon.agent_path) as agent, Client(daemon.operator_path) as operator:
        assert agent.call("rpc.discover") == expected
        assert operator.call("rpc.discover") == expected


@pytest.mark.parametrize("operator", [False, True], ids=["agent", "operator"])
def test_unknown_method_suggests_names_on_both_sockets(
    daemon: DaemonProcess, operator: bool
) -> None:
    path = daemon.operator_path if operator else daemon.agent_path
    with Client(path) as c:
        reply = _error_of(c, "fs.reed")
        assert reply["code"] == -32601
        assert reply["data"]["suggestions"][0] == "fs.read"
        assert len(reply["data"]["suggestions"]) <= 3
        assert "did you mean fs.read" in reply["message"]
        assert _error_of(c, "discover")["data"]["suggestions"] == ["rpc.discover"]
        assert _error_of(c, "zzzzzzzz")["data"]["suggestions"] == []


def _error_of(c: Client, method: str) -> dict[str, Any]:
    c.send_raw(json.dumps({"jsonrpc": "2.0", "id": 7, "method": method}).encode() + b"\n")
    message = c.read_message()
    assert message["id"] == 7
    error: dict[str, Any] = message["error"]
    return error
