"""Both grammar backends (xgrammar, llguidance) on the same grammars: JSON whitespace bounded
by count (or compact, or a pattern), a thinking block before the answer whose budget forces
`</think>`, the same refusals of what a library would drop, and the pattern construct xgrammar
compiles wrongly: refused there, honoured by llguidance."""

from __future__ import annotations

import itertools
import json
import random
import re

import llguidance.hf
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from pyserve.constrained import (
    MAX_JSON_WHITESPACE,
    GrammarError,
    GrammarKey,
    JsonWhitespace,
    ThinkBlock,
    serving_grammar_backend,
)
from pyserve.constrained.regex_check import optional_group_with_repeat

EOS = 2
VOCAB = 512
SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.fixture(scope="module")
def tokenizer(stories_path):
    return AutoTokenizer.from_pretrained(stories_path)


@pytest.fixture(scope="module")
def ids_of(tokenizer):
    """Text -> token ids without the sentencepiece prefix space (llguidance's tokenizer)."""
    return llguidance.hf.from_tokenizer(tokenizer).tokenize_str


@pytest.fixture(scope="module", params=["xgrammar", "llguidance"])
def backend(request, tokenizer):
    b = serving_grammar_backend(request.param, tokenizer, VOCAB, [EOS], JsonWhitespace())
    yield b
    b.shutdown()


def _compile(backend, kind, text, think=None):
    return backend.compile(GrammarKey(kind, text, think)).result(timeout=60)


def _matches(compiled, ids) -> bool:
    """Whether the grammar takes all of `ids` and then ends (takes EOS)."""
    matcher = compiled.new_matcher()
    return all(matcher.accept_token(t) for t in ids) and matcher.accept_token(EOS)


