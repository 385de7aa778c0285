"""`pyserve bench serve`: load a running server (pyserve or any OpenAI-compatible one) with a
workload and report latency and throughput.

Steps: probe the server (GET /v1/models, and /get_model_info on pyserve), pick the model and
the tokenizer, build the workload, send the warm-up requests (not counted), send the timed
requests on the arrival schedule under the concurrency cap, then count tokens, compute the
figures, print the table and write the optional JSONL line and plot.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from typing import Any

import aiohttp

from pyserve.bench.backends import RawResult, RequestSpec, resolve_backend, send_request
from pyserve.bench.datasets import DatasetRow, build_dataset
from pyserve.bench.load import arrival_offsets_s, resolve_count_source, to_record
from pyserve.bench.metrics import compute_metrics
from pyserve.bench.report import format_table, plot_distributions, write_result


def run_async(coro: Any) -> Any:
    """Run `coro` on a fresh uvloop event loop (asyncio's own where uvloop is missing): the
    client often shares its machine with the server it measures, so its loop should be cheap."""
    try:
        import uvloop
    except ImportError:  # Windows
        return asyncio.run(coro)
    return uvloop.run(coro)


class BenchError(Exception):
    """A condition that ends the benchmark with one message and exit status 1."""


def base_url_of(args: Any) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


async def _get_json(session: aiohttp.ClientSession, url: str, headers: dict[str, str]) -> Any:
    """The JSON body of GET url, or None on a non-200 answer or a body that is not JSON."""
    async with session.get(url, headers=headers) as resp:
        if resp.status != 200:
            return None
        try:
            return await resp.json(content_type=None)
        except ValueError:
            return None


async def probe_server(base_url: str, headers: dict[str, str]) -> tuple[Any, Any]:
    """(GET /v1/models body or None, GET /get_model_info body or None). Raises BenchError
    when the server cannot be reached at all."""
    timeout = aiohttp.ClientTimeout(total=30)
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            models = await _get_json(session, base_url + "/v1/models", headers)
            info = await _get_json(session, base_url + "/get_model_info", headers)
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as exc:
        reason = str(exc) or type(exc).__name__
        raise BenchError(f"cannot reach the server at {base_url}: {reason}") from None
    return models, info


def pick_model(args: Any, models: Any) -> str | None:
    if args.model:
        return args.model
    try:
        return str(models["data"][0]["id"])
    except (TypeError, KeyError, IndexError):
        if args.backend == "pyserve":
            return None
        raise BenchError("could not read a model id from GET /v1/models; pass --model") from None


def pick_tokenizer_path(args: Any, models: Any, info: Any) -> str:
    if args.tokenizer:
        return str(args.tokenizer)
    candidates = []
    if isinstance(info, dict):
        candidates += [info.get("tokenizer_path"), info.get("model_path")]
    with contextlib.suppress(TypeError, KeyError, IndexError, AttributeError):  # no "root" given
        candidates.append(models["data"][0].get("root"))
    for path in candidates:
        if isinstance(path, str) and os.path.exists(path):
            return path
    raise BenchError("no local tokenizer for the served model; pass --tokenizer PATH (an HF folder or a .gguf file)")


def load_tokenizer(path: str) -> Any:
    from pyserve.model_loader.tokenizer import get_tokenizer

    try:
        return get_tokenizer(path)
    except Exception as exc:  # transformers raises many kinds for a bad folder
        raise BenchError(f"--tokenizer {path!r}: cannot load a tokenizer ({exc})") from None


async def run_requests(
    args: Any, base_url: str, rows: list[DatasetRow], model: str | None, headers: dict[str, str]
) -> tuple[list[RawResult], float, list[RawResult]]:
    """Send the warm-up then the timed requests. Returns (timed results in dataset order,
    the timed run's start time, warm-up results)."""
    timeout = aiohttp.ClientTimeout(total=args.request_timeout_s)
    # force_close: aiohttp closes each connection once its response is read, so every request
    # connects anew (the same policy for every server a comparison loads)
    connector = aiohttp.TCPConnector(limit=0, force_close=getattr(args, "disable_keepalive", False))
    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None

    def spec(row: DatasetRow) -> RequestSpec:
        return RequestSpec(
            row.prompt,
            row.output_len,
            model,
            not args.disable_ignore_eos,
            args.extra_request_body,
            stream=not getattr(args, "disable_stream", False),
        )

    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:

        async def one(row: DatasetRow) -> RawResult:
            if limit is None:
                return await send_request(session, args.backend, base_url, spec(row), headers)
            async with limit:
                return await send_request(session, args.backend, base_url, spec(row), headers)

        warmup_rows = [rows[i % len(rows)] for i in range(args.warmup_requests)]
        warmup = list(await asyncio.gather(*(one(r) for r in warmup_rows)))
        failed = [w for w in warmup if w.error is not None]
        if failed:
            raise BenchError(f"warm-up request failed ({failed[0].error}): {failed[0].error_detail}")

        offsets = arrival_offsets_s(len(rows), args.request_rate, args.burstiness, args.seed)
        bar = None
        if not args.disable_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(rows), desc=f"bench {args.backend}", unit="req")

        async def timed(row: DatasetRow) -> RawResult:
            result = await one(row)
            if bar is not None:
                bar.update(1)
            return result

        start_s = time.perf_counter()
        tasks = []
        for row, offset in zip(rows, offsets):
            delay = start_s + offset - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(timed(row)))
        results = list(await asyncio.gather(*tasks))
        if bar is not None:
            bar.close()
    return results, start_s, warmup


