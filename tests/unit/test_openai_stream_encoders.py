"""The OpenAI stream encoders: the exact events of a streamed chat completion and completion
(role delta, content deltas, finish chunk, usage chunk; echo), and the prepared bytes of a
running chunk equal the general path's (`sse_event` of the chunk) for text that needs escapes,
with and without `stream_options`."""

from __future__ import annotations

import pytest

from pyserve.forward_batch_info import FinishReason
from pyserve.io_struct import GenerateOutput
from pyserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pyserve.server.openai.stream_encoders import ChatStreamEncoder, CompletionStreamEncoder
from pyserve.server.render import sse_event

DELTAS = ["Hel", "", 'lo "w"\n', "\udcff", "\x00 日本", "!"]


def outputs(deltas: list[str] = DELTAS) -> list[GenerateOutput]:
    outs, text = [], ""
    for k, delta in enumerate(deltas):
        text += delta
        last = k == len(deltas) - 1
        outs.append(
            GenerateOutput(
                rid="r",
                text=text,
                text_delta=delta,
                output_ids=list(range(k + 1)),
                ids_delta=[k],
                prompt_tokens=5,
                cached_tokens=2,
                finish_reason=FinishReason.stop("!") if last else None,
            )
        )
    return outs


def events(encoder, outs: list[GenerateOutput]) -> bytes:
    return b"".join(encoder(o) for o in outs) + encoder.end()


def chat_body(**extra) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "hi"}], "stream": True, **extra}
    )


def test_chat_events_are_exactly_openais():
    body = chat_body(stream_options={"include_usage": True})
    got = events(ChatStreamEncoder(body, "chatcmpl-r", 7, "m"), outputs())
    base = {"id": "chatcmpl-r", "object": "chat.completion.chunk", "created": 7, "model": "m"}

    def chunk(delta, reason=None):
        return sse_event(
            {
                **base,
                "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": reason}],
                "usage": None,
            }
        )

    want = [chunk({"role": "assistant", "content": ""})]
    want += [chunk({"content": d}) for d in DELTAS if d]
    usage = {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    want += [chunk({}, "stop"), sse_event({**base, "choices": [], "usage": usage})]
    assert got == b"".join(want)


@pytest.mark.parametrize("options", [None, {"include_usage": True}, {"include_usage": False}])
def test_prepared_running_chunks_equal_the_general_path(options):
    for make in (
        lambda: ChatStreamEncoder(chat_body(stream_options=options), 'chatcmpl-"x"', 7, "m/é"),
        lambda: CompletionStreamEncoder(
            CompletionRequest.model_validate({"prompt": "p", "stream": True, "stream_options": options}),
            "cmpl-x",
            7,
            "m",
            ("", None),
        ),
    ):
        fast, general = make(), make()
        assert fast._fast is not None
        general._fast = None
        assert events(fast, outputs()) == events(general, outputs())


def test_completion_events_with_echo_and_continuous_usage():
    body = CompletionRequest.model_validate(
        {"prompt": "p", "stream": True, "echo": True, "stream_options": {"continuous_usage_stats": True}}
    )
    encoder = CompletionStreamEncoder(body, "cmpl-r", 7, "m", ("Once", None))
    assert encoder._fast is None  # every chunk carries the usage so far
    outs = outputs(["a", "", "b"])
    got = events(encoder, outs)
    base = {"id": "cmpl-r", "object": "text_completion", "created": 7, "model": "m"}

    def chunk(text, completion_tokens, reason=None):
        usage = {
            "prompt_tokens": 5,
            "completion_tokens": completion_tokens,
            "total_tokens": 5 + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": 2},
        }
        return sse_event(
            {**base, "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": reason}], "usage": usage}
        )

    # the echo goes first, with the usage of the first output (it stands for the choice so far)
    assert got == chunk("Once", 1) + chunk("a", 1) + chunk("b", 3, "stop")
