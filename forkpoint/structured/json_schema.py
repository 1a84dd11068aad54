"""vLLM's default reading of a JSON schema: an object schema that lists its properties and says nothing
about others allows no others.

JSON Schema itself allows any extra property unless `additionalProperties` says otherwise, and
llguidance follows it; a model that keeps adding properties then never closes the object. vLLM's
default backend (xgrammar) forbids them, so a schema written against vLLM terminates there. This
module rewrites a schema into that reading; `StructuredOutputsConfig.disable_additional_properties=False`
keeps the JSON Schema semantics instead.
"""

from __future__ import annotations

import copy
from typing import Any

# keywords whose value maps names to subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
# keywords whose value is one subschema or a list of them
_SUBSCHEMAS = ("additionalProperties", "unevaluatedProperties", "propertyNames", "items", "prefixItems",
               "additionalItems", "unevaluatedItems", "contains", "not", "if", "then", "else", "allOf", "anyOf",
               "oneOf", "contentSchema")


def forbid_additional_properties(schema: Any) -> Any:
    """A copy of `schema` in which every object schema with `properties` or `patternProperties` and no
    `additionalProperties` (nor `unevaluatedProperties`) gets `additionalProperties: false`, at every
    depth (nested properties, items, $defs, combinators). Anything else is copied unchanged; `schema`
    itself is not modified."""
    result = copy.deepcopy(schema)
    _walk(result)
    return result


def _walk(node: Any) -> None:
    if isinstance(node, list):
        for item in node:
            _walk(item)
        return
    if not isinstance(node, dict):
        return
    for key in _SCHEMA_MAPS:
        children = node.get(key)
        if isinstance(children, dict):
            for child in children.values():
                _walk(child)
    for key in _SUBSCHEMAS:
        child = node.get(key)
        if isinstance(child, (dict, list)):
            _walk(child)
    lists_properties = isinstance(node.get("properties"), dict) or isinstance(node.get("patternProperties"), dict)
    if lists_properties and "additionalProperties" not in node and "unevaluatedProperties" not in node:
        node["additionalProperties"] = False
