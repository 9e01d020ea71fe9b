"""`docs/api.schema.json`: the method table rendered as one JSON Schema document."""

from __future__ import annotations

import json
from typing import Any

import msgspec

from substrate.schema.common import METHODS


def json_schema() -> dict[str, Any]:
    """The JSON Schema document of every method's params, result and properties.

    Covers the methods declared so far: import `substrate.schema` (which declares them
    all) before calling. Costs one schema walk over every Struct.
    """
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
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