def _allowed(compiled, ids, tokenizer) -> set[str]:
    matcher = compiled.new_matcher()
    for t in ids:
        assert matcher.accept_token(t)
    mask = torch.zeros((1, (VOCAB + 31) // 32), dtype=torch.int32)
    matcher.fill_next_token_bitmask(mask, 0)
    bits = [(int(mask[0, i // 32]) >> (i % 32)) & 1 for i in range(VOCAB)]
    return {tokenizer.convert_ids_to_tokens(i) for i in range(VOCAB) if bits[i]}


def test_json_whitespace_is_bounded_per_gap(backend, ids_of):
    compiled = _compile(backend, "json_schema", SCHEMA)
    most = " " * MAX_JSON_WHITESPACE
    assert _matches(compiled, ids_of('{"a": 1}'))
    assert _matches(compiled, ids_of('{\n  "a": 1\n}'))
    assert _matches(compiled, ids_of("{" + most + '"a":' + most + "1" + most + "}"))
    assert not _matches(compiled, ids_of("{" + most + ' "a": 1}'))
    assert not _matches(compiled, ids_of("{" + "\n" * (MAX_JSON_WHITESPACE + 1) + '"a": 1}'))
    assert not _matches(compiled, ids_of(' {"a": 1}'))  # none before the value
    assert not _matches(compiled, ids_of('{"a": "1"}'))


def test_tool_call_arrays_and_any_json_are_bounded_too(backend, ids_of):
    compiled = _compile(backend, "json_schema", "$$ANY$$")
    assert _matches(compiled, ids_of('[1, {"b": null}]'))
    assert not _matches(compiled, ids_of("[" + " " * (MAX_JSON_WHITESPACE + 1) + "1]"))


@pytest.mark.parametrize("name", ["xgrammar", "llguidance"])
def test_compact_json_writes_xgrammars_separators_on_both(name, tokenizer, ids_of):
    b = serving_grammar_backend(name, tokenizer, VOCAB, [EOS], JsonWhitespace(compact=True))
    try:
        compiled = _compile(
            b,
            "json_schema",
            json.dumps(
                {
                    "type": "object",
                    "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"],
                }
            ),
        )
        assert _matches(compiled, ids_of('{"a": 1, "b": 2}'))
        assert not _matches(compiled, ids_of('{"a":1,"b":2}'))
        assert not _matches(compiled, ids_of('{"a": 1,  "b": 2}'))
    finally:
        b.shutdown()


def test_a_whitespace_pattern_is_llguidance_only(tokenizer, ids_of):
    b = serving_grammar_backend("llguidance", tokenizer, VOCAB, [EOS], JsonWhitespace(pattern=r"[ ]*"))
    try:
        compiled = _compile(b, "json_schema", SCHEMA)
        assert _matches(compiled, ids_of("{" + " " * 40 + '"a": 1}'))
        assert not _matches(compiled, ids_of('{\n"a": 1}'))
    finally:
        b.shutdown()
    with pytest.raises(ValueError, match="xgrammar takes no whitespace pattern"):
        serving_grammar_backend("xgrammar", tokenizer, VOCAB, [EOS], JsonWhitespace(pattern=r"[ ]*"))


@pytest.mark.parametrize("starts_inside", [True, False])
def test_a_think_block_comes_before_the_answer(backend, ids_of, starts_inside):
    compiled = _compile(backend, "json_schema", SCHEMA, ThinkBlock(starts_inside, 64))
    assert _matches(compiled, ids_of('<think>hm, a < b</think>\n\n{"a": 1}'))
    assert not _matches(compiled, ids_of('<think>hm</think>{"a": "x"}'))
    assert not _matches(compiled, ids_of('<think>hm</think></think>{"a": 1}'))
    # deepseek-r1's template opens the thinking in the prompt: the reply may start inside it;
    # qwen3 may answer without thinking
    assert _matches(compiled, ids_of('hm</think>{"a": 1}')) is starts_inside
    assert _matches(compiled, ids_of('{"a": 1}')) is not starts_inside


@pytest.mark.parametrize("kind", ["json_schema", "regex", "ebnf"])
def test_the_thinking_budget_forces_its_end(backend, tokenizer, ids_of, kind):
    text = {"json_schema": SCHEMA, "regex": "[0-9]+", "ebnf": 'root ::= "yes" | "no"'}[kind]
    compiled = _compile(backend, kind, text, ThinkBlock(True, 6))
    thought = ids_of("one two three four five")
    assert len(thought) > 6
    # within the budget the thinking goes on; at it, only `</think>` follows (its first token:
    # `<` as a piece, or as its byte)
    assert tokenizer.convert_ids_to_tokens(thought[5]) in _allowed(compiled, thought[:5], tokenizer)
    assert _allowed(compiled, thought[:6], tokenizer) in ({"<"}, {"<", "<0x3C>"})
    forced = thought[:6] + ids_of("</think>")
    answer = {"json_schema": '{"a": 7}', "regex": "42", "ebnf": "no"}[kind]
    assert _matches(compiled, forced + ids_of(answer))


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "not": {"const": "a"}},
        {"type": "array", "uniqueItems": True},
        {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
        {"type": "array", "contains": {"const": 1}},
        {"type": "object", "dependentRequired": {"a": ["b"]}},
    ],
)
def test_what_a_library_would_drop_is_refused_on_both(backend, schema):
    with pytest.raises(GrammarError) as info:
        _compile(backend, "json_schema", json.dumps(schema))
    assert info.value.kind == "json_schema"
    assert str(info.value).startswith("json_schema: invalid JSON schema: ")


SEMVER = r"^x(-a(\.a)*)?$"


def test_an_optional_group_with_a_repeat_is_refused_on_xgrammar_and_honoured_on_llguidance(tokenizer, ids_of):
    schema = json.dumps({"type": "string", "pattern": SEMVER})
    xg = serving_grammar_backend("xgrammar", tokenizer, VOCAB, [EOS], JsonWhitespace())
    ll = serving_grammar_backend("llguidance", tokenizer, VOCAB, [EOS], JsonWhitespace())
    try:
        with pytest.raises(GrammarError) as info:
            _compile(xg, "json_schema", schema)
        assert str(info.value) == (
            "json_schema: invalid JSON schema: xgrammar compiles the optional group '(-a(\\\\.a)*)?' of the "
            "pattern at #/pattern wrongly (it accepts strings the pattern does not); write the group without "
            "`?`, or serve with --grammar-backend llguidance"
        )
        # xgrammar alone accepts the violation
        raw = xg.compiler._compiler.compile_json_schema(schema)
        matcher = xgr.GrammarMatcher(raw)
        assert matcher.accept_string('"x.a"') and matcher.accept_token(EOS)
        compiled = _compile(ll, "json_schema", schema)
        assert not _matches(compiled, ids_of('"x.a"'))
        assert _matches(compiled, ids_of('"x-a.a"'))
        assert _matches(compiled, ids_of('"x"'))
        # the regex kind compiles such patterns exactly on xgrammar: served there
        compiled = _compile(xg, "regex", "x(-a(\\.a)*)?")
        assert not _matches(compiled, ids_of("x.a")) and _matches(compiled, ids_of("x-a.a"))
    finally:
        xg.shutdown()
        ll.shutdown()


def _random_pattern(rng: random.Random, depth: int = 0) -> str:
    r = rng.random()
    if depth > 2 or r < 0.3:
        return rng.choice(["a", "b", "[ab]"])
    if r < 0.6:
        return _random_pattern(rng, depth + 1) + _random_pattern(rng, depth + 1)
    if r < 0.7:
        return "(" + _random_pattern(rng, depth + 1) + "|" + _random_pattern(rng, depth + 1) + ")"
    quantifier = rng.choice(["?", "*", "+", "{0,1}", "{1,2}", "{2}", "{0,2}"])
    return "(" + _random_pattern(rng, depth + 1) + ")" + quantifier


def test_every_pattern_xgrammar_gets_wrong_is_found(tokenizer):
    """Seeded random patterns over {a, b}: wherever xgrammar's schema `pattern` accepts other
    strings than Python's `re` (all strings up to 4 characters), regex_check finds the group."""
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=VOCAB, stop_token_ids=[EOS])
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    strings = [""] + ["".join(p) for n in range(1, 5) for p in itertools.product("ab", repeat=n)]
    rng = random.Random(0)
    wrong = 0
    for _ in range(150):
        pattern = "a" + _random_pattern(rng)
        compiled = compiler.compile_json_schema(json.dumps({"type": "string", "pattern": f"^{pattern}$"}))
        differs = []
        for s in strings:
            matcher = xgr.GrammarMatcher(compiled)
            xgrammar_says = matcher.accept_string(json.dumps(s)) and matcher.accept_token(EOS)
            if xgrammar_says != (re.fullmatch(pattern, s) is not None):
                differs.append(s)
        if differs:
            wrong += 1
            assert optional_group_with_repeat(pattern) is not None, (pattern, differs)
    assert wrong == 4  # (the seeded sample holds the construct this often)


@pytest.mark.parametrize(
    ("pattern", "group"),
    [
        (SEMVER, "(-a(\\.a)*)?"),
        (r"^x(?:-a(?:\.a)*)?$", r"(?:-a(?:\.a)*)?"),
        (r"x(ab+){0,1}", "(ab+){0,1}"),
        (r"x(a[*]b)?", None),  # a star in a class is a character
        (r"x(a\*b)?", None),  # and so is an escaped one
        (r"(ab*)?x", None),  # a leading optional group is read right
        (r"x(a(b)?)?", None),
        (r"x(a(b)*)*", None),
    ],
)
def test_regex_check_reads_groups_classes_and_escapes(pattern, group):
    assert optional_group_with_repeat(pattern) == group


def test_objects_that_list_their_properties_are_closed_on_both(backend, ids_of):
    """xgrammar's strict mode closes them; llguidance gets `additionalProperties: false` so the
    two write the same objects (an open one lets a small model add made-up properties)."""
    compiled = _compile(backend, "json_schema", SCHEMA)
    assert not _matches(compiled, ids_of('{"a": 1, "b": "x"}'))
    open_schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "additionalProperties": True})
    assert _matches(_compile(backend, "json_schema", open_schema), ids_of('{"a": 1, "b": "x"}'))
    any_object = _compile(backend, "json_schema", json.dumps({"type": "object"}))
    assert _matches(any_object, ids_of('{"b": "x"}'))


