"""A chat reply's text as an assistant message: reasoning, content and tool calls.

`ReplyPlan` says which parsers a request's reply goes through (the server's reasoning parser,
its tool-call parser, or the forced-call array); `ReplyParser` runs them on one choice's text,
piece by piece, and gives OpenAI delta objects (`{"reasoning_content": ...}`,
`{"content": ...}`, a call's first delta `{"tool_calls": [{"index", "id", "type", "function":
{"name", "arguments": ""}}]}`, then `{"tool_calls": [{"index", "function": {"arguments"}}]}`).
A non-streamed message is those deltas of the whole text added up (`ReplyMessage`), so the
streamed and non-streamed replies agree whatever the stream's chunking. Tool calls are parsed
in the content only, after the reasoning.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pyserve.constrained.spec import ThinkBlock
from pyserve.errors import InvalidRequestError
from pyserve.io_struct import GenerateOutput
from pyserve.model_loader.chat_template import ignores_tools, suggested_tool_parser
from pyserve.parsers.reasoning_parser import THINK_END, THINK_START, ReasoningParser
from pyserve.parsers.registry import (
    REASONING_STARTS_INSIDE,
    SPECIAL_TOKEN_MARKERS,
    make_forced_call_parser,
    make_reasoning_parser,
    make_tool_call_parser,
)
from pyserve.parsers.tool_call_base import CallArgs, CallStart, TextPiece, ToolCallParser
from pyserve.server.openai.protocol import ChatCompletionRequest
from pyserve.server.openai.structured import Constraint
from pyserve.server.openai.tools import new_call_id

# the tool parser of forced calls (tool_choice required or a named function)
FORCED = "forced"


@dataclass(frozen=True)
class ReplyPlan:
    """The parsers of a request's replies.

    reasoning_parser: a --reasoning-parser name, or None (no split). tool_parser: a
    --tool-call-parser name, FORCED, or None (no tool calls). max_calls: calls kept at most
    (parallel_tool_calls false: 1), None for all. stream_reasoning: stream the reasoning as it
    comes (False: in one delta once it ends). tool_names: the functions the request offers; a
    call to another name (a model's invention) is dropped, as SGLang does; None keeps all."""

    reasoning_parser: str | None
    tool_parser: str | None
    max_calls: int | None = None
    stream_reasoning: bool = True
    tool_names: frozenset[str] | None = None  # the request's tools; calls to others are dropped

    def parser(self) -> ReplyParser:
        """A fresh ReplyParser (one per choice)."""
        return ReplyParser(self)


def thinking_on(chat_template_kwargs: dict[str, Any] | None) -> bool:
    """Whether the request lets the model think (`chat_template_kwargs.enable_thinking`,
    true unless set to false)."""
    return (chat_template_kwargs or {}).get("enable_thinking", True) is not False


# the text a grammar waits for when the model thinks first: the end of its thinking
# a thinking budget's default when a constrained request gives none: this share of its
# max_tokens (so a model that never closes its thinking still has room for the answer)
DEFAULT_THINKING_SHARE = 0.5
# the grammar of a request that gives only a thinking budget: any answer
ANY_TEXT_REGEX = r"[\s\S]*"


class ReplyParser:
    """One choice's reply split into deltas (see the module docstring). Loop thread."""

    def __init__(self, plan: ReplyPlan) -> None:
        self.plan = plan
        self.reasoning: ReasoningParser | None = (
            make_reasoning_parser(plan.reasoning_parser) if plan.reasoning_parser else None
        )
        self.tools: ToolCallParser | None = None
        if plan.tool_parser == FORCED:
            self.tools = make_forced_call_parser()
        elif plan.tool_parser is not None:
            self.tools = make_tool_call_parser(plan.tool_parser)
        self.call_ids: list[str] = []
        self._call_index: dict[int, int | None] = {}  # the parser's call index -> the reply's (None: dropped)
        self._held_reasoning = ""  # stream_reasoning false: the reasoning so far
        self.finished = False

    @property
    def calls_made(self) -> bool:
        return bool(self.call_ids)

    def feed(self, text: str) -> list[dict[str, Any]]:
        """The deltas `text` (the reply's next piece) completes."""
        if self.reasoning is None:
            reasoning, content = "", text
        else:
            reasoning, content = self.reasoning.feed(text)
        return self._deltas(reasoning, content, final=False)

    def finish(self) -> list[dict[str, Any]]:
        """The deltas of the text held back; call once, after the last `feed`."""
        self.finished = True
        reasoning, content = ("", "") if self.reasoning is None else self.reasoning.finish()
        return self._deltas(reasoning, content, final=True)

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict[str, Any]]:
        out = _Deltas()
        if not self.plan.stream_reasoning and self.reasoning is not None:
            self._held_reasoning += reasoning
            reasoning = ""
            if self._held_reasoning and (final or not self.reasoning.in_reasoning):
                reasoning, self._held_reasoning = self._held_reasoning, ""
        if reasoning:
            out.text("reasoning_content", reasoning)
        if self.tools is None:
            if content:
                out.text("content", content)
            return out.items
        events = self.tools.feed(content) if content else []
        if final:
            events += self.tools.finish()
        limit, names = self.plan.max_calls, self.plan.tool_names
        for ev in events:
            if isinstance(ev, TextPiece):
                # a forced reply is the grammar's array and nothing else: its text is never
                # content, also when max_tokens cuts it before a call's name
                if self.plan.tool_parser != FORCED:
                    out.text("content", ev.text)
            elif isinstance(ev, CallStart):
                kept = (names is None or ev.name in names) and (limit is None or len(self.call_ids) < limit)
                self._call_index[ev.index] = len(self.call_ids) if kept else None
                if kept:  # (parallel_tool_calls false: the first call only)
                    self.call_ids.append(new_call_id())
                    out.call_start(len(self.call_ids) - 1, self.call_ids[-1], ev.name)
            elif isinstance(ev, CallArgs) and ev.text:
                index = self._call_index.get(ev.index)
                if index is not None:
                    out.call_args(index, ev.text)
        return out.items


