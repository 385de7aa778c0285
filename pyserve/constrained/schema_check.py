"""JSON Schema keywords xgrammar accepts but does not enforce: a schema using them is refused
(a 400 naming the keyword and where it is) rather than served with the keyword silently
ignored. The list is what xgrammar 0.2 ignores, checked by tests/unit/test_grammar_backend.py
(each keyword's violating value is accepted by xgrammar's matcher)."""

from __future__ import annotations

from typing import Any


def unenforced_keyword(schema: Any, path: str = "#") -> str | None:
    """A description of the first keyword in `schema` (a parsed JSON Schema) that xgrammar
    would ignore, with its JSON pointer, or None:
    * `not` (no negation in a grammar);
    * `multipleOf` on a number that may be fractional (integers are enforced);
    * `pattern` together with `minLength` / `maxLength` (xgrammar keeps the pattern only);
    * `allOf` with more than one subschema (xgrammar does not intersect them).
    """
    if isinstance(schema, list):
        for i, item in enumerate(schema):
            found = unenforced_keyword(item, f"{path}/{i}")
            if found:
                return found
        return None
    if not isinstance(schema, dict):
        return None
    if "not" in schema:
        return f"`not` (at {path})"
    if "multipleOf" in schema and schema.get("type") != "integer":
        return f"`multipleOf` on a number that is not an integer (at {path})"
    if "pattern" in schema and ("minLength" in schema or "maxLength" in schema):
        return f"`pattern` together with `minLength`/`maxLength` (at {path}); put the length in the pattern"
    all_of = schema.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        return f"`allOf` of {len(all_of)} schemas (at {path}); merge them into one"
    for key, value in schema.items():
        if key in ("const", "enum", "default", "examples", "description", "title"):
            continue  # values, not schemas
        if isinstance(value, (dict, list)):
            found = unenforced_keyword(value, f"{path}/{key}")
            if found:
                return found
    return None
