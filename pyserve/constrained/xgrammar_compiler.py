"""`XGrammarCompiler`: a request's grammar (`GrammarKey`) compiled by the xgrammar library,
and the worker's matcher operations over xgrammar's matchers (`XGrammarOps`).

JSON schemas are compiled with the server's whitespace bound (xgrammar's
`max_whitespace_cnt`); a keyword xgrammar would ignore (schema_check) or a pattern it would
compile wrongly (regex_check) is refused. A thinking block goes in front through xgrammar's
structural tags: a sequence of the optional `<think>`, `any_text` without `</think>` limited to
the think budget (xgrammar enforces `max_tokens` in the masks it fills), `</think>`, a
whitespace gap, then the answer's own grammar. Executor threads (compiles); worker thread
(matchers).
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr
from transformers import PreTrainedTokenizerBase

from pyserve.constrained.errors import GrammarError, reason_of
from pyserve.constrained.regex_check import optional_group_with_repeat
from pyserve.constrained.schema_check import schema_patterns, tag_schemas, unenforced_keyword
from pyserve.constrained.spec import ANY_JSON, GrammarKey, JsonWhitespace, ThinkBlock


class XGrammarCompiler:
    """Compiles grammars for one tokenizer's vocabulary with xgrammar.

    vocab_size: the model's logits width (at least the tokenizer's; the extra ids are never
    allowed); stop_token_ids: the model's EOS ids (a finished grammar allows only these).
    `compile(key)` runs on any thread (xgrammar compiles in C++ without the GIL) and raises
    GrammarError.
    """

    name = "xgrammar"

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int], whitespace: JsonWhitespace
    ) -> None:
        if whitespace.pattern is not None:
            raise ValueError("xgrammar takes no whitespace pattern (--constrained-json-whitespace-pattern)")
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
        # the backend's cache keeps failures too and bounds its size; xgrammar's would keep neither
        self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.whitespace = whitespace

    def compile(self, key: GrammarKey) -> XGrammarGrammar:
        kind = key.kind
        try:
            if key.think is None:
                return XGrammarGrammar(self._compile_answer(key))
            answer = self._answer_grammar(key)
            think = _think_then(key.think, answer, self.whitespace)
            return XGrammarGrammar(self._compiler.compile_structural_tag(json.dumps(think)))
        except GrammarError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError, ValueError and its own types
            raise GrammarError(kind, reason_of(exc)) from None

    def _compile_answer(self, key: GrammarKey) -> xgr.CompiledGrammar:
        compiler, kind, text = self._compiler, key.kind, key.text
        if kind == "json_schema":
            if text == ANY_JSON:  # the empty schema: any value, with the whitespace bound
                text = "{}"
            _check_enforceable(text)
            return compiler.compile_json_schema(text, **self._json_options())
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "ebnf":
            return compiler.compile_grammar(text, root_rule_name="root")
        if kind == "structural_tag":
            return compiler.compile_structural_tag(self._structural_tag(text))
        raise GrammarError(kind, f"unknown grammar kind {kind!r}")

    def _answer_grammar(self, key: GrammarKey) -> xgr.Grammar:
        """The answer's grammar, uncompiled (to follow a thinking block)."""
        kind, text = key.kind, key.text
        if kind == "json_schema":
            if text == ANY_JSON:
                text = "{}"
            _check_enforceable(text)
            return xgr.Grammar.from_json_schema(text, **self._json_options())
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "ebnf":
            return xgr.Grammar.from_ebnf(text, root_rule_name="root")
        if kind == "structural_tag":
            return xgr.Grammar.from_structural_tag(self._structural_tag(text))
        raise GrammarError(kind, f"unknown grammar kind {kind!r}")

    def _json_options(self) -> dict[str, Any]:
        ws = self.whitespace
        if ws.compact:
            return {"any_whitespace": False}
        return {"any_whitespace": True, "max_whitespace_cnt": ws.max_count}

    def _structural_tag(self, text: str) -> str:
        """xgrammar's structural-tag JSON for `text`: SGLang's form ({"structures": [{"begin",
        "schema", "end"}], "triggers": [...]}) becomes xgrammar's triggered tags; every JSON
        schema in it gets the whitespace bound unless it sets its own."""
        try:
            spec: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError("structural_tag", f"not JSON: {exc}") from None
        for schema in tag_schemas(spec):
            _check_schema("structural_tag", schema)
        if isinstance(spec, dict) and "structures" in spec:
            spec = _sglang_structural_tag(spec)
        if isinstance(spec, dict) and "format" in spec:
            spec = dict(spec, format=self._bounded(spec["format"]))
        return json.dumps(spec)

    def _bounded(self, node: Any) -> Any:
        """`node` (a structural-tag format) with the whitespace bound on each json_schema format."""
        if isinstance(node, list):
            return [self._bounded(item) for item in node]
        if not isinstance(node, dict):
            return node
        out = {k: self._bounded(v) if k != "json_schema" else v for k, v in node.items()}
        if out.get("type") == "json_schema" and "max_whitespace_cnt" not in out and not self.whitespace.compact:
            out["max_whitespace_cnt"] = self.whitespace.max_count
        return out


