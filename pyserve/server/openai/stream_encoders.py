"""The SSE events of streamed OpenAI chat completions and completions, one output at a time.

Chat: first a role delta per choice, then content deltas (with the logprobs of the tokens they
add), a chunk with the finish reason when a choice finishes, and after the last output the
usage chunk when `stream_options.include_usage` asks. With a ReplyPlan (tools, a reasoning
parser) each choice's text goes through its ReplyParser, whose deltas (reasoning_content,
content, tool_calls) become one chunk each. Completions: the echoed prompt per
choice first (with `echo`), then text deltas, the last carrying the finish reason, then usage.
With `continuous_usage_stats` every chunk carries the usage so far (the prompt counted once).

Both are the encoders of pyserve.server.stream_hub: called with each output in order (the
first output stands for every choice until each has its own), `end()` after the last. A
running choice-0 chunk without logprobs (what nearly every streamed token is) is written from
bytes prepared once; its bytes equal those of the general path (`sse_event` of the chunk).
Loop thread only.
"""

from __future__ import annotations

import abc
from typing import Any

from pyserve.io_struct import GenerateOutput
from pyserve.server.openai.chat_reply import ReplyParser, ReplyPlan, chat_finish_reason
from pyserve.server.openai.logprobs import chat_logprobs, completion_logprobs, text_end
from pyserve.server.openai.protocol import ChatCompletionRequest, CompletionRequest
from pyserve.server.render import json_bytes, sse_event, string_body


def finish_reason(out: GenerateOutput) -> str | None:
    if out.finish_reason is None:
        return None
    return out.finish_reason.kind.value


def _index(out: GenerateOutput) -> int:
    return out.index or 0


def prompt_once_usage(outs: list[GenerateOutput]) -> dict[str, Any]:
    """Usage fields of the samples of one prompt so far (prompt counted once)."""
    prompt = outs[0].prompt_tokens if outs else 0
    completion = sum(len(o.output_ids) for o in outs)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": max((o.cached_tokens for o in outs), default=0)},
    }


class _OpenAIStreamEncoder(abc.ABC):
    """What chat and completion streams share: per-choice progress (latest outputs, logprobs
    already sent), the chunk envelope, the usage chunk, and the fast running chunk."""

    def __init__(
        self,
        body: ChatCompletionRequest | CompletionRequest,
        base: dict[str, Any],
        delta_head: bytes,
        delta_tail: bytes,
    ) -> None:
        self.body = body
        self.base = base
        self.latest: dict[int, GenerateOutput] = {}
        self.sent_logprobs: dict[int, int] = {}
        self.started = False
        self._fast: tuple[bytes, bytes] | None = None
        if body.n == 1 and not body.continuous_usage:
            # `data: {<base>,"choices":[{"index":0,<delta_head>` + text + `<delta_tail>...}]}`
            usage = b',"usage":null' if body.include_usage else b""
            self._fast = (
                b"data: " + json_bytes(base)[:-1] + b',"choices":[{"index":0,' + delta_head,
                delta_tail + b',"logprobs":null,"finish_reason":null}]' + usage + b"}\n\n",
            )

    def __call__(self, out: GenerateOutput) -> bytes:
        fast = self._fast
        if fast is not None and self.started and out.finish_reason is None and out.logprobs is None:
            self.latest[0] = out
            delta = out.text_delta
            return fast[0] + string_body(delta) + fast[1] if delta else b""
        if not self.started:
            self.started = True
            self.latest[_index(out)] = out  # the first output stands for every choice so far
            return self.prelude(out) + self.encode(out)
        return self.encode(out)

    def prelude(self, first: GenerateOutput) -> bytes:
        """The events before the first output's own."""
        return b""

    @abc.abstractmethod
    def encode(self, out: GenerateOutput) -> bytes:
        """The events of `out` (the general path: any output of any choice)."""

    def update(self, out: GenerateOutput) -> tuple[int, int]:
        """Record `out`; returns (its choice index, output logprobs sent before it)."""
        i = _index(out)
        self.latest[i] = out
        sent = self.sent_logprobs.get(i, 0)
        if out.logprobs is not None:
            self.sent_logprobs[i] = len(out.logprobs["output_token_logprobs"])
        return i, sent

    def usage(self) -> dict[str, Any]:
        """Usage of the choices so far (the prompt counted once)."""
        return prompt_once_usage([self.latest[i] for i in sorted(self.latest)])

    def chunk(self, choice: dict[str, Any]) -> bytes:
        """One streamed chunk's event: the envelope with one choice and the usage the
        request's stream_options ask for."""
        out = {**self.base, "choices": [choice]}
        if self.body.continuous_usage:
            out["usage"] = self.usage()
        elif self.body.include_usage:
            out["usage"] = None  # as OpenAI: only the last chunk carries usage
        return sse_event(out)

    def end(self) -> bytes:
        if not self.body.include_usage:
            return b""
        return sse_event({**self.base, "choices": [], "usage": self.usage()})


