"""Write corpus.jsonl: a seeded sample of JSONSchemaBench's real-world schemas for
tests/e2e/test_schema_corpus.py.

Usage: python tests/data/jsonschemabench/make_sample.py PATH/TO/jsonschemabench [OUT.jsonl]

PATH is a checkout of https://github.com/guidance-ai/jsonschemabench; its schemas are
`data/<split>/<name>.json`, one schema per file. For each split (sorted by name) the candidates
are its files whose schema, serialized compactly (no whitespace, UTF-8), is at most MAX_BYTES
long, sorted by file name; PER_SPLIT of them are drawn with `random.Random(f"{SEED}/{split}")`
(a string seed is hashed with SHA-512, so the draw is the same on every Python 3 and every
platform, and one split's candidates never change another's draw). A split with fewer
candidates contributes all of them.

Each output line is one compact JSON object: {"id": "<split>/<name without .json>",
"split": ..., "path": "data/<split>/<name>.json", "schema": {...}}, sorted by id. The per-split
counts and the checkout's commit are printed for SOURCE.md.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

SEED = 48  # issue 48, which asked for this corpus test
PER_SPLIT = 10
MAX_BYTES = 20_000
OUT = Path(__file__).resolve().parent / "corpus.jsonl"


def compact(value: object) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def sample(checkout: Path) -> list[dict]:
    """The sampled rows (see the module docstring), sorted by id."""
    rows = []
    for split_dir in sorted(p for p in (checkout / "data").iterdir() if p.is_dir()):
        candidates = []
        for path in sorted(split_dir.glob("*.json"), key=lambda p: p.name):
            schema = json.loads(path.read_text(encoding="utf-8"))
            if len(compact(schema).encode()) <= MAX_BYTES:
                candidates.append((path, schema))
        rng = random.Random(f"{SEED}/{split_dir.name}")
        for path, schema in rng.sample(candidates, min(PER_SPLIT, len(candidates))):
            rows.append(
                {
                    "id": f"{split_dir.name}/{path.stem}",
                    "split": split_dir.name,
                    "path": path.relative_to(checkout).as_posix(),
                    "schema": schema,
                }
            )
    return sorted(rows, key=lambda r: r["id"])


def main(argv: list[str]) -> None:
    if len(argv) not in (2, 3):
        sys.exit(__doc__.split("\n\n")[1])
    checkout = Path(argv[1])
    out = Path(argv[2]) if len(argv) == 3 else OUT
    rows = sample(checkout)
    out.write_text("".join(compact(r) + "\n" for r in rows), encoding="utf-8")
    commit = subprocess.run(
        ["git", "-C", str(checkout), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    counts: dict[str, int] = {}
    for r in rows:
        counts[r["split"]] = counts.get(r["split"], 0) + 1
    print(f"commit {commit or 'unknown (not a git checkout)'}; seed {SEED}; {len(rows)} schemas -> {out}")
    for split, n in counts.items():
        print(f"  {split}: {n}")


if __name__ == "__main__":
    main(sys.argv)
