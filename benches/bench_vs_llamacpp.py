"""pyserve's server against llama.cpp's `llama-server` on CPU, same GGUF, same client: output
tokens/s, TTFT, ITL and resident memory at 1 and 8 concurrent streams.

llama-server is built once into `--cache-dir` (default ~/.cache/pyserve-llamacpp/0.3.36/),
outside the repository, from the llama.cpp sources the `llama-cpp-python==0.3.36` sdist vendors,
for the instruction sets this CPU runs: `-DGGML_NATIVE=ON` where that works, else one explicit
`-DGGML_<ISA>=ON` per instruction set /proc/cpuinfo lists, AMX off (benches/llamacpp_build.py
says how it chooses; `--isa` overrides). The build's cmake flags and ggml's own report of its
CPU features are printed first.

The servers (the model defaults to pyserve's default, SmolLM2-135M-Instruct Q4_1):
  llama-server -m GGUF -t 2 -np 8 -c 4096 --host 127.0.0.1 --port PORT --no-webui
  python -m pyserve serve --port PORT --log-level warning --model-path GGUF [--pyserve-args]
After each start, one warm-up request (a prompt of its own seed, outside the timed set, 128
tokens in and 64 out); then, per number of streams C (with its number of prompts N and seed
`--seed` + its index, so no timed prompt repeats another), the same client command for both:
  python -m pyserve bench serve --backend openai --base-url http://127.0.0.1:PORT
         --tokenizer GGUF --dataset-name random --random-input-len 128 --random-output-len 64
         --random-range-ratio 1.0 --num-prompts N --seed S --max-concurrency C
         --warmup-requests 0 --disable-keepalive --token-count usage --output-details
         --output-file RUNS.jsonl --disable-tqdm
The model id comes from each server's GET /v1/models. Requests are greedy and ignore EOS, and
every output token is counted from the server's own usage report.

Fairness: the same client command (the same prompts), the same GGUF, one server at a time (the
machine has few cores), alternated `--rounds` times with the order reversed every other round
(pyserve first in odd rounds, llama-server first in even ones). Both sides get a new connection
per request (`--disable-keepalive`): llama-server closes the connection after every streamed
response while announcing keep-alive, and a pooled client would send its next request on a
closed connection.

Checked (exit status 1 when any fails, after the tables): every request of every run completed
with exactly `--output-len` tokens, on both sides, so both complete the same requests with the
same output lengths. Speed goals are printed, not enforced.

Printed: the 1-minute load average at the start and the end (both servers run 2 OpenMP
threads; where other processes keep the cores busy, each parallel region waits for a
descheduled thread and both slow down many times over, unevenly), a table per number of
streams (server, round, output tok/s, mean and median TTFT, median ITL, RSS from
/proc/PID/status after the server's runs: VmRSS now and VmHWM peak, completed requests), the
median and range (min-max) over rounds, and the ratios pyserve /
llama-server of the medians, with the range of the per-round ratios. `--output-file` gets all
of it (with each run's full `bench serve` metrics) as JSON.

On a machine whose cores others keep busy, the scheduler shares them between sessions (Linux
autogroups), and the two servers' OpenMP threads then wait on each other at every parallel
region: both slow down many times over, unevenly. `--nice -10` (as root) runs this session's
processes, both servers and the client, ahead of the others', alike for both sides; the
niceness is printed.

Usage: python benches/bench_vs_llamacpp.py [--rounds 3] [--model-path GGUF] [--nice N]
                                           [--pyserve-args "--quantization none"]
                                           [--streams 1 8] [--num-prompts 8 32] [--isa auto]
                                           [--cache-dir DIR] [--output-file FILE.json]
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import shlex
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NoReturn

import httpx
from llamacpp_build import DEFAULT_CACHE, ISA_CHOICES, llama_server
from serve_process import start_server

from pyserve.model_loader.default_model import default_model_path

LLAMA = "llama-server"
PYSERVE = "pyserve"
INPUT_LEN = 128
WARMUP_SEED_OFFSET = 1000  # the warm-up prompt's seed: --seed + this, far from the timed runs'
GOALS = ["1=1.0", "8=2.0"]  # pyserve / llama-server output tok/s at this many streams (issue 34)
# the table's columns: (row key, heading, format)
COLUMNS = (
    ("output_tok_s", "out tok/s", ".1f"),
    ("mean_ttft_ms", "TTFT mean", ".1f"),
    ("median_ttft_ms", "TTFT med", ".1f"),
    ("median_itl_ms", "ITL med", ".1f"),
    ("rss_mb", "RSS MB", ".1f"),
    ("peak_rss_mb", "peak MB", ".1f"),
    ("completed", "done", "g"),
)


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


def client_command(
    port: int, gguf: str, streams: int, num_prompts: int, seed: int, output_len: int, runs_file: Path
) -> list[str]:
    return [
        sys.executable, "-m", "pyserve", "bench", "serve", "--backend", "openai",
        "--base-url", f"http://127.0.0.1:{port}", "--tokenizer", gguf,
        "--dataset-name", "random", "--random-input-len", str(INPUT_LEN), "--random-output-len", str(output_len),
        "--random-range-ratio", "1.0", "--num-prompts", str(num_prompts), "--seed", str(seed),
        "--max-concurrency", str(streams), "--warmup-requests", "0", "--disable-keepalive",
        "--token-count", "usage", "--output-details", "--output-file", str(runs_file), "--disable-tqdm",
    ]  # fmt: skip


def run_client(cmd: list[str], runs_file: Path) -> dict[str, Any]:
    """Run the bench command; the JSON line it appended to `runs_file` (metrics and requests).
    Raises RuntimeError when the command fails."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{done.stdout}\n{done.stderr}")
    return json.loads(runs_file.read_text().splitlines()[-1])


