"""Real-world JSON schemas through `/v1/chat/completions` on the default model (SmolLM2), once
per grammar backend.

The schemas: 100 from the public JSONSchemaBench corpus, 10 per split, seeded
(tests/data/jsonschemabench: corpus.jsonl, SOURCE.md, make_sample.py). Each is sent with
`response_format: {"type": "json_schema", ...}`, greedy, at most MAX_TOKENS tokens, with a
prompt that names the schema and asks for an instance of it (see `request_body`);
CONCURRENCY requests at a time, so the server batches them. For every reply:
* the status is 200, or 400 with the OpenAI error object naming `response_format` whose
  message gives the reason (REFUSALS: the schema refused, or its grammar's compile timed out),
  never a 5xx;
* a 200's finish_reason is "stop" or "length";
* no whitespace run between JSON tokens (outside string literals) is longer than
  MAX_JSON_WHITESPACE, whatever the finish reason;
* a 200 that finishes with "stop" parses as JSON and validates against its schema with
  `jsonschema` (the validator of the schema's `$schema`, Draft 2020-12 without one) with its
  format checker.
Every failure is collected and reported together, with the schema's id and the output. The
coverage per split (valid / total, refused, cut by length, bad, over the whitespace bound) is
printed, and each refusal's message (`pytest -s` shows them).
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest

from pyserve.constrained import MAX_JSON_WHITESPACE
from tests.conftest import start_server, wait_idle

pytestmark = pytest.mark.slow

CORPUS = Path(__file__).resolve().parents[1] / "data" / "jsonschemabench" / "corpus.jsonl"
BACKENDS = ["xgrammar", "llguidance"]
MAX_TOKENS = 256
CONCURRENCY = 32
POOL = 16384  # KV slots: CONCURRENCY requests of a short prompt and MAX_TOKENS tokens, twice over
DESCRIPTION_CHARS = 300
REQUEST_TIMEOUT_S = 900.0
# a refusal's message starts with one of these; the reason follows
REFUSALS = ("response_format: invalid JSON schema: ", "response_format: the grammar did not compile within ")
JSON_WHITESPACE = " \t\n\r"
# the formats JSON Schema 2020-12 defines; jsonschema checks some only with its format-nongpl
# extra installed (rfc3339-validator for date-time, rfc3986-validator for uri, ...), and skips
# a format it has no checker for, so the test requires them all
SPEC_FORMATS = (
    "date-time", "date", "time", "duration", "email", "idn-email", "hostname", "idn-hostname", "ipv4", "ipv6",
    "uri", "uri-reference", "iri", "iri-reference", "uuid", "uri-template", "json-pointer",
    "relative-json-pointer", "regex",
)  # fmt: skip


def load_corpus() -> list[dict[str, Any]]:
    return [json.loads(line) for line in CORPUS.read_text(encoding="utf-8").splitlines()]


def longest_whitespace_run(text: str) -> int:
    """The longest run of JSON whitespace (space, tab, LF, CR) in `text` outside string
    literals, i.e. between JSON tokens. `text` may be cut short (a `length` finish): the scan
    needs no complete value. A string's escapes are skipped, so `\\"` does not end it."""
    longest = run = 0
    in_string = escaped = False
    for c in text:
        if in_string:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
            elif c == '"':
                in_string = False
            continue
        if c in JSON_WHITESPACE:
            run += 1
            longest = max(longest, run)
            continue
        run = 0
        if c == '"':
            in_string = True
    return longest


