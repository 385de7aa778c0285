"""SGLang's and the OpenAI ecosystem's request shapes on a real stories260k server: every
SGLang 0.5.2 field accepted at its default, unsupported features refused by name on every
route, exact text (prompt context in the detokenizer, echo), stop trimming and no_stop_trim,
prompt logprobs with max_new_tokens 0, n > 1 (prefilled once, seeded streams), the info and
control routes (/get_server_info, /get_model_info, /flush_cache, /abort_request,
/v1/models/{id}) and the OpenAI templating and usage options."""

from __future__ import annotations

import json
import re
import threading
import time

import httpx
import pytest
from transformers import AutoTokenizer

from tests.conftest import CHAT_TEMPLATE as TEMPLATE
from tests.conftest import stories_chat_server, wait_idle
from tests.e2e.text_exact import _sse, check_all, expected_continuation

POOL = 4096

# Every field of SGLang 0.5.2's GenerateReqInput and SamplingParams, at its default.
SGLANG_DEFAULT_FIELDS = {
    "input_embeds": None,
    "image_data": None,
    "video_data": None,
    "audio_data": None,
    "rid": None,
    "return_logprob": None,
    "logprob_start_len": None,
    "top_logprobs_num": None,
    "token_ids_logprob": None,
    "return_text_in_logprobs": False,
    "stream": False,
    "log_metrics": True,
    "return_hidden_states": False,
    "modalities": None,
    "session_params": None,
    "lora_path": None,
    "lora_id": None,
    "custom_logit_processor": None,
    "bootstrap_host": None,
    "bootstrap_port": None,
    "bootstrap_room": None,
    "bootstrap_pair_key": None,
    "data_parallel_rank": None,
    "background": False,
    "conversation_id": None,
    "label": None,
    "priority": None,
    "return_bytes": False,
}
SGLANG_DEFAULT_SAMPLING = {
    "max_new_tokens": 128,
    "stop": None,
    "stop_token_ids": None,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "frequency_penalty": 0.0,
    "presence_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_new_tokens": 0,
    "n": 1,
    "json_schema": None,
    "regex": None,
    "ebnf": None,
    "structural_tag": None,
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "no_stop_trim": False,
    "custom_params": None,
    "stream_interval": None,
    "logit_bias": None,
}


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    yield from stories_chat_server(
        tmp_path_factory, stories_path, "stories-compat", POOL, ["--max-running-requests", "32"]
    )


@pytest.fixture(scope="module")
def tok(stories_path):
    tokenizer = AutoTokenizer.from_pretrained(stories_path)
    tokenizer.chat_template = TEMPLATE.read_text()  # as the server's --chat-template
    return tokenizer


def post(server, path: str, body) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=120)


def test_every_sglang_default_field_is_accepted(server):
    plain = post(
        server, "/generate", {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 12}}
    )
    full = post(
        server,
        "/generate",
        {
            "text": "Once upon a time",
            **SGLANG_DEFAULT_FIELDS,
            "sampling_params": {**SGLANG_DEFAULT_SAMPLING, "temperature": 0, "max_new_tokens": 12},
        },
    )
    assert plain.status_code == full.status_code == 200, full.text
    assert full.json()["output_ids"] == plain.json()["output_ids"]
    assert full.json()["text"] == plain.json()["text"]
    assert "input_token_logprobs" not in full.json()["meta_info"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("lora_path", "adapter-a"),
        ("lora_path", ["a"]),
        ("image_data", "http://x/y.png"),
        ("input_embeds", [[0.1]]),
        ("return_hidden_states", True),
        ("session_params", {"id": "s"}),
        ("custom_logit_processor", "x"),
        ("bootstrap_host", "h"),
        ("data_parallel_rank", 1),
        ("background", True),
        ("return_bytes", True),
        ("modalities", ["image"]),
    ],
)
def test_native_unsupported_fields_are_refused_by_name(server, field, value):
    r = post(server, "/generate", {"text": "hi", field: value})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert "not supported" in r.json()["error"]["message"] or "one data-parallel rank" in r.json()["error"]["message"]


