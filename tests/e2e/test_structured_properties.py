"""Property tests of structured output on one stories260k server (hypothesis, derandomized).

200 generated JSON schemas x (greedy, seeded temperature 1) x (streamed, not), 50 generated
regexes and 20 generated EBNF grammars, sent concurrently to `/generate`. Every output token
must be one the grammar allows (xgrammar's own GrammarMatcher, built here from the stories260k
tokenizer, is fed the returned `output_ids`). An output that finishes with `stop` ends with EOS
where the grammar may end, and its text parses and validates with `jsonschema`, fully matches
the regex (`re.fullmatch`), or is accepted by the grammar; one that finishes with `length` has
used all of `max_new_tokens`. Streamed and non-streamed runs of the same request give the same
output. Afterwards the server is idle: no KV, sampling or grammar row, grammar queue entry left.

xgrammar's semantics the checks follow: a regex `.` matches any character (Python: DOTALL);
string formats are checked for syntax, not for calendar dates or leading zeros in IPv4, as
xgrammar's format grammars do."""

from __future__ import annotations

import asyncio
import collections
import json
import re
import time
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import providers
from hypothesis_jsonschema import from_schema

from tests.conftest import stories_chat_server, wait_idle

POOL = 32768
CONCURRENCY = 32
NUM_SCHEMAS = 200
NUM_REGEXES = 50
NUM_GRAMMARS = 20
EOS = 2  # stories260k's </s>
SERVER_ARGS = ["--max-running-requests", "64", "--constrained-json-disable-any-whitespace"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    yield from stories_chat_server(tmp_path_factory, stories_path, "stories-structured", POOL, SERVER_ARGS)


@pytest.fixture(scope="module")
def compiler(stories_path):
    """xgrammar's compiler for the stories260k vocabulary, as the server builds it."""
    import xgrammar as xgr
    from transformers import AutoTokenizer

    config = json.loads((stories_path / "config.json").read_text())
    assert config["eos_token_id"] == EOS
    tokenizer = AutoTokenizer.from_pretrained(stories_path)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=config["vocab_size"], stop_token_ids=[EOS])
    return xgr.GrammarCompiler(info)


