"""The pythonic tool-call format (`--tool-call-parser pythonic`): a Python list of calls with
keyword arguments, as Llama 3.2/3.3/4's pythonic templates ask for:

    [get_weather(city="Paris", days=3), get_time()]

A candidate list is held back from its `[` while it can still be one (an identifier, `(`,
balanced brackets and strings, `,` or `]` after each call); once its `]` closes, it is parsed
with `ast` (never evaluated): every element must be a call of a (dotted) name with keyword
arguments whose values are Python literals, which become the call's JSON arguments. Anything
else is content, as written. A call's events go out when its list is complete.
"""

from __future__ import annotations

import ast
import json

from pyserve.parsers.tool_call_base import CallArgs, ToolCallParser, ToolEvent

# what a candidate list expects next
_OPEN, _NAME, _BEFORE_PAREN, _ARGS, _AFTER_CALL, _DONE, _REJECTED = range(7)
_WS = " \t\r\n"


class _ListScanner:
    """Checks, character by character, that text starting with `[` can still be a list of
    calls; `state` ends at _DONE (after the `]`) or _REJECTED (at the character that ruled it
    out, not consumed)."""

    def __init__(self) -> None:
        self.state = _OPEN
        self.depth = 0  # open brackets inside a call's parentheses
        self.quote = ""  # the open string's quote character, or ""
        self.escaped = False

    def step(self, c: str) -> None:
        state = self.state
        if state == _ARGS:
            self._args_char(c)
        elif c in _WS and state in (_OPEN, _AFTER_CALL):
            return  # whitespace around a call: nothing changes
        elif state == _OPEN:
            self.state = _NAME if c.isidentifier() else _REJECTED
        elif state == _NAME:
            if c == "(":
                self.state, self.depth = _ARGS, 1
            elif c in _WS:
                self.state = _BEFORE_PAREN
            elif not (c.isidentifier() or c.isdigit() or c == "."):
                self.state = _REJECTED
        elif state == _BEFORE_PAREN:
            if c == "(":
                self.state, self.depth = _ARGS, 1
            elif c not in _WS:
                self.state = _REJECTED
        elif state == _AFTER_CALL:
            self.state = _OPEN if c == "," else _DONE if c == "]" else _REJECTED

    def _args_char(self, c: str) -> None:
        if self.quote:
            if self.escaped:
                self.escaped = False
            elif c == "\\":
                self.escaped = True
            elif c == self.quote:
                self.quote = ""
        elif c in "\"'":
            self.quote = c
        elif c in "([{":
            self.depth += 1
        elif c in ")]}":
            self.depth -= 1
            if self.depth == 0:
                self.state = _AFTER_CALL if c == ")" else _REJECTED


def parse_call_list(text: str) -> list[tuple[str, str]] | None:
    """(name, JSON arguments) of each call in `text`, a Python list of calls with literal
    keyword arguments; None if it is not one."""
    try:
        tree = ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError):
        return None
    if not isinstance(tree, ast.List) or not tree.elts:
        return None
    calls = []
    for element in tree.elts:
        if not isinstance(element, ast.Call) or element.args:
            return None
        name = _dotted_name(element.func)
        if name is None or any(kw.arg is None for kw in element.keywords):
            return None
        try:
            arguments = {kw.arg: ast.literal_eval(kw.value) for kw in element.keywords}
            calls.append((name, json.dumps(arguments, ensure_ascii=False, allow_nan=False)))
        except (ValueError, TypeError, SyntaxError, RecursionError):
            return None
    return calls


def _dotted_name(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _dotted_name(node.value)
        return None if base is None else f"{base}.{node.attr}"
    return None


class PythonicParser(ToolCallParser):
    """`[f(a=1), g()]` (see the module docstring). One per reply; loop thread."""

    def __init__(self) -> None:
        super().__init__()
        self._scanner: _ListScanner | None = None  # set while `_buf` is a candidate
        self._scanned = 0  # characters of the candidate the scanner has seen

    def _step(self, out: list[ToolEvent]) -> bool:
        """Consume what the buffer allows; False when it must wait for more text."""
        if self._scanner is None:
            k = self._buf.find("[")
            if k < 0:
                self.content.add(self._buf, out)
                self._buf = ""
                return False
            self.content.add(self._buf[:k], out)
            self._buf, self._scanner, self._scanned = self._buf[k:], _ListScanner(), 1
            return True
        scanner, buf = self._scanner, self._buf
        while self._scanned < len(buf) and scanner.state not in (_DONE, _REJECTED):
            scanner.step(buf[self._scanned])
            self._scanned += 1
        if scanner.state == _REJECTED:  # not a call list: content up to the character at fault
            self._scanned -= 1
            self._release(self._scanned, out)
            return True
        if scanner.state != _DONE:
            return False
        calls = parse_call_list(buf[: self._scanned])
        if calls is None:
            self._release(self._scanned, out)
            return True
        for name, arguments in calls:
            index = self.start_call(name, out)
            out.append(CallArgs(index, arguments))
        self._buf, self._scanner = buf[self._scanned :], None
        return True

    def _release(self, n: int, out: list[ToolEvent]) -> None:
        """The candidate's first `n` characters are content after all."""
        n = max(n, 1)  # at least its `[`, so scanning moves on
        self.content.add(self._buf[:n], out)
        self._buf, self._scanner = self._buf[n:], None

    def finish(self) -> list[ToolEvent]:
        out: list[ToolEvent] = []
        self.content.add(self._buf, out)  # content, or a list cut short
        self._buf, self._scanner = "", None
        self.content.finish(out)
        return out
