"""POST /v1/responses end to end on a real stories260k server (greedy): the reply, its token
counts and its status equal those of /v1/chat/completions with the same messages; the stream's
events come in the Responses API's order with their sequence numbers, and its deltas add up to
the non-streamed text; the `openai` client's `responses.create` (streamed and not),
`responses.stream` and `responses.parse` read them; what pyserve cannot honour is a 400 naming
the field. The server's teardown checks, once idle, that no KV slot leaked."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import pytest
from pydantic import BaseModel

from tests.conftest import run_client, stories_chat_server

POOL = 4096
STORY = "Tell me a story"
# the events of a streamed response, in order, around its text deltas
OPENING = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
CLOSING = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
# a JSON schema whose every reply is one of two objects (no whitespace: see the server flags)
CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Rome"]}},
    "required": ["city"],
    "additionalProperties": False,
}


class City(BaseModel):
    city: Literal["Paris", "Rome"]


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    # (no JSON whitespace: left to itself stories260k writes whitespace runs inside a grammar)
    yield from stories_chat_server(
        tmp_path_factory, stories_path, "responses", POOL, ["--constrained-json-disable-any-whitespace"]
    )


@pytest.fixture(scope="module")
def client(server):
    import openai

    return openai.OpenAI(base_url=server.base_url + "/v1", api_key="unused", max_retries=0)


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def chat(server, messages: list[dict], **fields) -> dict:
    r = post(server, "/v1/chat/completions", {"messages": messages, "temperature": 0, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def respond(server, body: dict) -> dict:
    r = post(server, "/v1/responses", {"temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def output_text(response: dict) -> str:
    (item,) = response["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["id"].startswith("msg_")
    (part,) = item["content"]
    assert part["type"] == "output_text" and part["annotations"] == []
    return part["text"]


def stream_events(server, body: dict) -> list[tuple[str, dict]]:
    """(event name, data) of each event of a streamed response (no `data: [DONE]` after
    them: the Responses API ends with its terminal event)."""
    r = post(server, "/v1/responses", {"temperature": 0, **body, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    blocks = [b for b in r.text.split("\n\n") if b]
    events = []
    for block in blocks:
        name, data = block.split("\n")
        assert name.startswith("event: ") and data.startswith("data: "), block
        events.append((name[7:], json.loads(data[6:])))
    return events


CASES = [
    # (input, instructions, the same conversation as chat messages)
    (STORY, None, [{"role": "user", "content": STORY}]),
    (STORY, "Be kind.", [{"role": "system", "content": "Be kind."}, {"role": "user", "content": STORY}]),
    (
        [
            {"role": "developer", "content": "Be brief."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Lily had "}, {"type": "input_text", "text": "a dog."}],
            },
            {"role": "assistant", "content": "The dog was big."},
            {"role": "user", "content": "What was its name?"},
        ],
        None,
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Lily had a dog."},
            {"role": "assistant", "content": "The dog was big."},
            {"role": "user", "content": "What was its name?"},
        ],
    ),
]


@pytest.mark.parametrize(("input_", "instructions", "messages"), CASES)
@pytest.mark.parametrize("max_tokens", [1, 24])
def test_reply_and_usage_equal_the_chat_routes(server, input_, instructions, messages, max_tokens):
    want = chat(server, messages, max_tokens=max_tokens)
    got = respond(server, {"input": input_, "instructions": instructions, "max_output_tokens": max_tokens})
    assert output_text(got) == want["choices"][0]["message"]["content"]
    usage = want["usage"]
    assert got["usage"] == {
        "input_tokens": usage["prompt_tokens"],
        "input_tokens_details": {"cached_tokens": got["usage"]["input_tokens_details"]["cached_tokens"]},
        "output_tokens": usage["completion_tokens"],
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage["total_tokens"],
    }
    # the chat request cached this prompt's prefix: the response's found it (whole but its last token)
    assert got["usage"]["input_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert want["choices"][0]["finish_reason"] == "length" and got["status"] == "incomplete"
    assert got["incomplete_details"] == {"reason": "max_output_tokens"} and got["output"][0]["status"] == "incomplete"
    assert (
        got["object"] == "response"
        and got["id"].startswith("resp_")
        and got["output"][0]["id"] == "msg_" + got["id"][5:]
    )
    assert got["model"] == "stories260k" and got["instructions"] == instructions
    assert (got["max_output_tokens"], got["temperature"], got["store"], got["error"]) == (max_tokens, 0.0, False, None)


def test_an_earlier_output_item_carries_the_conversation_on(server):
    first = respond(server, {"input": STORY, "max_output_tokens": 12})
    follow_up = {"role": "user", "content": "And then?"}
    got = respond(
        server, {"input": [{"role": "user", "content": STORY}, *first["output"], follow_up], "max_output_tokens": 12}
    )
    want = chat(
        server,
        [{"role": "user", "content": STORY}, {"role": "assistant", "content": output_text(first)}, follow_up],
        max_tokens=12,
    )
    assert output_text(got) == want["choices"][0]["message"]["content"]
    assert got["usage"]["input_tokens"] == want["usage"]["prompt_tokens"]


def test_a_stop_completes_the_response(server):
    want = chat(server, [{"role": "user", "content": STORY}], max_tokens=64, stop=["."])
    assert want["choices"][0]["finish_reason"] == "stop"
    got = respond(server, {"input": STORY, "max_output_tokens": 64, "stop": ["."]})
    assert output_text(got) == want["choices"][0]["message"]["content"]
    assert got["status"] == "completed" and got["incomplete_details"] is None
    assert got["output"][0]["status"] == "completed"
    assert got["usage"]["output_tokens"] == want["usage"]["completion_tokens"] < 64


@pytest.mark.parametrize(("max_tokens", "stop"), [(6, None), (64, ["."])])
def test_stream_events_add_up_to_the_non_streamed_response(server, max_tokens, stop):
    body = {"input": STORY, "max_output_tokens": max_tokens, "stop": stop}
    plain = respond(server, body)
    events = stream_events(server, body)
    names = [name for name, _ in events]
    num_deltas = len(names) - len(OPENING) - len(CLOSING) - 1
    final_name = "response.completed" if plain["status"] == "completed" else "response.incomplete"
    assert names == OPENING + ["response.output_text.delta"] * num_deltas + CLOSING + [final_name]
    assert [data["type"] for _, data in events] == names
    assert [data["sequence_number"] for _, data in events] == list(range(len(events)))
    created, in_progress = events[0][1]["response"], events[1][1]["response"]
    assert created == in_progress and created["status"] == "in_progress" and created["output"] == []
    assert created["usage"] is None
    rid, msg_id = created["id"], "msg_" + created["id"][5:]
    assert events[2][1]["item"] == {
        "type": "message",
        "id": msg_id,
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    deltas = [data["delta"] for name, data in events if name == "response.output_text.delta"]
    text = output_text(plain)
    assert "".join(deltas) == text and all(deltas)
    assert all(data["item_id"] == msg_id for _, data in events[3:-2])
    assert events[-4][1]["text"] == text and events[-3][1]["part"]["text"] == text
    final = events[-1][1]["response"]
    assert events[-2][1]["item"] == final["output"][0]
    # the final response is the non-streamed one but for its id and time
    same = {k: v for k, v in final.items() if k not in ("id", "created_at", "output", "usage")}
    assert same == {k: v for k, v in plain.items() if k not in ("id", "created_at", "output", "usage")}
    assert final["id"] == rid and output_text(final) == text
    assert final["output"][0] | {"id": None} == plain["output"][0] | {"id": None}
    assert final["usage"]["output_tokens"] == plain["usage"]["output_tokens"]
    assert final["usage"]["input_tokens"] == plain["usage"]["input_tokens"]


def test_exact_greedy_reply(server):
    got = respond(server, {"input": STORY, "max_output_tokens": 6})
    assert output_text(got) == " Anna'"
    assert got["usage"]["input_tokens"] == 23 and got["usage"]["output_tokens"] == 6


def test_text_format_json_schema_is_the_chat_routes_grammar(server):
    fmt = {"type": "json_schema", "name": "city", "schema": CITY_SCHEMA, "strict": True}
    got = respond(server, {"input": "Where?", "max_output_tokens": 32, "text": {"format": fmt}})
    want = chat(
        server,
        [{"role": "user", "content": "Where?"}],
        max_tokens=32,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": CITY_SCHEMA}},
    )
    assert output_text(got) == want["choices"][0]["message"]["content"]
    assert json.loads(output_text(got))["city"] in ("Paris", "Rome") and got["status"] == "completed"
    assert got["text"]["format"] == fmt
    # a schema the compiler refuses names the request's field
    bad = {"type": "json_schema", "name": "x", "schema": {"type": "foo"}}
    r = post(server, "/v1/responses", {"input": "Where?", "text": {"format": bad}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "text.format", r.text


def test_openai_client_create_stream_and_parse(server, client):
    want = chat(server, [{"role": "system", "content": "Be kind."}, {"role": "user", "content": STORY}], max_tokens=20)
    content, usage = want["choices"][0]["message"]["content"], want["usage"]
    kwargs = {"model": "default", "input": STORY, "instructions": "Be kind.", "max_output_tokens": 20, "temperature": 0}
    response = client.responses.create(**kwargs)
    assert response.output_text == content and response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert (response.usage.input_tokens, response.usage.output_tokens) == (
        usage["prompt_tokens"],
        usage["completion_tokens"],
    )
    assert response.usage.total_tokens == usage["total_tokens"]
    # streamed: the raw events
    events = list(client.responses.create(**kwargs, stream=True))
    types = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert types == OPENING + ["response.output_text.delta"] * len(deltas) + CLOSING + ["response.incomplete"]
    assert "".join(deltas) == content and events[-1].response.output_text == content
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # the stream helper assembles the same response
    with client.responses.stream(**kwargs) as stream:
        helper_deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
    assert "".join(helper_deltas) == content
    # a reply that stops by itself completes
    with client.responses.stream(**{**kwargs, "max_output_tokens": 64}, extra_body={"stop": ["."]}) as stream:
        list(stream)
        final = stream.get_final_response()
    assert final.status == "completed"
    stopped = chat(
        server,
        [{"role": "system", "content": "Be kind."}, {"role": "user", "content": STORY}],
        max_tokens=64,
        stop=["."],
    )
    assert final.output_text == stopped["choices"][0]["message"]["content"]
    # structured output into a pydantic model
    parsed = client.responses.parse(
        model="default", input="Where?", text_format=City, max_output_tokens=32, temperature=0
    )
    assert type(parsed.output_parsed) is City and parsed.output_parsed == City.model_validate_json(parsed.output_text)


# the same through the client venv's openai (the version langchain-openai pins): the reply
# non-streamed, streamed and through the stream helper, as JSON lines
CLIENT_SCRIPT = """
import json, sys
import openai
client = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="unused", max_retries=0)
kwargs = {"model": "default", "input": "Tell me a story", "max_output_tokens": 20, "temperature": 0}
r = client.responses.create(**kwargs)
events = list(client.responses.create(**kwargs, stream=True))
with client.responses.stream(**{**kwargs, "max_output_tokens": 64}, extra_body={"stop": ["."]}) as stream:
    list(stream)
    final = stream.get_final_response()
