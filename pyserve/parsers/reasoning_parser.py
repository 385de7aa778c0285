"""Reasoning parsers (`--reasoning-parser`, SGLang's names): split a reply's thinking,
`<think> ... </think>`, from its answer, incrementally.

* `deepseek-r1`: the reply starts inside the thinking (DeepSeek-R1's template opens `<think>`
  in the prompt): everything up to `</think>` is reasoning, with or without an opening
  `<think>` in the reply; a reply that never closes it is all reasoning.
* `qwen3`: reasoning only when the reply opens with `<think>` (after whitespace), up to
  `</think>`; otherwise, as with `chat_template_kwargs.enable_thinking: false`, all content.

Whitespace around the reasoning and before the answer is dropped ("<think>\\nHm.\\n</think>\\n\\n
Yes" gives "Hm." and "Yes"). Markers cut across pieces are held back until they are whole.
"""

from __future__ import annotations

from pyserve.parsers.tool_call_base import held_marker_len

THINK_START = "<think>"
THINK_END = "</think>"

# states
_BEGIN, _REASONING, _CONTENT = range(3)


class ReasoningParser:
    """Splits one reply into reasoning and content (one instance per reply; loop thread).

    starts_in_reasoning: the reply begins inside the thinking (deepseek-r1), else only an
    opening `<think>` starts it (qwen3). `feed(text)` and `finish()` return
    (reasoning_delta, content_delta); concatenated over a reply they are the same whatever the
    pieces."""

    def __init__(self, starts_in_reasoning: bool, start: str = THINK_START, end: str = THINK_END) -> None:
        self.starts_in_reasoning = starts_in_reasoning
        self.start, self.end = start, end
        self._state = _BEGIN
        self._buf = ""
        self._reasoning_ws = ""  # trailing whitespace of the reasoning, held back
        self._reasoning_started = False  # reasoning text was emitted (leading whitespace is dropped)
        self._strip_content = False  # content right after the end marker: drop its leading whitespace

    @property
    def in_reasoning(self) -> bool:
        return self._state == _REASONING or (self._state == _BEGIN and self.starts_in_reasoning)

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning: list[str] = []
        content: list[str] = []
        while self._buf:
            if not self._step(reasoning, content):
                break
        return "".join(reasoning), "".join(content)

    def _step(self, reasoning: list[str], content: list[str]) -> bool:
        """Consume what the buffer allows; False when it must wait for more text."""
        buf = self._buf
        if self._state == _BEGIN:
            stripped = buf.lstrip()
            if not stripped or (self.start.startswith(stripped) and stripped != self.start):
                return False  # whitespace, or maybe the opening marker: wait
            if stripped.startswith(self.start):
                self._buf, self._state = stripped[len(self.start) :], _REASONING
            else:
                self._state = _REASONING if self.starts_in_reasoning else _CONTENT
            return True
        if self._state == _REASONING:
            k = buf.find(self.end)
            if k < 0:
                keep = held_marker_len(buf, self.end)
                self._add_reasoning(buf[: len(buf) - keep], reasoning)
                self._buf = buf[len(buf) - keep :]
                return False
            self._add_reasoning(buf[:k], reasoning)
            self._buf, self._state, self._strip_content = buf[k + len(self.end) :], _CONTENT, True
            self._reasoning_ws = ""
            return True
        if self._strip_content:
            buf = buf.lstrip()
            if not buf:
                self._buf = ""
                return False
            self._strip_content = False
        content.append(buf)
        self._buf = ""
        return False

    def _add_reasoning(self, text: str, reasoning: list[str]) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
        body = text.rstrip()
        if not body:
            self._reasoning_ws += text
            return
        reasoning.append(self._reasoning_ws + body)
        self._reasoning_ws = text[len(body) :]
        self._reasoning_started = True

    def finish(self) -> tuple[str, str]:
        """The held-back text: a marker's start that never completed is text after all."""
        buf, self._buf = self._buf, ""
        if self._state == _BEGIN:
            if self.starts_in_reasoning:
                reasoning: list[str] = []
                self._add_reasoning(buf, reasoning)
                return "".join(reasoning), ""
            return "", buf
        if self._state == _REASONING:
            reasoning = []
            self._add_reasoning(buf, reasoning)
            return "".join(reasoning), ""
        return "", "" if self._strip_content else buf
