"""pyserve's server against llama.cpp's `llama-server` on CPU, same GGUF, same client: output
tokens/s, TTFT, ITL and resident memory at 1 and 8 concurrent streams.

llama-server is built once into `--cache-dir` (default ~/.cache/pyserve-llamacpp/0.3.36/),
outside the repository, from the llama.cpp sources vendored by the `llama-cpp-python==0.3.36`
sdist, with cmake and ninja from PyPI in a venv of their own there:
  pip download --no-deps --no-binary llama-cpp-python llama-cpp-python==0.3.36
  cmake -S <sdist>/vendor/llama.cpp -B build -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF
        -DGGML_AVX2=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF (+ the offline flags in CMAKE_FLAGS)
  cmake --build build --target llama-server
The servers (the model defaults to pyserve's default, SmolLM2-135M-Instruct Q4_1):
  llama-server -m GGUF -t 2 -np 8 -c 4096 --host 127.0.0.1 --port PORT --no-webui
  python -m pyserve serve --port PORT --log-level warning --model-path GGUF [--pyserve-args]
Each is loaded, per number of streams C (with its number of prompts N), by:
  python -m pyserve bench serve --backend openai --base-url http://127.0.0.1:PORT
         --tokenizer GGUF --dataset-name random --random-input-len 128 --random-output-len 64
         --random-range-ratio 1.0 --num-prompts N --max-concurrency C --warmup-requests 1
         --token-count tokenizer --output-file RUNS.jsonl --disable-tqdm
(the model id comes from each server's GET /v1/models; requests ignore EOS, so each server
generates 64 tokens per request; the client counts them by re-tokenizing the text returned
with the GGUF's tokenizer, which can give a few fewer, on both sides alike).

Fairness: the same client command line (same port, same seed, hence the same prompts), the
same GGUF, one server at a time (the machine has few cores), the servers alternated
(pyserve, llama-server, pyserve, llama-server for `--rounds 2`). Resident memory is read from
/proc/PID/status of the server process (each is one process) after its runs: VmRSS (now) and
VmHWM (peak).

llama-server closes the connection after every streamed response while announcing keep-alive
(its chunked content provider returns false at the stream's end, which cpp-httplib treats as
a failed write). The bench client reuses such a connection when it has not yet seen it closed;
that request fails at once, before the server sees it ("connection" errors, counted in the
`failed` column; the figures are those of the completed requests). Any other failure stops
the script.

Printed: a table per number of streams (server, round, output tok/s, mean and median TTFT,
median ITL, RSS, failed requests), the medians over rounds, and the ratios pyserve /
llama-server of output tok/s at each number of streams and of peak RSS. `--output-file` gets
all of it (with each run's full `bench serve` metrics) as JSON.

Usage: python benches/bench_vs_llamacpp.py [--rounds 2] [--model-path GGUF]
                                           [--pyserve-args "--quantization none"]
                                           [--streams 1 8] [--num-prompts 8 32]
                                           [--cache-dir DIR] [--output-file FILE.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx
from serve_process import start_server

from pyserve.model_loader.default_model import default_model_path

VERSION = "0.3.36"
CMAKE_FLAGS = [
    "-G",
    "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX2=ON",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS client needed
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would download the web UI; the server then has none
]
LLAMA = "llama-server"
PYSERVE = "pyserve"
# the table's columns: (row key, heading, format)
COLUMNS = (
    ("output_tok_s", "out tok/s", ".1f"),
    ("mean_ttft_ms", "TTFT mean", ".1f"),
    ("median_ttft_ms", "TTFT med", ".1f"),
    ("median_itl_ms", "ITL med", ".1f"),
    ("rss_mb", "RSS MB", ".1f"),
    ("peak_rss_mb", "peak MB", ".1f"),
    ("failed", "failed", "g"),
)


def run_logged(cmd: list[str], **kwargs: Any) -> None:
    print("$ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def build_llama_server(cache: Path) -> Path:
    """The llama-server binary in `cache`, built there first if missing."""
    binary = cache / "build" / "bin" / "llama-server"
    if binary.exists():
        return binary
    start = time.monotonic()
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        # only this package from source: with `:all:`, pip would also build cmake itself
        # from source to read the sdist's metadata
        run_logged(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"]
            + [f"llama-cpp-python=={VERSION}", "-d", str(cache)]
        )
    src = cache / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if not src.exists():
        with tarfile.open(sdist) as tar:
            prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
            tar.extractall(cache, members=[m for m in tar if m.name.startswith(prefix)], filter="data")
    tools = cache / "tools"
    if not (tools / "bin" / "ninja").exists():
        run_logged([sys.executable, "-m", "venv", str(tools)])
        run_logged([str(tools / "bin" / "python"), "-m", "pip", "install", "--quiet", "cmake", "ninja"])
    env = os.environ | {"PATH": f"{tools / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    cmake = str(tools / "bin" / "cmake")
    run_logged([cmake, "-S", str(src), "-B", str(cache / "build"), *CMAKE_FLAGS], env=env)
    run_logged([cmake, "--build", str(cache / "build"), "--target", "llama-server"], env=env)
    print(f"built llama-server in {(time.monotonic() - start) / 60:.1f} min", flush=True)
    return binary


def start_llama_server(binary: Path, gguf: str, port: int, log: Path, timeout_s: float = 300.0) -> subprocess.Popen:
    """llama-server on `gguf` (its log to `log`), returned once its /health answers 200."""
    cmd = [str(binary), "-m", gguf, "-t", "2", "-np", "8", "-c", str(8 * 512), "--host", "127.0.0.1"]
    cmd += ["--port", str(port), "--no-webui"]
    print("$ " + shlex.join(cmd), flush=True)
    with log.open("ab") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout_s
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"llama-server did not start; see {log}")
        time.sleep(0.2)


@contextlib.contextmanager
def running(proc: subprocess.Popen) -> Iterator[subprocess.Popen]:
    """`proc`, terminated (killed after 60 s) on the way out, whatever happens."""
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def memory_mb(pid: int) -> dict[str, float]:
    """{"rss_mb": VmRSS, "peak_rss_mb": VmHWM} of a live process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {"rss_mb": int(fields["VmRSS"].split()[0]) / 1024, "peak_rss_mb": int(fields["VmHWM"].split()[0]) / 1024}