print(json.dumps({
    "text": r.output_text, "status": r.status, "usage": [r.usage.input_tokens, r.usage.output_tokens],
    "types": [e.type for e in events],
    "deltas": "".join(e.delta for e in events if e.type == "response.output_text.delta"),
    "final": [final.status, final.output_text],
}))
"""


def test_the_client_venvs_openai_reads_them(server, client_python, tmp_path):
    out = run_client(client_python, ["-c", CLIENT_SCRIPT, server.base_url], tmp_path).stdout
    got = json.loads(out.strip().splitlines()[-1])
    want = chat(server, [{"role": "user", "content": STORY}], max_tokens=20)
    content = want["choices"][0]["message"]["content"]
    assert got["text"] == got["deltas"] == content and got["status"] == "incomplete"
    assert got["usage"] == [want["usage"]["prompt_tokens"], want["usage"]["completion_tokens"]]
    num_deltas = len(got["types"]) - len(OPENING) - len(CLOSING) - 1
    assert got["types"] == OPENING + ["response.output_text.delta"] * num_deltas + CLOSING + ["response.incomplete"]
    stopped = chat(server, [{"role": "user", "content": STORY}], max_tokens=64, stop=["."])
    assert got["final"] == ["completed", stopped["choices"][0]["message"]["content"]]


def test_openai_client_gets_the_400s(client):
    import openai

    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(model="default", input=STORY, previous_response_id="resp_abc")
    assert info.value.body["param"] == "previous_response_id" and "not supported" in info.value.body["message"]
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.retrieve("resp_abc")
    assert "not supported" in info.value.body["message"]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"conversation": "conv_1"}, "conversation"),
        ({"store": True}, "store"),
        ({"background": True}, "background"),
        ({"tools": [{"type": "function", "name": "f", "parameters": {}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"include": ["message.output_text.logprobs"]}, "include"),
        ({"reasoning": {"effort": "high"}}, "reasoning"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"truncation": "auto"}, "truncation"),
        ({"prompt": {"id": "pmpt_1"}}, "prompt"),
        ({"text": {"verbosity": "low"}}, "text.verbosity"),
        ({"text": {"format": {"type": "text", "name": "x"}}}, "text.format.name"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"text": {"format": {"type": "grammar"}}}, "text.format.type"),
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": "x"}]}, "input.0.type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input.0.content.0.type",
        ),
        ({"input": [{"role": "tool", "content": "x"}]}, "input.0.role"),
        ({"frobnicate": 1}, "frobnicate"),
        ({"temperature": 3}, "temperature"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
    ],
)
def test_what_cannot_be_honoured_is_a_400_naming_the_field(server, body, param):
    r = post(server, "/v1/responses", {"input": STORY, **body})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error", error


def test_defaults_and_harmless_fields_are_accepted(server):
    body = {
        "input": STORY,
        "max_output_tokens": 4,
        "store": False,
        "tool_choice": "none",
        "tools": [],
        "reasoning": {},
        "metadata": {"k": "v"},
        "user": "u",
        "truncation": "disabled",
        "parallel_tool_calls": False,
        "stream_options": None,
        "text": {"format": {"type": "text"}, "verbosity": "medium"},
    }
    got = respond(server, body)
    assert got["metadata"] == {"k": "v"} and got["user"] == "u" and got["parallel_tool_calls"] is False
    assert got["tool_choice"] == "none" and got["usage"]["output_tokens"] == 4
    assert post(server, "/v1/responses", {"input": STORY, "model": "gpt-9"}).status_code == 404
