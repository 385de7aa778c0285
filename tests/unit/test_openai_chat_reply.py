"""Chat replies with tools and reasoning (pyserve/server/openai/chat_reply.py and the chat stream
encoder): the non-streamed message, the streamed deltas (a call's first delta carries index, id,
type, name and empty arguments; later ones only argument text) adding up to that message at
stream_interval 1 and 16, and the finish_reason rule."""

from __future__ import annotations

import json
import re

import pytest

from pyserve.forward_batch_info import EndCause, FinishReason
from pyserve.io_struct import GenerateOutput
from pyserve.server.openai.chat_reply import FORCED, ReplyPlan, chat_finish_reason, parse_reply
from pyserve.server.openai.protocol import ChatCompletionRequest
from pyserve.server.openai.stream_encoders import ChatStreamEncoder

FORCED_TEXT = (
    '[{"name": "get_weather", "parameters": {"city": "Paris", "note": "a \\"quoted\\" }]"}}, '
    '{"name": "now", "parameters": {}}]'
)
QWEN_TEXT = (
    "<think>\nThe user wants weather.\n</think>\n\nLet me check.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}}\n</tool_call>\n'
    '<tool_call>\n{"name": "now", "arguments": {}}\n</tool_call>'
)
CALL_ID = re.compile(r"^call_[0-9a-f]{24}$")


def outputs(text: str, interval: int, finish: FinishReason, piece_len: int = 2, index: int | None = None):
    """The outputs a stream of `text` gives: tokens of `piece_len` characters, one output per
    `interval` tokens (the last one finishing)."""
    pieces = [text[k : k + piece_len] for k in range(0, len(text), piece_len)]
    groups = ["".join(pieces[k : k + interval]) for k in range(0, len(pieces), interval)]
    outs, so_far, ids = [], "", 0
    for k, delta in enumerate(groups):
        so_far += delta
        ids += min(interval, len(pieces) - k * interval)
        last = k == len(groups) - 1
        outs.append(
            GenerateOutput(
                rid="r",
                text=so_far,
                text_delta=delta,
                output_ids=list(range(ids)),
                ids_delta=[0],
                prompt_tokens=4,
                cached_tokens=0,
                finish_reason=finish if last else None,
                index=index,
            )
        )
    return outs


def chunks(encoder: ChatStreamEncoder, outs) -> list[dict]:
    data = b"".join(encoder(o) for o in outs) + encoder.end()
    events = [e for e in data.decode().split("\n\n") if e]
    return [json.loads(e.removeprefix("data: ")) for e in events]


def streamed_message(chunk_list: list[dict], index: int = 0) -> tuple[dict, str | None]:
    """The message the deltas of choice `index` add up to, and its finish_reason; checks each
    tool-call delta's shape on the way."""
    content = reasoning = ""
    calls: list[dict] = []
    reason = None
    for chunk in chunk_list:
        (choice,) = chunk["choices"]
        if choice["index"] != index:
            continue
        delta = choice["delta"]
        content += delta.get("content") or ""
        reasoning += delta.get("reasoning_content") or ""
        for call in delta.get("tool_calls", ()):
            if "id" in call:
                assert set(call) == {"index", "id", "type", "function"} and call["type"] == "function"
                assert call["function"]["arguments"] == "" and call["index"] == len(calls)
                assert CALL_ID.match(call["id"])
                calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
                calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        reason = choice["finish_reason"] or reason
    return {"content": content or None, "reasoning_content": reasoning or None, "tool_calls": calls}, reason


def without_ids(message: dict) -> dict:
    out = dict(message)
    out["tool_calls"] = [{k: v for k, v in c.items() if k != "id"} for c in message.get("tool_calls", [])]
    return out


def body(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, **fields}
    )


