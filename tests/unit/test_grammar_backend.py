"""GrammarBackend: each grammar kind compiles through xgrammar off the calling thread, refusals
quote the compiler's reason and name the field, and the cache answers repeats (failures too)."""

from __future__ import annotations

import json
import threading

import pytest
import xgrammar as xgr
from transformers import AutoTokenizer

from pyserve.constrained import GrammarBackend, GrammarError, grammar_stop_ids


@pytest.fixture(scope="module")
def backend(stories_path):
    tok = AutoTokenizer.from_pretrained(stories_path)
    b = GrammarBackend(tok, 512, [2])
    yield b
    b.shutdown()


def _accepts(compiled: xgr.CompiledGrammar, text: str) -> bool:
    matcher = xgr.GrammarMatcher(compiled)
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
    compiled = backend.compile(kind, text).result(timeout=30)
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
    compiled = backend.compile("structural_tag", json.dumps(spec)).result(timeout=30)
    matcher = xgr.GrammarMatcher(compiled)
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
        backend.compile(kind, text).result(timeout=30)
    assert str(info.value).startswith(f"{kind}: {reason}")
    assert info.value.kind == kind


def test_repeats_come_from_the_cache_failures_too(backend):
    before = backend.cache_hits
    first = backend.compile("regex", "[a-c]+(")
    with pytest.raises(GrammarError):
        first.result(timeout=30)
    again = backend.compile("regex", "[a-c]+(")
    assert again is first and again.done()
    assert backend.cache_hits == before + 1
    good = backend.compile("regex", "[a-c]+")
    assert backend.compile("regex", "[a-c]+") is good
    assert backend.cache_hits == before + 2


def test_compiles_on_an_executor_thread(backend, monkeypatch):
    seen = []
    real = backend._compile

    def spy(kind, text):
        seen.append(threading.current_thread().name)
        return real(kind, text)

    monkeypatch.setattr(backend, "_compile", spy)
    backend.compile("regex", "z{2,5}").result(timeout=30)
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
    ],
)
def test_keywords_xgrammar_would_ignore_are_refused(backend, schema, violation, reason):
    """Each keyword is one xgrammar ignores (its matcher accepts a violating value), so pyserve
    refuses the schema instead of serving it unenforced."""
    compiled = backend._compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
    assert _accepts(compiled, violation)  # xgrammar alone lets the violation through
    with pytest.raises(GrammarError) as info:
        backend.compile("json_schema", json.dumps(schema)).result(timeout=30)
    assert str(info.value).startswith(f"json_schema: invalid JSON schema: xgrammar cannot enforce {reason}")


def test_integer_multiple_of_and_a_single_all_of_are_served(backend):
    compiled = backend.compile("json_schema", json.dumps({"type": "integer", "multipleOf": 3})).result(timeout=30)
    assert _accepts(compiled, "9") and not _accepts(compiled, "4")
    ref = {"allOf": [{"type": "integer", "minimum": 5}], "description": "a not-keyword in prose: not"}
    compiled = backend.compile("json_schema", json.dumps(ref)).result(timeout=30)
    assert _accepts(compiled, "7") and not _accepts(compiled, "3")


class _Tok:
    def __init__(self, eos_token_id):
        self.eos_token_id = eos_token_id


def test_grammar_stop_ids_prefer_the_config_then_the_tokenizer():
    assert grammar_stop_ids({7, 3}, _Tok(2)) == [3, 7]
    assert grammar_stop_ids(set(), _Tok(2)) == [2]
    assert grammar_stop_ids(set(), _Tok(None)) == []
