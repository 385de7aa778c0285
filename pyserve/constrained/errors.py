"""`GrammarError`, the refusal of a request's grammar by either backend, and `reason_of`, a
library's message as a one-line reason."""

from __future__ import annotations

import re

# xgrammar prefixes its messages with "[hh:mm:ss] /path/file.cc:line: "; the reason follows
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] [^:]+:\d+: ")
# ... and its assertion failures with "Check failed: (cond) is false: "
_CHECK_PREFIX = re.compile(r"^Check failed: \(.*?\) is false: ")

_NOUNS = {
    "json_schema": "JSON schema",
    "regex": "regular expression",
    "ebnf": "grammar",
    "structural_tag": "structural tag",
}


class GrammarError(ValueError):
    """A grammar the backend refused. `kind` is the request field it came from (json_schema,
    regex, ebnf or structural_tag); the message quotes the compiler's reason."""

    def __init__(self, kind: str, reason: str) -> None:
        super().__init__(f"{kind}: invalid {_NOUNS.get(kind, 'grammar')}: {reason}")
        self.kind = kind


def reason_of(exc: BaseException | str) -> str:
    """A compiler's message (an exception or text) as one line, without xgrammar's log prefix
    (time, source file and line)."""
    text = str(exc).strip()
    if not text:
        return type(exc).__name__ if isinstance(exc, BaseException) else "refused"
    return _CHECK_PREFIX.sub("", _LOG_PREFIX.sub("", text.splitlines()[0]))