def test_non_streamed_forced_message():
    message, calls_made = parse_reply(ReplyPlan(None, FORCED), FORCED_TEXT)
    assert calls_made
    assert without_ids(message) == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "note": "a \\"quoted\\" }]"}'},
            },
            {"type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    }
    assert all(CALL_ID.match(c["id"]) for c in message["tool_calls"])
    assert json.loads(message["tool_calls"][0]["function"]["arguments"]) == {"city": "Paris", "note": 'a "quoted" }]'}


def test_non_streamed_reasoning_and_calls():
    message, calls_made = parse_reply(ReplyPlan("qwen3", "qwen25"), QWEN_TEXT)
    assert calls_made
    assert without_ids(message) == {
        "role": "assistant",
        "content": "Let me check.",
        "reasoning_content": "The user wants weather.",
        "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": [1, 2]}'}},
            {"type": "function", "function": {"name": "now", "arguments": "{}"}},
        ],
    }
    plain, calls_made = parse_reply(ReplyPlan("qwen3", "qwen25"), "Just text.")
    assert plain == {"role": "assistant", "content": "Just text.", "reasoning_content": None} and not calls_made
    # parallel_tool_calls false: the first call only
    first, _ = parse_reply(ReplyPlan(None, FORCED, max_calls=1), FORCED_TEXT)
    assert [c["function"]["name"] for c in first["tool_calls"]] == ["get_weather"]


@pytest.mark.parametrize("interval", [1, 16])
@pytest.mark.parametrize(
    "plan,text,fields",
    [
        (ReplyPlan(None, FORCED), FORCED_TEXT, {"tools": [], "tool_choice": "none"}),
        (ReplyPlan("qwen3", "qwen25"), QWEN_TEXT, {}),
        (ReplyPlan("qwen3", "qwen25", stream_reasoning=False), QWEN_TEXT, {}),
        (ReplyPlan("deepseek-r1", None), "Hm, 2+2.</think>4", {}),
    ],
)
def test_streamed_deltas_add_up_to_the_message(interval, plan, text, fields):
    want, calls_made = parse_reply(plan, text)
    for piece_len in (1, 2, 5):
        encoder = ChatStreamEncoder(body(**fields), "chatcmpl-r", 1, "m", plan)
        got = chunks(encoder, outputs(text, interval, FinishReason.stop(2), piece_len))
        assert got[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
        message, reason = streamed_message(got)
        assert reason == ("tool_calls" if calls_made else "stop")
        assert without_ids(message) == without_ids(
            {"reasoning_content": None, "tool_calls": [], **{k: v for k, v in want.items() if k != "role"}}
        )
    if not plan.stream_reasoning:  # the reasoning comes in one delta
        deltas = [c["choices"][0]["delta"] for c in got if c["choices"][0]["delta"].get("reasoning_content")]
        assert deltas == [{"reasoning_content": "The user wants weather."}]


def test_a_call_cut_by_length_stays_length():
    plan = ReplyPlan(None, FORCED)
    text = '[{"name": "now", "parameters": {"a": "unfinish'
    encoder = ChatStreamEncoder(body(), "chatcmpl-r", 1, "m", plan)
    message, reason = streamed_message(chunks(encoder, outputs(text, 3, FinishReason.length_limit(9))))
    assert reason == "length"
    assert message["tool_calls"][0]["function"] == {"name": "now", "arguments": '{"a": "unfinish'}
    cut = GenerateOutput("r", text, "", [1], [], 4, 0, FinishReason.length_limit(9))
    assert chat_finish_reason(cut, True) == "length"


@pytest.mark.parametrize("text", ['[{"name"', "[", '[{"name": "now", "parameters": {}}, {"na'])
def test_a_forced_reply_cut_short_leaves_no_content(text):
    """The forced array's text is never content: cut before a call's name, the message has no
    content and only the calls whose name was complete."""
    plan = ReplyPlan(None, FORCED)
    message, calls_made = parse_reply(plan, text)
    assert message["content"] is None
    assert [c["function"]["name"] for c in message.get("tool_calls", [])] == (["now"] if "now" in text else [])
    assert calls_made == ("now" in text)
    encoder = ChatStreamEncoder(body(), "chatcmpl-r", 1, "m", plan)
    streamed, reason = streamed_message(chunks(encoder, outputs(text, 2, FinishReason.length_limit(9))))
    assert reason == "length" and streamed["content"] is None
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in message.get("tool_calls", [])]