def run_serve(args: Any, note: str | None = None) -> dict[str, Any]:
    """Run `pyserve bench serve` for parsed flags; print `note` (the workload's defaults in
    use) once the server answers, then the table; return the result dict (the JSONL line).
    Raises BenchError. An SGLang --backend name (sglang, vllm, ...) is
    replaced in `args` by the backend it speaks (pyserve, openai, openai-chat)."""
    args.backend = resolve_backend(args.backend)
    base_url = base_url_of(args)
    api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    models, info = run_async(probe_server(base_url, headers))
    if note:
        print(note, flush=True)
    model = pick_model(args, models)
    tokenizer_path = pick_tokenizer_path(args, models, info)
    tokenizer = load_tokenizer(tokenizer_path)
    rows = build_dataset(args, tokenizer)
    results, start_s, _ = run_async(run_requests(args, base_url, rows, model, headers))
    source = resolve_count_source(args.token_count, results)
    try:
        records = [to_record(r, row.prompt_len, source, tokenizer) for r, row in zip(results, rows)]
    except ValueError as exc:
        raise BenchError(f"--token-count usage: {exc}; use --token-count tokenizer") from None
    metrics = compute_metrics(records, start_s)
    config = {k: v for k, v in vars(args).items() if k not in ("api_key", "func")}
    result: dict[str, Any] = {
        "kind": "serve",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "base_url": base_url,
        "model": model,
        "tokenizer": tokenizer_path,
        "token_count_source": source,
        "config": config,
        "metrics": metrics,
    }
    if args.output_details:
        result["requests"] = [
            {
                "prompt_len": r.prompt_len,
                "output_len": r.output_len,
                "ttft_ms": r.ttft_ms,
                "e2e_ms": r.e2e_ms,
                "tpot_ms": r.tpot_ms,
                "itl_ms": r.itl_ms(),
                "chunk_num_tokens": r.chunk_num_tokens,
                "error": r.error,
                "error_detail": r.error_detail,
            }
            for r in records
        ]
    print(format_table(result))
    if args.output_file:
        write_result(args.output_file, result)
    if args.plot:
        plot_distributions(args.plot, records, title=f"{args.backend} {model or ''} @ {base_url}")
    return result
