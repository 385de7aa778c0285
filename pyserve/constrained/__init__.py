"""Structured output: grammars compiled by xgrammar or llguidance off the loop thread
(`GrammarBackend`), what a grammar is asked to be (`GrammarKey`, `ThinkBlock`,
`JsonWhitespace`), and the checks of what a library would silently get wrong."""

from pyserve.constrained.errors import GrammarError
from pyserve.constrained.grammar_backend import (
    GRAMMAR_BACKENDS,
    GrammarBackend,
    grammar_stop_ids,
    serving_grammar_backend,
)
from pyserve.constrained.spec import ANY_JSON, MAX_JSON_WHITESPACE, GrammarKey, JsonWhitespace, ThinkBlock

__all__ = [
    "ANY_JSON",
    "GRAMMAR_BACKENDS",
    "MAX_JSON_WHITESPACE",
    "GrammarBackend",
    "GrammarError",
    "GrammarKey",
    "JsonWhitespace",
    "ThinkBlock",
    "grammar_stop_ids",
    "serving_grammar_backend",
]
