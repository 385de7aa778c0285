"""JSON Schema keywords xgrammar accepts but does not enforce: a schema using them is refused
(a 400 naming the keyword and where it is) rather than served with the keyword silently
ignored. The list is what xgrammar 0.2 ignores, checked by tests/unit/test_grammar_backend.py
(each case's violating value is accepted by xgrammar's matcher).

The walk visits schema positions only (JSON Schema 2020-12, "Keywords for Applying
Subschemas", and draft 4-7's `definitions`, `dependencies` and tuple `items`): a property
*named* `not` or `pattern` is a name, not a keyword, and `enum` / `const` / `default` /
`examples` values are data."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

# keywords xgrammar drops whatever their value
_IGNORED = {
    "not": "no negation in a grammar",
    "if": "no conditionals in a grammar",
    "then": "no conditionals in a grammar",
    "else": "no conditionals in a grammar",
    "contains": "no 'some item matches' in a grammar",
    "dependentRequired": "no property dependencies in a grammar",
    "dependentSchemas": "no property dependencies in a grammar",
    "dependencies": "no property dependencies in a grammar",
}
# what a schema may hold beside anyOf / oneOf without xgrammar dropping it (it keeps the
# branches only): annotations and definitions
_BESIDE_A_UNION = {"anyOf", "oneOf", "$defs", "definitions", "$schema", "$id", "$comment", "title", "description"}
_BESIDE_A_UNION |= {"default", "examples", "deprecated", "readOnly", "writeOnly"}
# constraints xgrammar ignores once `enum` or `const` fixes the values
_VALUE_CONSTRAINTS = (
    "minimum",
    "maximum",
    "exclusiveMinimum",
    "exclusiveMaximum",
    "multipleOf",
    "minLength",
    "maxLength",
    "pattern",
    "format",
    "minItems",
    "maxItems",
    "items",
    "properties",
    "required",
)
# subschema positions: a schema, a map of names to schemas, a list of schemas
_SUBSCHEMA = ("additionalProperties", "propertyNames", "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SUBSCHEMA_LISTS = ("allOf", "anyOf", "oneOf", "prefixItems")
MAX_DEPTH = 64  # nested schemas deeper than this are refused: xgrammar's compile time grows steeply


def unenforced_keyword(schema: Any, path: str = "#", depth: int = 0) -> str | None:
    """A description of the first keyword in `schema` (a parsed JSON Schema) that xgrammar
    would ignore, with its JSON pointer, or None:
    * `not`, `if`/`then`/`else`, `contains`, `dependentRequired`, `dependentSchemas`,
      `dependencies` (see _IGNORED);
    * `multipleOf` on a number that may be fractional (integers are enforced);
    * `pattern` with `minLength` / `maxLength` or `format`; `format` with a length;
    * `allOf` with more than one subschema (xgrammar does not intersect them);
    * `anyOf` / `oneOf` beside constraints (xgrammar keeps the branches only);
    * `enum` / `const` beside value constraints; `required` naming a property `properties`
      does not list (xgrammar's strict objects drop the requirement); `uniqueItems: true`; a `$ref` outside the
      document (xgrammar reads any value there);
    * nesting deeper than MAX_DEPTH.
    Never raises on odd input (a non-dict is not a schema to check)."""
    if not isinstance(schema, dict):
        return None
    if depth > MAX_DEPTH:
        return f"a schema nested more than {MAX_DEPTH} levels deep (at {path})"
    for key, why in _IGNORED.items():
        if key in schema:
            return f"`{key}` (at {path}): {why}"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"`multipleOf` on a number that is not an integer (at {path})"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"`pattern` together with `minLength`/`maxLength` (at {path}); put the length in the pattern"
    if "format" in schema and ("pattern" in schema or "minLength" in schema or "maxLength" in schema):
        return f"`format` together with `pattern`/`minLength`/`maxLength` (at {path}); use one pattern"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"`allOf` of {len(all_of)} schemas (at {path}); merge them into one"
    for union in ("anyOf", "oneOf"):
        if union in schema:
            beside = sorted(k for k in schema if k not in _BESIDE_A_UNION)
            if beside:
                return f"`{union}` beside {', '.join(f'`{k}`' for k in beside)} (at {path}); put them in each branch"
    for fixed in ("enum", "const"):
        if fixed in schema:
            beside = [k for k in _VALUE_CONSTRAINTS if k in schema]
            if beside:
                return f"`{fixed}` beside `{beside[0]}` (at {path}); list only the values allowed"
    required = schema.get("required")
    if isinstance(required, list):
        properties = schema.get("properties")
        listed: dict[str, Any] = properties if isinstance(properties, dict) else {}
        missing = [name for name in required if isinstance(name, str) and name not in listed]
        if missing:
            return f"`required` naming {missing[0]!r}, which `properties` does not list (at {path}); list it there"
    if schema.get("uniqueItems") is True:
        return f"`uniqueItems` (at {path}): a grammar cannot compare items"
    ref = schema.get("$ref")
    if isinstance(ref, str) and not ref.startswith("#"):
        return f"`$ref` to {ref!r} (at {path}): only references inside the schema (#/...) are read"
    return _first(_children(schema, path), depth)


def _children(schema: dict[str, Any], path: str) -> list[tuple[Any, str]]:
    """The subschemas of `schema` with their JSON pointers."""
    out: list[tuple[Any, str]] = []
    for key in _SUBSCHEMA:
        if key in schema:
            out.append((schema[key], f"{path}/{key}"))
    items = schema.get("items")
    if isinstance(items, list):  # draft 4-7 tuple form
        out += [(s, f"{path}/items/{i}") for i, s in enumerate(items)]
    elif items is not None:
        out.append((items, f"{path}/items"))
    for key in _SUBSCHEMA_MAPS:
        value = schema.get(key)
        if isinstance(value, dict):
            out += [(s, f"{path}/{key}/{name}") for name, s in value.items()]
    for key in _SUBSCHEMA_LISTS:
        value = schema.get(key)
        if isinstance(value, list):
            out += [(s, f"{path}/{key}/{i}") for i, s in enumerate(value)]
    return out


def _first(children: list[tuple[Any, str]], depth: int) -> str | None:
    for child, child_path in children:
        found = unenforced_keyword(child, child_path, depth + 1)
        if found:
            return found
    return None


def schema_patterns(schema: Any, path: str = "#", depth: int = 0) -> list[tuple[str, str]]:
    """Every regular expression in `schema` (a parsed JSON Schema) with its JSON pointer: each
    `pattern`, and each `patternProperties` name."""
    if not isinstance(schema, dict) or depth > MAX_DEPTH:
        return []
    out: list[tuple[str, str]] = []
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        out.append((pattern, f"{path}/pattern"))
    names = schema.get("patternProperties")
    if isinstance(names, dict):
        out += [(name, f"{path}/patternProperties") for name in names if isinstance(name, str)]
    for child, child_path in _children(schema, path):
        out += schema_patterns(child, child_path, depth + 1)
    return out


def tag_schemas(node: Any) -> Iterator[Any]:
    """The JSON schemas inside a structural tag: each SGLang structure's `schema`, and in
    xgrammar's form every `{"type": "json_schema", "json_schema": ...}` format, however deep."""
    if isinstance(node, dict):
        if node.get("type") == "json_schema" and "json_schema" in node:
            yield node["json_schema"]
        structures = node.get("structures")
        if isinstance(structures, list):
            yield from (s["schema"] for s in structures if isinstance(s, dict) and "schema" in s)
        for key, value in node.items():
            if key not in ("json_schema", "structures"):
                yield from tag_schemas(value)
    elif isinstance(node, list):
        for item in node:
            yield from tag_schemas(item)
