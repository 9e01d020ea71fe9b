"""The wire schema: msgspec Structs, one source of truth (SPEC §1).

Importing this package declares every method in `METHODS`. `json_schema()` renders the
whole table as JSON Schema for `docs/api.schema.json`.
"""

from __future__ import annotations

import importlib
from typing import Any

import msgspec

from substrate.schema import fs, journal, workspace
from substrate.schema.common import METHODS, MethodSpec, Params, Result

__all__ = ["METHODS", "MethodSpec", "Params", "Result", "fs", "journal", "json_schema", "workspace"]

# Schemas owned by later layers; each declares its methods when imported.
for _optional in ("proc", "artifact", "grant", "pty", "profile"):
    try:
        importlib.import_module(f"substrate.schema.{_optional}")
    except ModuleNotFoundError as _exc:
        if _exc.name != f"substrate.schema.{_optional}":
            raise


def json_schema() -> dict[str, Any]:
    """The JSON Schema document of every method's params and result."""
    names = sorted(METHODS)
    types: list[Any] = []
    for name in names:
        types.append(METHODS[name].params)
        types.append(METHODS[name].result)
    schemas, components = msgspec.json.schema_components(types, ref_template="#/$defs/{name}")
    methods: dict[str, Any] = {}
    for i, name in enumerate(names):
        spec = METHODS[name]
        methods[name] = {
            "params": schemas[2 * i],
            "result": schemas[2 * i + 1],
            "operator_only": spec.operator_only,
            "mutating": spec.mutating,
            "shielded": spec.shielded,
            "description": spec.doc,
        }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "substrate JSON-RPC API",
        "methods": methods,
        "$defs": components,
    }


def render() -> str:
    """The exact text of `docs/api.schema.json`."""
    import json

    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
