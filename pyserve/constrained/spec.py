"""What a grammar is asked to be: the request's constraint (`GrammarKey`), the thinking block a
reasoning model may write before it (`ThinkBlock`), and how much whitespace JSON may hold
between its tokens (`JsonWhitespace`). Plain data, shared by both grammar backends; a key is
also the backend's cache key, so equal keys compile once."""

from __future__ import annotations

from dataclasses import dataclass

# SGLang's marker for "any JSON value" in json_schema
ANY_JSON = "$$ANY$$"

# Whitespace characters allowed in one gap between JSON tokens (after `{`, around `:` and `,`,
# before `}`), by default: a newline and eight spaces, which holds JSON indented two spaces a
# level four levels deep (or four spaces, two levels). A model that favours whitespace (small
# models do: a newline is often their likeliest token after `{`) then spends at most this many
# tokens a gap instead of its whole budget (tests/e2e/test_structured_stories.py).
MAX_JSON_WHITESPACE = 10

# the whitespace JSON allows between tokens (RFC 8259, section 2)
_JSON_WS_CLASS = r"[\x20\x0A\x0D\x09]"


@dataclass(frozen=True)
class JsonWhitespace:
    """How much whitespace the grammars built from JSON (json_schema, json_object, tool calls,
    structural tags' schemas) allow between tokens; one per server.

    max_count: at most this many whitespace characters per gap (None: any number, which only
    `pattern` may ask for); compact: none at all, separators `", "` and `": "`
    (`--constrained-json-disable-any-whitespace`); pattern: a regex every gap matches
    (`--constrained-json-whitespace-pattern`; llguidance only: xgrammar has no such option).
    """

    max_count: int | None = MAX_JSON_WHITESPACE
    compact: bool = False
    pattern: str | None = None

    @property
    def gap_regex(self) -> str:
        """A regex of one gap (used between `</think>` and the answer too)."""
        if self.pattern is not None:
            return self.pattern
        if self.compact:
            return ""
        return _JSON_WS_CLASS + (f"{{0,{self.max_count}}}" if self.max_count is not None else "*")


@dataclass(frozen=True)
class ThinkBlock:
    """A reasoning model's thinking before the constrained answer: `start` (optional when the
    reply begins inside the thinking, `starts_inside`: deepseek-r1's template opens it in the
    prompt; else the whole block is optional, as qwen3 may answer without thinking), any text
    without `end`, then `end`. The thinking holds at most `max_tokens` tokens: past them the
    grammar allows only `end`, so a model that never closes it still answers."""

    starts_inside: bool
    max_tokens: int
    start: str = "<think>"
    end: str = "</think>"


@dataclass(frozen=True)
class GrammarKey:
    """A request's grammar: `kind` (json_schema, regex, ebnf or structural_tag), its `text`
    (ANY_JSON for any JSON value), and the thinking allowed before it (None: the grammar
    constrains the reply from its first token)."""

    kind: str
    text: str
    think: ThinkBlock | None = None
