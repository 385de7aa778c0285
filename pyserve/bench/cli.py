"""Command line of the bench tool: `pyserve bench {serve,offline,one-batch} [flags]`
(also `python -m pyserve.bench ...`).

Flag names follow SGLang's bench_serving / bench_offline_throughput / bench_one_batch where
they exist, and so do its --backend names (sglang, vllm, ...: pyserve.bench.backends). The
workload's defaults (50 prompts of up to 128 tokens in, up to 64 out) make a run of one to
two minutes on two CPU cores with the default model, SmolLM2-135M; SGLang's (1000 prompts of
up to 1024 in and out) are a GPU's. Every failure the user can cause (a bad flag, an unreachable
server, a missing file) ends with ONE line on stderr and a non-zero exit status: 2 for flags,
1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from typing import Any

from pyserve.bench.backends import BACKENDS, SGLANG_BACKENDS
from pyserve.bench.load import TOKEN_COUNT_SOURCES
from pyserve.cli_parser import DefaultsHelpFormatter, OneLineArgumentParser, subparser, unrecognized_message

__all__ = ["OneLineArgumentParser", "build_parser", "check_args", "main"]

DATASETS = ("random", "random-ids", "sharegpt", "generated-shared-prefix", "jsonl")
# the workload flags whose defaults the run names when the user leaves them out
WORKLOAD_DEFAULTS = {"num_prompts": 50, "random_input_len": 128, "random_output_len": 64}


def _json_object(text: str) -> dict[str, Any]:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return obj


def add_dataset_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    a(
        "--dataset-name",
        choices=DATASETS,
        default="random",
        help="workload: random token ids as text (random-ids: decoded once, not re-encoded to "
        "length), a sharegpt JSON file, generated-shared-prefix groups, or a jsonl file",
    )
    a("--dataset-path", default=None, help="local file for sharegpt (JSON) and jsonl; nothing is downloaded")
    a(
        "--num-prompts",
        type=int,
        default=WORKLOAD_DEFAULTS["num_prompts"],
        help="requests in the timed run (not generated-shared-prefix)",
    )
    a("--seed", type=int, default=1, help="seed of the workload and of the arrival times")
    a(
        "--random-input-len",
        type=int,
        default=WORKLOAD_DEFAULTS["random_input_len"],
        help="prompt tokens of random and random-ids (the most, unless --random-range-ratio is 1)",
    )
    a(
        "--random-output-len",
        type=int,
        default=WORKLOAD_DEFAULTS["random_output_len"],
        help="output tokens of random and random-ids (the most, unless --random-range-ratio is 1)",
    )
    a(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform integers in [max(1, int(len * ratio)), len]; 1.0 = fixed lengths",
    )
    a("--sharegpt-output-len", type=int, default=None, help="output length of every sharegpt request")
    a("--sharegpt-context-len", type=int, default=None, help="skip pairs longer than this in total")
    a("--gsp-num-groups", type=int, default=64, help="generated-shared-prefix: groups")
    a("--gsp-prompts-per-group", type=int, default=16, help="generated-shared-prefix: prompts per group")
    a("--gsp-system-prompt-len", type=int, default=2048, help="generated-shared-prefix: shared prefix tokens")
    a("--gsp-question-len", type=int, default=128, help="generated-shared-prefix: tokens after the prefix")
    a("--gsp-output-len", type=int, default=256, help="generated-shared-prefix: output tokens")


def add_serve_args(p: argparse.ArgumentParser) -> None:
    a = p.add_argument
    sglang_names = ", ".join(f"{k} = {v}" for k, v in SGLANG_BACKENDS.items())
    a(
        "--backend",
        choices=(*BACKENDS, *SGLANG_BACKENDS),
        default="pyserve",
        metavar="{" + ",".join(BACKENDS) + ",sglang,vllm,...}",
        help="pyserve: POST /generate; openai: /v1/completions; openai-chat: /v1/chat/completions; "
        "openai-embeddings: /v1/embeddings (an embedding server: requests/s, input tok/s, latency); "
        f"SGLang bench_serving's names: {sglang_names}",
    )
    a("--base-url", default=None, help="e.g. http://127.0.0.1:30000 (overrides --host/--port)")
    a("--host", default="127.0.0.1", help="the server's host")
    a("--port", type=int, default=30000, help="the server's port")
    a("--model", default=None, help="model name sent to OpenAI routes; default: first id of GET /v1/models")
    a(
        "--tokenizer",
        default=None,
        help="tokenizer (HF folder or .gguf) for the workload and token counts; default: the model "
        "path the server reports, if it exists here",
    )
    a("--api-key", default=None, help="bearer token; default: $OPENAI_API_KEY")
    add_dataset_args(p)
    a("--request-rate", type=float, default=math.inf, help="requests per second; inf sends all at once")
    a("--burstiness", type=float, default=1.0, help="gamma shape of arrival gaps; 1.0 = Poisson")
    a("--max-concurrency", type=int, default=None, help="most requests in flight at once")
    a("--warmup-requests", type=int, default=1, help="requests sent before the timed run, not counted")
    a("--disable-ignore-eos", action="store_true", help="let requests stop at EOS")
    a(
        "--disable-stream",
        action="store_true",
        help="ask for whole responses, not streams (TTFT is then the whole latency)",
    )
    a(
        "--extra-request-body",
        type=_json_object,
        default={},
        help="JSON object merged into each request body (pyserve backend: into sampling_params)",
    )
    a(
        "--token-count",
        choices=TOKEN_COUNT_SOURCES,
        default="auto",
        help="count tokens from the server's usage or with the tokenizer; auto = usage when reported",
    )
    a("--request-timeout-s", type=float, default=6 * 3600.0, help="a request not answered by then fails")
    a(
        "--disable-keepalive",
        action="store_true",
        help="a new connection per request, closed after its response (default: connections are "
        "pooled and reused); for servers that close a connection they announced as kept alive",
    )
    a("--output-file", default=None, help="append one JSON line with all figures and the configuration")
    a("--output-details", action="store_true", help="include per-request figures in the JSON line")
    a("--plot", default=None, metavar="FILE.png", help="save TTFT and ITL histograms (needs matplotlib)")
    a("--disable-tqdm", action="store_true", help="no progress bar")


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from pyserve.server_flags import add_cli_args

    add_cli_args(p, seed_alias=False)  # --seed is the workload's here


def build_parser(prog: str = "pyserve bench") -> OneLineArgumentParser:
    parser = OneLineArgumentParser(prog=prog, description="pyserve's load and latency tool")
    sub = parser.add_subparsers(
        dest="bench_command",
        metavar="{serve,offline,host,one-batch}",
        required=True,
        parser_class=OneLineArgumentParser,
    )
    fmt = DefaultsHelpFormatter  # every flag's default in --help
    serve = sub.add_parser("serve", help="load a running server (pyserve or OpenAI-compatible)", formatter_class=fmt)
    add_serve_args(serve)
    offline = sub.add_parser("offline", help="in-process Engine throughput on a workload", formatter_class=fmt)
    add_engine_args(offline)
    add_dataset_args(offline)
    offline.add_argument("--output-file", default=None, help="append one JSON line with all figures")
    host = sub.add_parser(
        "host", help="the host path against a simulated device (in-process server)", formatter_class=fmt
    )
    from pyserve.bench.host import add_host_args

    add_host_args(host)
    one = sub.add_parser("one-batch", help="static batch: prefill and per-step decode latency", formatter_class=fmt)
    from pyserve.bench.one_batch import add_one_batch_args

    add_one_batch_args(one)
    return parser


def check_args(args: argparse.Namespace) -> str | None:
    """The first invalid flag value as a message, or None."""
    positive = [
        "num_prompts",
        "random_input_len",
        "random_output_len",
        "gsp_num_groups",
        "gsp_prompts_per_group",
        "gsp_system_prompt_len",
        "gsp_question_len",
        "gsp_output_len",
        "sharegpt_output_len",
        "sharegpt_context_len",
        "max_concurrency",
    ]
    for name in positive:
        value = getattr(args, name, None)
        if value is not None and value < 1:
            return f"--{name.replace('_', '-')}: got {value}; must be >= 1"
    ratio = getattr(args, "random_range_ratio", None)
    if ratio is not None and not 0.0 <= ratio <= 1.0:
        return f"--random-range-ratio: got {ratio}; must be in [0, 1]"
    if args.bench_command == "host":
        for name in ("clients", "decode_step_ms"):
            bad = [v for v in getattr(args, name) if not v > 0]
            if bad:
                return f"--{name.replace('_', '-')}: got {bad[0]}; must be > 0"
        for name in ("input_len", "output_len", "requests_per_client"):
            if getattr(args, name) < 1:
                return f"--{name.replace('_', '-')}: got {getattr(args, name)}; must be >= 1"
        for name in ("decode_us_per_req", "extend_us_per_token"):
            if not getattr(args, name) >= 0:
                return f"--{name.replace('_', '-')}: got {getattr(args, name)}; must be >= 0"
        if args.client_cpus is not None:
            from pyserve.bench.host import parse_cpu_list
            from pyserve.bench.serve import BenchError

            try:
                parse_cpu_list(args.client_cpus)
            except BenchError as exc:
                return str(exc)
    if args.bench_command == "serve":
        if not args.request_rate > 0:
            return f"--request-rate: got {args.request_rate}; must be > 0 (inf: all at once)"
        if not (args.burstiness > 0 and math.isfinite(args.burstiness)):
            return f"--burstiness: got {args.burstiness}; must be > 0"
        if args.warmup_requests < 0:
            return f"--warmup-requests: got {args.warmup_requests}; must be >= 0"
        if not args.request_timeout_s > 0:
            return f"--request-timeout-s: got {args.request_timeout_s}; must be > 0"
        if args.base_url and not args.base_url.startswith(("http://", "https://")):
            return f"--base-url: got {args.base_url!r}; must start with http:// or https://"
        if not 0 < args.port < 65536:
            return f"--port: got {args.port}; must be in 1..65535"
        if args.plot:
            try:
                import matplotlib  # noqa: F401
            except ImportError:
                return "--plot needs matplotlib: pip install matplotlib"
    return None


def flags_given(parser: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The dests of `parser`'s flags that `argv` gives: by their whole name, as `--flag=value`
    or as a prefix of one flag only (argparse's abbreviations); up to a lone `--`."""
    dests = {opt: action.dest for action in parser._actions for opt in action.option_strings}
    given: set[str] = set()
    for arg in argv:
        if arg == "--":
            break
        name = arg.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        matches = {dests[name]} if name in dests else {d for opt, d in dests.items() if opt.startswith(name)}
        if len(matches) == 1:
            given |= matches
    return given


