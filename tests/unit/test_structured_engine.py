"""Structured output through the Engine on stories260k: outputs follow their grammar, greedy
grammar outputs do not depend on overlap or on the batch around them, bad grammars fail with a
400-type error before any token (the second from the cache), the grammar queue waits for the
compile without holding anyone else up, and nothing leaks."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time

import pytest
import torch

from pyserve.errors import InvalidRequestError
from tests.conftest import make_stories_engine, wait_engine_idle

PROMPT = "Once upon a time"
SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
)
GRAMMARS = [
    {"json_schema": SCHEMA},
    {"regex": "(cat|dog)s? [0-9]{2}"},
    {"ebnf": 'root ::= "yes" | "no" | "maybe " root'},
]


@pytest.fixture(scope="module", params=[False, True], ids=["overlap", "no-overlap"])
def engine(request, stories_path):
    eng = make_stories_engine(
        stories_path, 4096, disable_overlap_schedule=request.param, constrained_json_disable_any_whitespace=True
    )
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def greedy_reference(stories_path):
    """Each grammar's greedy output, alone, on an engine with overlap on."""
    eng = make_stories_engine(stories_path, 4096, constrained_json_disable_any_whitespace=True)
    try:
        return [eng.generate(PROMPT, {**g, "temperature": 0, "max_new_tokens": 40}) for g in GRAMMARS]
    finally:
        eng.shutdown()


def test_outputs_follow_their_grammar(greedy_reference):
    schema_out, regex_out, ebnf_out = greedy_reference
    if schema_out["meta_info"]["finish_reason"]["type"] == "stop":
        value = json.loads(schema_out["text"])
        assert set(value) == {"name", "age"} and isinstance(value["age"], int) and len(value["name"]) <= 6
    else:
        assert schema_out["meta_info"]["finish_reason"] == {"type": "length", "length": 40}
    assert regex_out["meta_info"]["finish_reason"]["type"] == "stop"
    assert re.fullmatch("(cat|dog)s? [0-9]{2}", regex_out["text"])
    assert (
        re.fullmatch("(maybe )*(yes|no)", ebnf_out["text"])
        or ebnf_out["meta_info"]["finish_reason"]["type"] == "length"
    )


def test_greedy_grammar_outputs_do_not_depend_on_overlap_or_the_batch(engine, greedy_reference):
    alone = [engine.generate(PROMPT, {**g, "temperature": 0, "max_new_tokens": 40}) for g in GRAMMARS]
    assert [o["text"] for o in alone] == [o["text"] for o in greedy_reference]
    # inside a batch of unconstrained (and sampled) requests
    params = [{"temperature": 1.0, "seed": i, "max_new_tokens": 30} for i in range(5)]
    params[1:1] = [{**g, "temperature": 0, "max_new_tokens": 40} for g in GRAMMARS]
    mixed = engine.generate([PROMPT] * len(params), params)
    assert [o["text"] for o in mixed[1:4]] == [o["text"] for o in greedy_reference]
    wait_engine_idle(engine)


def test_seeded_grammar_outputs_repeat(engine):
    sp = {"json_schema": SCHEMA, "temperature": 1.0, "seed": 7, "max_new_tokens": 48}
    first, second = engine.generate([PROMPT, PROMPT], [sp, sp])
    assert first["text"] == second["text"] == engine.generate(PROMPT, sp)["text"]


def test_a_bad_grammar_is_a_400_before_any_token_and_cached(engine):
    backend = engine.core.scheduler.grammar_queue.backend
    for attempt in range(2):
        hits = backend.cache_hits
        with pytest.raises(InvalidRequestError) as info:
            list(engine.generate(PROMPT, {"regex": "(ab", "max_new_tokens": 8}, stream=True))
        assert info.value.param == "regex"
        assert str(info.value) == (
            "regex: invalid regular expression: Regex parsing error at position 4: The parenthesis is not closed."
        )
        assert backend.cache_hits == hits + attempt  # the second one is answered from the cache
    assert engine.generate(PROMPT, {"max_new_tokens": 4, "temperature": 0})["meta_info"]["completion_tokens"] == 4
    wait_engine_idle(engine)


def test_at_most_one_grammar_per_request(engine):
    with pytest.raises(InvalidRequestError) as info:
        engine.generate(PROMPT, {"regex": "a", "ebnf": 'root ::= "a"'})
    assert str(info.value) == (
        "sampling_params: give at most one of json_schema, regex, ebnf and structural_tag (got regex, ebnf)"
    )