@pytest.mark.parametrize("interval", [1, 3, 1000])
def test_calls_to_tools_the_request_did_not_offer_are_dropped(interval):
    """A model's invented function is dropped (as SGLang does); the kept calls are numbered
    from 0, streamed as not."""
    plan = ReplyPlan(None, "qwen25", tool_names=frozenset({"now"}))
    text = (
        '<tool_call>\n{"name": "nope", "arguments": {"a": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "now", "arguments": {"tz": "UTC"}}\n</tool_call>'
    )
    message, calls_made = parse_reply(plan, text)
    assert calls_made and [c["function"] for c in message["tool_calls"]] == [
        {"name": "now", "arguments": '{"tz": "UTC"}'}
    ]
    encoder = ChatStreamEncoder(body(), "chatcmpl-r", 1, "m", plan)
    streamed, reason = streamed_message(chunks(encoder, outputs(text, interval, FinishReason.stop(2))))
    assert reason == "tool_calls"
    assert [c["function"] for c in streamed["tool_calls"]] == [c["function"] for c in message["tool_calls"]]
    assert streamed["content"] == message["content"]
    only_invented, calls_made = parse_reply(plan, text.split("\n<tool_call>")[0])
    assert not calls_made and "tool_calls" not in only_invented


def test_finish_reason_rule():
    stop = GenerateOutput("r", "", "", [1], [], 4, 0, FinishReason.stop(2))
    running = GenerateOutput("r", "", "", [1], [], 4, 0)
    assert chat_finish_reason(stop, True) == "tool_calls"
    assert chat_finish_reason(stop, False) == "stop"
    assert chat_finish_reason(running, True) is None
    assert (
        chat_finish_reason(GenerateOutput("r", "", "", [], [], 4, 0, FinishReason.abort(EndCause.ABORTED, "x")), True)
        == "abort"
    )


def test_each_choice_has_its_own_parser():
    plan = ReplyPlan(None, "qwen25")
    texts = ['<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>', "No call here."]
    encoder = ChatStreamEncoder(body(n=2), "chatcmpl-r", 1, "m", plan)
    outs0 = outputs(texts[0], 2, FinishReason.stop(2), index=0)
    outs1 = outputs(texts[1], 3, FinishReason.stop(2), index=1)
    mixed = [o for pair in zip(outs0, outs1) for o in pair] + outs0[len(outs1) :] + outs1[len(outs0) :]
    got = chunks(encoder, mixed)
    m0, r0 = streamed_message(got, 0)
    m1, r1 = streamed_message(got, 1)
    assert (r0, r1) == ("tool_calls", "stop")
    assert without_ids(m0)["tool_calls"] == [{"type": "function", "function": {"name": "a", "arguments": '{"x": 1}'}}]
    assert m0["content"] is None and m1 == {"content": "No call here.", "reasoning_content": None, "tool_calls": []}


def test_logprobs_of_held_back_text_are_still_sent():
    plan = ReplyPlan(None, "qwen25")
    entry = [-0.5, 7, "<tool"]
    out = GenerateOutput(
        "r",
        "<tool",
        "<tool",
        [7],
        [7],
        4,
        0,
        logprobs={"output_token_logprobs": [entry], "output_top_logprobs": [None]},
        num_logprobs_delta=1,
    )
    encoder = ChatStreamEncoder(body(logprobs=True), "chatcmpl-r", 1, "m", plan)
    got = chunks(encoder, [out])
    assert got[1]["choices"][0]["delta"] == {"content": ""}
    assert got[1]["choices"][0]["logprobs"]["content"][0]["token"] == "<tool"
