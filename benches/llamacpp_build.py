"""llama.cpp's `llama-server`, built for the instruction sets this CPU runs, as its users build it.

The sources are those the `llama-cpp-python==0.3.36` sdist vendors; cmake and ninja come from
PyPI into a venv of their own. Everything lives under a cache folder outside the repository
(default ~/.cache/pyserve-llamacpp/0.3.36/), one build folder per configuration:

* `native`: `-DGGML_NATIVE=ON` (the compiler's `-march=native`: every instruction set the CPU
  reports), llama.cpp's default for a local build. Its folder is keyed by the CPU's model name
  and /proc/cpuinfo flags, so a build never moves to another CPU.
* `explicit`: `-DGGML_NATIVE=OFF` and one `-DGGML_<ISA>=ON|OFF` per x86 instruction set ggml
  offers, ON where /proc/cpuinfo lists it (see ISA_FLAGS), AMX always OFF. Its folder is keyed
  by that list.

`auto` (the default) picks `native` unless /proc/cpuinfo lists AMX: the cloud VMs this project
runs on advertise AMX but do not let a guest use it, and a native build (whose ggml then has its
AMX matmul path) dies there with SIGILL once it multiplies. A native build is checked by serving
a few tokens before it is used; if the server dies on a signal, `auto` falls back to `explicit`
and remembers that for this CPU (a `native-failed` file in the cache folder).

What a build used is printed: the cmake flags and ggml's own report of its CPU features (the
`system_info` line llama-server logs at start with `-lv 4`, e.g. `CPU : SSE3 = 1 | ... | AVX2 = 1 | ...`).

Usage (also run by bench_vs_llamacpp.py): python benches/llamacpp_build.py [--isa auto]
[--cache-dir DIR] [--gguf FILE (checks the build by serving it)]. Needs network access once
(the sdist, cmake and ninja from PyPI); the build takes 10-20 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform
import re
import shlex
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = "0.3.36"
DEFAULT_CACHE = Path.home() / ".cache" / "pyserve-llamacpp" / VERSION
COMMON_FLAGS = [
    "-G",
    "Ninja",
    "-DCMAKE_BUILD_TYPE=Release",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_OPENSSL=OFF",  # no HTTPS client needed
    "-DLLAMA_USE_PREBUILT_UI=OFF",  # would download the web UI; the server then has none
]
# ggml's x86 instruction-set options (ggml/CMakeLists.txt of the vendored llama.cpp) and the
# /proc/cpuinfo flags each needs; GGML_AVX512 compiles with -mavx512f/cd/vl/dq/bw.
ISA_FLAGS: dict[str, tuple[str, ...]] = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
AMX_OPTIONS = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
ISA_CHOICES = ("auto", "native", "explicit")


@dataclass
class Build:
    """One llama-server build: its kind ("native" or "explicit"), the cmake flags that select
    its instruction sets, its folder and binary, and ggml's feature report (None until served)."""

    kind: str
    isa_flags: list[str]
    folder: Path
    system_info: str | None = None

    @property
    def binary(self) -> Path:
        return self.folder / "bin" / "llama-server"

    def describe(self) -> str:
        report = self.system_info or "(not served yet)"
        return f"llama-server build {self.kind}: {' '.join(self.isa_flags)}\n  ggml reports: {report}"