class _Deltas:
    """Delta objects in order, a piece merged into the one before when of the same kind."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []
        self._last: tuple[str, int] | None = None  # (kind, call index) of the last item

    def text(self, key: str, text: str) -> None:
        if self._last == (key, -1):
            self.items[-1][key] += text
        else:
            self.items.append({key: text})
            self._last = (key, -1)

    def call_start(self, index: int, call_id: str, name: str) -> None:
        call = {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        self.items.append({"tool_calls": [call]})
        self._last = ("call_start", index)

    def call_args(self, index: int, text: str) -> None:
        if self._last == ("call_args", index):
            self.items[-1]["tool_calls"][0]["function"]["arguments"] += text
        else:
            self.items.append({"tool_calls": [{"index": index, "function": {"arguments": text}}]})
            self._last = ("call_args", index)


class ReplyMessage:
    """Adds deltas up into the assistant message of a non-streamed choice."""

    def __init__(self, with_reasoning: bool) -> None:
        self.with_reasoning = with_reasoning
        self.content = ""
        self.reasoning = ""
        self.calls: list[dict[str, Any]] = []

    def add(self, deltas: list[dict[str, Any]]) -> ReplyMessage:
        for delta in deltas:
            self.content += delta.get("content", "")
            self.reasoning += delta.get("reasoning_content", "")
            for call in delta.get("tool_calls", ()):
                if "id" in call:
                    self.calls.append({"id": call["id"], "type": "function", "function": dict(call["function"])})
                else:
                    self.calls[call["index"]]["function"]["arguments"] += call["function"]["arguments"]
        return self

    def message(self) -> dict[str, Any]:
        """`{"role": "assistant", "content": <text or null>, ...}` with `reasoning_content`
        (when the reasoning is split) and `tool_calls` (when calls were made)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content or None}
        if self.with_reasoning:
            out["reasoning_content"] = self.reasoning or None
        if self.calls:
            out["tool_calls"] = self.calls
        return out


def parse_reply(plan: ReplyPlan, text: str) -> tuple[dict[str, Any], bool]:
    """The assistant message of a whole reply's `text`, and whether it made calls."""
    parser = plan.parser()
    message = ReplyMessage(plan.reasoning_parser is not None).add(parser.feed(text)).add(parser.finish())
    return message.message(), parser.calls_made


def chat_finish_reason(out: GenerateOutput, calls_made: bool) -> str | None:
    """OpenAI's finish_reason of a choice: `tool_calls` when it ended by itself (stop) having
    made calls; `length` stays `length`."""
    reason = out.finish_reason
    if reason is None:
        return None
    kind = reason.kind.value
    return "tool_calls" if calls_made and kind == "stop" else kind


