"""The serving parts of benches/bench_structured.py: grammar requests against unconstrained ones
on the same engine, in the same run.

Part `serve`:
  * simulated device (the `SimulatedRunner` of `pyserve bench host`, a fixed step time, the
    default model's 49,152-token vocabulary): 64 concurrent requests with a JSON schema against
    64 without, decoding max_new_tokens each; output tok/s of each and their ratio (goal: at
    least 0.9). Each case runs twice, alternating, and the better of the two counts.
  * the same on a real model (stories260k on CPU, greedy).
  * compile stall: while 16 unconstrained streams decode on the simulated device, a request
    with a 200-property schema arrives; the longest gap between a stream's tokens before and
    during its compile.
Part `compile`: cold compile time of a few schemas with the default model's tokenizer.

Checked in `serve` (the problems are returned; bench_structured.py exits with status 1 on any):
every request of every case ends by stop or length (none aborted); an unconstrained one has
MAX_NEW tokens; a constrained one that stopped is a JSON object of the schema (a `title` and a
`story` string), one cut by length has MAX_NEW tokens; every stall-test stream gets its 400
tokens and the wide-schema request ends by stop or length.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from typing import Any

STEP_MS = 5.0
MAX_NEW = 64
PROMPT = "Write a JSON object that describes a short story."
# a schema whose value is mostly free text: structure first, then a long string
STORY_SCHEMA = json.dumps(
    {
        "type": "object",
        "properties": {"title": {"type": "string"}, "story": {"type": "string"}},
        "required": ["title", "story"],
    }
)


def wide_schema(properties: int) -> str:
    """An object schema with `properties` required fields of mixed types."""
    kinds = [{"type": "integer"}, {"type": "string"}, {"type": "boolean"}, {"type": "number"}]
    props = {f"field_{i}": kinds[i % len(kinds)] for i in range(properties)}
    return json.dumps({"type": "object", "properties": props, "required": list(props)})


def _requests(n: int, grammar: dict[str, str], seed0: int) -> list[Any]:
    from pyserve.io_struct import SingleReq
    from pyserve.sampling_params import SamplingParams

    return [
        SingleReq(
            text=PROMPT,
            input_ids=None,
            sampling_params=SamplingParams(max_new_tokens=MAX_NEW, temperature=0, ignore_eos=True, **grammar),
            rid=f"bench-{seed0}-{i}",
        )
        for i in range(n)
    ]


def output_problems(outs: list[Any], n: int, constrained: bool) -> list[str]:
    """What is wrong with the outputs of n requests (see the module docstring); [] if nothing."""
    from pyserve.forward_batch_info import FinishKind

    problems = [f"{len(outs)} outputs for {n} requests"] if len(outs) != n else []
    for k, o in enumerate(outs):
        kind = o.finish_reason.kind if o.finish_reason is not None else None
        if kind not in (FinishKind.STOP, FinishKind.LENGTH):
            problems.append(f"request {k} ended by {o.finish_reason}")
        elif kind == FinishKind.LENGTH or not constrained:
            if len(o.output_ids) != MAX_NEW:
                problems.append(f"request {k}: {len(o.output_ids)} tokens, not {MAX_NEW} ({kind})")
        else:
            try:
                value = json.loads(o.text)
                ok = isinstance(value, dict) and all(isinstance(value.get(f), str) for f in ("title", "story"))
            except ValueError:
                ok = False
            if not ok:
                problems.append(f"request {k}: stopped with text not of the schema: {o.text[:80]!r}")
    return problems


async def _throughput(core: Any, n: int, grammar: dict[str, str], seed0: int) -> tuple[float, int, int, list[str]]:
    """(output tok/s, output tokens, requests that ended before MAX_NEW, output problems) of n
    concurrent requests."""
    reqs = _requests(n, grammar, seed0)
    start = time.perf_counter()
    outs = await core.generate_all(reqs)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.output_ids) for o in outs)
    problems = output_problems(outs, n, bool(grammar))
    return tokens / elapsed, tokens, sum(1 for o in outs if len(o.output_ids) < MAX_NEW), problems


async def _compare(core: Any, n: int) -> dict[str, Any]:
    """Alternate unconstrained and constrained runs twice; the better of each."""
    await _throughput(core, 4, {"json_schema": STORY_SCHEMA}, -1)  # compile and warm up
    free_runs, json_runs = [], []
    for rep in range(2):
        free_runs.append(await _throughput(core, n, {}, 2 * rep))
        json_runs.append(await _throughput(core, n, {"json_schema": STORY_SCHEMA}, 2 * rep + 1))
    free, constrained = max(free_runs), max(json_runs)
    return {
        "free_tok_s": free[0],
        "json_tok_s": constrained[0],
        "ratio": constrained[0] / free[0],
        "json_tokens": constrained[1],
        "json_ended_early": constrained[2],
        "problems": [p for run in free_runs + json_runs for p in run[3]],
    }


async def _compile_stall(core: Any, streams: int) -> dict[str, Any]:
    """Longest inter-token gap of `streams` decoding streams before and while a 200-property
    schema compiles (its request is submitted mid-way); "problems" lists streams that did not
    get their 400 tokens and a wide request that did not end by stop or length."""
    from pyserve.forward_batch_info import FinishKind
    from pyserve.io_struct import SingleReq
    from pyserve.sampling_params import SamplingParams

    gaps_before: list[float] = []
    gaps_during: list[float] = []
    compiling = asyncio.Event()

    problems: list[str] = []

    async def stream(i: int) -> None:
        sp = SamplingParams(max_new_tokens=400, temperature=0, ignore_eos=True)
        last, tokens = None, 0
        async for out in core.generate(
            SingleReq(text=PROMPT, input_ids=None, sampling_params=sp, stream=True, rid=f"s{i}")
        ):
            now = time.perf_counter()
            if last is not None:
                (gaps_during if compiling.is_set() else gaps_before).append(now - last)
            last, tokens = now, len(out.output_ids)
        if tokens != 400:
            problems.append(f"stall stream {i}: {tokens} tokens, not 400")

    async def wide() -> float:
        await asyncio.sleep(0.6)
        compiling.set()
        start = time.perf_counter()
        sp = SamplingParams(max_new_tokens=8, temperature=0, json_schema=wide_schema(200))
        out = await core.generate_all([SingleReq(text=PROMPT, input_ids=None, sampling_params=sp, rid="wide")])
        reason = out[0].finish_reason
        if reason is None or reason.kind not in (FinishKind.STOP, FinishKind.LENGTH):
            problems.append(f"the 200-property request ended by {reason}")
        return time.perf_counter() - start

    results = await asyncio.gather(*(stream(i) for i in range(streams)), wide())
    return {
        "max_gap_before_ms": 1e3 * max(gaps_before),
        "max_gap_during_ms": 1e3 * max(gaps_during),
        "median_gap_ms": 1e3 * statistics.median(gaps_before + gaps_during),
        "wide_request_s": float(results[-1]),
        "problems": problems,
    }


def _simulated_core() -> Any:
    from pyserve.config import ServerArgs
    from pyserve.engine.engine_core import EngineCore
    from pyserve.model_executor.simulated_runner import SimulatedRunner
    from pyserve.model_loader.default_model import default_model_path
    from pyserve.model_loader.tokenizer import get_tokenizer

    path = default_model_path()
    tok = get_tokenizer(path)
    eos = {tok.eos_token_id} if tok.eos_token_id is not None else set()
    runner = SimulatedRunner(len(tok), eos, max_total_tokens=1 << 16, context_len=2048, decode_base_ms=STEP_MS)
    args = ServerArgs(model_path=path, max_running_requests=128, log_level="warning", stats_interval_s=3600.0)
    return EngineCore(args, model_runner=runner)


async def _serve_simulated(n: int) -> dict[str, Any]:
    core = _simulated_core()
    await core.start()
    try:
        out = await _compare(core, n)
        out["stall"] = await _compile_stall(core, 16)
        return out
    finally:
        await core.shutdown()


async def _serve_real(model_path: str, n: int) -> dict[str, Any]:
    from pyserve.config import ServerArgs
    from pyserve.engine.engine_core import EngineCore

    args = ServerArgs(model_path=model_path, max_running_requests=128, log_level="warning", stats_interval_s=3600.0)
    core = EngineCore(args)
    await core.start()
    try:
        return await _compare(core, n)
    finally:
        await core.shutdown()


def serve_report(n: int = 64, real_model: str | None = None) -> dict[str, Any]:
    """Run the `serve` part and print its table; returns the figures ("rows") and the output
    problems of every case ("problems", [] when every output is as it must be)."""
    sim = asyncio.run(_serve_simulated(n))
    rows = [("simulated device", sim)]
    if real_model:
        rows.append((f"real model ({real_model.rstrip('/').split('/')[-1]})", asyncio.run(_serve_real(real_model, n))))
    print(f"\n{n} concurrent requests x {MAX_NEW} tokens, JSON schema against none ({STEP_MS:g} ms simulated step)")
    print(f"{'engine':>28} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>7} {'json ended early':>17}")
    for name, r in rows:
        print(
            f"{name:>28} {r['free_tok_s']:11.0f} {r['json_tok_s']:11.0f} {r['ratio']:7.3f} "
            f"{r['json_ended_early']:>9}/{n} req"
        )
    stall = sim["stall"]
    print(
        "\ncompile stall (16 streams decoding; a 200-property schema arrives): longest gap "
        f"{stall['max_gap_before_ms']:.1f} ms before, {stall['max_gap_during_ms']:.1f} ms while it compiles "
        f"(median gap {stall['median_gap_ms']:.1f} ms; that request took {stall['wide_request_s']:.2f} s)"
    )
    problems = [f"{name}: {p}" for name, r in rows for p in r["problems"]] + stall["problems"]
    return {"rows": rows, "problems": problems}


def compile_report() -> dict[str, float]:
    """Cold compile times (ms) of a few schemas with the default model's tokenizer, on each
    grammar backend."""
    from pyserve.constrained import GrammarKey, JsonWhitespace, serving_grammar_backend
    from pyserve.model_loader.default_model import default_model_path
    from pyserve.model_loader.tokenizer import get_tokenizer

    tok = get_tokenizer(default_model_path())
    cases = {
        "story object (2 strings)": ("json_schema", STORY_SCHEMA),
        "20 properties": ("json_schema", wide_schema(20)),
        "200 properties": ("json_schema", wide_schema(200)),
        "any JSON": ("json_schema", "$$ANY$$"),
        "regex (date)": ("regex", r"\d{4}-\d{2}-\d{2}"),
        "ebnf (yes/no list)": ("ebnf", 'root ::= item ("," item)*\nitem ::= "yes" | "no"'),
    }
    times = {}
    for backend_name in ("xgrammar", "llguidance"):
        start = time.perf_counter()
        backend = serving_grammar_backend(backend_name, tok, len(tok), [tok.eos_token_id], JsonWhitespace())
        assert backend is not None
        setup_ms = 1e3 * (time.perf_counter() - start)
        print(f"\n{backend_name} compile times, {len(tok)}-token vocabulary (tokenizer info: {setup_ms:.0f} ms, once)")
        for name, (kind, text) in cases.items():
            key = GrammarKey(kind, text)
            start = time.perf_counter()
            backend.compile(key).result()
            times[f"{backend_name}: {name}"] = cold_ms = 1e3 * (time.perf_counter() - start)
            start = time.perf_counter()
            backend.compile(key).result()
            cached_us = 1e6 * (time.perf_counter() - start)
            print(f"{name:>28}: {cold_ms:8.1f} ms cold, {cached_us:6.1f} us cached")
        backend.shutdown()
    return times