def output_problems(where: str, run: dict[str, Any], num_prompts: int, output_len: int) -> list[str]:
    """What is wrong with a run's outputs: requests that failed or did not get `output_len`
    tokens (in the server's usage), or a count other than `num_prompts`."""
    m, requests = run["metrics"], run["requests"]
    problems = []
    if len(requests) != num_prompts or m["completed"] != num_prompts:
        problems.append(f"{where}: {m['completed']} of {num_prompts} requests completed ({m['errors']})")
    errors = sorted({f"{r['error']}: {r['error_detail']}" for r in requests if r["error"]})
    problems += [f"{where}: {e}" for e in errors[:3]]
    short = [(k, r["output_len"]) for k, r in enumerate(requests) if not r["error"] and r["output_len"] != output_len]
    if short:
        problems.append(f"{where}: {len(short)} requests not of {output_len} tokens, (index, tokens): {short[:5]}")
    return problems


def stats(values: list[float]) -> tuple[float, float, float]:
    """(median, min, max)."""
    return statistics.median(values), min(values), max(values)


def table_line(server: str, round_: str, values: dict[str, Any]) -> str:
    return f"{server:<13} {round_:>6}" + "".join(f"{values[key]:>11{fmt}}" for key, _, fmt in COLUMNS)


def set_niceness(nice: int) -> None:
    """Run this process, and every process and thread it starts from now on, at `nice`; with
    Linux's scheduler autogroups on, nice only orders the processes of one session, so the
    session's autogroup gets `nice` too (its former value is restored at exit)."""
    os.setpriority(os.PRIO_PROCESS, 0, nice)
    group = Path("/proc/self/autogroup")
    if group.exists():  # "/autogroup-N nice K"
        before = group.read_text().split()[-1]
        group.write_text(str(nice))
        atexit.register(group.write_text, before)


