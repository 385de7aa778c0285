"""Structured output through real clients against the default model (SmolLM2-135M-Instruct):
the `openai` client's `chat.completions.parse` with a pydantic model (streamed and not) and
`response_format` `json_object` / `json_schema`; instructor in TOOLS, JSON and JSON_SCHEMA modes
and langchain's `with_structured_output` (json_schema, function_calling) and `bind_tools` with a
forced tool choice (tests/clients/structured_clients.py); SGLang 0.5.2's frontend with
`gen(regex=...)`, `gen(dtype=int)` and `gen(json_schema=...)` (tests/clients/sgl_structured.py).

Every case must give a parsed object of the exact type and fields, equal to what the server's
own reply parses to, and (greedy) the same object when repeated. Afterwards the server is idle
and holds no KV, sampling or grammar row.

The server runs the float32 path (`--quantization none`): on the quantized path a repeated
greedy request whose prompt comes from the prefix cache can differ from the first (the int8
rounding of activations turns attention's last-ulp difference between a whole-prompt prefill
and a one-token extend into different tokens), and this file checks structured output, not
that."""

from __future__ import annotations

import json
import re

import httpx
import jsonschema
import pytest
from pydantic import BaseModel

from tests.conftest import REPO, run_client, start_server, wait_idle

POOL = 16384
MAX_TOKENS = 64
CITY_PROMPT = (
    "Paris is the capital of France. About 2100000 people live there. "
    "Give the city's name, its country and its population."
)


class City(BaseModel):
    """A city."""

    name: str
    country: str
    population: int