def defaults_note(args: argparse.Namespace, given: set[str]) -> str | None:
    """The line telling the user which workload defaults this run takes, e.g. `50 prompts of
    1-128 tokens in, 1-64 out (defaults; change with --num-prompts, --random-input-len,
    --random-output-len)`, or None when every flag that shapes the workload was given
    (`given`: the dests of the flags on the command line, as flags_given finds them)."""
    if args.dataset_name == "generated-shared-prefix":
        return None
    shaping = ["num_prompts"]
    if args.dataset_name in ("random", "random-ids"):
        shaping += ["random_input_len", "random_output_len"]
    defaulted = [name for name in shaping if name not in given]
    if not defaulted:
        return None
    if len(shaping) == 1:
        return f"{args.num_prompts} prompts (default; change with --num-prompts)"
    flags = ", ".join(f"--{name.replace('_', '-')}" for name in defaulted)

    def span(length: int) -> str:
        low = max(1, int(length * args.random_range_ratio))
        return str(length) if low == length else f"{low}-{length}"

    what = f"{args.num_prompts} prompts of {span(args.random_input_len)} tokens in, {span(args.random_output_len)} out"
    return f"{what} ({'defaults' if len(defaulted) > 1 else 'default'}; change with {flags})"


def main(argv: list[str] | None = None, prog: str = "pyserve bench") -> int:
    """Run a bench command; returns the exit status (0 ok, 1 failure, 2 bad flags)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(prog)
    args, unknown = parser.parse_known_args(argv)
    sub_prog = f"{prog} {args.bench_command}"
    sub = subparser(parser, args.bench_command)
    if unknown:
        print(f"{sub_prog}: error: {unrecognized_message(sub, unknown)} (see {sub_prog} --help)", file=sys.stderr)
        return 2
    problem = check_args(args)
    if problem:
        print(f"{sub_prog}: error: {problem}", file=sys.stderr)
        return 2
    from pyserve.bench.datasets import DatasetError
    from pyserve.bench.serve import BenchError
    from pyserve.config import ServerArgsError

    try:
        if args.bench_command == "serve":
            from pyserve.bench.serve import run_serve

            run_serve(args, defaults_note(args, flags_given(sub, argv)))
        elif args.bench_command == "offline":
            from pyserve.bench.offline import run_offline

            run_offline(args)
        elif args.bench_command == "host":
            from pyserve.bench.host import run_host

            run_host(args)
        else:
            from pyserve.bench.one_batch import run_one_batch

            run_one_batch(args)
    except ServerArgsError as exc:
        print(f"{sub_prog}: error: {exc}", file=sys.stderr)
        return 2
    except (BenchError, DatasetError, OSError) as exc:
        print(f"{sub_prog}: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{sub_prog}: interrupted", file=sys.stderr)
        return 130
    return 0