def test_closed_objects_leave_all_of_members_open():
    from pyserve.constrained.llguidance_compiler import closed_objects

    a = {"properties": {"a": {"type": "integer"}}}
    b = {"properties": {"b": {"type": "object", "properties": {"c": {"type": "string"}}}}}
    assert closed_objects({"allOf": [a, b]}) == {
        "allOf": [a, {"properties": {"b": {**b["properties"]["b"], "additionalProperties": False}}}]
    }
    assert closed_objects({"type": "array", "items": a}) == {
        "type": "array",
        "items": {**a, "additionalProperties": False},
    }
    assert closed_objects({**a, "patternProperties": {"^x": {}}}) == {**a, "patternProperties": {"^x": {}}}
    assert closed_objects({**a, "required": ["a", "key"]}) == {**a, "required": ["a", "key"]}


def test_a_required_property_not_listed_is_refused_on_xgrammar_and_enforced_on_llguidance(tokenizer, ids_of):
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a", "key"]})
    xg = serving_grammar_backend("xgrammar", tokenizer, VOCAB, [EOS], JsonWhitespace())
    ll = serving_grammar_backend("llguidance", tokenizer, VOCAB, [EOS], JsonWhitespace())
    try:
        with pytest.raises(GrammarError, match="`required` naming 'key', which `properties` does not list"):
            _compile(xg, "json_schema", schema)
        compiled = _compile(ll, "json_schema", schema)
        assert not _matches(compiled, ids_of('{"a": 1}'))
        assert _matches(compiled, ids_of('{"a": 1, "key": 2}'))
    finally:
        xg.shutdown()
        ll.shutdown()