def _sglang_structural_tag(spec: dict[str, Any]) -> dict[str, Any]:
    """SGLang's structural tag as xgrammar's triggered-tags format: free text in which each
    trigger starts one of the tags that begin with it."""
    try:
        tags = [
            {
                "type": "tag",
                "begin": s["begin"],
                "content": {"type": "json_schema", "json_schema": s["schema"]},
                "end": s["end"],
            }
            for s in spec["structures"]
        ]
        triggers = [str(t) for t in spec["triggers"]]
    except (KeyError, TypeError) as exc:
        raise GrammarError(
            "structural_tag", f"each structure needs begin, schema and end, and triggers a list ({exc!r})"
        ) from None
    return {"type": "structural_tag", "format": {"type": "triggered_tags", "triggers": triggers, "tags": tags}}


def _think_then(think: ThinkBlock, answer: xgr.Grammar, whitespace: JsonWhitespace) -> dict[str, Any]:
    """The structural tag of `think` followed by `answer`."""
    block: list[dict[str, Any]] = [
        {"type": "any_text", "excludes": [think.end], "max_tokens": think.max_tokens},
        {"type": "const_string", "value": think.end},
    ]
    start = {"type": "const_string", "value": think.start}
    if think.starts_inside:
        thinking: list[dict[str, Any]] = [{"type": "optional", "content": start}, *block]
    else:
        thinking = [{"type": "optional", "content": {"type": "sequence", "elements": [start, *block]}}]
    gap = whitespace.gap_regex or None
    elements = [
        *thinking,
        *([{"type": "regex", "pattern": gap}] if gap else []),
        {"type": "grammar", "grammar": str(answer)},
    ]
    return {"type": "structural_tag", "format": {"type": "sequence", "elements": elements}}


def _check_enforceable(text: str) -> None:
    """Raise GrammarError for a schema xgrammar would not enforce as written (text that is not
    JSON is left to xgrammar's own message)."""
    try:
        schema = json.loads(text)
    except json.JSONDecodeError:
        return
    _check_schema("json_schema", schema)


def _check_schema(kind: str, schema: Any) -> None:
    found = unenforced_keyword(schema)
    if found is not None:
        raise GrammarError(kind, f"xgrammar cannot enforce {found}")
    for pattern, where in schema_patterns(schema):
        group = optional_group_with_repeat(pattern)
        if group is not None:
            raise GrammarError(
                kind,
                f"xgrammar compiles the optional group {group!r} of the pattern at {where} wrongly (it "
                "accepts strings the pattern does not); write the group without `?`, or serve with "
                "--grammar-backend llguidance",
            )


class XGrammarGrammar:
    """A compiled xgrammar grammar (host data; it travels to the worker in the request's
    sampling row), which makes each request's matcher."""

    __slots__ = ("compiled",)

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        self.compiled = compiled

    def new_matcher(self) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(self.compiled)

    @staticmethod
    def new_ops() -> XGrammarOps:
        return XGrammarOps()


class XGrammarOps:
    """The worker's operations on xgrammar matchers, batched by xgrammar. Worker thread."""

    def __init__(self) -> None:
        self._batch = xgr.BatchGrammarMatcher()

    def fill(self, matchers: list[Any], bitmask: torch.Tensor, indices: list[int]) -> None:
        """Write each matcher's allowed-token mask into bitmask[indices[i]] (int32 [rows, words])."""
        if len(matchers) == 1:
            matchers[0].fill_next_token_bitmask(bitmask, indices[0])
        else:
            self._batch.batch_fill_next_token_bitmask(matchers, bitmask, indices)

    @staticmethod
    def accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
        """Each matcher takes its token; whether it was allowed."""
        return list(xgr.BatchGrammarMatcher.batch_accept_token(matchers, tokens))