def schema_errors(schema: dict[str, Any], instance: Any) -> list[str]:
    """The messages of every error of `instance` against `schema`, with format checks (the
    validator of the schema's `$schema`; Draft 2020-12 when it names none)."""
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    validator = cls(schema, format_checker=cls.FORMAT_CHECKER)
    return [f"at /{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(instance)]


def request_body(row: dict[str, Any]) -> dict[str, Any]:
    """The chat request for one corpus row. The prompt names the schema (and gives its top-level
    description, cut to DESCRIPTION_CHARS) but does not quote it: the grammar carries the
    schema, and quoting it would cost about 116k prompt tokens of prefill for the 100 schemas
    (up to 9k for one, past SmolLM2's 8192-token context), more than the whole decode."""
    name = re.sub(r"[^A-Za-z0-9_-]", "_", row["id"])[:64]  # OpenAI's name rule: [a-zA-Z0-9_-]{1,64}
    prompt = f"Reply with one JSON value, and nothing else, that is valid against the JSON Schema {name}."
    description = row["schema"].get("description")
    if isinstance(description, str) and description.strip():
        prompt += f" The schema's description: {description.strip()[:DESCRIPTION_CHARS]}"
    return {
        "model": "default",
        "messages": [{"role": "user", "content": prompt}],
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
        "response_format": {"type": "json_schema", "json_schema": {"name": name, "schema": row["schema"]}},
    }


@dataclass
class Result:
    """One schema's reply: `outcome` is "valid" (stop, validates), "refused" (a 400 that quotes
    its reason), "length" (cut at MAX_TOKENS), or "bad" (anything else: a 5xx or other status,
    another finish reason, a stop that is not JSON or does not validate); `failures` lists every
    rule the reply broke (the whitespace bound included, whatever the outcome)."""

    outcome: str
    failures: list[str] = field(default_factory=list)
    longest_whitespace: int = 0
    completion_tokens: int = 0
    refusal: str | None = None


def check(row: dict[str, Any], status: int, body: dict[str, Any]) -> Result:
    where = row["id"]
    if status == 400:
        error = body.get("error", {})
        message = error.get("message", "")
        prefix = next((p for p in REFUSALS if message.startswith(p)), None)
        if error.get("param") == "response_format" and prefix is not None and len(message) > len(prefix):
            return Result("refused", refusal=message)
        return Result("bad", [f"{where}: 400 without a refusal's reason: {body}"])
    if status != 200:
        return Result("bad", [f"{where}: HTTP {status}: {body}"])
    choice = body["choices"][0]
    content, finish = choice["message"]["content"] or "", choice["finish_reason"]
    result = Result("length", longest_whitespace=longest_whitespace_run(content))
    result.completion_tokens = body["usage"]["completion_tokens"]
    if result.longest_whitespace > MAX_JSON_WHITESPACE:
        result.failures.append(
            f"{where}: a whitespace run of {result.longest_whitespace} > {MAX_JSON_WHITESPACE} ({finish}); "
            f"output {content!r}"
        )
    if finish == "length":
        return result
    result.outcome = "bad"
    if finish != "stop":
        result.failures.append(f"{where}: finish_reason {finish!r}; output {content!r}")
        return result
    try:
        instance = json.loads(content)
    except json.JSONDecodeError as exc:
        result.failures.append(f"{where}: stop, but not JSON ({exc}); output {content!r}")
        return result
    errors = schema_errors(row["schema"], instance)
    if errors:
        result.failures.append(f"{where}: stop, but invalid: {' | '.join(errors[:3])}; output {content!r}")
        return result
    result.outcome = "valid"
    return result


async def run_corpus(base_url: str, rows: list[dict[str, Any]]) -> list[tuple[int, dict[str, Any]]]:
    """(status, JSON body) of each row's request, in order, CONCURRENCY at a time; status 0
    when no reply came (the exception in the body)."""
    gate = asyncio.Semaphore(CONCURRENCY)
    async with httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(REQUEST_TIMEOUT_S)) as client:

        async def one(row: dict[str, Any]) -> tuple[int, dict[str, Any]]:
            async with gate:
                try:
                    r = await client.post("/v1/chat/completions", json=request_body(row))
                except httpx.HTTPError as exc:  # no reply (status 0): reported with the others
                    return 0, {"exception": repr(exc)}
                try:
                    return r.status_code, r.json()
                except json.JSONDecodeError:
                    return r.status_code, {"text": r.text}

        return await asyncio.gather(*(one(row) for row in rows))


def coverage_table(backend: str, rows: list[dict[str, Any]], results: list[Result], seconds: float) -> str:
    """The per-split table: valid / total, refused, cut by length, bad (5xx, other status or
    finish, invalid output), and how many replies broke the whitespace bound."""
    columns = ("total", "valid", "refused", "length", "bad", "ws")
    splits: dict[str, dict[str, int]] = {}
    for row, result in zip(rows, results):
        counts = splits.setdefault(row["split"], dict.fromkeys(columns, 0))
        counts["total"] += 1
        counts[result.outcome] += 1
        counts["ws"] += result.longest_whitespace > MAX_JSON_WHITESPACE
    splits["all"] = {k: sum(c[k] for c in splits.values()) for k in columns}
    tokens = sum(r.completion_tokens for r in results)
    ws_header = f"ws>{MAX_JSON_WHITESPACE}"
    lines = [
        f"JSONSchemaBench sample on SmolLM2, --grammar-backend {backend}, greedy, max_tokens {MAX_TOKENS}, "
        f"{CONCURRENCY} at a time: {seconds:.0f} s, {tokens} completion tokens",
        f"{'split':<16} {'valid/total':>11} {'refused':>8} {'length':>7} {'bad':>4} {ws_header:>6}",
    ]
    for split, c in splits.items():
        lines.append(
            f"{split:<16} {c['valid']:>5}/{c['total']:<5} {c['refused']:>8} {c['length']:>7} {c['bad']:>4} {c['ws']:>6}"
        )
    return "\n".join(lines)