CITY_FIELDS = {"name": str, "country": str, "population": int}
TRIP_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "country": {"type": "string", "enum": ["France", "Germany", "Italy"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 14},
        "sights": {"type": "array", "items": {"type": "string", "maxLength": 24}, "minItems": 1, "maxItems": 3},
    },
    "required": ["city", "country", "days", "sights"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = ["--max-total-tokens", str(POOL), "--quantization", "none"]
    srv = start_server(tmp_path_factory, "smollm2-structured", args)
    try:
        yield srv
        info = wait_idle(srv.base_url, timeout_s=60)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL, info
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def assert_city(value: dict) -> None:
    assert set(value) == set(CITY_FIELDS), value
    for name, kind in CITY_FIELDS.items():
        assert type(value[name]) is kind, (name, value)


def closed_schema(model: type[BaseModel]) -> dict:
    """`model`'s JSON schema with every field required and no other (what `parse` asks for)."""
    schema = model.model_json_schema()
    return {**schema, "required": list(schema["properties"]), "additionalProperties": False}


# ---- the openai client -----------------------------------------------------------------------
def _parse(client) -> tuple[City, str, str]:
    completion = client.chat.completions.parse(
        model="default",
        messages=[{"role": "user", "content": CITY_PROMPT}],
        response_format=City,
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    choice = completion.choices[0]
    return choice.message.parsed, choice.message.content, choice.finish_reason


def test_openai_parse_pydantic(client):
    first, content, finish = _parse(client)
    assert type(first) is City and finish == "stop"
    assert_city(first.model_dump())
    assert first == City.model_validate_json(content, strict=True)
    jsonschema.validate(json.loads(content), closed_schema(City))
    again, content_again, _ = _parse(client)
    assert again == first and content_again == content
    # streamed, the client assembles the same object from the deltas
    with client.chat.completions.stream(
        model="default",
        messages=[{"role": "user", "content": CITY_PROMPT}],
        response_format=City,
        temperature=0,
        max_tokens=MAX_TOKENS,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert final.choices[0].message.parsed == first and "".join(deltas) == content


def _create(client, response_format: dict, content: str, stream: bool = False) -> tuple[str, str]:
    kwargs = {
        "model": "default",
        "messages": [{"role": "user", "content": content}],
        "response_format": response_format,
        "temperature": 0,
        "max_tokens": MAX_TOKENS,
    }
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(**kwargs, stream=True):
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    return text, finish


def test_openai_response_format_json_object(client):
    prompt = "Describe Paris as a JSON object with its name and country."
    content, finish = _create(client, {"type": "json_object"}, prompt)
    assert finish == "stop" and isinstance(json.loads(content), dict), content
    assert _create(client, {"type": "json_object"}, prompt) == (content, finish)
    assert _create(client, {"type": "json_object"}, prompt, stream=True) == (content, finish)


def test_openai_response_format_json_schema(client):
    rf = {"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP_SCHEMA, "strict": True}}
    prompt = "Plan a short trip to Paris: the city, its country, how many days and up to three sights."
    content, finish = _create(client, rf, prompt)
    value = json.loads(content)
    jsonschema.validate(value, TRIP_SCHEMA)
    assert finish == "stop" and list(value) == list(TRIP_SCHEMA["properties"]), content
    assert _create(client, rf, prompt) == (content, finish)
    assert _create(client, rf, prompt, stream=True) == (content, finish)


# ---- instructor and langchain (client venv) ----------------------------------------------------
CITY_CASES = {  # case: (what the client must have sent, where the server's reply holds the object)
    "instructor_tools": ({"tool_choice": {"type": "function", "function": {"name": "City"}}}, "tool"),
    "instructor_json": ({"response_format": {"type": "json_object"}}, "content"),
    "instructor_json_schema": ({"response_format.type": "json_schema"}, "content"),
    "langchain_json_schema": ({"response_format.type": "json_schema"}, "content"),
    "langchain_function_calling": ({"tool_choice": {"type": "function", "function": {"name": "City"}}}, "tool"),
}
TOOL_CASES = ["langchain_bind_tools_required", "langchain_bind_tools_any"]


@pytest.fixture(scope="module")
def client_results(server, client_python, tmp_path_factory) -> dict[str, dict]:
    out = run_client(
        client_python,
        [str(REPO / "tests" / "clients" / "structured_clients.py"), server.base_url],
        tmp_path_factory.mktemp("structured-clients"),
    ).stdout
    results = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return {r["case"]: r for r in results}


def _runs(client_results, case: str) -> list[dict]:
    result = client_results[case]
    assert "error" not in result, result["error"]
    runs = result["runs"]
    assert len(runs) == 2 and runs[0]["value"] == runs[1]["value"], runs  # greedy: the same object
    for run in runs:
        assert run["request"]["temperature"] == 0 and run["request"]["model"] == "default"
    return runs


def _sent(request: dict, key: str):
    for part in key.split("."):
        request = request[part]
    return request


@pytest.mark.parametrize("case", sorted(CITY_CASES))
def test_client_structured_city(client_results, case):
    wanted, where = CITY_CASES[case]
    for run in _runs(client_results, case):
        for key, value in wanted.items():
            assert _sent(run["request"], key) == value, run["request"]
        choice = run["response"]["choices"][0]
        assert run["type"] == "City"
        assert_city(run["value"])
        if where == "tool":
            calls = choice["message"]["tool_calls"]
            assert choice["finish_reason"] == "tool_calls" and calls and choice["message"]["content"] is None
            assert all(c["type"] == "function" and c["function"]["name"] == "City" for c in calls)
            raw = calls[0]["function"]["arguments"]  # both clients take the first call
        else:
            assert choice["finish_reason"] == "stop" and not choice["message"].get("tool_calls")
            raw = choice["message"]["content"]
        # the object is what the server's reply parses to (JSON mode: lax, as the case asks)
        assert City.model_validate_json(raw, strict=case != "instructor_json").model_dump() == run["value"]


@pytest.mark.parametrize("case", TOOL_CASES)
def test_langchain_bind_tools_forced(client_results, case):
    for run in _runs(client_results, case):
        assert run["request"]["tool_choice"] == "required"
        assert [t["function"]["name"] for t in run["request"]["tools"]] == ["GetWeather"]
        choice = run["response"]["choices"][0]
        calls = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and calls
        assert run["value"] == [
            {"name": c["function"]["name"], "args": json.loads(c["function"]["arguments"])} for c in calls
        ]
        for call in run["value"]:
            assert call["name"] == "GetWeather" and set(call["args"]) == {"city", "unit"}
            assert type(call["args"]["city"]) is str and call["args"]["unit"] in ("celsius", "fahrenheit")


# ---- SGLang's frontend language ------------------------------------------------------------------
REGEX_INT = r"[-+]?[0-9]+[ \n]*"  # what sgl.gen(dtype=int) sends (sglang/lang/ir.py)


def test_sgl_constrained_gen(server, client_python, tmp_path):
    out = tmp_path / "sgl.json"
    run_client(
        client_python, [str(REPO / "tests" / "clients" / "sgl_structured.py"), server.base_url, str(out)], tmp_path
    )
    got = json.loads(out.read_text())
    for name in ("ip", "legs", "city"):
        first, second = got[name]
        assert first["value"] == second["value"] and first["text"] == second["text"], got[name]
        assert first["text"] == got["prompts"][name] + first["value"]
    ip = got["ip"][0]
    assert re.fullmatch(got["ip_regex"], ip["value"]) and ip["meta"]["finish_reason"]["type"] == "stop", ip
    legs = got["legs"][0]
    assert re.fullmatch(r"[-+]?[0-9]+", legs["value"]) and isinstance(int(legs["value"]), int), legs
    city = got["city"][0]
    assert city["meta"]["finish_reason"]["type"] == "stop", city
    value = json.loads(city["value"])
    jsonschema.validate(value, got["city_schema"])
    assert_city(value)
    # each gen returned exactly what /generate answers to the same prompt and constraint
    replays = {
        "ip": {"max_new_tokens": 24, "regex": got["ip_regex"]},
        "legs": {"max_new_tokens": 8, "regex": REGEX_INT, "stop": [" ", "\n"]},
        "city": {"max_new_tokens": 96, "json_schema": json.dumps(got["city_schema"])},
    }
    for name, params in replays.items():
        body = {"text": got["prompts"][name], "sampling_params": {"temperature": 0, **params}}
        r = httpx.post(server.base_url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        assert r.json()["text"] == got[name][0]["value"], (name, r.json())