def test_ignore_eos_still_ends_when_the_grammar_does(engine):
    out = engine.generate(PROMPT, {"ebnf": 'root ::= "yes"', "ignore_eos": True, "max_new_tokens": 20})
    assert out["text"] == "yes"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": 2}


class _HeldBackend:
    """A grammar backend whose compiles finish only when the test says so."""

    def __init__(self, real):
        self.real = real
        self.futures: list[concurrent.futures.Future] = []
        self.cache_hits = 0
        self.begun: set[tuple[str, str]] = set()  # compiles the test says are running
        self.released: list[tuple[str, str]] = []

    def compile(self, key):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self.futures.append((fut, key))
        return fut

    def started(self, key):
        return (key.kind, key.text) in self.begun

    def release(self, key):
        self.released.append((key.kind, key.text))

    def release_all(self):
        for fut, key in self.futures:
            fut.set_result(self.real.compile(key).result(timeout=30))


def test_the_grammar_queue_holds_only_its_own_requests(stories_path):
    eng = make_stories_engine(stories_path, 4096)
    try:
        queue = eng.core.scheduler.grammar_queue
        held = _HeldBackend(queue.backend)
        queue.backend = held
        results = {}

        def run(name, sp):
            results[name] = eng.generate(PROMPT, sp, rid=name)

        waiting = threading.Thread(target=run, args=("g", {"regex": "[0-9]{4}", "temperature": 0}))
        waiting.start()
        while len(queue) == 0:
            time.sleep(0.01)
        # an unconstrained request runs to the end while the grammar compiles
        assert eng.generate(PROMPT, {"max_new_tokens": 8, "temperature": 0})["meta_info"]["completion_tokens"] == 8
        assert "g" not in results and len(queue) == 1
        held.release_all()
        waiting.join(timeout=30)
        assert re.fullmatch("[0-9]{4}", results["g"]["text"])
        # an abort takes a request out of the queue
        aborted = threading.Thread(target=run, args=("a", {"regex": "[a-z]{3}"}))
        aborted.start()
        while len(queue) == 0:
            time.sleep(0.01)
        assert eng.abort_request("a") == 1
        aborted.join(timeout=30)
        assert results["a"]["meta_info"]["finish_reason"]["type"] == "abort" and len(queue) == 0
        assert held.released == [("regex", "[a-z]{3}")]  # nobody waits for it: its compile is dropped
        # the limit counts from the grammar's own compile: waiting behind others does not fail
        queue.timeout_s = 0.2
        errors = []

        def timed_out():
            try:
                eng.generate(PROMPT, {"ebnf": 'root ::= "x"'})
            except InvalidRequestError as exc:
                errors.append(exc)

        slow = threading.Thread(target=timed_out)
        slow.start()
        time.sleep(1.0)  # five limits pass while its compile has not begun
        assert not errors and len(queue) == 1
        held.begun.add(("ebnf", 'root ::= "x"'))
        slow.join(timeout=30)
        (error,) = errors
        assert str(error).startswith("ebnf: the grammar did not compile within 0.2 s") and error.param == "ebnf"
        wait_engine_idle(eng)
    finally:
        eng.shutdown()


def test_grammar_backend_none_refuses_grammars(stories_path):
    eng = make_stories_engine(stories_path, 2048, grammar_backend="none")
    try:
        with pytest.raises(InvalidRequestError, match=r"^json_schema: structured output is off on this server"):
            eng.generate(PROMPT, {"json_schema": SCHEMA})
        assert eng.generate(PROMPT, {"max_new_tokens": 3})["meta_info"]["completion_tokens"] == 3
    finally:
        eng.shutdown()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_grammars_on_cuda_follow_their_grammar_with_overlap_on_and_off(stories_path):
    """On CUDA the matchers take step N's ids from the asynchronous copy while step N+1's
    forward runs: outputs still follow their grammar, and are the same with overlap off."""
    texts = []
    for no_overlap in (False, True):
        eng = make_stories_engine(
            stories_path,
            4096,
            device="cuda",
            dtype="float32",
            disable_overlap_schedule=no_overlap,
            constrained_json_disable_any_whitespace=True,
        )
        try:
            params = [{**g, "temperature": 0, "max_new_tokens": 40} for g in GRAMMARS]
            params += [{"temperature": 1.0, "seed": i, "max_new_tokens": 30} for i in range(4)]
            outs = eng.generate([PROMPT] * len(params), params)
            texts.append([o["text"] for o in outs[:3]])
            wait_engine_idle(eng)
        finally:
            eng.shutdown()
    assert texts[0] == texts[1]
    assert re.fullmatch("(cat|dog)s? [0-9]{2}", texts[0][1])
