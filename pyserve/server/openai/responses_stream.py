"""The objects of the OpenAI Responses API (`/v1/responses`) and the SSE events of a streamed one.

A response holds one output item, the assistant message `{"type": "message", "id": "msg_...",
"role": "assistant", "status", "content": [{"type": "output_text", "text", "annotations": [],
"logprobs": []}]}`. How the request ended gives the response's status: a stop (EOS, a stop
string) "completed"; a length limit "incomplete" with `incomplete_details.reason`
"max_output_tokens"; an abort (/abort_request, a stream at the drain's deadline)
"cancelled"; a failure after the stream started "failed" with `error`. Usage is in the
Responses API's words (`input_tokens`, `output_tokens`, `input_tokens_details.cached_tokens`).

Streamed, every event is `event: <type>` plus `data: <json>` whose `type` repeats the event's
and whose `sequence_number` counts from 0: `response.created` and `response.in_progress`
(status "in_progress", no output yet), `response.output_item.added`,
`response.content_part.added`, one `response.output_text.delta` per detokenized chunk that
adds text, then `response.output_text.done`, `response.content_part.done`,
`response.output_item.done` and `response.completed` (or `response.incomplete` for a length
limit or an abort), and nothing after it (no `data: [DONE]`, unlike the chat streams).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyserve.errors import InvalidRequestError
from pyserve.forward_batch_info import FinishKind
from pyserve.io_struct import GenerateOutput
from pyserve.server.render import json_bytes


@dataclass(frozen=True)
class ResponseHead:
    """What a response's objects share from start to end.

    id: "resp_<rid>". message_id: "msg_<rid>", the id of its one output item.
    created_at: Unix seconds. model: the served model's name. echo: the request settings a
    Response object repeats (instructions, max_output_tokens, temperature, top_p, text,
    tool_choice, tools, ...), in the Response object's field names."""

    id: str
    message_id: str
    created_at: int
    model: str
    echo: dict[str, Any]


def usage(out: GenerateOutput) -> dict[str, Any]:
    """The Responses API's usage object of a (final or latest) output."""
    num_output = len(out.output_ids)
    return {
        "input_tokens": out.prompt_tokens,
        "input_tokens_details": {"cached_tokens": out.cached_tokens},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": out.prompt_tokens + num_output,
    }


def outcome(out: GenerateOutput) -> tuple[str, dict[str, Any] | None]:
    """(the response's status, its incomplete_details) for a final output that did not fail."""
    reason = out.finish_reason
    if reason is None or reason.kind is FinishKind.STOP:
        return "completed", None
    if reason.kind is FinishKind.LENGTH:
        return "incomplete", {"reason": "max_output_tokens"}
    return "cancelled", None


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message_item(head: ResponseHead, text: str | None, status: str) -> dict[str, Any]:
    """The output item: the assistant message (text None: no content part yet). status:
    "in_progress", "completed" or "incomplete"."""
    content = [] if text is None else [text_part(text)]
    return {"type": "message", "id": head.message_id, "status": status, "role": "assistant", "content": content}


def response_object(
    head: ResponseHead,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None,
    incomplete_details: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The Response object (`object: "response"`) with the fields the `openai` client's
    Response model requires and the request settings it repeats."""
    return {
        "id": head.id,
        "object": "response",
        "created_at": head.created_at,
        "status": status,
        "background": False,
        "error": error,
        "incomplete_details": incomplete_details,
        "model": head.model,
        "output": output,
        "previous_response_id": None,
        "store": False,
        **head.echo,
        "usage": usage,
    }


def final_response(head: ResponseHead, out: GenerateOutput) -> dict[str, Any]:
    """The Response object of a request's final output (one that did not fail)."""
    status, details = outcome(out)
    item = message_item(head, out.text, "completed" if status == "completed" else "incomplete")
    return response_object(head, status, [item], usage(out), details)


def failure_error(exc: Exception) -> dict[str, Any]:
    """A Response object's `error` for a request that failed mid-way: the request's own
    parameters ("invalid_request_error", with the field) or a failed model step or pyserve
    fault ("server_error")."""
    if isinstance(exc, InvalidRequestError) and exc.status < 500:
        return {"code": "invalid_request_error", "message": str(exc), "param": exc.param}
    return {"code": "server_error", "message": str(exc) or type(exc).__name__, "param": None}


class ResponsesStreamEncoder:
    """The SSE events of one streamed response (a pyserve.server.stream_hub StreamEncoder):
    called with each output of the request in order; `fail(exc)` once the request failed
    after its first event, then `end()` gives `response.failed`. Loop thread only."""

    # the Responses API ends a stream with its terminal event, not chat's `data: [DONE]`
    done_event = b""

    def __init__(self, head: ResponseHead) -> None:
        self.head = head
        self.sequence_number = 0
        self.started = False  # an event was made: the stream's 200 is (about to be) sent
        self.latest: GenerateOutput | None = None
        self.failure: Exception | None = None

    def event(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return b"event: " + kind.encode() + b"\ndata: " + json_bytes(data) + b"\n\n"

    def __call__(self, out: GenerateOutput) -> bytes:
        data = b"" if self.started else self.prelude()
        self.started = True
        self.latest = out
        if out.text_delta:
            data += self.event(
                "response.output_text.delta",
                item_id=self.head.message_id,
                output_index=0,
                content_index=0,
                delta=out.text_delta,
                logprobs=[],
            )
        if out.finish_reason is not None:
            data += self.finish(out)
        return data

    def prelude(self) -> bytes:
        head = self.head
        running = response_object(head, "in_progress", [], None)
        where = {"output_index": 0, "content_index": 0}
        return b"".join(
            (
                self.event("response.created", response=running),
                self.event("response.in_progress", response=running),
                self.event("response.output_item.added", output_index=0, item=message_item(head, None, "in_progress")),
                self.event("response.content_part.added", item_id=head.message_id, **where, part=text_part("")),
            )
        )

    def finish(self, out: GenerateOutput) -> bytes:
        head = self.head
        response = final_response(head, out)
        item = response["output"][0]
        where = {"output_index": 0, "content_index": 0}
        final = "response.completed" if response["status"] == "completed" else "response.incomplete"
        return b"".join(
            (
                self.event("response.output_text.done", item_id=head.message_id, **where, text=out.text, logprobs=[]),
                self.event("response.content_part.done", item_id=head.message_id, **where, part=item["content"][0]),
                self.event("response.output_item.done", output_index=0, item=item),
                self.event(final, response=response),
            )
        )

    def fail(self, exc: Exception) -> None:
        """The request failed after the stream started: `end()` reports it."""
        self.failure = exc

    def end(self) -> bytes:
        """`response.failed` (with the text so far) after `fail`, else nothing: a finished
        request's last events came with its final output."""
        if self.failure is None:
            return b""
        out = self.latest
        output = [message_item(self.head, out.text, "incomplete")] if out is not None else []
        failed = response_object(
            self.head, "failed", output, usage(out) if out is not None else None, error=failure_error(self.failure)
        )
        return self.event("response.failed", response=failed)
