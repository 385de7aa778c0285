"""`LLGuidanceCompiler`: a request's grammar (`GrammarKey`) compiled by the llguidance library
(`--grammar-backend llguidance`), and the worker's matcher operations over its matchers.

JSON schemas compile with the server's whitespace (`whitespace_pattern`) and never leniently:
a keyword llguidance does not implement is a compile error, so nothing is silently dropped.
Objects that list their properties are closed to others (`closed_objects`), as xgrammar's
strict mode closes them.
EBNF (GBNF) grammars go through llguidance's own converter to its Lark syntax; structural tags
in SGLang's form become llguidance's structural tags (xgrammar's own format is xgrammar's
only). A thinking block goes in front in Lark: an optional `<think>`, a lazy lexeme that stops
at `</think>` with `max_tokens` set to the think budget, `</think>` (forced once the budget
ends the lexeme), a whitespace gap, then the answer's grammar by reference.
Executor threads (compiles); worker thread (matchers).
"""

from __future__ import annotations

import json
from typing import Any

import llguidance
import llguidance.hf
import llguidance.torch
import torch
from llguidance.gbnf_to_lark import gbnf_to_lark
from transformers import PreTrainedTokenizerBase

from pyserve.constrained.errors import GrammarError, reason_of
from pyserve.constrained.spec import ANY_JSON, GrammarKey, JsonWhitespace, ThinkBlock