def cpu_flags() -> set[str]:
    """The `flags` of the first processor in /proc/cpuinfo (empty where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    return set()


def cpu_key() -> str:
    """12 hex digits naming this CPU: its model name and flags."""
    model = ""
    with contextlib.suppress(OSError):
        model = next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "")
    return hashlib.sha256((model + " ".join(sorted(cpu_flags()))).encode()).hexdigest()[:12]


def explicit_isa_flags(flags: set[str]) -> list[str]:
    """-DGGML_<ISA>=ON for each instruction set whose cpuinfo flags are all in `flags`, OFF
    otherwise; AMX OFF."""
    out = ["-DGGML_NATIVE=OFF"]
    out += [f"-D{opt}={'ON' if all(f in flags for f in need) else 'OFF'}" for opt, need in ISA_FLAGS.items()]
    return out + [f"-D{opt}=OFF" for opt in AMX_OPTIONS]


def plan(kind: str, cache: Path) -> Build:
    """The Build of `kind` ("native" or "explicit") for this CPU, in `cache`."""
    if kind == "native":
        return Build("native", ["-DGGML_NATIVE=ON"], cache / f"build-native-{cpu_key()}")
    isa = explicit_isa_flags(cpu_flags())
    on = [f[len("-DGGML_") : -len("=ON")].lower() for f in isa if f.endswith("=ON")]
    return Build("explicit", isa, cache / f"build-explicit-{'-'.join(on) or 'none'}")


def choose_kind(isa: str, cache: Path) -> tuple[str, str]:
    """(kind, why) for --isa `isa`."""
    if isa != "auto":
        return isa, f"--isa {isa}"
    if (cache / f"native-failed-{cpu_key()}").exists():
        return "explicit", "a native build died on this CPU before"
    amx = sorted(f for f in cpu_flags() if f.startswith("amx"))
    if amx:
        return "explicit", f"the CPU lists {' '.join(amx)}, which these VMs forbid (a native build dies with SIGILL)"
    return "native", "GGML_NATIVE=ON works on this CPU (no AMX listed)"


def run_logged(cmd: list[str], **kwargs: Any) -> None:
    print("$ " + shlex.join(cmd), flush=True)
    subprocess.run(cmd, check=True, **kwargs)


def sources(cache: Path) -> Path:
    """The vendored llama.cpp source folder, downloaded and unpacked into `cache` if missing."""
    cache.mkdir(parents=True, exist_ok=True)
    src = cache / f"llama_cpp_python-{VERSION}" / "vendor" / "llama.cpp"
    if src.exists():
        return src
    sdist = cache / f"llama_cpp_python-{VERSION}.tar.gz"
    if not sdist.exists():
        # only this package from source: with `:all:`, pip would also build cmake itself
        # from source to read the sdist's metadata
        run_logged(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-python"]
            + [f"llama-cpp-python=={VERSION}", "-d", str(cache)]
        )
    with tarfile.open(sdist) as tar:
        prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
        tar.extractall(cache, members=[m for m in tar if m.name.startswith(prefix)], filter="data")
    return src


def compile_build(build: Build, cache: Path) -> None:
    """Configure and build `build` (its binary missing)."""
    start = time.monotonic()
    src = sources(cache)
    tools = cache / "tools"
    if not (tools / "bin" / "ninja").exists():
        run_logged([sys.executable, "-m", "venv", str(tools)])
        run_logged([str(tools / "bin" / "python"), "-m", "pip", "install", "--quiet", "cmake", "ninja"])
    env = os.environ | {"PATH": f"{tools / 'bin'}{os.pathsep}{os.environ['PATH']}"}
    cmake = str(tools / "bin" / "cmake")
    run_logged([cmake, "-S", str(src), "-B", str(build.folder), *COMMON_FLAGS, *build.isa_flags], env=env)
    run_logged([cmake, "--build", str(build.folder), "--target", "llama-server"], env=env)
    print(f"built llama-server ({build.kind}) in {(time.monotonic() - start) / 60:.1f} min", flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def serve_check(binary: Path, gguf: str, log: Path, timeout_s: float = 300.0) -> tuple[int | None, str | None]:
    """Start `binary` on `gguf`, ask for 8 tokens, stop it. Returns (the signal that killed
    it, or None if it served; ggml's system_info line from its log, if logged)."""
    port = free_port()
    cmd = [str(binary), "-m", gguf, "-t", "2", "-c", "512", "--host", "127.0.0.1", "--port", str(port), "--no-webui"]
    cmd += ["-lv", "4"]  # the trace level, where it logs its system_info line
    with log.open("wb") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT)
    body = json.dumps({"prompt": "Once upon a time", "n_predict": 8}).encode()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/completion", data=body, method="POST")
                with urllib.request.urlopen(req, timeout=60) as resp:
                    if resp.status == 200:
                        break
            except OSError:  # not listening yet, or 503 while loading
                time.sleep(0.3)
        else:
            if proc.poll() is None:
                raise RuntimeError(f"llama-server did not answer in {timeout_s:.0f} s; see {log}")
        time.sleep(0.2)  # a crash right after the answer still counts
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(60)
    signal_ = -proc.returncode if proc.returncode is not None and proc.returncode < 0 else None
    crashed = signal_ not in (None, 15)  # 15: our own terminate
    match = re.search(r"system_info:.*", log.read_text(errors="replace"))
    if not crashed and proc.returncode not in (0, -15, None):
        raise RuntimeError(f"llama-server exited with status {proc.returncode}; see {log}")
    return (signal_ if crashed else None), (match.group(0) if match else None)


def llama_server(cache: Path = DEFAULT_CACHE, isa: str = "auto", gguf: str | None = None) -> Build:
    """A llama-server Build for this CPU in `cache` (built there first if missing), checked by
    serving `gguf` when given (once per build; the result is kept in the build folder). Raises
    RuntimeError when no build serves."""
    kind, why = choose_kind(isa, cache)
    print(f"llama-server build: {kind} ({why}) on {platform.machine()}", flush=True)
    build = plan(kind, cache)
    if not build.binary.exists():
        compile_build(build, cache)
    checked = build.folder / "served.txt"
    if checked.exists():
        build.system_info = checked.read_text().strip() or None
    elif gguf is not None:
        sig, build.system_info = serve_check(build.binary, gguf, build.folder / "check.log")
        if sig is not None:
            msg = f"the {kind} llama-server died on signal {sig} serving {gguf} (see {build.folder / 'check.log'})"
            if kind != "native" or isa != "auto":
                raise RuntimeError(msg)
            print(msg + "; falling back to explicit flags", flush=True)
            (cache / f"native-failed-{cpu_key()}").write_text(msg + "\n")
            return llama_server(cache, "auto", gguf)
        checked.write_text((build.system_info or "") + "\n")
    print(build.describe(), flush=True)
    return build


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--isa", choices=ISA_CHOICES, default="auto", help="native, explicit flags, or auto (default)")
    p.add_argument("--cache-dir", type=Path, default=DEFAULT_CACHE)
    p.add_argument("--gguf", help="check the build by serving 8 tokens of this GGUF")
    args = p.parse_args()
    build = llama_server(args.cache_dir, args.isa, args.gguf)
    print(build.binary)


if __name__ == "__main__":
    main()
