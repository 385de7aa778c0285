"""The chat template while serving (stories260k in process): the x-pyserve-warning header of a
request with tools on a template that ignores them (streamed or not, chat and tokenize), the
start-up warning, a template's refusal (400, nothing logged) and its own error (400 and a
warning naming the request), /v1/tokenize with tools equal to transformers' rendering, and the
chat route of an embedding server."""

from __future__ import annotations

import logging

import pytest
from starlette.testclient import TestClient
from transformers import AutoTokenizer

from pyserve.config import ServerArgs
from pyserve.model_loader.chat_template import TOOLS_IGNORED_WARNING
from pyserve.model_loader.tokenizer import set_chat_template
from pyserve.server.app import create_app
from tests.conftest import CHAT_TEMPLATE, REPO

TOOLS_TEMPLATE = REPO / "tests" / "data" / "stories_tools_chat_template.jinja"
# ignores tools; refuses a message "refuse me" (line 3); reads a tool message's `name` (line 5)
STRICT_TEMPLATE = """{%- for m in messages -%}
{%- if m['content'] == 'refuse me' -%}
{{ raise_exception('this template refuses that') }}
{%- elif m['role'] == 'tool' -%}
{{ 'Tool ' + m['name'] + ': ' }}
{%- endif -%}
{{ m['role'] + ': ' + m['content'] + '\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}assistant:{%- endif -%}
"""
USER = {"role": "user", "content": "Tell me a story about a cat."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
CHAT_LOGGER = "pyserve.server.openai.chat_prompt"


def _client(stories_path, chat_template: str, **kwargs):
    args = ServerArgs(
        model_path=str(stories_path), chat_template=chat_template, max_total_tokens=1024, log_level="warning", **kwargs
    )
    return TestClient(create_app(args))


@pytest.fixture(scope="module")
def strict(stories_path, tmp_path_factory):
    path = tmp_path_factory.mktemp("strict") / "strict.jinja"
    path.write_text(STRICT_TEMPLATE)
    with _client(stories_path, str(path), tool_call_parser="qwen25") as c:
        yield c


@pytest.fixture(scope="module")
def with_tools(stories_path):
    with _client(stories_path, str(TOOLS_TEMPLATE)) as c:
        yield c


@pytest.fixture
def chat_warnings(caplog):
    """The messages chat_prompt.py logged at warning level and above (a function of none)."""
    caplog.set_level(logging.WARNING, logger=CHAT_LOGGER)
    return lambda: [r.getMessage() for r in caplog.records if r.name == CHAT_LOGGER]


@pytest.mark.parametrize("stream", [False, True])
def test_tools_on_a_template_that_ignores_them_carry_a_warning_header(strict, stream):
    body = {"messages": [USER], "max_tokens": 1, "stream": stream}
    r = strict.post("/v1/chat/completions", json={**body, "tools": TOOLS})
    assert r.status_code == 200, r.text
    assert r.headers["x-pyserve-warning"] == TOOLS_IGNORED_WARNING
    r = strict.post("/v1/chat/completions", json=body)
    assert r.status_code == 200 and "x-pyserve-warning" not in r.headers
    r = strict.post("/v1/tokenize", json={"messages": [USER], "tools": TOOLS})
    assert r.headers["x-pyserve-warning"] == TOOLS_IGNORED_WARNING


def test_a_template_refusing_the_messages_is_a_400_and_logs_nothing(strict, chat_warnings):
    r = strict.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "refuse me"}]})
    assert (r.status_code, r.json()) == (
        400,
        {
            "error": {
                "message": "the chat template refused the messages: line 3: this template refuses that",
                "type": "invalid_request_error",
                "param": "messages",
                "code": None,
            }
        },
    )
    assert chat_warnings() == []


def test_a_template_failing_on_the_messages_is_a_400_and_a_warning_naming_the_request(strict, chat_warnings):
    messages = [USER, {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}]
    reason = "line 5: 'dict object' has no attribute 'name'"
    r = strict.post("/v1/chat/completions", json={"messages": messages, "rid": "story-1"})
    assert (r.status_code, r.json()["error"]["message"]) == (400, f"the chat template failed: {reason}")
    r = strict.post("/v1/tokenize", json={"messages": messages})
    assert (r.status_code, r.json()["error"]["message"]) == (400, f"the chat template failed: {reason}")
    assert chat_warnings() == [
        f"request story-1: the chat template failed: {reason}",
        f"a /v1/tokenize request: the chat template failed: {reason}",
    ]


def test_tokenize_with_tools_is_transformers_rendering(with_tools, stories_path):
    tok = AutoTokenizer.from_pretrained(stories_path)
    tok.chat_template = TOOLS_TEMPLATE.read_text()
    text = tok.apply_chat_template([USER], tools=TOOLS, tokenize=False, add_generation_prompt=True)
    assert text == "Tools: get_weather\nUser: Tell me a story about a cat.\nAssistant:"
    ids = tok.encode(text, add_special_tokens=False)
    context = with_tools.get("/get_model_info").json()["context_length"]
    r = with_tools.post("/v1/tokenize", json={"messages": [USER], "tools": TOOLS, "return_text": True})
    assert r.json() == {"tokens": ids, "count": len(ids), "max_model_len": context, "text": text}
    assert "x-pyserve-warning" not in r.headers
    r = with_tools.post("/v1/tokenize", json={"prompt": "a", "tools": TOOLS})
    assert (r.status_code, r.json()["error"]["param"]) == (400, "tools")
    r = with_tools.post("/v1/tokenize", json={"messages": [USER], "chat_template_kwargs": {"tools": TOOLS}})
    assert (r.status_code, r.json()["error"]["message"]) == (400, "chat_template_kwargs may not set 'tools'")


def test_the_start_up_warning_of_a_template_that_ignores_tools(stories_path, caplog):
    logger = "pyserve.model_loader.tokenizer"
    caplog.set_level(logging.WARNING, logger=logger)
    tok = AutoTokenizer.from_pretrained(stories_path)
    set_chat_template(tok, str(TOOLS_TEMPLATE))
    set_chat_template(tok, str(CHAT_TEMPLATE))
    assert tok.chat_template == CHAT_TEMPLATE.read_text()
    tok.chat_template = "{{ messages[0]['content'] + 1 }}"  # (as a model's own, unchecked)
    set_chat_template(tok, None)
    assert [r.getMessage() for r in caplog.records if r.name == logger] == [
        f"--chat-template {CHAT_TEMPLATE} ignores tools: the prompt of a request with tools does not show them "
        "(its response carries an x-pyserve-warning header); give a --chat-template that renders tools to use them",
        'the model\'s chat template fails: line 1: can only concatenate str (not "int") '
        "to str (rendering a sample conversation: system, user, assistant); chat requests may fail",
    ]


def test_an_embedding_server_answers_chat_with_what_it_serves(stories_path):
    with _client(stories_path, str(CHAT_TEMPLATE), is_embedding=True) as c:
        chat = c.post("/v1/chat/completions", json={"messages": [USER]})
        responses = c.post("/v1/responses", json={"input": "hi"})
    for r, route in ((chat, "chat completions"), (responses, "responses")):
        assert (r.status_code, r.json()) == (
            400,
            {
                "error": {
                    "message": "this server serves an embedding model: it answers /v1/embeddings and /encode, "
                    f"not {route}",
                    "type": "invalid_request_error",
                    "param": "model",
                    "code": None,
                }
            },
        )
