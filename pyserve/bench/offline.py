"""`pyserve bench offline`: throughput of the in-process `pyserve.Engine` on a workload.

The engine loads the model (ServerArgs flags), one warm-up request runs, then every prompt of
the workload is submitted at once as one batch call (`Engine.generate(list, list)`; for an
embedding model `Engine.encode(list)`, no output tokens), so the scheduler sees the whole
queue, as SGLang's bench_offline_throughput does. Token counts are the engine's own
(meta_info prompt_tokens / completion_tokens). No HTTP is involved.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from pyserve.bench.datasets import build_dataset
from pyserve.bench.report import write_result


def format_offline_table(result: dict[str, Any]) -> str:
    m = result["metrics"]
    rows = [
        ("model", result["model_path"]),
        ("dataset", f"{result['config']['dataset_name']} ({m['num_requests']} requests)"),
        ("duration (s)", f"{m['duration_s']:.2f}"),
        ("total input / output tokens", f"{m['total_input_tokens']} / {m['total_output_tokens']}"),
        ("request throughput (req/s)", f"{m['request_throughput']:.2f}"),
        ("input token throughput (tok/s)", f"{m['input_throughput']:.2f}"),
        ("output token throughput (tok/s)", f"{m['output_throughput']:.2f}"),
        ("total token throughput (tok/s)", f"{m['total_token_throughput']:.2f}"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [" pyserve bench offline ".center(60, "=")]
    lines += [f"{k:<{width}}  {v}" for k, v in rows]
    lines.append("=" * 60)
    return "\n".join(lines)


def run_offline(args: Any) -> dict[str, Any]:
    """Run the offline benchmark for parsed flags; print the table; return the result dict.
    Raises ServerArgsError for bad engine flags, BenchError when the model cannot load or
    the workload does not fit the model."""
    from pyserve.bench.serve import BenchError
    from pyserve.config import ServerArgs
    from pyserve.entrypoints.engine import Engine
    from pyserve.errors import InvalidRequestError

    # the whole workload is one batch call to the bench's own engine: the per-request prompt
    # limit guards a server against its clients and must not refuse it
    server_args = dataclasses.replace(ServerArgs.from_cli_args(args), max_prompts_per_request=2**31 - 1)
    try:
        engine = Engine(server_args)
    except (ValueError, OSError) as exc:
        raise BenchError(f"cannot load the model: {exc}") from None
    with engine:
        rows = build_dataset(args, engine.core.tokenizer)
        params = [{"max_new_tokens": r.output_len, "temperature": 0.0, "ignore_eos": True} for r in rows]
        run: Any = (
            (lambda prompts, p: engine.generate(prompts, p))
            if engine.core.is_generation
            else (lambda prompts, p: engine.encode(prompts))
        )
        try:
            run([rows[0].prompt], params[:1])  # warm-up, not counted
            start_s = time.perf_counter()
            outs = run([r.prompt for r in rows], params)
            duration_s = time.perf_counter() - start_s
        except InvalidRequestError as exc:
            raise BenchError(f"the workload does not fit the model: {exc}") from None
    total_in = sum(o["meta_info"]["prompt_tokens"] for o in outs)
    total_out = sum(o["meta_info"]["completion_tokens"] for o in outs)  # (0 for embeddings)
    metrics = {
        "num_requests": len(outs),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(outs) / duration_s,
        "input_throughput": total_in / duration_s,
        "output_throughput": total_out / duration_s,
        "total_token_throughput": (total_in + total_out) / duration_s,
    }
    result = {
        "kind": "offline",
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "model_path": engine.core.model_path,
        "token_count_source": "engine",
        "config": {k: v for k, v in vars(args).items()},
        "metrics": metrics,
    }
    print(format_offline_table(result))
    if args.output_file:
        write_result(args.output_file, result)
    return result
