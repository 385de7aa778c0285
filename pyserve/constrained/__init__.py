"""Structured output: grammars compiled by xgrammar off the loop thread (`GrammarBackend`)."""

from pyserve.constrained.grammar_backend import (
    GrammarBackend,
    GrammarError,
    grammar_stop_ids,
    serving_grammar_backend,
)

__all__ = ["GrammarBackend", "GrammarError", "grammar_stop_ids", "serving_grammar_backend"]
