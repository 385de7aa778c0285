"""GrammarBackend on xgrammar: each grammar kind compiles off the calling thread, refusals
quote the compiler's reason and name the field, and the cache answers repeats (failures too)."""

from __future__ import annotations

import json
import threading
import time

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from pyserve.constrained import GrammarBackend, GrammarError, GrammarKey, JsonWhitespace, grammar_stop_ids
from pyserve.constrained.xgrammar_compiler import XGrammarCompiler, XGrammarGrammar

K = GrammarKey


@pytest.fixture(scope="module")
def backend(stories_path):
    tok = AutoTokenizer.from_pretrained(stories_path)
    b = GrammarBackend(XGrammarCompiler(tok, 512, [2], JsonWhitespace()))
    yield b
    b.shutdown()


def _accepts(compiled: xgr.CompiledGrammar | XGrammarGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled.compiled if isinstance(compiled, XGrammarGrammar) else compiled)
    return matcher.accept_string(text) and matcher.is_completed()


@pytest.mark.parametrize(
    ("kind", "text", "good", "bad"),
    [
        (
            "json_schema",
            json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
            '{"a": 12}',
            '{"a": "x"}',
        ),
        ("json_schema", "$$ANY$$", "[1, true]", "[1,"),
        ("regex", "[0-9]{3}-x", "123-x", "12-x"),
        ("ebnf", 'root ::= "yes" | "no"', "no", "maybe"),
    ],
)
def test_each_kind_compiles_to_its_language(backend, kind, text, good, bad):
    compiled = backend.compile(K(kind, text)).result(timeout=30)
    assert _accepts(compiled, good)
    assert not _accepts(compiled, bad)


def test_structural_tag_in_sglangs_form(backend):
    spec = {
        "type": "structural_tag",
        "structures": [
            {"begin": "<f>", "schema": {"type": "object", "properties": {"x": {"type": "integer"}}}, "end": "</f>"}
        ],
        "triggers": ["<f>"],
    }
    compiled = backend.compile(K("structural_tag", json.dumps(spec))).result(timeout=30)
    matcher = xgr.GrammarMatcher(compiled.compiled)
    assert matcher.accept_string('hello <f>{"x": 1}</f>')


@pytest.mark.parametrize(
    ("kind", "text", "reason"),
    [
        ("regex", "(", "invalid regular expression: Regex parsing error at position 2: The parenthesis is not closed."),
        ("json_schema", '{"type": "objekt"}', 'invalid JSON schema: Unsupported type "objekt"'),
        ("ebnf", 'root ::= "a', 'invalid grammar: EBNF lexer error at line 1, column 12: Expect " in string literal'),
        ("structural_tag", "{", "invalid structural tag: not JSON: Expecting property name enclosed in double quotes"),
    ],
)
def test_refusals_quote_the_compiler_and_name_the_field(backend, kind, text, reason):
    with pytest.raises(GrammarError) as info:
        backend.compile(K(kind, text)).result(timeout=30)
    assert str(info.value).startswith(f"{kind}: {reason}")
    assert info.value.kind == kind


def test_repeats_come_from_the_cache_failures_too(backend):
    before = backend.cache_hits
    first = backend.compile(K("regex", "[a-c]+("))
    with pytest.raises(GrammarError):
        first.result(timeout=30)
    again = backend.compile(K("regex", "[a-c]+("))
    assert again is first and again.done()
    assert backend.cache_hits == before + 1
    good = backend.compile(K("regex", "[a-c]+"))
    assert backend.compile(K("regex", "[a-c]+")) is good
    assert backend.cache_hits == before + 2


def test_compiles_on_an_executor_thread(backend, monkeypatch):
    seen = []
    real = backend._compile

    def spy(key):
        if key.text == "z{2,5}":  # (an earlier test's compile may still be running)
            seen.append(threading.current_thread().name)
        return real(key)

    monkeypatch.setattr(backend, "_compile", spy)
    backend.compile(K("regex", "z{2,5}")).result(timeout=30)
    assert len(seen) == 1 and seen[0].startswith("pyserve-grammar")