class LLGuidanceCompiler:
    """Compiles grammars for one tokenizer's vocabulary with llguidance.

    vocab_size: the model's logits width; stop_token_ids: the model's EOS ids (a finished
    grammar allows only these). Building the tokenizer reads the whole vocabulary (about a
    second): construct it off the loop thread. `compile(key)` runs on any thread and raises
    GrammarError.
    """

    name = "llguidance"

    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, vocab_size: int, stop_token_ids: list[int], whitespace: JsonWhitespace
    ) -> None:
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer,  # type: ignore[arg-type]
            n_vocab=vocab_size,
            eos_token=list(stop_token_ids),
        )
        self.stop_token_ids = list(stop_token_ids)
        self.whitespace = whitespace

    def compile(self, key: GrammarKey) -> LLGuidanceGrammar:
        grammar = self._grammar(key)
        if key.think is not None:
            grammar = _think_then(key.think, grammar, self.whitespace)
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise GrammarError(key.kind, reason_of(matcher.get_error()))
        return LLGuidanceGrammar(matcher, self.stop_token_ids)

    def _json_options(self) -> dict[str, Any]:
        ws = self.whitespace
        # never lenient: a keyword llguidance cannot enforce is an error, not dropped
        options: dict[str, Any] = {"lenient": False}
        if ws.compact:  # xgrammar's compact separators, so both backends write the same JSON
            return options | {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        return options | {"whitespace_flexible": True, "whitespace_pattern": ws.gap_regex}

    def _grammar(self, key: GrammarKey) -> str:
        kind, text = key.kind, key.text
        if kind == "json_schema":
            return self._json_grammar(kind, text)
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "ebnf":
            try:
                return llguidance.LLMatcher.grammar_from_lark(gbnf_to_lark(text))
            except Exception as exc:  # the converter raises its own error and ValueError
                raise GrammarError(kind, reason_of(exc)) from None
        if kind == "structural_tag":
            return self._structural_tag(text)
        raise GrammarError(kind, f"unknown grammar kind {kind!r}")

    def _json_grammar(self, kind: str, text: str) -> str:
        if text == ANY_JSON:
            schema: Any = {}
        else:
            try:
                schema = json.loads(text)
            except json.JSONDecodeError as exc:
                raise GrammarError(kind, f"not JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise GrammarError(kind, "a JSON schema is an object (or true / false)")
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(
                closed_objects(schema),
                overrides=self._json_options(),  # type: ignore[arg-type]
            )
        except ValueError as exc:
            raise GrammarError(kind, reason_of(exc)) from None

    def _structural_tag(self, text: str) -> str:
        try:
            spec: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise GrammarError("structural_tag", f"not JSON: {exc}") from None
        if not (isinstance(spec, dict) and "structures" in spec):
            raise GrammarError(
                "structural_tag",
                'llguidance reads SGLang\'s form ({"structures": [...], "triggers": [...]}); xgrammar\'s own '
                "structural-tag format needs --grammar-backend xgrammar",
            )
        try:
            triggers = [str(t) for t in spec["triggers"]]
            tags = []
            for s in spec["structures"]:
                begin = s["begin"]
                trigger = next((t for t in triggers if t and begin.startswith(t)), None)
                if trigger is None:
                    raise GrammarError("structural_tag", f"no trigger starts the begin {begin!r}")
                schema = s["schema"]
                if not isinstance(schema, dict):
                    raise GrammarError("structural_tag", f"the schema of {begin!r} is not an object")
                schema = dict(closed_objects(schema), **{"x-guidance": self._json_options()})
                tags.append(llguidance.StructTag(trigger=trigger, begin=begin, grammar=schema, end=s["end"]))
        except (KeyError, TypeError, AttributeError) as exc:
            raise GrammarError(
                "structural_tag", f"each structure needs begin, schema and end, and triggers a list ({exc!r})"
            ) from None
        if not tags:
            raise GrammarError("structural_tag", "no structures")
        return llguidance.StructTag.to_grammar(tags, assume_special=False)


# the keywords whose value is one subschema, a map of them, or a list of them
_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "contains", "not", "if", "then", "else")
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_LISTS = ("anyOf", "oneOf", "prefixItems")
# an object schema that names any of these is left open (closing it could refuse what they allow)
_OPEN_BESIDE = ("additionalProperties", "unevaluatedProperties", "patternProperties", "allOf", "anyOf", "oneOf", "$ref")


def closed_objects(schema: Any, closable: bool = True) -> Any:
    """`schema` with `additionalProperties: false` on each object schema that lists
    `properties` and says nothing of other ones: what xgrammar's strict mode does, so both
    backends write the same objects. A small model left free to add properties (JSON Schema's
    default) writes long made-up ones. The members of an `allOf` stay open (closing each would
    refuse the others' properties)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _ONE:
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    for key in _MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    if isinstance(out.get("items"), list):
        out["items"] = [closed_objects(sub) for sub in out["items"]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [closed_objects(sub, closable=False) for sub in out["allOf"]]
    properties = out.get("properties")
    listed_required = out.get("required")
    required: list[Any] = listed_required if isinstance(listed_required, list) else []
    # an object that requires a property it does not list stays open: that property is
    # another one, which closing would forbid
    if (
        closable
        and isinstance(properties, dict)
        and not any(k in out for k in _OPEN_BESIDE)
        and all(name in properties for name in required)
    ):
        out["additionalProperties"] = False
    return out


def _think_then(think: ThinkBlock, answer: str, whitespace: JsonWhitespace) -> str:
    """The grammar of `think` followed by `answer` (an llguidance grammar: Lark text or its
    JSON form), as llguidance's JSON form."""
    try:
        spec = json.loads(answer)
        grammars = list(spec["grammars"])
    except (json.JSONDecodeError, KeyError, TypeError):
        grammars = [{"lark_grammar": answer}]
    old = grammars[0].get("name")
    grammars = [_renamed(g, old, "pyserve_answer") for g in grammars]
    grammars[0] = dict(grammars[0], name="pyserve_answer")
    end = json.dumps(think.end)
    opening = json.dumps(think.start)
    thinking = f"{opening}? think" if think.starts_inside else f"({opening} think)?"
    gap = whitespace.gap_regex
    # `stop` makes the thinking a lazy lexeme that ends at the first end marker and eats it;
    # the rule after it writes the marker again (llguidance matches the two as one text) and
    # is what the model must write once max_tokens ends the lexeme early
    lark = "\n".join(
        [
            f"start: {thinking}{' GAP' if gap else ''} @pyserve_answer",
            f"think: think_text {end}",
            f"think_text[stop={end}, max_tokens={think.max_tokens}]: /(?s:.*)/",
            *([f"GAP: /{gap.replace('/', chr(92) + '/')}/"] if gap else []),
        ]
    )
    return json.dumps({"grammars": [{"name": "pyserve_think", "lark_grammar": lark}, *grammars]})


def _renamed(grammar: dict[str, Any], old: str | None, new: str) -> dict[str, Any]:
    """`grammar` with its references to the grammar named `old` (`@old`) naming `new`."""
    out = dict(grammar)
    lark = out.get("lark_grammar")
    if isinstance(lark, str) and old:
        out["lark_grammar"] = lark.replace("@" + old, "@" + new)
    return out


class LLGuidanceMatcher:
    """One request's llguidance matcher, with xgrammar's matcher methods. Worker thread."""

    __slots__ = ("_m", "stop_token_ids")

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: list[int]) -> None:
        self._m = matcher
        self.stop_token_ids = stop_token_ids

    def accept_token(self, token: int) -> bool:
        return bool(self._m.consume_token(token))

    def fill_next_token_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        llguidance.torch.fill_next_token_bitmask(self._m, bitmask, index)

    def is_terminated(self) -> bool:
        return bool(self._m.is_stopped())


class LLGuidanceGrammar:
    """A compiled llguidance grammar: a validated matcher each request's matcher copies."""

    def __init__(self, template: llguidance.LLMatcher, stop_token_ids: list[int]) -> None:
        self._template = template
        self.stop_token_ids = stop_token_ids

    def new_matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._template.deep_copy(), self.stop_token_ids)

    @staticmethod
    def new_ops() -> LLGuidanceOps:
        return LLGuidanceOps()


class LLGuidanceOps:
    """The worker's operations on llguidance matchers, one by one. Worker thread."""

    @staticmethod
    def fill(matchers: list[Any], bitmask: torch.Tensor, indices: list[int]) -> None:
        for matcher, index in zip(matchers, indices):
            matcher.fill_next_token_bitmask(bitmask, index)

    @staticmethod
    def accept(matchers: list[Any], tokens: list[int]) -> list[bool]:
        return [m.accept_token(t) for m, t in zip(matchers, tokens)]