def on_sigterm(signum: int, frame: object) -> NoReturn:
    sys.exit(128 + signum)  # unwinds through `running`, which stops the server


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-path", help="the GGUF both servers load (default: pyserve's default model)")
    p.add_argument("--pyserve-args", default="", help="extra `pyserve serve` flags, one string")
    p.add_argument("--rounds", type=int, default=3, help="alternations of the two servers (default 3)")
    p.add_argument("--streams", type=int, nargs="+", default=[1, 8], help="concurrent streams (default: 1 8)")
    p.add_argument("--num-prompts", type=int, nargs="+", default=[8, 32], help="per --streams entry (default: 8 32)")
    p.add_argument("--output-len", type=int, default=64, help="output tokens per request (default 64)")
    p.add_argument("--seed", type=int, default=1, help="the first timed run's prompts; the next get seed + 1, ...")
    p.add_argument("--port", type=int, default=30231, help="both servers, one at a time")
    p.add_argument("--isa", choices=ISA_CHOICES, default="auto", help="llama.cpp build: see llamacpp_build.py")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--output-file", type=Path, help="write the runs, medians and ratios here as JSON")
    p.add_argument(
        "--goals",
        nargs="+",
        default=GOALS,
        metavar="STREAMS=RATIO",
        help=f"the printed goals: pyserve / llama-server output tok/s at so many streams (default: {' '.join(GOALS)})",
    )
    p.add_argument(
        "--nice",
        type=int,
        default=None,
        help="run this script, both servers and the client at this niceness, and this session's "
        "scheduler autogroup too (below 0 needs root: on a machine others keep busy, it gives the "
        "measured processes the cores first, both sides alike)",
    )
    args = p.parse_args()
    try:
        args.goals = {int(a): float(b) for a, b in (g.split("=") for g in args.goals)}
    except ValueError:
        p.error(f"--goals takes STREAMS=RATIO pairs, got {' '.join(args.goals)}")
    if len(args.num_prompts) != len(args.streams):
        p.error("--num-prompts needs one count per --streams entry")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, on_sigterm)
    if args.nice is not None:
        set_niceness(args.nice)
    gguf = os.path.abspath(args.model_path or default_model_path())
    build = llama_server(args.cache_dir, args.isa, gguf)
    load_start = os.getloadavg()[0]
    group = Path("/proc/self/autogroup")
    group_nice = f", autogroup {group.read_text().split()[-1]}" if group.exists() else ""
    print(f"niceness {os.getpriority(os.PRIO_PROCESS, 0)}{group_nice} (servers and client alike)", flush=True)
    runs_file = args.cache_dir / "runs.jsonl"
    runs_file.unlink(missing_ok=True)
    pyserve_args = ["--model-path", gguf, *shlex.split(args.pyserve_args)]

    def start(server: str) -> subprocess.Popen:
        if server == PYSERVE:
            print("$ python -m pyserve serve " + shlex.join(pyserve_args), flush=True)
            return start_server(pyserve_args, args.port)
        return start_llama_server(build.binary, gguf, args.port, args.cache_dir / "llama-server.log")

    rows: list[dict[str, Any]] = []
    problems: list[str] = []
    for round_ in range(1, args.rounds + 1):
        for server in (PYSERVE, LLAMA) if round_ % 2 else (LLAMA, PYSERVE):
            with running(start(server)) as proc:
                warmup = client_command(
                    args.port, gguf, 1, 1, args.seed + WARMUP_SEED_OFFSET, args.output_len, runs_file
                )
                if round_ == 1:
                    print("$ " + shlex.join(warmup) + "    # the warm-up", flush=True)
                problems += output_problems(
                    f"{server} round {round_} warm-up", run_client(warmup, runs_file), 1, args.output_len
                )
                mine = []
                for k, (streams, num_prompts) in enumerate(zip(args.streams, args.num_prompts)):
                    cmd = client_command(
                        args.port, gguf, streams, num_prompts, args.seed + k, args.output_len, runs_file
                    )
                    if round_ == 1:
                        print("$ " + shlex.join(cmd), flush=True)
                    run = run_client(cmd, runs_file)
                    where = f"{server} round {round_}, {streams} streams"
                    problems += output_problems(where, run, num_prompts, args.output_len)
                    m = run["metrics"]
                    mine.append({
                        "server": server, "round": round_, "streams": streams, "metrics": m,
                        "output_lens": [r["output_len"] for r in run["requests"]],
                        "output_tok_s": m["output_throughput"], "mean_ttft_ms": m["ttft_ms"]["mean"],
                        "median_ttft_ms": m["ttft_ms"]["median"], "median_itl_ms": m["itl_ms"]["median"],
                        "completed": m["completed"],
                    })  # fmt: skip
                    print(f"{where}: {m['output_throughput']:.1f} tok/s, {m['completed']} done", flush=True)
                memory = memory_mb(proc.pid)
                rows += [row | memory for row in mine]

    print("\n" + build.describe())
    # both servers run 2 OpenMP threads: on a machine whose cores others keep busy, every
    # parallel region waits for a descheduled thread and both slow down many times over
    print(
        f"load average (1 min) at the start {load_start:.2f}, at the end {os.getloadavg()[0]:.2f} "
        f"({os.cpu_count()} cores)"
    )
    medians: dict[str, dict[str, dict[str, float]]] = {}
    ratios: dict[str, dict[str, float]] = {}
    for streams in args.streams:
        at = [r for r in rows if r["streams"] == streams]
        print(f"\n{streams} concurrent stream(s), {INPUT_LEN} tokens in, {args.output_len} out (TTFT and ITL in ms)")
        print(f"{'server':<13} {'round':>6}" + "".join(f"{heading:>11}" for _, heading, _ in COLUMNS))
        for r in sorted(at, key=lambda r: (r["server"] != PYSERVE, r["round"])):
            print(table_line(r["server"], str(r["round"]), r))
        medians[str(streams)] = {}
        for server in (PYSERVE, LLAMA):
            mine = [r for r in at if r["server"] == server]
            medians[str(streams)][server] = {key: stats([r[key] for r in mine])[0] for key, _, _ in COLUMNS}
            print(table_line(server, "median", medians[str(streams)][server]))
            med, lo, hi = stats([r["output_tok_s"] for r in mine])
            print(f"{server:<13} {'range':>6} {f'{lo:.1f}-{hi:.1f}':>11} (min-max)")
        by_round = {r["round"]: r["output_tok_s"] for r in at if r["server"] == PYSERVE}
        per_round = [by_round[r["round"]] / r["output_tok_s"] for r in at if r["server"] == LLAMA]
        _, lo, hi = stats(per_round)
        ratio = medians[str(streams)][PYSERVE]["output_tok_s"] / medians[str(streams)][LLAMA]["output_tok_s"]
        ratios[f"output_tok_s_{streams}_streams"] = {"median": ratio, "min_round": lo, "max_round": hi}
    peak = {s: statistics.median(r["peak_rss_mb"] for r in rows if r["server"] == s) for s in (PYSERVE, LLAMA)}
    ratios["peak_rss"] = {"median": peak[PYSERVE] / peak[LLAMA]}

    print(f"\npyserve / llama-server: ratio of the medians over {args.rounds} round(s) [range of the per-round ratios]")
    for name, r in ratios.items():
        spread = f"  [{r['min_round']:.3f}-{r['max_round']:.3f}]" if "min_round" in r else ""
        print(f"  {name:<24} {r['median']:.3f}x{spread}")
    for streams, goal in args.goals.items():
        if (r := ratios.get(f"output_tok_s_{streams}_streams")) is not None:
            print(f"  goal {goal:.1f}x at {streams} stream(s): {'met' if r['median'] >= goal else 'NOT met'}")
    if args.output_file:
        result = {
            "gguf": gguf,
            "llama_server": {"binary": str(build.binary), "kind": build.kind, "cmake_isa_flags": build.isa_flags},
            "llama_server_system_info": build.system_info,
            "pyserve_args": pyserve_args,
            "runs": rows,
            "medians": medians,
            "ratios": ratios,
            "output_problems": problems,
        }
        args.output_file.write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.output_file}")
    if problems:
        print(f"\nOUTPUTS DIFFER ({len(problems)} problem(s)):", *problems, sep="\n  ")
        return 1
    completed = sum(r["completed"] for r in rows if r["server"] == PYSERVE)
    print(
        f"\noutputs checked: both servers completed {completed} timed requests each, every one {args.output_len} tokens"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