def draw(strategy: st.SearchStrategy, n: int, key=json.dumps) -> list:
    """The first n distinct (by `key`) values hypothesis generates from `strategy`: derandomized,
    generation only (the requests run afterwards, concurrently; nothing is shrunk)."""
    found: dict[str, Any] = {}

    @settings(
        max_examples=3 * n,
        derandomize=True,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(value):
        if len(found) < n:
            found.setdefault(key(value), value)

    # Hypothesis also draws constants it finds in the modules loaded so far, so the same seed
    # gives other values once more modules are loaded (alone, or after other tests): drawn
    # without them, the cases are the same in any process.
    with mock.patch.object(providers, "_get_local_constants", providers.Constants):
        collect()
    assert len(found) == n, f"hypothesis gave {len(found)} distinct values, not {n}"
    return list(found.values())


# ---- regular expressions (and grammars) as small syntax trees --------------------------------
# ("lit", s) | ("cls", body) | ("dot",) | ("cat", [node]) | ("alt", [node]) | ("rep", node, lo, hi)
# (hi None: unbounded). Literals and classes avoid quotes, backslashes and control characters.

LITERAL_ALPHABET = "abcdelorstxyzAB0129 ,-."
CLASSES = ["a-z", "0-9", "A-Z", "aeiou", "a-f0-9", "xyz ", "^0-9a-z"]
PATTERN_CLASSES = ["a-z", "0-9", "A-Z", "aeiou", "a-f0-9", "xyz "]  # JSON patterns: no negation
REPEATS = [(0, 1), (0, None), (1, None), (2, 2), (1, 3), (0, 2), (2, None)]


def regex_trees(classes: list[str], allow_dot: bool, max_leaves: int = 6) -> st.SearchStrategy:
    leaves = [
        st.text(LITERAL_ALPHABET, min_size=1, max_size=4).map(lambda s: ("lit", s)),
        st.sampled_from(classes).map(lambda c: ("cls", c)),
    ]
    if allow_dot:
        leaves.append(st.just(("dot",)))

    def extend(children):
        return st.one_of(
            st.lists(children, min_size=2, max_size=3).map(lambda xs: ("cat", xs)),
            st.lists(children, min_size=2, max_size=3).map(lambda xs: ("alt", xs)),
            st.tuples(children, st.sampled_from(REPEATS)).map(lambda t: ("rep", t[0], *t[1])),
        )

    return st.recursive(st.one_of(leaves), extend, max_leaves=max_leaves)


def _quantifier(lo: int, hi: int | None) -> str:
    return {(0, 1): "?", (0, None): "*", (1, None): "+"}.get((lo, hi)) or (
        f"{{{lo}}}" if lo == hi else f"{{{lo},{'' if hi is None else hi}}}"
    )


def to_regex(node) -> str:
    """The tree as a regex that xgrammar and Python's `re` read alike."""
    kind = node[0]
    if kind == "lit":
        return "".join("\\." if c == "." else c for c in node[1])
    if kind == "cls":
        return f"[{node[1]}]"
    if kind == "dot":
        return "."
    if kind == "cat":
        return "".join(to_regex(x) for x in node[1])
    if kind == "alt":
        return "(" + "|".join(to_regex(x) for x in node[1]) + ")"
    return f"({to_regex(node[1])}){_quantifier(node[2], node[3])}"


def to_ebnf(node, nest: int) -> str:
    """The tree as a GBNF grammar with root rule `root`: each alternation and repetition is a
    rule of its own; with nest > 0 the root is wrapped in a recursive rule of balanced brackets
    `wrap ::= "[" wrap "]" | body`."""
    rules: list[str] = []

    def expr(n) -> str:
        kind = n[0]
        if kind == "lit":
            return json.dumps(n[1])
        if kind == "cls":
            return f"[{n[1]}]"
        if kind == "cat":
            return " ".join(expr(x) for x in n[1])
        name = f"r{len(rules)}"
        rules.append("")  # reserve the name before the children take theirs
        at = len(rules) - 1
        if kind == "alt":
            body = " | ".join(expr(x) for x in n[1])
        else:
            lo, hi = n[2], n[3]
            body = f"({expr(n[1])}){_quantifier(lo, hi)}"
        rules[at] = f"{name} ::= {body}"
        return name

    body = expr(node)
    head = [f'root ::= wrap\nwrap ::= "[" wrap "]" | {body}'] if nest else [f"root ::= {body}"]
    return "\n".join(head + rules)


# ---- JSON schemas ----------------------------------------------------------------------------
FORMATS = ["date", "time", "date-time", "email", "ipv4", "ipv6", "uuid", "hostname"]
NAMES = st.text("abcdefgh", min_size=1, max_size=3)
SMALL_VALUES = st.one_of(
    st.integers(-50, 50), st.text("abcxyz ", max_size=4), st.booleans(), st.none(), st.sampled_from([1.5, -0.25])
)


@st.composite
def integer_schemas(draw_) -> dict:
    schema: dict[str, Any] = {"type": "integer"}
    lo = draw_(st.none() | st.integers(-1000, 1000))
    hi = draw_(st.none() | st.integers(-1000, 1000))
    if lo is not None and hi is not None and lo > hi:
        lo, hi = hi, lo
    exclusive = draw_(st.booleans()) and (lo is None or hi is None or hi - lo >= 2)
    if lo is not None:
        schema["exclusiveMinimum" if exclusive else "minimum"] = lo
    if hi is not None:
        schema["exclusiveMaximum" if exclusive else "maximum"] = hi
    return schema


@st.composite
def number_schemas(draw_) -> dict:
    schema: dict[str, Any] = {"type": "number"}
    if draw_(st.booleans()):  # bounded, quarter steps
        lo, hi = sorted((draw_(st.integers(-400, 400)) / 4, draw_(st.integers(-400, 400)) / 4))
        if lo == hi:
            hi += 1
        schema.update(minimum=lo, maximum=hi)
    return schema


@st.composite
def string_schemas(draw_) -> dict:
    kind = draw_(st.sampled_from(["plain", "format", "pattern"]))
    if kind == "format":
        return {"type": "string", "format": draw_(st.sampled_from(FORMATS))}
    if kind == "pattern":
        pattern = to_regex(draw_(regex_trees(PATTERN_CLASSES, allow_dot=False, max_leaves=4)))
        return {"type": "string", "pattern": f"^{pattern}$" if draw_(st.booleans()) else pattern}
    schema: dict[str, Any] = {"type": "string"}
    hi = draw_(st.none() | st.integers(0, 12))
    if hi is not None:
        schema["maxLength"] = hi
    lo = draw_(st.integers(0, 3 if hi is None else min(hi, 3)))
    if lo:
        schema["minLength"] = lo
    return schema


LEAF_SCHEMAS = st.one_of(
    st.sampled_from([{"type": "boolean"}, {"type": "null"}]),
    integer_schemas(),
    integer_schemas(),
    number_schemas(),
    string_schemas(),
    string_schemas(),
    string_schemas(),
    st.one_of(
        st.lists(SMALL_VALUES, min_size=1, max_size=4, unique_by=json.dumps).map(lambda v: {"enum": v}),
        SMALL_VALUES.map(lambda v: {"const": v}),
    ),
)


@st.composite
def array_schemas(draw_, items: st.SearchStrategy) -> dict:
    schema: dict[str, Any] = {"type": "array", "items": draw_(items)}
    hi = draw_(st.none() | st.integers(0, 3))
    lo = draw_(st.integers(0, 2 if hi is None else min(hi, 2)))
    if hi is not None:
        schema["maxItems"] = hi
    if lo:
        schema["minItems"] = lo
    return schema


@st.composite
def object_schemas(draw_, values: st.SearchStrategy) -> dict:
    names = draw_(st.lists(NAMES, min_size=1, max_size=4, unique=True))
    props = {name: draw_(values) for name in names}
    required = [name for name in names if draw_(st.booleans())]
    schema: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        schema["required"] = required
    if draw_(st.booleans()):
        schema["additionalProperties"] = False
    return schema


def json_schemas() -> st.SearchStrategy:
    nested = st.recursive(
        LEAF_SCHEMAS,
        lambda children: st.one_of(
            array_schemas(children),
            object_schemas(children),
            st.lists(children, min_size=2, max_size=2).map(lambda xs: {"anyOf": xs}),
        ),
        max_leaves=5,
    )
    return st.one_of(object_schemas(nested), object_schemas(nested), array_schemas(nested), LEAF_SCHEMAS)


def instances(schema: dict) -> st.SearchStrategy:
    """Values of `schema`: hypothesis-jsonschema's `from_schema` for the leaves, composed here
    for objects, arrays and anyOf (its own object strategy calls `many.more()`, a hypothesis
    internal that hypothesis 6.170 no longer has)."""
    if "anyOf" in schema:
        return st.one_of([instances(s) for s in schema["anyOf"]])
    if schema.get("type") == "object":
        required = set(schema.get("required", ()))
        props = {k: instances(v) for k, v in schema["properties"].items()}
        return st.fixed_dictionaries(
            {k: v for k, v in props.items() if k in required},
            optional={k: v for k, v in props.items() if k not in required},
        )
    if schema.get("type") == "array":
        return st.lists(
            instances(schema["items"]), min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 3)
        )
    # hypothesis-jsonschema draws a format it does not know ("uuid") as any text
    return from_schema(schema, custom_formats={"uuid": st.uuids().map(str)})


