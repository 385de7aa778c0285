"""What the GPU-check scripts (check_greedy.py, bench_decode.py) share: where the packed models
are, which engine options this checkout's pyserve already has, and a plain-text table.

Stdlib only at import time, so a script can set environment variables (TRITON_INTERPRET)
before torch or triton load.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import sys
from typing import Any

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
GPU_DIR = os.path.join(REPO, ".gpu")


def stories_path() -> str:
    """stories260k: under $PYSERVE_SHARED (run.sh points it at .gpu/shared), else ../shared."""
    shared = os.environ.get("PYSERVE_SHARED", os.path.join(REPO, "..", "shared"))
    return os.path.join(shared, "models", "stories260k")


def smollm2_path() -> str | None:
    """The truncated SmolLM2 GGUF that pack.sh wrote (.gpu/models/smollm2-<N>l.Q4_1.gguf), or
    None when pack.sh has not run."""
    found = sorted(glob.glob(os.path.join(GPU_DIR, "models", "smollm2-*.gguf")))
    return found[0] if found else None


def out_dir() -> str:
    """$OUT (what comes back from the device machine), else /tmp/out; created."""
    path = os.environ.get("OUT") or "/tmp/out"
    os.makedirs(path, exist_ok=True)
    return path


def server_arg_names() -> set[str]:
    """The ServerArgs fields of this checkout (options being added elsewhere may be missing)."""
    from pyserve.config import ServerArgs

    return {f.name for f in dataclasses.fields(ServerArgs)}


def attention_backend_names() -> tuple[str, ...]:
    """The --attention-backend values ServerArgs accepts in this checkout."""
    from pyserve import config

    return tuple(getattr(config, "ATTENTION_BACKENDS", ()))


def engine_options(wanted: dict[str, Any], notes: list[str]) -> dict[str, Any]:
    """`wanted` less the options ServerArgs does not have yet (each one noted once)."""
    names = server_arg_names()
    kept = {}
    for key, value in wanted.items():
        if key in names:
            kept[key] = value
        else:
            note = f"ServerArgs has no {key!r} yet: left out"
            if note not in notes:
                notes.append(note)
    return kept


def format_table(title: str, header: list[str], rows: list[list[Any]]) -> str:
    """A fixed-width text table (what the device's output tail shows)."""
    cells = [[str(c) for c in header]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    line = "-+-".join("-" * w for w in widths)
    out = [f"== {title}", " | ".join(h.ljust(w) for h, w in zip(cells[0], widths)), line]
    out += [" | ".join(c.ljust(w) for c, w in zip(r, widths)) for r in cells[1:]]
    return "\n".join(out)


def write_json(name: str, payload: dict[str, Any]) -> str:
    path = os.path.join(out_dir(), name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=1, default=str)
    return path


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
