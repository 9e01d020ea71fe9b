"""The OpenRPC document `rpc.discover` answers (docs/protocol.md §14), from the method table.

Theory of operation: one pass of `msgspec.json.schema_components` over every method's
params and result Struct gives JSON Schemas with shared `components.schemas`
(`$ref: #/components/schemas/<Name>`). Each Struct's schema then gets the docs written in
its source, as `substrate.schema.reference` finds them for docs/protocol.md: the class
docstring as `description`, each field's comment as its property's `description`. Each
method becomes an OpenRPC method object whose params are its Struct's fields by name
(content descriptors with `required` and the field's doc); its result is a `$ref`.
Refusals (`substrate.errors`) are `components.errors`, referenced by every method. A method
that starts server notifications (`proc.subscribe`) names them, with a `$ref` to the
Struct of their params, in `x-substrate-notifications`.

Pure and deterministic (sorted by name); `encoded()` renders once per process, so
`rpc.discover` costs a lookup after the first call. Nothing here changes when the daemon
runs: the table is complete once `substrate.schema` is imported.
"""

from __future__ import annotations

import functools
from typing import Any

import msgspec
import msgspec.inspect as mi

from substrate import __version__
from substrate.errors import all_refusals
from substrate.schema import METHODS, MethodSpec
from substrate.schema.reference import class_doc, field_comments, section_of

#: The OpenRPC specification version the document follows.
OPENRPC_VERSION = "1.3.2"
SCHEMA_REF = "#/components/schemas/{name}"
ERROR_REF = "#/components/errors/{name}"
#: Refusals that answer a request line, a connection or a terminal WebSocket, never a
#: method call: listed under `components.errors`, not under each method.
NOT_METHOD_REPLIES = frozenset(
    {"request_too_large", "request_too_deep", "origin_denied", "controller_busy"}
)
#: Standard JSON-RPC errors worth naming (the others are in the JSON-RPC spec).
STANDARD_ERRORS: dict[str, dict[str, Any]] = {
    "method_not_found": {
        "code": -32601,
        "message": "No such method; data.suggestions names up to 3 close ones.",
        "data": {"suggestions": []},
    },
}

DESCRIPTION = (
    "JSON-RPC 2.0, one JSON object per line, over two Unix sockets in the daemon's state"
    " dir: `substrate.sock` for agents and `operator.sock` for operators. A method's"
    " `x-substrate-sockets` says where it may be called (an operator-only method is"
    " refused `unauthorized` on the agent socket). Params are by name; unknown fields are"
    " `invalid_params` (code -32602, `data.path` names the field). Every named refusal is"
    " code -32001 with `data.refusal` naming it (`components.errors`). The contract in"
    " prose is docs/protocol.md; `x-substrate-section` is a method's section there."
)


def _component_classes(names: dict[str, Any], roots: list[type]) -> dict[str, type]:
    """Component name → Struct class, matching msgspec's naming (the class name, or
    `module.qualname` where two classes share a name)."""
    classes: dict[type, None] = {}
    stack = list(roots)
    while stack:
        cls = stack.pop()
        if cls in classes:
            continue
        classes[cls] = None
        info = mi.type_info(cls)
        assert isinstance(info, mi.StructType), cls
        for field in info.fields:
            stack.extend(_structs_in(field.type))
    found: dict[str, type] = {}
    for cls in classes:
        for name in (cls.__name__, f"{cls.__module__}.{cls.__qualname__}"):
            if name in names:
                found[name] = cls
    return found


def _structs_in(t: mi.Type) -> list[type]:
    match t:
        case mi.StructType():
            return [t.cls]
        case mi.UnionType():
            return [cls for member in t.types for cls in _structs_in(member)]
        case mi.ListType() | mi.VarTupleType() | mi.SetType() | mi.FrozenSetType():
            return _structs_in(t.item_type)
        case mi.TupleType():
            return [cls for item in t.item_types for cls in _structs_in(item)]
        case mi.DictType():
            return _structs_in(t.key_type) + _structs_in(t.value_type)
        case mi.Metadata():
            return _structs_in(t.type)
        case _:
            return []