def json_cases() -> st.SearchStrategy:
    """(schema, instance, seed, max_new_tokens); the prompt shows the instance."""

    def with_instance(schema):
        return st.tuples(st.just(schema), instances(schema), st.integers(0, 2**32 - 1), st.sampled_from([64, 96]))

    return json_schemas().flatmap(with_instance)


# ---- checks ------------------------------------------------------------------------------------
_DATE = r"\d{4}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
_TIME = r"([01]\d|2[0-3]):[0-5]\d:([0-5]\d|60)(\.\d+)?([Zz]|[+-]([01]\d|2[0-3]):[0-5]\d)"
_OCTET = r"(25[0-5]|2[0-4]\d|[01]?\d?\d)"
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?"
SYNTAX = {
    "date": _DATE,
    "time": _TIME,
    "date-time": f"{_DATE}[Tt]{_TIME}",
    "ipv4": rf"{_OCTET}(\.{_OCTET}){{3}}",
    "hostname": rf"{_LABEL}(\.{_LABEL})*",
}
FORMAT_CHECKER = jsonschema.FormatChecker()  # email, ipv6 and uuid as jsonschema checks them
for _name, _syntax in SYNTAX.items():
    FORMAT_CHECKER.checks(_name)(
        lambda value, _p=re.compile(_syntax): not isinstance(value, str) or bool(_p.fullmatch(value))
    )
