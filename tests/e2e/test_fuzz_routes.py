"""A property-based fuzz of /generate, /v1/completions and /v1/chat/completions on a real
stories260k server (hypothesis, derandomized, at least 2,000 requests, about a minute).

Valid bodies are mutated: wrong types, huge, negative and non-finite numbers, unknown fields,
lone surrogates and NULs in every string field, deep nesting, empty and oversized arrays,
truncated JSON, wrong content types. Every answer must be complete and below 500; every 4xx
carries an OpenAI-style error object; a 200 stream ends with `data: [DONE]`. Afterwards the
server is healthy, its log holds no unhandled exception, and no KV is leaked."""

from __future__ import annotations

import copy
import json
import time
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import REPO, start_server

POOL = 4096
NUM_EXAMPLES = 2100
TEMPLATE = REPO / "tests" / "data" / "stories_chat_template.jinja"

BASES: dict[str, dict[str, Any]] = {
    "/generate": {
        "text": "Once upon a time",
        "rid": "fuzz",
        "stream": False,
        "return_logprob": True,
        "logprob_start_len": 1,
        "top_logprobs_num": 2,
        "token_ids_logprob": [5, 6],
        "return_text_in_logprobs": True,
        "sampling_params": {
            "max_new_tokens": 4,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 5,
            "min_p": 0.05,
            "stop": ["."],
            "stop_token_ids": [13],
            "seed": 1,
            "n": 1,
            "frequency_penalty": 0.5,
            "repetition_penalty": 1.1,
            "logit_bias": {"5": 1.0},
            "min_new_tokens": 1,
            "stream_interval": 1,
            "no_stop_trim": False,
        },
    },
    "/v1/completions": {
        "model": "stories260k",
        "prompt": "Lily went",
        "max_tokens": 4,
        "temperature": 0.5,
        "logprobs": 2,
        "echo": True,
        "stop": ["."],
        "stream": False,
        "n": 1,
        "seed": 3,
        "logit_bias": {"5": 1.0},
        "top_k": 4,
        "stream_options": {"include_usage": True},
        "user": "u",
    },
    "/v1/chat/completions": {
        "model": "default",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        "max_tokens": 4,
        "temperature": 0.5,
        "stream": False,
        "logprobs": True,
        "top_logprobs": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        "n": 1,
        "chat_template_kwargs": {"greeting": "x"},
        "presence_penalty": 0.1,
    },
}

HUGE_TEXT = "x" * 200_000
HUGE_IDS = list(range(300)) * 400  # 120,000 ids: longer than any context


def nested(depth: int) -> Any:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    return value


strings = st.one_of(
    st.text(alphabet=st.characters(blacklist_categories=()), max_size=12),  # surrogates included
    st.sampled_from(["\udcff", "\ud800x", "x\udfff", "\x00", "a\x00b", "", " ", HUGE_TEXT, "stories260k"]),
)
numbers = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, -1, 1, 2, 2**31, 2**32, 2**63 - 1, 2**63, 2**64, 10**30, -(10**30)]),
    st.sampled_from([1e300, -1e300, 3.4e38, -3.4e38, 1e-45, -0.0]),  # float32 overflow / underflow
    st.floats(allow_nan=True, allow_infinity=True, width=64),  # NaN / inf are sent as JSON's NaN
)
leaf = st.one_of(st.none(), st.booleans(), numbers, strings)
weird = st.deferred(lambda: _weird).map(copy.deepcopy)  # never mutate the shared big values
_weird = st.one_of(
    leaf,
    st.lists(leaf, max_size=4),
    st.dictionaries(strings, leaf, max_size=3),
    st.sampled_from([[], {}, [[]], [{}], HUGE_IDS, [0] * 5000, [-1], [2**40]]),
    st.integers(min_value=2, max_value=200).map(nested),
)


# values a valid body could hold: mutations with them often stay valid and reach the model
plausible = st.one_of(
    st.integers(min_value=0, max_value=6),
    st.floats(min_value=0.0, max_value=1.0),
    st.booleans(),
    st.text(alphabet="abc .", max_size=6),
)
values = st.one_of(weird, plausible)


def paths(obj: Any) -> list[tuple]:
    """Paths of every value in `obj` (lists: their first 4 items), iteratively."""
    out: list[tuple] = []
    stack: list[tuple[Any, tuple]] = [(obj, ())]
    while stack:
        value, prefix = stack.pop()
        if prefix:
            out.append(prefix)
        if isinstance(value, dict):
            stack.extend((v, prefix + (k,)) for k, v in value.items())
        elif isinstance(value, list):
            stack.extend((v, prefix + (i,)) for i, v in enumerate(value[:4]))
    return out


def put(obj: Any, path: tuple, value: Any) -> None:
    for key in path[:-1]:
        obj = obj[key]
    obj[path[-1]] = value