def _describe(schema: dict[str, Any], cls: type) -> None:
    """Put `cls`'s docstring and field comments into its component schema."""
    doc = class_doc(cls)
    if doc:
        schema["description"] = doc
    else:
        schema.pop("description", None)
    comments = field_comments(cls)
    properties = schema.get("properties", {})
    info = mi.type_info(cls)
    assert isinstance(info, mi.StructType)
    for field in info.fields:
        comment = comments.get(field.name)
        if comment and field.encode_name in properties:
            properties[field.encode_name]["description"] = comment


def _ref_name(ref: dict[str, Any]) -> str:
    return str(ref["$ref"]).rsplit("/", 1)[-1]


def _params(spec: MethodSpec, component: dict[str, Any]) -> list[dict[str, Any]]:
    """Content descriptors of the params Struct's fields, in declaration order."""
    info = mi.type_info(spec.params)
    assert isinstance(info, mi.StructType)
    properties = component.get("properties", {})
    out = []
    for field in info.fields:
        schema = dict(properties[field.encode_name])
        descriptor: dict[str, Any] = {"name": field.encode_name}
        description = schema.pop("description", None)
        if description:
            descriptor["description"] = description
        descriptor["required"] = field.required
        descriptor["schema"] = schema
        out.append(descriptor)
    return out


def _method(
    spec: MethodSpec,
    params_ref: dict[str, Any],
    result_ref: dict[str, Any],
    schemas: dict[str, Any],
    refusals: list[str],
) -> dict[str, Any]:
    entry: dict[str, Any] = {"name": spec.name}
    if spec.doc:
        entry["summary"] = spec.doc
    params_doc = schemas[_ref_name(params_ref)].get("description")
    if params_doc:
        entry["description"] = params_doc
    result_name = _ref_name(result_ref)
    result: dict[str, Any] = {"name": result_name, "schema": result_ref}
    result_doc = schemas[result_name].get("description")
    if result_doc:
        result["description"] = result_doc
    entry.update(
        {
            "paramStructure": "by-name",
            "params": _params(spec, schemas[_ref_name(params_ref)]),
            "result": result,
            "errors": [{"$ref": ERROR_REF.format(name=name)} for name in refusals],
            "x-substrate-sockets": ["operator"] if spec.operator_only else ["agent", "operator"],
            "x-substrate-mutating": spec.mutating,
            "x-substrate-section": section_of(spec.name),
        }
    )
    return entry


def errors() -> dict[str, dict[str, Any]]:
    """`components.errors`: every refusal (code, its docstring, `data.refusal`), then the
    standard errors that carry substrate's own `data`."""
    found: dict[str, dict[str, Any]] = {}
    for name, cls in sorted(all_refusals().items()):
        found[name] = {"code": cls.code, "message": class_doc(cls), "data": {"refusal": name}}
    for name, error in STANDARD_ERRORS.items():
        found.setdefault(name, error)
    return found


def document() -> dict[str, Any]:
    """The OpenRPC document of every declared method. Costs a schema walk over every
    Struct and a parse of their source (for the field comments): call `encoded()`."""
    specs = [METHODS[name] for name in sorted(METHODS)]
    roots: list[type] = [cls for spec in specs for cls in (spec.params, spec.result)]
    roots += [cls for spec in specs for _, cls in spec.notifications]
    tops, schemas = msgspec.json.schema_components(roots, ref_template=SCHEMA_REF)
    ref_of = dict(zip(roots, tops, strict=True))
    for name, cls in _component_classes(schemas, roots).items():
        _describe(schemas[name], cls)
    error_objects = errors()
    refusals = [name for name in sorted(all_refusals()) if name not in NOT_METHOD_REPLIES]
    methods = []
    for spec in specs:
        entry = _method(spec, ref_of[spec.params], ref_of[spec.result], schemas, refusals)
        if spec.notifications:
            entry["x-substrate-notifications"] = [
                {"name": name, "schema": ref_of[cls]} for name, cls in spec.notifications
            ]
        methods.append(entry)
    return {
        "openrpc": OPENRPC_VERSION,
        "info": {"title": "substrate", "version": __version__, "description": DESCRIPTION},
        "methods": methods,
        "components": {"schemas": dict(sorted(schemas.items())), "errors": error_objects},
    }


@functools.cache
def encoded() -> bytes:
    """`document()` as JSON, rendered once per process."""
    return msgspec.json.encode(document())