@pytest.mark.parametrize(
    ("schema", "violation", "reason"),
    [
        ({"not": {"type": "string"}}, '"x"', "`not` (at #)"),
        ({"type": "number", "multipleOf": 0.5}, "0.3", "`multipleOf` on a number that is not an integer (at #)"),
        (
            {"type": "object", "properties": {"s": {"type": "string", "pattern": "^[a-z]+$", "minLength": 6}}},
            '{"s": "abc"}',
            "`pattern` together with `minLength`/`maxLength` (at #/properties/s)",
        ),
        ({"allOf": [{"type": "integer"}, {"minimum": 5}]}, "3", "`allOf` of 2 schemas (at #)"),
        (
            {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
                "anyOf": [{"required": ["a"]}, {"required": ["b"]}],
            },
            "true",
            "`anyOf` beside `properties`, `type` (at #)",
        ),
        ({"if": {}, "then": {"type": "integer"}}, "true", "`if` (at #)"),
        ({"$ref": "http://example.com/int.json"}, "true", "`$ref` to 'http://example.com/int.json' (at #)"),
        ({"type": "integer", "enum": [1, 5], "maximum": 2}, "5", "`enum` beside `maximum` (at #)"),
        (
            {"type": "string", "format": "date", "pattern": "^1999-"},
            '"4524-07-30"',
            "`format` together with `pattern`/`minLength`/`maxLength` (at #)",
        ),
        ({"type": "array", "contains": {"type": "integer"}}, "[]", "`contains` (at #)"),
        (
            {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "key"]},
            '{"a": 1}',
            "`required` naming 'key', which `properties` does not list (at #); list it there",
        ),
        (
            {"type": "array", "items": {"enum": [1, 2]}, "uniqueItems": True, "minItems": 2, "maxItems": 2},
            "[2, 2]",
            "`uniqueItems` (at #)",
        ),
        (  # a property named like a keyword is a name; its schema is still checked
            {
                "type": "object",
                "properties": {"description": {"type": "string", "pattern": "^[a-z]+$", "maxLength": 2}},
            },
            '{"description": "abcde"}',
            "`pattern` together with `minLength`/`maxLength` (at #/properties/description)",
        ),
    ],
)
def test_keywords_xgrammar_would_ignore_are_refused(backend, schema, violation, reason):
    """Each keyword is one xgrammar ignores (its matcher accepts a violating value), so pyserve
    refuses the schema instead of serving it unenforced."""
    compiled = backend.compiler._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    assert _accepts(compiled, violation)  # xgrammar alone lets the violation through
    with pytest.raises(GrammarError) as info:
        backend.compile(K("json_schema", json.dumps(schema))).result(timeout=30)
    assert str(info.value).startswith(f"json_schema: invalid JSON schema: xgrammar cannot enforce {reason}")


def test_integer_multiple_of_and_a_single_all_of_are_served(backend):
    compiled = backend.compile(K("json_schema", json.dumps({"type": "integer", "multipleOf": 3}))).result(timeout=30)
    assert _accepts(compiled, "9") and not _accepts(compiled, "4")
    ref = {"allOf": [{"type": "integer", "minimum": 5}], "description": "a not-keyword in prose: not"}
    compiled = backend.compile(K("json_schema", json.dumps(ref))).result(timeout=30)
    assert _accepts(compiled, "7") and not _accepts(compiled, "3")


def test_property_names_that_look_like_keywords_are_served(backend):
    schema = {
        "type": "object",
        "properties": {"not": {"type": "boolean"}, "pattern": {"type": "string"}, "allOf": {"type": "integer"}},
        "required": ["not", "pattern", "allOf"],
        "additionalProperties": False,
    }
    compiled = backend.compile(K("json_schema", json.dumps(schema))).result(timeout=30)
    assert _accepts(compiled, '{"not": true, "pattern": "x", "allOf": 3}')
    assert not _accepts(compiled, '{"not": 1, "pattern": "x", "allOf": 3}')
    union = {"anyOf": [{"type": "string"}, {"type": "null"}], "default": None, "title": "Maybe"}  # pydantic's Optional
    compiled = backend.compile(K("json_schema", json.dumps(union))).result(timeout=30)
    assert _accepts(compiled, "null") and not _accepts(compiled, "3")


def test_deep_schemas_and_structural_tags_are_checked(backend):
    deep: dict = {"type": "integer"}
    for _ in range(70):
        deep = {"type": "object", "properties": {"a": deep}}
    with pytest.raises(GrammarError, match=r"nested more than 64 levels deep \(at #/properties/a/"):
        backend.compile(K("json_schema", json.dumps(deep))).result(timeout=30)
    bad = {"type": "object", "properties": {"x": {"not": {"type": "string"}}}}
    sglang_form = {"structures": [{"begin": "<f>", "schema": bad, "end": "</f>"}], "triggers": ["<f>"]}
    xgrammar_form = {"type": "structural_tag", "format": {"type": "json_schema", "json_schema": bad}}
    for tag in (sglang_form, xgrammar_form):
        with pytest.raises(GrammarError) as info:
            backend.compile(K("structural_tag", json.dumps(tag))).result(timeout=30)
        assert str(info.value).startswith(
            "structural_tag: invalid structural tag: xgrammar cannot enforce `not` (at #/properties/x)"
        )


class _Tok:
    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id


def test_grammar_stop_ids_prefer_the_config_then_the_tokenizer():
    assert grammar_stop_ids({7, 3}, _Tok(2)) == [3, 7]
    assert grammar_stop_ids(set(), _Tok(2)) == [2]
    assert grammar_stop_ids(set(), _Tok(None)) == []


def test_a_released_compile_that_has_not_begun_is_dropped(stories_path):
    tokenizer = AutoTokenizer.from_pretrained(stories_path)
    backend = GrammarBackend(XGrammarCompiler(tokenizer, 512, [2], JsonWhitespace()), max_workers=1)
    gate = threading.Event()
    real = backend._compile

    def gated(key):
        if key.text == "a+":
            gate.wait(timeout=30)
        return real(key)

    backend._compile = gated  # type: ignore[method-assign]
    try:
        first = backend.compile(K("regex", "a+"))  # holds the one compile thread
        queued = backend.compile(K("regex", "b+"))
        while not backend.started(K("regex", "a+")):
            time.sleep(0.01)
        assert not backend.started(K("regex", "b+"))
        backend.release(K("regex", "b+"))
        assert queued.cancelled()
        backend.release(K("regex", "a+"))  # running: it goes on
        gate.set()
        assert first.result(timeout=30) is not None and backend.started(K("regex", "a+"))
        again = backend.compile(K("regex", "b+"))  # compiled afresh, not the cancelled one
        assert again is not queued and again.result(timeout=30) is not None
    finally:
        backend.shutdown()