@pytest.mark.parametrize(
    "field,value",
    [
        ("spaces_between_special_tokens", False),
        ("custom_params", {"a": 1}),
    ],
)
def test_native_unsupported_sampling_fields_are_refused_by_name(server, field, value):
    r = post(server, "/generate", {"text": "hi", "sampling_params": {field: value}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == f"sampling_params.{field}"


@pytest.mark.parametrize(
    "field,good,check,bad",
    [
        ("regex", "(ab|cd){2}", lambda text: re.fullmatch("(ab|cd){2}", text), "(ab"),
        ("json_schema", '{"type": "boolean"}', lambda text: json.loads(text) in (True, False), '{"type": 1}'),
        ("ebnf", 'root ::= "a" | "b"', lambda text: text in ("a", "b"), 'root ::= "a'),
        ("structural_tag", None, None, "{}"),
    ],
)
def test_native_grammar_fields_are_followed_or_refused_with_the_compilers_reason(server, field, good, check, bad):
    if good is not None:
        r = post(server, "/generate", {"text": "hi", "sampling_params": {field: good, "max_new_tokens": 16}})
        assert r.status_code == 200, r.text
        assert check(r.json()["text"]), r.json()
    for _ in range(2):  # the second answer comes from the compile cache
        r = post(server, "/generate", {"text": "hi", "sampling_params": {field: bad}})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == field
        assert r.json()["error"]["message"].startswith(f"{field}: invalid ")


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(
    "field,value",
    [
        ("guided_whitespace_pattern", r"\s*"),
        ("guided_choice", []),
        ("response_format", {"type": "json_schema", "json_schema": {"name": "x"}}),
        ("functions", [{"name": "f"}]),
        ("use_beam_search", True),
        ("lora_path", "a"),
        ("spaces_between_special_tokens", False),
        ("prompt_logprobs", 1),
        ("allowed_token_ids", [1, 2]),
        ("length_penalty", 0.5),
        ("bogus_field", 1),
    ],
)
def test_openai_unsupported_fields_are_refused_by_name(server, route, field, value):
    body = {"max_tokens": 2, field: value}
    body |= {"prompt": "hi"} if route == "/v1/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    r = post(server, route, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == field and err["type"] == "invalid_request_error"
    if field == "bogus_field":
        assert err["message"] == "Unrecognized request argument supplied: bogus_field"


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_openai_harmless_fields_are_accepted(server, route):
    body = {
        "max_tokens": 4,
        "temperature": 0,
        "user": "u1",
        "metadata": {"k": "v"},
        "store": False,
        "service_tier": "auto",
        "regex": None,
        "json_schema": None,
        "lora_path": None,
        "rid": None,
        "return_hidden_states": False,
        "guided_decoding_backend": "xgrammar",
        "stream_options": None,
    }
    plain = {"max_tokens": 4, "temperature": 0}
    if route == "/v1/completions":
        body |= {"prompt": "Lily", "best_of": 1}
        plain |= {"prompt": "Lily"}
    else:
        body |= {
            "messages": [{"role": "user", "content": "Lily"}],
            "tool_choice": "none",
            "parallel_tool_calls": True,
            "separate_reasoning": True,
        }
        plain |= {"messages": [{"role": "user", "content": "Lily"}]}
    r, p = post(server, route, body), post(server, route, plain)
    assert r.status_code == p.status_code == 200, r.text
    assert r.json()["choices"] == p.json()["choices"]


def test_text_equals_decode_of_prompt_plus_output(server, tok):
    check_all(server.base_url, tok, max_new=12)


def test_first_output_token_keeps_its_space(server):
    r = post(
        server, "/generate", {"text": "Once upon a time,", "sampling_params": {"temperature": 0, "max_new_tokens": 1}}
    )
    assert r.json()["text"] == " there"
    r = post(server, "/v1/completions", {"prompt": "Once upon a", "max_tokens": 1, "temperature": 0, "echo": True})
    assert r.json()["choices"][0]["text"] == "Once upon a time"


def test_stop_token_is_trimmed_unless_no_stop_trim(server, tok):
    ids = tok.encode("Once upon a time,")
    out = post(server, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6}})
    stop_id = out.json()["output_ids"][3]
    cut = out.json()["output_ids"][:4]
    sp = {"temperature": 0, "max_new_tokens": 6, "stop_token_ids": [stop_id]}
    trimmed = post(server, "/generate", {"input_ids": ids, "sampling_params": sp}).json()
    assert trimmed["output_ids"] == cut
    assert trimmed["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert trimmed["text"] == expected_continuation(tok, ids, cut[:-1])
    kept = post(server, "/generate", {"input_ids": ids, "sampling_params": {**sp, "no_stop_trim": True}}).json()
    assert kept["text"] == expected_continuation(tok, ids, cut)
    # the OpenAI spelling, vLLM's include_stop_str_in_output, on a stop string
    body = {"prompt": ids, "max_tokens": 6, "temperature": 0, "stop": [" was"]}
    full = expected_continuation(tok, ids, out.json()["output_ids"])
    assert " was" in full
    r = post(server, "/v1/completions", body).json()
    assert r["choices"][0]["text"] == full[: full.index(" was")]
    r = post(server, "/v1/completions", {**body, "include_stop_str_in_output": True}).json()
    assert r["choices"][0]["text"] == full[: full.index(" was") + 4]
    r = post(
        server,
        "/generate",
        {
            "input_ids": ids,
            "sampling_params": {"temperature": 0, "max_new_tokens": 6, "stop": " was", "no_stop_trim": True},
        },
    ).json()
    assert r["text"] == full[: full.index(" was") + 4]


def test_prompt_logprobs_with_max_new_tokens_zero(server):
    body = {
        "text": "Once upon a time there was",
        "return_logprob": True,
        "logprob_start_len": 2,
        "return_text_in_logprobs": True,
    }
    zero = post(server, "/generate", {**body, "sampling_params": {"max_new_tokens": 0}}).json()
    one = post(server, "/generate", {**body, "sampling_params": {"max_new_tokens": 1, "temperature": 0}}).json()
    assert zero["output_ids"] == [] and zero["text"] == ""
    assert zero["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    assert zero["meta_info"]["output_token_logprobs"] == []
    assert zero["meta_info"]["input_token_logprobs"] == one["meta_info"]["input_token_logprobs"]
    assert [e[2] for e in zero["meta_info"]["input_token_logprobs"]] == [" upon", " a", " time", " there", " was"]
    # max_new_tokens 0 caches the prefix (what SGLang's frontend relies on)
    post(server, "/generate", {"text": "Lily and Ben found a red kite", "sampling_params": {"max_new_tokens": 0}})
    again = post(
        server, "/generate", {"text": "Lily and Ben found a red kite", "sampling_params": {"max_new_tokens": 1}}
    )
    assert again.json()["meta_info"]["cached_tokens"] == again.json()["meta_info"]["prompt_tokens"] - 1


def _n_choices_ok(choices: list[dict], n: int) -> None:
    assert sorted(c["index"] for c in choices) == list(range(n))
    assert all(c["finish_reason"] == "length" for c in choices)


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n4_non_streamed(server, route):
    prompt = f"Tom and his dog played near the big {route[4:8]} tree"
    body = {"max_tokens": 5, "n": 4, "temperature": 1.0, "seed": 7}
    body |= {"prompt": prompt} if "chat" not in route else {"messages": [{"role": "user", "content": prompt}]}
    r = post(server, route, body).json()
    _n_choices_ok(r["choices"], 4)
    usage = r["usage"]
    assert usage["completion_tokens"] == 20
    assert usage["total_tokens"] == usage["prompt_tokens"] + 20
    # the prompt was prefilled once: every sample found all but its last token cached
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    one = post(server, route, {**body, "n": 1}).json()
    assert one["usage"]["prompt_tokens"] == usage["prompt_tokens"]
    texts = [c.get("text", c.get("message", {}).get("content")) for c in r["choices"]]
    # seeded: the same request gives the same samples; sample 0 equals the n=1 request
    again = post(server, route, body).json()
    assert [c.get("text", c.get("message", {}).get("content")) for c in again["choices"]] == texts
    assert texts[0] == one["choices"][0].get("text", one["choices"][0].get("message", {}).get("content"))
    assert len(set(texts)) > 1


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_n4_streamed(server, route):
    prompt = f"Sue found a shiny {route[4:8]} stone by the river"
    body = {
        "max_tokens": 5,
        "n": 4,
        "temperature": 1.0,
        "seed": 11,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    body |= {"prompt": prompt} if "chat" not in route else {"messages": [{"role": "user", "content": prompt}]}
    chunks = _sse(server.base_url + route, body)
    finishes = [c["choices"][0] for c in chunks if c["choices"] and c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finishes) == [0, 1, 2, 3]
    usage = chunks[-1]["usage"]
    assert chunks[-1]["choices"] == []
    assert usage["completion_tokens"] == 20
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    streamed = [
        "".join(
            (c["choices"][0].get("text") or (c["choices"][0].get("delta") or {}).get("content") or "")
            for c in chunks
            if c["choices"] and c["choices"][0]["index"] == i
        )
        for i in range(4)
    ]
    whole = post(server, route, {**body, "stream": False, "stream_options": None}).json()
    assert streamed == [c.get("text", c.get("message", {}).get("content")) for c in whole["choices"]]


def test_native_n(server):
    r = post(
        server,
        "/generate",
        {"text": "Ben had a", "sampling_params": {"n": 3, "max_new_tokens": 4, "temperature": 1.0, "seed": 5}},
    ).json()
    assert isinstance(r, list) and [o["index"] for o in r] == [0, 1, 2]
    assert all(o["meta_info"]["completion_tokens"] == 4 for o in r)
    events = _sse(
        server.base_url + "/generate",
        {
            "text": "Ben had a",
            "stream": True,
            "sampling_params": {"n": 3, "max_new_tokens": 4, "temperature": 1.0, "seed": 5},
        },
    )
    last = {e["index"]: e for e in events}
    assert [last[i]["text"] for i in range(3)] == [o["text"] for o in r]
    assert all(last[i]["meta_info"]["finish_reason"]["type"] == "length" for i in range(3))


def test_best_of_must_equal_n(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "n": 2, "best_of": 3, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "best_of"
    r = post(server, "/v1/completions", {"prompt": "hi", "n": 2, "best_of": 2, "max_tokens": 1})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2


def test_flush_cache(server):
    body = {"text": "The little red hen baked some bread", "sampling_params": {"max_new_tokens": 2}}
    post(server, "/generate", body)
    assert post(server, "/generate", body).json()["meta_info"]["cached_tokens"] > 0
    wait_idle(server.base_url)
    for method in ("POST", "GET"):
        r = httpx.request(method, server.base_url + "/flush_cache", timeout=30)
        assert r.status_code == 200, r.text
    info = httpx.get(server.base_url + "/get_server_info").json()
    assert info["kv_evictable_slots"] == 0 and info["kv_free_slots"] == POOL
    assert post(server, "/generate", body).json()["meta_info"]["cached_tokens"] == 0
    # while a request runs: 400, nothing flushed
    stream = threading.Thread(
        target=lambda: _sse(
            server.base_url + "/generate",
            {"text": "Once", "stream": True, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}},
        )
    )
    stream.start()
    try:
        deadline = time.monotonic() + 30
        while httpx.get(server.base_url + "/get_server_info").json()["num_running_reqs"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(server.base_url + "/flush_cache", timeout=30)
        assert r.status_code == 400
        assert "while requests are queued or running" in r.json()["error"]["message"]
    finally:
        stream.join()


def test_abort_request_ends_a_stream_and_frees_its_kv(server):
    wait_idle(server.base_url)
    events: list[dict] = []
    body = {
        "text": "Once upon a time",
        "rid": "abort-me",
        "stream": True,
        "sampling_params": {"max_new_tokens": 500, "ignore_eos": True},
    }

    def read() -> None:
        with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))

    t = threading.Thread(target=read)
    t.start()
    deadline = time.monotonic() + 30
    while len(events) < 3:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    r = post(server, "/abort_request", {"rid": "abort-me"})
    assert r.status_code == 200 and r.json()["num_aborted"] == 1
    t.join(timeout=30)
    assert not t.is_alive()
    last = events[-1]["meta_info"]
    assert last["finish_reason"]["type"] == "abort"
    assert last["completion_tokens"] < 500
    info = wait_idle(server.base_url)
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL
    # abort_all, and an unknown rid
    assert post(server, "/abort_request", {"rid": "nobody"}).json()["num_aborted"] == 0
    assert post(server, "/abort_request", {"abort_all": True}).status_code == 200
    assert post(server, "/abort_request", {}).status_code == 400


def test_info_routes_in_sglang_shape(server, stories_path):
    info = httpx.get(server.base_url + "/get_server_info").json()
    assert info["model_path"] == str(stories_path)
    assert info["max_total_num_tokens"] == POOL and info["status"] == "ready"
    assert len(info["internal_states"]) == 1
    state = info["internal_states"][0]
    assert state["memory_usage"]["token_capacity"] == POOL
    assert "avg_spec_accept_length" not in state and isinstance(state["last_gen_throughput"], float)
    assert info["version"]
    model = httpx.get(server.base_url + "/get_model_info").json()
    assert model["model_path"] == str(stories_path) and model["is_generation"] is True
    assert model["weight_version"] == "default" and model["preferred_sampling_params"] is None
    for name in ("stories260k", "default", str(stories_path)):
        r = httpx.get(server.base_url + f"/v1/models/{name}")
        assert r.status_code == 200 and r.json()["id"] == "stories260k"
    r = httpx.get(server.base_url + "/v1/models/gpt-4")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"


def test_chat_templating_options(server, tok):
    messages = [{"role": "user", "content": "Tell me a story"}, {"role": "assistant", "content": "Once upon a"}]

    def ids_for(**kwargs) -> list[int]:
        return tok.encode(tok.apply_chat_template(messages, tokenize=False, **kwargs), add_special_tokens=False)

    cases = [
        (
            {"continue_final_message": True, "add_generation_prompt": False},
            {"continue_final_message": True, "add_generation_prompt": False},
        ),
        ({"add_generation_prompt": False}, {"add_generation_prompt": False}),
        ({"chat_template_kwargs": {"greeting": "Hello!"}}, {"add_generation_prompt": True, "greeting": "Hello!"}),
    ]
    for fields, kwargs in cases:
        ids = ids_for(**kwargs)
        want_ids = post(
            server, "/generate", {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 6}}
        ).json()["output_ids"]
        r = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 6, "temperature": 0, **fields})
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == expected_continuation(tok, ids, want_ids), fields
        assert r.json()["usage"]["prompt_tokens"] == len(ids)
    r = post(server, "/v1/chat/completions", {"messages": messages, "continue_final_message": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    r = post(server, "/v1/chat/completions", {"messages": messages, "chat_template_kwargs": {"tokenize": True}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"


def test_continuous_usage_stats(server):
    body = {
        "prompt": "Lily",
        "max_tokens": 5,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"continuous_usage_stats": True, "include_usage": True},
    }
    chunks = _sse(server.base_url + "/v1/completions", body)
    token_chunks = [c for c in chunks if c["choices"]]
    assert all(c["usage"]["prompt_tokens"] == 2 for c in chunks)
    counts = [c["usage"]["completion_tokens"] for c in token_chunks]
    assert counts == sorted(counts) and counts[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5


def test_stream_interval(server):
    body = {
        "text": "Once upon a time",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 9, "ignore_eos": True, "stream_interval": 4},
    }
    events = _sse(server.base_url + "/generate", body)
    assert [e["meta_info"]["completion_tokens"] for e in events] == [4, 8, 9]
    whole = post(server, "/generate", {**body, "stream": False}).json()
    assert events[-1]["text"] == whole["text"]
    chunks = _sse(
        server.base_url + "/v1/completions",
        {"prompt": "Once upon a time", "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True},
    )
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def _stream_in_thread(server, path: str, body: dict, events: list) -> threading.Thread:
    def read() -> None:
        with httpx.stream("POST", server.base_url + path, json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    events.append(json.loads(line[6:]))

    t = threading.Thread(target=read)
    t.start()
    return t


def test_abort_by_rid_reaches_derived_requests(server):
    """A rid also names what is derived from it: the prompts of a batch, the n samples."""
    wait_idle(server.base_url)
    results: dict[str, httpx.Response] = {}
    bodies = {
        "batch": ("/v1/completions", {"prompt": ["Tom", "Lily"], "rid": "rr", "max_tokens": 400, "ignore_eos": True}),
        "native": (
            "/generate",
            {"text": ["Tom", "Lily"], "rid": "gg", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}},
        ),
        "n": (
            "/generate",
            {"text": "Sue", "rid": "nn", "sampling_params": {"n": 2, "max_new_tokens": 400, "ignore_eos": True}},
        ),
    }
    threads = [
        threading.Thread(target=lambda k=k, p=p, b=b: results.__setitem__(k, post(server, p, b)))
        for k, (p, b) in bodies.items()
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while httpx.get(server.base_url + "/get_server_info").json()["num_running_reqs"] < 6:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    # a second n > 1 request under a running one's rid is refused and changes nothing
    dup = post(server, "/generate", {"text": "Sue", "rid": "nn", "sampling_params": {"n": 2}})
    assert dup.status_code == 400 and "already running" in dup.json()["error"]["message"]
    assert [post(server, "/abort_request", {"rid": rid}).json()["num_aborted"] for rid in ("rr", "gg", "nn")] == [
        2,
        2,
        2,
    ]
    for t in threads:
        t.join(timeout=60)
    assert [c["finish_reason"] for c in results["batch"].json()["choices"]] == ["abort", "abort"]
    assert [o["meta_info"]["finish_reason"]["type"] for o in results["native"].json()] == ["abort"] * 2
    assert [o["meta_info"]["finish_reason"]["type"] for o in results["n"].json()] == ["abort"] * 2
    wait_idle(server.base_url)


def test_openai_nulls_mean_defaults_and_more_options(server):
    plain = post(server, "/v1/completions", {"prompt": "Lily", "max_tokens": 4, "temperature": 0}).json()
    nulls = post(
        server,
        "/v1/completions",
        {
            "prompt": "Lily",
            "max_tokens": 4,
            "temperature": 0,
            "top_p": None,
            "n": None,
            "presence_penalty": None,
            "frequency_penalty": None,
            "stream": None,
            "logprobs": None,
            "seed": None,
            "stop": None,
            "echo": None,
            "best_of": None,
            "user": None,
        },
    )
    assert nulls.status_code == 200, nulls.text
    assert nulls.json()["choices"] == plain["choices"]
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "temperature": None,
            "logprobs": None,
            "tools": None,
        },
    )
    assert chat.status_code == 200, chat.text
    r = post(
        server,
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "Hi"}], "chat_template_kwargs": {"chat_template": "x"}},
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    r = post(server, "/generate", {"text": "Hi", "priority": 0, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    # priority scheduling is off here: a priority is ignored, as in SGLang (it orders
    # requests, it never changes an output); a non-integer one is still refused
    r = post(server, "/generate", {"text": "Hi", "priority": 7, "sampling_params": {"max_new_tokens": 1}})
    assert r.status_code == 200, r.text
    r = post(server, "/generate", {"text": "Hi", "priority": "high"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"
    r = post(server, "/generate", {"text": ["Hi", "Yo"], "token_ids_logprob": [[1]], "return_logprob": True})
    assert r.status_code == 400 and "token_ids_logprob" in r.json()["error"]["message"]
    # stream_interval on the OpenAI routes
    chunks = _sse(
        server.base_url + "/v1/completions",
        {"prompt": "Lily", "max_tokens": 9, "temperature": 0, "ignore_eos": True, "stream": True, "stream_interval": 4},
    )
    whole = post(server, "/v1/completions", {"prompt": "Lily", "max_tokens": 9, "temperature": 0, "ignore_eos": True})
    assert len(chunks) == 3
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole.json()["choices"][0]["text"]


def test_echo_logprob_offsets_point_into_the_text(server):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "temperature": 0,
        "echo": True,
        "logprobs": 1,
        "ignore_eos": True,
    }
    r = post(server, "/v1/completions", body).json()["choices"][0]
    lp = r["logprobs"]
    assert lp["tokens"][:5] == ["<s>", " Once", " upon", " a", " time"]
    assert lp["text_offset"][:5] == [0, 0, 4, 9, 11]  # "Once upon a time": where each token starts
    text = r["text"]
    for tok, off in zip(lp["tokens"][5:], lp["text_offset"][5:]):
        assert text[off : off + len(tok)] == tok
    streamed = _sse(server.base_url + "/v1/completions", {**body, "stream": True})
    offsets = [
        o
        for c in streamed
        if c["choices"] and c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    assert offsets == lp["text_offset"]
    # text held back for a possible stop string does not shift the offsets
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 8,
        "temperature": 0,
        "logprobs": 1,
        "stop": [", there was a dragon"],
        "ignore_eos": True,
    }
    whole = post(server, "/v1/completions", body).json()["choices"][0]["logprobs"]["text_offset"]
    streamed = _sse(server.base_url + "/v1/completions", {**body, "stream": True})
    assert [
        o
        for c in streamed
        if c["choices"] and c["choices"][0]["logprobs"]
        for o in c["choices"][0]["logprobs"]["text_offset"]
    ] == whole


def test_continuous_usage_counts_the_prompt_from_the_first_chunk(server):
    chunks = _sse(
        server.base_url + "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "n": 2,
            "stream": True,
            "stream_options": {"continuous_usage_stats": True},
        },
    )
    prompt_tokens = {c["usage"]["prompt_tokens"] for c in chunks}
    assert len(prompt_tokens) == 1 and prompt_tokens.pop() > 0


def test_router_facing_routes(server, stories_path):
    r = post(server, "/generate", {"text": "Lily", "model": "stories260k", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    for name in ("default", str(stories_path)):
        assert (
            post(
                server, "/generate", {"text": "Lily", "model": name, "sampling_params": {"max_new_tokens": 1}}
            ).status_code
            == 200
        )
    r = post(server, "/generate", {"text": "Lily", "model": "gpt-4"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    assert httpx.get(server.base_url + "/model_info").json() == httpx.get(server.base_url + "/get_model_info").json()
    info = httpx.get(server.base_url + "/server_info").json()
    assert info["internal_states"] and info["max_total_num_tokens"] == POOL
    wait_idle(server.base_url)
    load = httpx.get(server.base_url + "/get_load").json()
    assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]


def test_http2_probe_is_refused_in_http2_terms(server):
    """An HTTP/2 prior-knowledge client (sglang-router probing for gRPC) gets SETTINGS +
    GOAWAY(HTTP_1_1_REQUIRED), not a logged parse error."""
    import socket
    import struct

    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + b"\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        data = b""
        while chunk := sock.recv(4096):
            data += chunk
    settings, rest = data[:9], data[9:]
    assert settings == b"\x00\x00\x00\x04\x00\x00\x00\x00\x00"  # empty SETTINGS on stream 0
    length = int.from_bytes(rest[:3], "big")
    assert rest[3] == 0x7 and rest[5:9] == b"\0\0\0\0"  # GOAWAY on stream 0
    last_stream, code = struct.unpack(">II", rest[9:17])
    assert (last_stream, code) == (0, 0xD) and rest[17 : 9 + length] == b"pyserve speaks HTTP/1.1"
    assert "Invalid HTTP request" not in server.log()
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_parameters_that_leave_nothing_to_sample_fail_only_their_request(server, tok):
    """A request whose own bias / penalties / bans leave no token to draw gets a 400 (an SSE
    error event once streaming), and the requests batched with it are untouched."""
    r = post(server, "/generate", {"text": "a", "sampling_params": {"logit_bias": {"1": 1e300}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params"
    assert "no token to sample" in r.json()["error"]["message"]
    r = httpx.post(
        server.base_url + "/generate",
        headers={"content-type": "application/json"},
        content=b'{"text": "a", "sampling_params": {"logit_bias": {"1": 1e400}}}',
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "sampling_params.logit_bias"
    r = post(
        server, "/generate", {"text": "a", "sampling_params": {"min_new_tokens": 2, "stop_token_ids": list(range(512))}}
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_new_tokens"
    # greedy, a grammar of 32 digits then "x", and every token holding an "x" biased to -inf
    # (-1e300 is -inf in float32): output token 32 has nothing left. Penalties come before the
    # bias (SGLang's order), so a penalty cannot push a biased logit over the edge.
    x_ids = [i for i in range(tok.vocab_size) if "x" in tok.decode([i])]
    assert x_ids
    bad = {
        "input_ids": [1],
        "stream": True,
        "sampling_params": {
            "temperature": 0,
            "max_new_tokens": 60,
            "regex": "[0-9]{32}x",
            "logit_bias": {str(t): -1e300 for t in x_ids},
        },
    }
    good = {
        "text": "Once upon a time",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 120, "ignore_eos": True},
    }
    want = post(server, "/generate", {**good, "stream": False}).json()["text"]
    results: dict[str, list] = {"bad": [], "good0": [], "good1": []}
    threads = [
        _stream_in_thread(server, "/generate", good, results["good0"]),
        _stream_in_thread(server, "/generate", bad, results["bad"]),
        _stream_in_thread(server, "/generate", good, results["good1"]),
    ]
    for t in threads:
        t.join(timeout=120)
    err = results["bad"][-1]["error"]
    assert err["code"] == 400 and err["param"] == "sampling_params" and "output token 32" in err["message"]
    assert len(results["bad"]) == 33  # 32 chunks, then the error event
    for key in ("good0", "good1"):
        assert results[key][-1]["text"] == want
        assert results[key][-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 120}
    wait_idle(server.base_url)


def test_abort_names_only_what_it_derived(server):
    events: list[dict] = []
    t = _stream_in_thread(
        server,
        "/generate",
        {
            "text": "Lily",
            "rid": "job-2",
            "stream": True,
            "sampling_params": {"max_new_tokens": 300, "ignore_eos": True},
        },
        events,
    )
    deadline = time.monotonic() + 30
    while not events:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert post(server, "/abort_request", {"rid": "job"}).json()["num_aborted"] == 0
    assert post(server, "/abort_request", {"rid": ""}).json()["num_aborted"] == 0
    t.join(timeout=60)
    assert events[-1]["meta_info"]["finish_reason"]["type"] == "length"


def test_error_bodies_stay_small_and_disconnects_are_quiet(server):
    r = post(server, "/generate", {"text": "a", "k" * 5000: 1})
    assert r.status_code == 400 and len(r.content) < 1400
    assert r.json()["error"]["param"].endswith("(4800 more characters)")
    import socket

    with socket.create_connection(("127.0.0.1", server.port)) as sock:  # a body cut short
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b'Content-Length: 100\r\n\r\n{"text": "Once upon'
        )
    time.sleep(0.5)
    assert httpx.get(server.base_url + "/health").status_code == 200
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]