class ChatStreamEncoder(_OpenAIStreamEncoder):
    """`chat.completion.chunk` events of one streamed chat completion; `plan`: the parsers
    of its replies (None: the text is all content)."""

    def __init__(
        self, body: ChatCompletionRequest, rid: str, created: int, model: str, plan: ReplyPlan | None = None
    ) -> None:
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model}
        super().__init__(body, base, b'"delta":{"content":"', b'"}')
        self.plan = plan
        self.parsers: dict[int, ReplyParser] = {}  # per choice
        if plan is not None:
            self._fast = None  # every output goes through its choice's parser

    def _chunk(self, index: int, delta: dict[str, Any], reason: str | None, logprobs: Any = None) -> bytes:
        return self.chunk({"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason})

    def prelude(self, first: GenerateOutput) -> bytes:
        return b"".join(self._chunk(i, {"role": "assistant", "content": ""}, None) for i in range(self.body.n))

    def encode(self, out: GenerateOutput) -> bytes:
        if self.plan is not None:
            return self._encode_parsed(out, self.plan)
        i, sent = self.update(out)
        data = b""
        # a chunk carries the logprobs of the tokens it adds (even with no text yet)
        new_logprobs = out.logprobs is not None and out.num_logprobs_delta > 0
        if out.text_delta or new_logprobs:
            logprobs = chat_logprobs(out, sent) if new_logprobs else None
            data = self._chunk(i, {"content": out.text_delta}, None, logprobs)
        if out.finish_reason is not None:
            data += self._chunk(i, {}, finish_reason(out))
        return data

    def _encode_parsed(self, out: GenerateOutput, plan: ReplyPlan) -> bytes:
        """The chunks of `out` through its choice's parser: one per delta, the first with
        the logprobs of the tokens `out` adds, then the finish chunk (`tool_calls` when the
        choice made calls and stopped by itself)."""
        i, sent = self.update(out)
        parser = self.parsers.get(i)
        if parser is None:
            parser = self.parsers[i] = plan.parser()
        deltas = parser.feed(out.text_delta) if out.text_delta else []
        if out.finish_reason is not None and not parser.finished:
            deltas += parser.finish()
        logprobs = chat_logprobs(out, sent) if out.logprobs is not None and out.num_logprobs_delta > 0 else None
        if logprobs is not None and not deltas:
            deltas = [{"content": ""}]  # the tokens' text is held back: their logprobs go now
        data = b"".join(self._chunk(i, d, None, logprobs if k == 0 else None) for k, d in enumerate(deltas))
        if out.finish_reason is not None:
            data += self._chunk(i, {}, chat_finish_reason(out, parser.calls_made))
        return data


class CompletionStreamEncoder(_OpenAIStreamEncoder):
    """`text_completion` events of one streamed completion. echo: the echoed prompt text ("" without
    echo) and, with logprobs, its tokens' character offsets."""

    def __init__(
        self, body: CompletionRequest, rid: str, created: int, model: str, echo: tuple[str, list[int] | None]
    ) -> None:
        base = {"id": rid, "object": "text_completion", "created": created, "model": model}
        super().__init__(body, base, b'"text":"', b'"')
        self.completion_body = body
        self.echo, self.prompt_offsets = echo
        # character offset of each choice's next token (logprobs): where the last sent
        # token's text ends, whatever text is still held back for a stop string
        self.offsets = [len(self.echo)] * body.n

    def _chunk(self, index: int, text: str, reason: str | None, logprobs: Any = None) -> bytes:
        return self.chunk({"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason})

    def prelude(self, first: GenerateOutput) -> bytes:
        if not self.completion_body.echo:
            return b""
        # the prompt's logprobs (echo) go with the echoed prompt
        prompt_lp = None
        if first.logprobs is not None:
            prompt_lp = completion_logprobs(first, 0, 0, echo=True, prompt_offsets=self.prompt_offsets)
        return b"".join(self._chunk(i, self.echo, None, prompt_lp) for i in range(self.body.n))

    def encode(self, out: GenerateOutput) -> bytes:
        i, sent = self.update(out)
        new_logprobs = out.logprobs is not None and out.num_logprobs_delta > 0
        if not (out.text_delta or out.finish_reason is not None or new_logprobs):
            return b""
        logprobs = None
        if out.logprobs is not None:
            logprobs = completion_logprobs(out, sent, text_offset=self.offsets[i])
            if logprobs is not None and logprobs["tokens"]:
                self.offsets[i] = text_end(logprobs)
        return self._chunk(i, out.text_delta, finish_reason(out), logprobs)
