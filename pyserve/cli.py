"""The `pyserve` command: `pyserve serve [flags]` (also `python -m pyserve serve`) and
`pyserve bench {serve,offline,one-batch} [flags]` (see pyserve.bench.cli).

Every mistake in the flags ends with one line on stderr and exit status 2: an unknown flag
with the closest known one, a bad value with the flag it belongs to."""

from __future__ import annotations

import argparse
import logging
import sys

from pyserve import __version__
from pyserve.cli_parser import OneLineArgumentParser, subparser, unrecognized_message
from pyserve.config import ServerArgs, ServerArgsError, setup_logging
from pyserve.server_flags import add_cli_args

logger = logging.getLogger("pyserve")


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineArgumentParser(prog="pyserve", description="pyserve: an LLM inference server")
    parser.add_argument("--version", action="version", version=f"pyserve {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over HTTP (native and OpenAI APIs)")
    add_cli_args(serve)
    # Listed for --help only: main() hands `bench ...` to pyserve.bench.cli before parsing.
    sub.add_parser(
        "bench",
        help="benchmark: serve (load a server), offline (Engine), host (simulated device), one-batch",
        add_help=False,
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] == "bench":
        from pyserve.bench.cli import main as bench_main

        return bench_main(argv[1:], prog="pyserve bench")
    parser = build_parser()
    ns, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the command they were given to
        sub = subparser(parser, ns.command)
        sub.error(unrecognized_message(sub, unknown, "a model is given as --model-path {arg}"))
    if ns.command == "serve":
        try:
            args = ServerArgs.from_cli_args(ns)
        except ServerArgsError as exc:
            subparser(parser, "serve").error(str(exc))
        if args.trust_remote_code:
            setup_logging(args.log_level)
            logger.info("--trust-remote-code changes nothing: pyserve runs no code from model checkpoints")
        if args.node_rank > 0:  # a further machine of a tensor-parallel group: ranks only
            from pyserve.engine.rank_launch import serve_node

            return serve_node(args)
        from pyserve.server.launch import StartupError, launch_server

        try:
            return launch_server(args)
        except StartupError as exc:  # a bad --model-path or a busy port: before anything loads
            print(f"pyserve: error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # Ctrl-C before the server took the signals (imports, a download)
            print("pyserve: interrupt, exiting now", file=sys.stderr)
            return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
