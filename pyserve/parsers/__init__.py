"""Parsers of model output text (no imports: config.py reads the names from here).

Tool-call parsers split a reply into content and function calls (`--tool-call-parser`),
reasoning parsers split `<think>...</think>` into reasoning_content (`--reasoning-parser`); both
work incrementally on streamed text. The parsers live in the modules of this package
(registry.py makes them by name); this file only names them, with SGLang's names.
"""

from __future__ import annotations

# --tool-call-parser names (SGLang's): qwen25 (and its aliases hermes, qwen), llama3, mistral, pythonic
TOOL_CALL_PARSERS = ("qwen25", "qwen", "hermes", "llama3", "mistral", "pythonic")
# --reasoning-parser names (SGLang's)
REASONING_PARSERS = ("deepseek-r1", "qwen3")

__all__ = ["TOOL_CALL_PARSERS", "REASONING_PARSERS"]