@pytest.fixture(scope="module", params=BACKENDS)
def backend_server(request, tmp_path_factory):
    backend = request.param
    srv = start_server(
        tmp_path_factory,
        f"corpus-{backend}",
        [
            "--grammar-backend",
            backend,
            "--max-total-tokens",
            str(POOL),
            "--max-running-requests",
            str(CONCURRENCY),
            # one schema takes xgrammar 16 s of CPU to compile: a loaded machine must not turn it
            # into a timeout refusal
            "--grammar-compile-timeout-s",
            "300",
        ],
    )
    try:
        yield backend, srv
        info = wait_idle(srv.base_url)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL
    finally:
        srv.stop()


def require_format_checkers() -> None:
    missing = sorted(set(SPEC_FORMATS) - set(jsonschema.Draft202012Validator.FORMAT_CHECKER.checkers))
    assert missing == [], f"jsonschema cannot check {missing}: install jsonschema[format-nongpl]"


def test_helpers_on_known_text():
    """The whitespace scan skips string literals and escaped quotes; a cut text scans; every
    format of the spec is checked."""
    require_format_checkers()
    assert longest_whitespace_run('{"a":  "x      y", "b\\"    ":\n\n\n1}') == 3
    assert longest_whitespace_run('{"a": "\\\\"     ,') == 5
    assert longest_whitespace_run('["     ') == 0
    assert longest_whitespace_run("") == 0
    assert schema_errors({"type": "string", "format": "date-time"}, "yesterday") == [
        "at /: 'yesterday' is not a 'date-time'"
    ]
    draft4 = {"$schema": "http://json-schema.org/draft-04/schema#", "maximum": 3, "exclusiveMaximum": True}
    assert schema_errors(draft4, 3) == ["at /: 3 is greater than or equal to the maximum of 3"]


def test_check_on_known_replies():
    """Each outcome of `check` on hand-made replies."""
    row = {"id": "t/1", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}

    def reply(content: str, finish: str) -> dict[str, Any]:
        return {
            "choices": [{"message": {"content": content}, "finish_reason": finish}],
            "usage": {"completion_tokens": 7},
        }

    refusal = {"error": {"message": REFUSALS[0] + "`not` (at #)", "param": "response_format"}}
    assert check(row, 400, refusal) == Result("refused", refusal=REFUSALS[0] + "`not` (at #)")
    assert check(row, 400, {"error": {"message": REFUSALS[0], "param": "response_format"}}).outcome == "bad"
    assert check(row, 400, {"error": {"message": "prompt too long", "param": "messages"}}).outcome == "bad"
    assert check(row, 500, {"error": {"message": "boom"}}) == Result(
        "bad", ["t/1: HTTP 500: {'error': {'message': 'boom'}}"]
    )
    assert check(row, 200, reply('{"a": 1}', "stop")) == Result("valid", longest_whitespace=1, completion_tokens=7)
    assert check(row, 200, reply('{"a": 1.5}', "stop")).failures == [
        """t/1: stop, but invalid: at /a: 1.5 is not of type 'integer'; output '{"a": 1.5}'"""
    ]
    assert check(row, 200, reply('{"a"', "stop")).outcome == "bad"
    assert check(row, 200, reply('{"a"', "abort")).outcome == "bad"
    cut = check(row, 200, reply('{"a":' + " " * (MAX_JSON_WHITESPACE + 1), "length"))
    assert (cut.outcome, len(cut.failures), cut.longest_whitespace) == ("length", 1, MAX_JSON_WHITESPACE + 1)


def test_corpus(backend_server, tmp_path):
    backend, server = backend_server
    require_format_checkers()
    rows = load_corpus()
    assert len(rows) == 100 and len({r["id"] for r in rows}) == 100
    start = time.monotonic()
    replies = asyncio.run(run_corpus(server.base_url, rows))
    seconds = time.monotonic() - start
    results = [check(row, status, body) for row, (status, body) in zip(rows, replies)]
    replies_path = tmp_path / f"replies-{backend}.jsonl"  # every reply, to study a failure
    replies_path.write_text(
        "".join(json.dumps({"id": r["id"], "status": st, "body": b}) + "\n" for r, (st, b) in zip(rows, replies))
    )
    print("\n" + coverage_table(backend, rows, results, seconds) + f"\nreplies: {replies_path}")
    for row, result in zip(rows, results):
        if result.refusal is not None:
            print("REFUSED", row["id"], result.refusal)
    failures = [failure for result in results for failure in result.failures]
    for failure in failures:
        print("FAILURE", failure)
    assert failures == []