@st.composite
def cases(draw: st.DrawFn) -> tuple[str, bytes, str]:
    route = draw(st.sampled_from(sorted(BASES)))
    body: Any = copy.deepcopy(BASES[route])
    for _ in range(draw(st.sampled_from([0, 0, 1, 1, 1, 2, 3]))):
        kind = draw(st.sampled_from(["replace", "replace", "replace", "add", "delete", "stream"]))
        targets = paths(body) if isinstance(body, (dict, list)) else []
        if kind == "stream" and isinstance(body, dict):
            body["stream"] = True
        elif kind == "add" and isinstance(body, dict):
            body[draw(strings)] = draw(values)
        elif kind == "delete" and targets:
            path = draw(st.sampled_from(targets))
            parent = body
            for key in path[:-1]:
                parent = parent[key]
            del parent[path[-1]]
        elif kind == "replace" and targets:
            put(body, draw(st.sampled_from(targets)), draw(values))
        elif kind == "replace":
            body = draw(weird)
    raw = json.dumps(body).encode()  # ASCII: lone surrogates travel as escapes, NaN as NaN
    form = draw(st.sampled_from(["json"] * 14 + ["truncated", "form", "text", "empty", "not-utf8", "deep"]))
    content_type = "application/json"
    if form == "truncated":
        raw = raw[: draw(st.integers(min_value=0, max_value=max(len(raw) - 1, 0)))]
    elif form == "form":
        raw, content_type = b"text=hello&max_new_tokens=3", "application/x-www-form-urlencoded"
    elif form == "text":
        content_type = "text/plain"
    elif form == "empty":
        raw = b""
    elif form == "not-utf8":
        raw = raw.replace(b'"', b'\xff"', 1)
    elif form == "deep":  # nested past any recursion limit
        depth = draw(st.integers(min_value=1000, max_value=200_000))
        raw = b'{"text": ' + b"[" * depth + b"]" * depth + b"}"
    return route, raw, content_type


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories_path):
    srv = start_server(
        tmp_path_factory,
        "stories-fuzz",
        [
            "--model-path",
            str(stories_path),
            "--max-total-tokens",
            str(POOL),
            "--context-length",
            "64",
            "--chat-template",
            str(TEMPLATE),
            "--max-running-requests",
            "16",
        ],
    )
    try:
        yield srv
    finally:
        srv.stop()


def check_response(r: httpx.Response) -> None:
    assert r.status_code < 500, (r.status_code, r.text[:2000])
    if r.status_code >= 400:
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}, err
        assert isinstance(err["message"], str) and err["message"], err
        assert err["param"] is None or isinstance(err["param"], str)
        assert len(err["message"]) < 1200, err["message"][:200]
        return
    assert r.status_code == 200, r.status_code
    if r.headers["content-type"].startswith("text/event-stream"):
        text = r.text
        assert text.endswith("data: [DONE]\n\n"), text[-500:]
        for event in text.split("\n\n")[:-2]:
            assert event.startswith("data: "), event
            obj = json.loads(event[6:])
            assert "error" not in obj, obj
    else:
        json.loads(r.content)


def test_fuzzed_bodies_never_break_the_server(server):
    sent = 0
    statuses: dict[tuple[str, int], int] = {}
    with httpx.Client(base_url=server.base_url, timeout=120) as client:

        @settings(
            max_examples=NUM_EXAMPLES,
            deadline=None,
            derandomize=True,
            database=None,
            suppress_health_check=list(HealthCheck),
        )
        @given(case=cases())
        def one(case: tuple[str, bytes, str]) -> None:
            nonlocal sent
            route, raw, content_type = case
            r = client.post(route, content=raw, headers={"content-type": content_type})
            sent += 1
            statuses[(route, r.status_code)] = statuses.get((route, r.status_code), 0) + 1
            check_response(r)

        one()
        print("fuzz statuses:", sorted(statuses.items()))
        assert sent >= 2000
        # the mutations keep enough bodies valid to reach generation on every route
        assert all(statuses.get((route, 200), 0) >= 100 for route in BASES), statuses
        assert client.get("/health").status_code == 200
        deadline = time.monotonic() + 60
        while True:
            info = client.get("/get_server_info").json()
            if info["num_running_reqs"] == 0 and info["num_waiting_reqs"] == 0 and info["kv_protected_slots"] == 0:
                break
            assert time.monotonic() < deadline, info
            time.sleep(0.05)
        assert info["kv_free_slots"] + info["kv_evictable_slots"] == POOL
        ok = client.post("/generate", json={"text": "Tom", "sampling_params": {"max_new_tokens": 3, "temperature": 0}})
        assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
    log = server.log()
    assert "Traceback" not in log and "ERROR" not in log, log[-5000:]
