"""Structured output: grammars compiled by xgrammar off the loop thread (`GrammarBackend`)."""

from pyserve.constrained.grammar_backend import GrammarBackend, GrammarError

__all__ = ["GrammarBackend", "GrammarError"]