def reply_plan(
    body: ChatCompletionRequest,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    tools_template: str | None = None,
) -> ReplyPlan | None:
    """The parsers of `body`'s replies on a server with these --tool-call-parser and
    --reasoning-parser settings; None when the reply is plain content (no tools, no reasoning
    split). Raises InvalidRequestError (param "tools") for tools the model may call at will
    (tool_choice auto) on a server without a tool-call parser: nothing could find the calls;
    the message names the parser `tools_template` (the chat template rendering requests with
    tools) teaches the format of, or says that it ignores tools.

    The reasoning is split unless `separate_reasoning` is false, or the request turned the
    thinking off for a parser whose replies start inside it (deepseek-r1)."""
    reasoning = None
    if reasoning_parser is not None and body.separate_reasoning:
        if thinking_on(body.chat_template_kwargs) or not REASONING_STARTS_INSIDE[reasoning_parser]:
            reasoning = reasoning_parser
    mode = body.tool_mode
    tools = FORCED if mode == "forced" else None
    if mode == "auto":
        if tool_call_parser is None:
            raise InvalidRequestError(missing_parser_message(tools_template), param="tools")
        tools = tool_call_parser
    if reasoning is None and tools is None:
        return None
    names = frozenset(t.function.name for t in body.tools) if tools is not None and body.tools else None
    return ReplyPlan(reasoning, tools, body.max_calls, body.stream_reasoning, names)


def missing_parser_message(tools_template: str | None) -> str:
    """The 400 of tools with tool_choice auto on a server without --tool-call-parser, naming
    the parser the chat template's markers point to where they point to one."""
    need = "tools with tool_choice auto need a server started with --tool-call-parser"
    forced = "tool_choice required or a named function works without one"
    suggested = suggested_tool_parser(tools_template)
    if suggested is not None:
        how = f"this model's chat template writes calls in the {suggested} format (--tool-call-parser {suggested})"
        return f"{need}: {how}; {forced}"
    if tools_template is not None and ignores_tools(tools_template):
        how = "a chat template that renders tools (this model's ignores them: give --chat-template)"
        return f"{need} and {how}; {forced}"
    return f"{need} (the model's format: qwen25, llama3, mistral, pythonic); {forced}"


def thinking_constraint(
    body: ChatCompletionRequest, reasoning_parser: str | None, constraint: Constraint | None
) -> Constraint | None:
    """The request's grammar: `constraint`, or any text when the request gives only a
    `thinking_budget` (a budget is enforced by the grammar's thinking block). Raises
    InvalidRequestError for a budget on a server without a reasoning parser."""
    if body.thinking_budget is None or constraint is not None:
        return constraint
    if reasoning_parser is None:
        raise InvalidRequestError(
            "thinking_budget needs a server started with --reasoning-parser (the model's thinking markers)",
            param="thinking_budget",
        )
    return Constraint("regex", ANY_TEXT_REGEX, "thinking_budget")


def grammar_think(
    body: ChatCompletionRequest, reasoning_parser: str | None, has_grammar: bool, max_new_tokens: int
) -> ThinkBlock | None:
    """The thinking a grammar allows before it constrains the reply, when the server has a
    reasoning parser and the request lets the model think (so JSON and forced calls land in
    the content): `<think>...</think>` (its opening optional where the template opens it) of
    at most `thinking_budget` tokens (default: DEFAULT_THINKING_SHARE of `max_new_tokens`,
    the request's output limit). None: the grammar starts with the reply."""
    if not (has_grammar and reasoning_parser is not None and thinking_on(body.chat_template_kwargs)):
        return None
    budget = body.thinking_budget
    if budget is None:
        budget = int(max_new_tokens * DEFAULT_THINKING_SHARE)
    return ThinkBlock(REASONING_STARTS_INSIDE[reasoning_parser], budget, THINK_START, THINK_END)


def keeps_special_tokens(plan: ReplyPlan | None, body: ChatCompletionRequest) -> bool | None:
    """False for `skip_special_tokens` when the tool-call format's markers are special tokens
    (llama3's <|python_tag|>, mistral's [TOOL_CALLS]) and the request left it unset; None:
    the request's own setting."""
    if (
        plan is not None
        and plan.tool_parser in SPECIAL_TOKEN_MARKERS
        and "skip_special_tokens" not in body.model_fields_set
    ):
        return False
    return None
