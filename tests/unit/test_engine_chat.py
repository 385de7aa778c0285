"""The Python Engine's face matches the HTTP API's on stories260k: `chat` / `async_chat` give
what /v1/chat/completions gives for the same messages (greedy: the same text and tokens, the
same assistant message), and a bad request raises InvalidRequestError with the message and
param the API answers with, naming no pydantic or pyserve class."""

from __future__ import annotations

import asyncio

import pytest
from starlette.testclient import TestClient

from pyserve.config import ServerArgs
from pyserve.errors import InvalidRequestError
from pyserve.server.app import create_app
from tests.conftest import CHAT_TEMPLATE, make_stories_engine, wait_engine_idle

MESSAGES = [{"role": "system", "content": "Tell a story."}, {"role": "user", "content": "Once upon a time"}]


@pytest.fixture(scope="module")
def engine(stories_path):
    eng = make_stories_engine(stories_path, 2048, chat_template=str(CHAT_TEMPLATE), log_level="warning")
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def client(stories_path):
    args = ServerArgs(
        model_path=str(stories_path), max_total_tokens=2048, chat_template=str(CHAT_TEMPLATE), log_level="warning"
    )
    with TestClient(create_app(args)) as c:
        yield c


def test_chat_gives_what_the_chat_route_gives(engine, client):
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "temperature": 0, "max_tokens": 24})
    assert r.status_code == 200
    choice, usage = r.json()["choices"][0], r.json()["usage"]
    out = engine.chat(MESSAGES, {"temperature": 0, "max_new_tokens": 24})
    assert out["message"] == choice["message"] == {"role": "assistant", "content": out["text"]}
    assert len(out["output_ids"]) == usage["completion_tokens"] == 24
    assert out["meta_info"]["prompt_tokens"] == usage["prompt_tokens"]
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 24}

    async def from_another_loop():
        return await engine.async_chat(MESSAGES, {"temperature": 0, "max_new_tokens": 24})

    again = asyncio.run(from_another_loop())
    assert (again["text"], again["output_ids"], again["message"]) == (out["text"], out["output_ids"], out["message"])
    wait_engine_idle(engine)


def test_chat_with_n_samples_gives_a_list(engine):
    outs = engine.chat(MESSAGES, {"temperature": 0, "max_new_tokens": 4, "n": 2})
    assert [len(o["output_ids"]) for o in outs] == [4, 4]
    assert outs[0]["text"] == outs[1]["text"]  # (greedy)
    wait_engine_idle(engine)


@pytest.mark.parametrize(
    "sampling_params",
    [{"temperatur": 0.5}, {"temperature": -1}, {"max_new_tokens": "8"}],
)
def test_bad_sampling_params_raise_the_apis_error(engine, client, sampling_params):
    r = client.post("/generate", json={"text": "Once", "sampling_params": sampling_params})
    assert r.status_code == 400
    api = r.json()["error"]
    for call in (
        lambda: engine.generate("Once", sampling_params),
        lambda: engine.chat(MESSAGES, sampling_params),
    ):
        with pytest.raises(InvalidRequestError) as info:
            call()
        assert (str(info.value), info.value.param, info.value.status) == (api["message"], api["param"], 400)
        assert "SamplingParams" not in str(info.value) and "pydantic" not in str(info.value)


def test_the_messages_of_known_mistakes(engine):
    cases = [
        ({"temperatur": 0.5}, "Unrecognized request argument supplied: sampling_params.temperatur"),
        ({"temperature": -1}, "sampling_params.temperature: Input should be greater than or equal to 0"),
    ]
    for sampling_params, message in cases:
        with pytest.raises(InvalidRequestError) as info:
            engine.generate("Once", sampling_params)
        assert str(info.value) == message


def test_bad_messages_raise_the_chat_routes_error(engine, client):
    messages = [{"role": "bot", "content": "hi"}]
    r = client.post("/v1/chat/completions", json={"messages": messages})
    assert r.status_code == 400
    api = r.json()["error"]
    with pytest.raises(InvalidRequestError) as info:
        engine.chat(messages)
    assert (str(info.value), info.value.param) == (api["message"], api["param"])


def test_an_unknown_chat_option_is_named(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.chat(MESSAGES, temperature=0)
    assert info.value.param == "temperature"
    assert str(info.value) == (
        "Unrecognized argument: temperature (sampling parameters go in sampling_params; the chat options are "
        "add_generation_prompt, chat_template_kwargs, continue_final_message, parallel_tool_calls, rid, "
        "separate_reasoning, thinking_budget, tool_choice)"
    )


def test_tools_with_tool_choice_auto_need_a_parser_as_in_the_api(engine, client):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    r = client.post("/v1/chat/completions", json={"messages": MESSAGES, "tools": tools})
    assert r.status_code == 400
    with pytest.raises(InvalidRequestError) as info:
        engine.chat(MESSAGES, tools=tools)
    assert (str(info.value), info.value.param) == (r.json()["error"]["message"], "tools")
