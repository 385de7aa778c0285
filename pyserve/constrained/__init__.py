"""Structured output: grammars compiled by xgrammar off the loop thread (`GrammarBackend`)."""

from pyserve.constrained.grammar_backend import GrammarBackend, GrammarError, grammar_stop_ids

__all__ = ["GrammarBackend", "GrammarError", "grammar_stop_ids"]