def client_command(port: int, gguf: str, streams: int, num_prompts: int, runs_file: Path) -> list[str]:
    return [
        sys.executable, "-m", "pyserve", "bench", "serve", "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", gguf,
        "--dataset-name", "random", "--random-input-len", "128", "--random-output-len", "64",
        "--random-range-ratio", "1.0", "--num-prompts", str(num_prompts), "--max-concurrency", str(streams),
        "--warmup-requests", "1", "--token-count", "tokenizer", "--output-file", str(runs_file), "--disable-tqdm",
    ]  # fmt: skip


def run_client(cmd: list[str], runs_file: Path) -> dict[str, Any]:
    """Run the bench command; its metrics (the line it appended to `runs_file`)."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    metrics = json.loads(runs_file.read_text().splitlines()[-1])["metrics"]
    if set(metrics["errors"]) - {"connection"}:
        raise RuntimeError(f"{metrics['failed']} requests failed: {metrics['errors']}")
    return metrics


def median_of(rows: list[dict[str, Any]], server: str, key: str, streams: int | None = None) -> float:
    return statistics.median(r[key] for r in rows if r["server"] == server and streams in (None, r["streams"]))


def table_line(server: str, round_: str, values: dict[str, Any]) -> str:
    return f"{server:<13} {round_:>6}" + "".join(f"{values[key]:>11{fmt}}" for key, _, fmt in COLUMNS)


def on_sigterm(signum: int, frame: object) -> NoReturn:
    sys.exit(128 + signum)  # unwinds through `running`, which stops the server


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="the GGUF both servers load (default: pyserve's default model)")
    p.add_argument("--pyserve-args", default="", help="extra `pyserve serve` flags, one string")
    p.add_argument("--rounds", type=int, default=2, help="pyserve then llama-server, this many times")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8], help="concurrent streams (default: 1 8)")
    p.add_argument("--num-prompts", type=int, nargs="+", default=[8, 32], help="per --streams entry (default: 8 32)")
    p.add_argument("--port", type=int, default=30231, help="both servers, one at a time")
    p.add_argument("--cache-dir", type=Path, default=Path.home() / ".cache" / "pyserve-llamacpp" / VERSION)
    p.add_argument("--output-file", type=Path, help="write the runs, medians and ratios here as JSON")
    args = p.parse_args()
    if len(args.num_prompts) != len(args.streams):
        p.error("--num-prompts needs one count per --streams entry")
    signal.signal(signal.SIGTERM, on_sigterm)
    gguf = os.path.abspath(args.model_path or default_model_path())
    binary = build_llama_server(args.cache_dir)
    print(f"llama-server: {binary}", flush=True)
    runs_file = args.cache_dir / "runs.jsonl"
    runs_file.unlink(missing_ok=True)
    pyserve_args = ["--model-path", gguf, *shlex.split(args.pyserve_args)]

    def start(server: str) -> subprocess.Popen:
        if server == PYSERVE:
            print("$ python -m pyserve serve " + shlex.join(pyserve_args), flush=True)
            return start_server(pyserve_args, args.port)
        return start_llama_server(binary, gguf, args.port, args.cache_dir / "llama-server.log")

    rows: list[dict[str, Any]] = []
    for round_ in range(1, args.rounds + 1):
        for server in (PYSERVE, LLAMA):
            with running(start(server)) as proc:
                mine = []
                for streams, num_prompts in zip(args.streams, args.num_prompts):
                    cmd = client_command(args.port, gguf, streams, num_prompts, runs_file)
                    if round_ == 1:
                        print("$ " + shlex.join(cmd), flush=True)
                    m = run_client(cmd, runs_file)
                    mine.append({"server": server, "round": round_, "streams": streams, "metrics": m})
                    mine[-1] |= {
                        "output_tok_s": m["output_throughput"],
                        "mean_ttft_ms": m["ttft_ms"]["mean"],
                        "median_ttft_ms": m["ttft_ms"]["median"],
                        "median_itl_ms": m["itl_ms"]["median"],
                        "failed": m["failed"],
                    }
                    print(f"{server} round {round_}, {streams} streams: {m['output_throughput']:.1f} tok/s", flush=True)
                memory = memory_mb(proc.pid)
                rows += [row | memory for row in mine]

    medians: dict[str, dict[str, dict[str, float]]] = {}
    for streams in args.streams:
        print(f"\n{streams} concurrent stream(s), 128 tokens in, 64 out (TTFT and ITL in ms)")
        print(f"{'server':<13} {'round':>6}" + "".join(f"{heading:>11}" for _, heading, _ in COLUMNS))
        for r in (r for r in rows if r["streams"] == streams):
            print(table_line(r["server"], str(r["round"]), r))
        medians[str(streams)] = {}
        for server in (PYSERVE, LLAMA):
            medians[str(streams)][server] = {key: median_of(rows, server, key, streams) for key, _, _ in COLUMNS}
            print(table_line(server, "median", medians[str(streams)][server]))
    if any(r["failed"] for r in rows):
        print("(failed: requests sent on a connection the server had closed; see the docstring)")
    ratios = {
        f"output_tok_s_{s}_streams": medians[str(s)][PYSERVE]["output_tok_s"] / medians[str(s)][LLAMA]["output_tok_s"]
        for s in args.streams
    }
    ratios["peak_rss"] = median_of(rows, PYSERVE, "peak_rss_mb") / median_of(rows, LLAMA, "peak_rss_mb")
    print(f"\npyserve / llama-server (medians over {args.rounds} round(s)):")
    for name, ratio in ratios.items():
        print(f"  {name:<24} {ratio:.3f}x")
    if args.output_file:
        result = {
            "gguf": gguf,
            "llama_server": str(binary),
            "cmake_flags": CMAKE_FLAGS,
            "pyserve_args": pyserve_args,
            "runs": rows,
            "medians": medians,
            "ratios": ratios,
        }
        args.output_file.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output_file}")


if __name__ == "__main__":
    main()
