"""End to end on a real server with the real stories260k weights: exact greedy tokens (KV page
sizes 1 and 16), page-aligned prefix reuse, streaming equals non-streaming under concurrency,
errors, and KV returned after a disconnect. Each server's teardown checks, once idle, that
every KV slot is free or evictable (no leak)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import socket
import time

import httpx
import pytest

from tests.conftest import start_server, wait_idle

POOL_TOKENS = 4096


def _server(tmp_path_factory, stories_path, page_size: int):
    srv = start_server(
        tmp_path_factory,
        f"stories-page{page_size}",
        [
            "--model-path",
            str(stories_path),
            "--max-total-tokens",
            str(POOL_TOKENS),
            "--max-running-requests",
            "32",
            "--stats-interval-s",
            "1",
            "--page-size",
            str(page_size),
        ],
    )
    try:
        yield srv
        assert_no_kv_leak(srv)
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    yield from _server(tmp_path_factory, stories_path, 1)


@pytest.fixture(scope="module")
def server_page16(tmp_path_factory, stories_path):
    yield from _server(tmp_path_factory, stories_path, 16)


@pytest.fixture(params=["server", "server_page16"])
def any_server(request):
    return request.getfixturevalue(request.param)


def assert_no_kv_leak(server) -> None:
    info = wait_idle(server.base_url)
    assert info["kv_free_slots"] + info["kv_evictable_slots"] == info["kv_total_slots"] == POOL_TOKENS


def post(server, path: str, body, timeout: float = 120) -> httpx.Response:
    return httpx.post(server.base_url + path, json=body, timeout=timeout)


def test_greedy_equals_hf_reference(any_server, stories_reference):
    server = any_server
    assert len(stories_reference) == 5
    for case in stories_reference:
        r = post(
            server,
            "/generate",
            {
                "input_ids": case["input_ids"],
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": case["max_new_tokens"],
                    "ignore_eos": case["ignore_eos"],
                },
            },
        )
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["output_ids"] == case["output_ids"], case["prompt"]
        assert out["meta_info"]["completion_tokens"] == len(case["output_ids"])
        assert out["meta_info"]["prompt_tokens"] == len(case["input_ids"])
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": case["max_new_tokens"]}


def test_prefix_reuse_is_page_aligned(any_server, stories_reference):
    page_size = httpx.get(any_server.base_url + "/get_server_info").json()["page_size"]
    prefix = list(range(5, 105))  # with the leading 1: a 101-token shared prefix
    for last in (7, 9):
        r = post(
            any_server,
            "/generate",
            {"input_ids": [1] + prefix + [last], "sampling_params": {"max_new_tokens": 2, "temperature": 0}},
        )
    assert r.json()["meta_info"]["cached_tokens"] == {1: 101, 16: 96}[page_size]
    case = stories_reference[1]
    body = {
        "input_ids": case["input_ids"],
        "sampling_params": {"temperature": 0, "max_new_tokens": case["max_new_tokens"], "ignore_eos": True},
    }
    first, again = post(any_server, "/generate", body).json(), post(any_server, "/generate", body).json()
    assert first["output_ids"] == again["output_ids"] == case["output_ids"]
    assert again["meta_info"]["cached_tokens"] == (len(case["input_ids"]) - 1) // page_size * page_size


def test_text_prompt_batch_equals_single(server, stories_reference):
    prompts = [c["prompt"] for c in stories_reference if c["prompt"]][:3]
    params = {"temperature": 0, "max_new_tokens": 20, "ignore_eos": True}
    batch = post(server, "/generate", {"text": prompts, "sampling_params": params}).json()
    assert len(batch) == 3
    for prompt, out in zip(prompts, batch):
        single = post(server, "/generate", {"text": prompt, "sampling_params": params}).json()
        assert out["output_ids"] == single["output_ids"]
        assert out["text"] == single["text"]


def _stream_completion(server, prompt: str, max_tokens: int) -> tuple[str, str | None]:
    text, reason = "", None
    with httpx.stream(
        "POST",
        server.base_url + "/v1/completions",
        timeout=120,
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True},
    ) as r:
        assert r.status_code == 200
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    for ln in lines[:-1]:
        chunk = json.loads(ln.removeprefix("data: "))
        text += chunk["choices"][0]["text"]
        reason = chunk["choices"][0]["finish_reason"] or reason
    return text, reason


def test_16_concurrent_streams_equal_non_streamed(server):
    prompts = [
        f"Once upon a time, there was a {w}"
        for w in (
            "cat",
            "dog",
            "girl",
            "boy",
            "tree",
            "bird",
            "ball",
            "car",
            "fish",
            "king",
            "queen",
            "frog",
            "sun",
            "moon",
            "cake",
            "box",
        )
    ]
    with cf.ThreadPoolExecutor(16) as pool:
        streamed = list(pool.map(lambda p: _stream_completion(server, p, 48), prompts))
    for prompt, (text, reason) in zip(prompts, streamed):
        full = post(server, "/v1/completions", {"prompt": prompt, "max_tokens": 48, "temperature": 0}).json()
        assert text == full["choices"][0]["text"]
        assert reason == full["choices"][0]["finish_reason"]
        assert full["usage"]["completion_tokens"] <= 48
    assert len({t for t, _ in streamed}) > 1


def test_generate_stream_is_sse_with_cumulative_text(server):
    body = {
        "text": "Lily had a",
        "stream": True,
        "sampling_params": {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True},
    }
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as r:
        lines = [ln for ln in r.iter_lines() if ln]
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(ln.removeprefix("data: ")) for ln in lines[:-1]]
    final = post(server, "/generate", {**body, "stream": False}).json()
    assert chunks[-1]["text"] == final["text"]
    assert chunks[-1]["output_ids"] == final["output_ids"]
    assert [len(c["output_ids"]) for c in chunks] == sorted(len(c["output_ids"]) for c in chunks)
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 12}


@pytest.mark.parametrize(
    "raw, status, param",
    [
        (b"{not json", 400, None),
        (
            json.dumps({"text": "hi", "sampling_params": {"max_new_tokens": -1}}).encode(),
            400,
            "sampling_params.max_new_tokens",
        ),
        (
            json.dumps({"text": "hi", "sampling_params": {"temperature": "hot"}}).encode(),
            400,
            "sampling_params.temperature",
        ),
        (json.dumps({"text": "word " * 600}).encode(), 400, "prompt"),
        (json.dumps({"input_ids": [1, 99999]}).encode(), 400, "input_ids"),
        (json.dumps({"input_ids": [1, 2**70]}).encode(), 400, "input_ids"),
        (json.dumps({"input_ids": [3, -1, 4]}).encode(), 400, "input_ids"),
        (json.dumps({"sampling_params": {}}).encode(), 400, None),
        (b'{"text": "a", "sampling_params": {"seed": 18446744073709551616}}', 400, "sampling_params.seed"),
        (b'{"text": "a", "sampling_params": {"temperature": Infinity}}', 400, None),
        (b'{"text": "\\ud800 hi"}', 400, "text"),
        (b"[" * 100000 + b"]" * 100000, 400, None),
        (b'{"input_ids": [true]}', 400, "input_ids.0"),
        (b'{"text": "a", "sampling_params": {"max_new_tokens": "2"}}', 400, "sampling_params.max_new_tokens"),
        (b'{"text": "a", "sampling_params": {"stop_token_ids": [-1]}}', 400, "sampling_params.stop_token_ids.0"),
        (b'{"text": ["a", "b"], "rid": ["x", "x"]}', 400, None),
    ],
)
def test_bad_requests_get_error_objects(server, raw, status, param):
    r = httpx.post(server.base_url + "/generate", content=raw, timeout=30, headers={"content-type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert err["message"]
    ok = post(server, "/generate", {"text": "Tom", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3


def test_openai_echo_of_invalid_ids_and_unsupported_fields(server):
    r = post(server, "/v1/completions", {"prompt": [-5], "echo": True, "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input_ids"
    r = httpx.post(
        server.base_url + "/v1/completions",
        timeout=30,
        headers={"content-type": "application/json"},
        content=json.dumps({"prompt": "\ud83d x", "echo": True, "max_tokens": 2}),
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    for field, value in (
        ("tools", [{"type": "function"}]),
        ("logit_bias", {"99999": 1}),
        ("best_of", 2),
        ("response_format", {"type": "json_schema"}),
    ):
        r = post(server, "/v1/completions", {"prompt": "hi", field: value})
        assert r.status_code == 400 and r.json()["error"]["param"] == field
    r = post(server, "/v1/completions", {"prompt": [5, 6], "echo": True, "max_tokens": 2, "temperature": 0})
    assert r.status_code == 200


def test_extreme_sampling_values_do_not_fail_the_batch(server):
    good = {"text": "Once upon a time", "sampling_params": {"temperature": 0, "max_new_tokens": 30, "ignore_eos": True}}
    bad = [
        {"text": "Hi", "sampling_params": {"temperature": 1e-45, "max_new_tokens": 8, "ignore_eos": True}},
        {
            "text": "Hi",
            "sampling_params": {"temperature": 0.7, "top_k": 2**70, "max_new_tokens": 8, "ignore_eos": True},
        },
    ]
    expected = post(server, "/generate", good).json()["output_ids"]
    with cf.ThreadPoolExecutor(6) as pool:
        outs = list(pool.map(lambda b: post(server, "/generate", b), [good] * 4 + bad))
    assert [o.status_code for o in outs] == [200] * 6
    for o in outs[:4]:
        assert o.json()["output_ids"] == expected
    for o in outs[4:]:
        assert o.json()["meta_info"]["finish_reason"] == {"type": "length", "length": 8}
    tiny = outs[4].json()["output_ids"]
    greedy = post(server, "/generate", {**bad[0], "sampling_params": {**bad[0]["sampling_params"], "temperature": 0}})
    assert tiny == greedy.json()["output_ids"]


def test_rid_reused_after_disconnect_can_still_be_aborted(server):
    wait_idle(server.base_url)
    long_body = json.dumps({"input_ids": [1] + [300] * 400, "rid": "R2", "sampling_params": {"max_new_tokens": 5}})
    sock = _raw_post(server.port, "/generate", long_body)
    time.sleep(0.05)
    sock.close()
    body = json.dumps(
        {
            "input_ids": [1, 100, 200],
            "rid": "R2",
            "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True},
        }
    )
    for _ in range(500):  # until the server has noticed the first client left (then the rid is free)
        with _raw_post(server.port, "/generate", body) as sock2:
            received = b""
            while received.count(b"data: ") < 2 and not received.endswith(b"}}"):
                chunk = sock2.recv(4096)
                assert chunk, received
                received += chunk
        if b" 400 " not in received[:13]:
            break
        assert b"already running" in received
        time.sleep(0.001)
    after = wait_idle(server.base_url)
    assert after["kv_free_slots"] + after["kv_evictable_slots"] == POOL_TOKENS


def test_openai_errors(server):
    r = post(server, "/v1/completions", {"prompt": "hi", "temperature": "hot"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "temperature"
    r = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "chat template" in r.json()["error"]["message"]
    r = post(server, "/v1/completions", {"prompt": "hi", "n": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    r = httpx.get(server.base_url + "/nope")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    r = post(server, "/generate", {"sampling_params": {}})
    assert r.status_code == 400 and r.json()["error"]["message"] == "give exactly one of 'text' and 'input_ids'"
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 1}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    ):
        r = post(server, path, dict(body, model="gpt-4"))
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert r.json()["error"]["param"] == "model" and "stories260k" in r.json()["error"]["message"]
    for model in ("default", "stories260k", None):
        r = post(server, "/v1/completions", {"prompt": "hi", "max_tokens": 1, "model": model})
        assert r.status_code == 200 and r.json()["model"] == "stories260k"


def _raw_post(port: int, path: str, body: str) -> socket.socket:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.sendall(
        (
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n{body}"
        ).encode()
    )
    return sock


def test_disconnect_while_waiting_for_non_streamed_reply_returns_kv(server):
    idle = wait_idle(server.base_url)
    body = json.dumps({"text": "The big tree", "sampling_params": {"max_new_tokens": 450, "ignore_eos": True}})
    sock = _raw_post(server.port, "/generate", body)
    deadline = time.monotonic() + 10
    while httpx.get(server.base_url + "/get_server_info").json()["num_running_reqs"] == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sock.close()
    after = wait_idle(server.base_url)
    assert after["kv_free_slots"] == idle["kv_free_slots"]
    assert after["num_generated_tokens"] - idle["num_generated_tokens"] < 450


def test_disconnect_mid_stream_returns_kv(server):
    idle = wait_idle(server.base_url)
    assert idle["kv_total_slots"] == POOL_TOKENS
    body = json.dumps(
        {
            "text": "The little dog ran",
            "stream": True,
            "sampling_params": {"max_new_tokens": 400, "ignore_eos": True, "temperature": 0},
        }
    )
    with _raw_post(server.port, "/generate", body) as sock:
        received = b""
        while received.count(b"data: ") < 3:
            chunk = sock.recv(4096)
            assert chunk, received
            received += chunk
        mid = httpx.get(server.base_url + "/get_server_info").json()
        assert mid["num_running_reqs"] == 1
        assert mid["kv_free_slots"] < idle["kv_free_slots"]
    after = wait_idle(server.base_url)
    assert after["kv_free_slots"] == idle["kv_free_slots"]


def test_info_routes(server, stories_path):
    models = httpx.get(server.base_url + "/v1/models").json()
    assert models["data"][0]["id"] == "stories260k"
    info = httpx.get(server.base_url + "/get_model_info").json()
    assert info["model_path"] == str(stories_path)
    assert info["context_length"] == 512
    sinfo = httpx.get(server.base_url + "/get_server_info").json()
    assert sinfo["kv_total_slots"] == POOL_TOKENS
    assert sinfo["max_total_num_tokens"] == POOL_TOKENS


def test_completions_logprobs_with_echo_and_stream(server):
    body = {"prompt": "Once upon a time", "max_tokens": 6, "temperature": 0, "logprobs": 3, "echo": True}
    r = post(server, "/v1/completions", body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    lp = choice["logprobs"]
    prompt_tokens = r.json()["usage"]["prompt_tokens"]
    assert len(lp["tokens"]) == prompt_tokens + 6
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert all(isinstance(v, float) for v in lp["token_logprobs"][1:])
    assert "".join(lp["tokens"][prompt_tokens:]) == choice["text"][len("Once upon a time") :]
    for k in range(prompt_tokens, prompt_tokens + 6):  # greedy: the chosen token is the top one
        top = lp["top_logprobs"][k]
        assert len(top) == 3 and max(top.values()) == lp["token_logprobs"][k]
        assert list(top.values()) == sorted(top.values(), reverse=True)
    # offsets point into the choice's text: "<s>" is not in it, " Once" starts it at 0
    assert lp["text_offset"][:3] == [0, 0, 4] and lp["tokens"][:3] == ["<s>", " Once", " upon"]
    # streamed: the chunks' logprobs concatenate to the same lists
    with httpx.stream("POST", server.base_url + "/v1/completions", json={**body, "stream": True}, timeout=60) as resp:
        chunks = [
            json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
    tokens, values = [], []
    for c in chunks:
        clp = c["choices"][0]["logprobs"]
        if clp:
            tokens += clp["tokens"]
            values += clp["token_logprobs"]
    assert tokens == lp["tokens"]
    assert values == lp["token_logprobs"]
    plain = post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "temperature": 0}).json()
    assert plain["choices"][0]["logprobs"] is None


def test_native_stream_carries_logprobs(server):
    body = {
        "text": "Lily",
        "stream": True,
        "return_logprob": True,
        "top_logprobs_num": 2,
        "sampling_params": {"temperature": 0, "max_new_tokens": 5, "ignore_eos": True},
    }
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=60) as resp:
        chunks = [
            json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"
        ]
    for c in chunks:  # cumulative, one entry per output id so far
        meta = c["meta_info"]
        assert [e[1] for e in meta["output_token_logprobs"]] == c["output_ids"]
        assert len(meta["output_top_logprobs"]) == len(c["output_ids"])
    assert len(chunks[-1]["output_ids"]) == 5