assert FORMAT_CHECKER.conforms("::1", "ipv6") and not FORMAT_CHECKER.conforms("1:2", "ipv6")


@dataclass
class Request:
    kind: str  # json_schema | regex | ebnf | "" (unconstrained)
    grammar: str  # the text sent
    prompt: str
    sampling: dict  # temperature / seed
    max_new_tokens: int
    stream: bool
    check: Any  # the stop-output check: text -> None, raises AssertionError
    result: dict = field(default_factory=dict)

    def body(self) -> dict:
        params = {"max_new_tokens": self.max_new_tokens, **self.sampling}
        if self.kind:
            params[self.kind] = self.grammar
        return {"text": self.prompt, "sampling_params": params, "stream": self.stream}


async def _send(client: httpx.AsyncClient, req: Request) -> None:
    if not req.stream:
        r = await client.post("/generate", json=req.body())
        assert r.status_code == 200, (r.status_code, r.text, req.grammar)
        req.result = r.json()
        return
    chunks = []
    async with client.stream("POST", "/generate", json=req.body()) as r:
        assert r.status_code == 200, (r.status_code, await r.aread(), req.grammar)
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:]))
            elif line == "data: [DONE]":
                chunks.append(None)
    assert chunks and chunks[-1] is None, chunks[-3:]
    chunks.pop()
    for before, after in zip(chunks, chunks[1:]):  # cumulative text and ids, one final chunk
        assert after["text"].startswith(before["text"]) and before["meta_info"]["finish_reason"] is None
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
    req.result = chunks[-1]


def run_all(base_url: str, requests: list[Request]) -> float:
    """Sends every request, CONCURRENCY at a time; returns the wall seconds."""

    async def main():
        sem = asyncio.Semaphore(CONCURRENCY)
        limits = httpx.Limits(max_connections=CONCURRENCY, max_keepalive_connections=CONCURRENCY)
        async with httpx.AsyncClient(base_url=base_url, timeout=300, limits=limits) as client:

            async def one(req):
                async with sem:
                    await _send(client, req)

            await asyncio.gather(*(one(r) for r in requests))

    t0 = time.monotonic()
    asyncio.run(main())
    return time.monotonic() - t0


def check_output(compiler, req: Request, compiled_cache: dict) -> str:
    """Checks one output against its grammar; returns its finish reason."""
    import xgrammar as xgr

    out = req.result
    ids, text, meta = out["output_ids"], out["text"], out["meta_info"]
    key = (req.kind, req.grammar)
    if key not in compiled_cache:
        if req.kind == "json_schema":
            compiled_cache[key] = compiler.compile_json_schema(req.grammar, any_whitespace=False)
        elif req.kind == "regex":
            compiled_cache[key] = compiler.compile_regex(req.grammar)
        else:
            compiled_cache[key] = compiler.compile_grammar(req.grammar, root_rule_name="root")
    matcher = xgr.GrammarMatcher(compiled_cache[key])
    where = f"{req.kind}={req.grammar!r} {req.sampling} stream={req.stream}: {text!r} {ids}"
    for i, token in enumerate(ids):
        assert matcher.accept_token(token), f"token {i} ({token}) not allowed: {where}"
    reason = meta["finish_reason"]["type"]
    assert meta["completion_tokens"] == len(ids), where
    if reason == "length":
        assert len(ids) == req.max_new_tokens and EOS not in ids, where
    else:
        assert reason == "stop" and meta["finish_reason"]["matched"] == EOS, where
        assert ids[-1] == EOS and matcher.is_terminated(), where
        req.check(text, where)
    return reason


def check_all(compiler, requests: list[Request]) -> collections.Counter:
    cache: dict = {}
    reasons: collections.Counter = collections.Counter()
    for req in requests:
        reasons[(req.kind, req.stream, "seed" in req.sampling, check_output(compiler, req, cache))] += 1
    return reasons


SAMPLINGS = [{"temperature": 0}, {"temperature": 1.0}]


def _variants(kind, grammar, prompt, seed, max_new_tokens, check) -> list[Request]:
    return [
        Request(
            kind, grammar, prompt, {**s, **({"seed": seed} if s["temperature"] else {})}, max_new_tokens, stream, check
        )
        for s in SAMPLINGS
        for stream in (False, True)
    ]


def interleave(many: list, few: list) -> list:
    """`many` with one of `few` before every len(many) // len(few) of them."""
    step = len(many) // len(few)
    out = []
    for i, item in enumerate(many):
        if i % step == 0 and i // step < len(few):
            out.append(few[i // step])
        out.append(item)
    assert len(out) == len(many) + len(few)
    return out


def _output(req: Request) -> tuple:
    return req.result["text"], req.result["output_ids"], req.result["meta_info"]["finish_reason"]


def _same_across_streaming(requests: list[Request]) -> None:
    """Each request's streamed run gave what its non-streamed run gave."""
    for plain, streamed in zip(requests[0::2], requests[1::2]):
        assert not plain.stream and streamed.stream and plain.sampling == streamed.sampling
        for k in ("text", "output_ids"):
            assert plain.result[k] == streamed.result[k], (plain.grammar, plain.sampling, plain.result, streamed.result)
        assert plain.result["meta_info"]["finish_reason"] == streamed.result["meta_info"]["finish_reason"]


def _report(label: str, seconds: float, reasons: collections.Counter) -> None:
    by_reason = collections.Counter()
    for (_, _, _, reason), count in reasons.items():
        by_reason[reason] += count
    print(f"{label}: {sum(reasons.values())} requests in {seconds:.1f}s, finish reasons {dict(by_reason)}")


FEATURES = ["object", "array", "enum", "const", "anyOf", "format", "pattern", "minimum", "maximum"]
FEATURES += ["exclusiveMinimum", "maxLength", "minItems", "required", "additionalProperties"]


def validation_errors(schema: dict, value: Any) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema, format_checker=FORMAT_CHECKER)
    return [e.message for e in validator.iter_errors(value)]


def test_json_schemas_validate(server, compiler):
    cases = draw(json_cases(), NUM_SCHEMAS, key=lambda c: json.dumps(c[0]))
    features = collections.Counter(f for schema, *_ in cases for f in FEATURES if f'"{f}"' in json.dumps(schema))
    assert min(features.values()) >= 10 and len(features) == len(FEATURES), features  # every kind of schema
    for schema, instance, *_ in cases:  # the checks accept what hypothesis-jsonschema calls valid
        assert not validation_errors(schema, instance), (schema, instance)

    def validator(schema):
        def check(text: str, where: str) -> None:
            try:
                value = json.loads(text)
            except json.JSONDecodeError as exc:
                raise AssertionError(f"not JSON ({exc}): {where}") from None
            errors = validation_errors(schema, value)
            assert not errors, f"{errors}: {where}"

        return check

    requests = [
        req
        for schema, instance, seed, max_new in cases
        for req in _variants(
            "json_schema",
            json.dumps(schema),
            "Example: " + json.dumps(instance)[:160] + "\nAnother: ",
            seed,
            max_new,
            validator(schema),
        )
    ]
    # unconstrained requests, first on their own, then inside the grammar load: the masks
    # must leave their rows alone
    plain = [
        Request("", "", "Once upon a time " + json.dumps(instance)[:40], sampling, 64, stream, None)
        for _, instance, seed, _ in cases[:: NUM_SCHEMAS // 32]
        for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": seed})
        for stream in (False, True)
    ]
    run_all(server.base_url, plain)
    alone = [_output(r) for r in plain]
    seconds = run_all(server.base_url, interleave(requests, plain))
    assert [_output(r) for r in plain] == alone
    reasons = check_all(compiler, requests)
    _report("json_schema", seconds, reasons)
    _same_across_streaming(requests)
    for stream in (False, True):  # both outcomes occur, greedy and sampled, streamed and not
        for seeded in (False, True):
            for reason in ("stop", "length"):
                assert reasons[("json_schema", stream, seeded, reason)] >= 10, reasons
    wait_idle(server.base_url)


def test_regexes_fullmatch(server, compiler):
    cases = draw(
        st.tuples(
            regex_trees(CLASSES, allow_dot=True),
            st.sampled_from(["Once upon a time", "Lily and Tom", "The code is", "Ben said:"]),
            st.integers(0, 2**32 - 1),
        ),
        NUM_REGEXES,
        key=lambda c: to_regex(c[0]),
    )

    def fullmatch(pattern):
        compiled = re.compile(pattern, re.DOTALL)

        def check(text: str, where: str) -> None:
            assert compiled.fullmatch(text), where

        return check

    requests = [
        req
        for tree, prompt, seed in cases
        for req in _variants("regex", to_regex(tree), prompt, seed, 48, fullmatch(to_regex(tree)))
    ]
    seconds = run_all(server.base_url, requests)
    reasons = check_all(compiler, requests)
    _report("regex", seconds, reasons)
    _same_across_streaming(requests)
    assert sum(c for k, c in reasons.items() if k[3] == "stop") >= 20, reasons
    assert sum(c for k, c in reasons.items() if k[3] == "length") >= 10, reasons
    wait_idle(server.base_url)


def test_ebnf_grammars_accept(server, compiler):
    import xgrammar as xgr

    cases = draw(
        st.tuples(regex_trees(CLASSES, allow_dot=False), st.integers(0, 1), st.integers(0, 2**32 - 1)),
        NUM_GRAMMARS,
        key=lambda c: to_ebnf(c[0], c[1]),
    )

    def accepted(grammar: str, regular: str | None):
        compiled = compiler.compile_grammar(grammar, root_rule_name="root")

        def check(text: str, where: str) -> None:
            matcher = xgr.GrammarMatcher(compiled)
            assert matcher.accept_string(text) and matcher.is_completed(), where
            if regular is not None:  # the same language, read by Python's re
                assert re.fullmatch(regular, text, re.DOTALL), where

        return check

    requests = []
    for tree, nest, seed in cases:
        grammar = to_ebnf(tree, nest)
        regular = None if nest else to_regex(tree)
        requests += _variants("ebnf", grammar, "Once upon a time", seed, 48, accepted(grammar, regular))
    assert sum(1 for _, nest, _ in cases if nest) >= 5
    seconds = run_all(server.base_url, requests)
    reasons = check_all(compiler, requests)
    _report("ebnf", seconds, reasons)
    _same_across_streaming(requests)
    assert sum(c for k, c in reasons.items() if k[3] == "stop") >= 10, reasons
    info = wait_idle(server.base_url)
    assert info["num_grammar_rows_live"] == info["num_grammar_queue_reqs"] == 0
    assert httpx.get(server.base_url + "/health").status_code == 200
    assert "Traceback" not in server.log(), server.log()[-4000:]


FORMAT_SAMPLES = {
    "date": ["2024-02-31", "2024-13-01", "2024-1-01", "0000-01-01"],
    "time": ["23:59:60Z", "24:00:00Z", "12:00:00", "12:00:00.5+01:00", "12:00:00-25:00"],
    "date-time": ["2024-01-01T00:00:00Z", "2024-01-01 00:00:00Z", "2024-01-01T00:00Z"],
    "ipv4": ["010.1.2.255", "256.1.1.1", "1.2.3", "0.0.0.0"],
    "ipv6": ["::1", "1:2", "::ffff:1.2.3.4", "fe80::1:2:3:4", "1::2::3"],
    "uuid": ["123e4567-e89b-12d3-a456-426614174000", "123e4567e89b12d3a456426614174000", "123e4567-e89b"],
    "email": ["a@b", "ab", "first.last@example.com"],
    "hostname": ["a-b.example", "-ab", "ab-", "a..b", "x"],
}


def test_format_checks_agree_with_xgrammar(compiler):
    """The format checks above accept and refuse what xgrammar's format grammars do."""
    import xgrammar as xgr

    for fmt, samples in FORMAT_SAMPLES.items():
        compiled = compiler.compile_json_schema(json.dumps({"type": "string", "format": fmt}), any_whitespace=False)
        verdicts = []
        for sample in samples:
            matcher = xgr.GrammarMatcher(compiled)
            by_xgrammar = matcher.accept_string(json.dumps(sample)) and matcher.is_completed()
            verdicts.append(by_xgrammar)
            assert FORMAT_CHECKER.conforms(sample, fmt) == by_xgrammar, (fmt, sample, by_xgrammar)
        assert True in verdicts and False in verdicts, (fmt, verdicts)
