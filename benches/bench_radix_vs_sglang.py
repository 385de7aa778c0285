"""pyserve's Rust radix cache against SGLang's own `RadixCache`, same seeded workloads, same
results, timed in one run.

SGLang's tree and its KV slot allocator come from the `sglang==0.5.6` wheel, downloaded at run
time into a cache folder outside the repository (`--cache-dir`, default
~/.cache/pyserve-bench/sglang) with `pip download --no-deps`; nothing of it is vendored or
installed. Its `srt/mem_cache/radix_cache.py` (with the small `cache_init_params.py` and
`evict_policy.py` beside it) and `srt/mem_cache/allocator.py` are loaded from the wheel as
modules, with stand-ins for the imports they do not need here (metrics, KV events, host-cache
hashing, the bigram helper; the sliding-window pool class and the paged allocator's helpers,
which raise if called). Both run on torch tensors, as in SGLang. The SGLang side is timed as
SGLang's scheduler runs it: its `RadixCache` over its own `TokenToKVPoolAllocator` with the
serving defaults (page size 1, `need_sort` off, as outside disaggregation), the tree freeing
evicted slots into that allocator. (The client venv's `sglang==0.5.2` is not used: it is
installed without torch, which the allocator imports.)

Each request, on both sides: match the prompt minus its last token (pyserve: `add_req`, which
also takes a row and locks; SGLang: `match_prefix` then `inc_lock_ref`); evict the shortfall
if the free pool cannot hold the new tokens (same `evict(n)` call on both); allocate the new
tokens (pyserve: `prepare_extend`, which also lays out the step's slot arrays; SGLang: its
allocator's `alloc`); insert prompt + output and unlock (pyserve: `cache_finished_req`; SGLang: `insert`,
freeing the duplicates, `dec_lock_ref`). Token ids reach pyserve as int32 arrays. Checked
equal after every request: the matched length, the tokens each eviction freed, and the
evictable and protected sizes; the script exits with status 1 when any of them differs.

Workloads (seeded): `shared-prompt` (16 system prompts of 1024 tokens, 3000 requests each
with one of them and a 64-token question, 64 output tokens); `chat` (300 conversations of 6
turns, interleaved: each turn the whole conversation so far, a 48-token message and a
96-token reply); `long-random` (400 unrelated 4096-token prompts). The pool (64k tokens) is
smaller than each workload, so every one evicts.

Page size 1 (SGLang's default): its allocator counts tokens, not pages.

Usage: PYTHONPATH=. python benches/bench_radix_vs_sglang.py [--cache-dir D]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import random
import subprocess
import sys
import time
import types
import zipfile
from pathlib import Path
from typing import NoReturn

import numpy as np

SGLANG = "sglang==0.5.6"
POOL_TOKENS = 65536


def fetch_wheel(cache_dir: Path) -> Path:
    """The sglang 0.5.6 wheel in `cache_dir` (downloaded once with pip, no dependencies)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    found = sorted(cache_dir.glob("sglang-0.5.6-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SGLANG, "-d", str(cache_dir)], check=True
        )
        found = sorted(cache_dir.glob("sglang-0.5.6-*.whl"))
    return found[0]


MODULES = ("cache_init_params", "evict_policy", "radix_cache", "allocator")


def load_sglang_modules(wheel: Path) -> tuple[types.ModuleType, types.ModuleType]:
    """SGLang's radix_cache and allocator modules from the wheel, the imports they do not
    need here stood in for."""
    src = wheel.parent / "sglang-0.5.6-src"
    if not all((src / f"sglang/srt/mem_cache/{name}.py").exists() for name in MODULES):
        with zipfile.ZipFile(wheel) as z:
            for name in MODULES:
                z.extract(f"sglang/srt/mem_cache/{name}.py", src)

    def package(name: str) -> None:
        mod = types.ModuleType(name)
        mod.__path__ = []  # type: ignore[attr-defined]
        sys.modules[name] = mod

    for name in ("sglang", "sglang.srt", "sglang.srt.mem_cache", "sglang.srt.disaggregation"):
        package(name)

    def stand_in(name: str, **attrs: object) -> None:
        mod = types.ModuleType(name)
        mod.__dict__.update(attrs)
        sys.modules[name] = mod

    class _Event:
        def __init__(self, *args: object, **kwargs: object) -> None:
            pass

    class BasePrefixCache:  # what the tree uses of its base: the metrics hook, a no-op here
        def update_eviction_metrics(self, *args: object) -> None:
            pass

        def init_metrics_collector(self) -> None:
            pass

    from typing import Any, NamedTuple

    class MatchResult(NamedTuple):
        device_indices: Any
        last_device_node: Any
        last_host_node: Any
        host_hit_length: int = 0

    stand_in(
        "sglang.srt.disaggregation.kv_events",
        MEDIUM_GPU="gpu",
        AllBlocksCleared=_Event,
        BlockRemoved=_Event,
        BlockStored=_Event,
    )
    stand_in("sglang.srt.mem_cache.base_prefix_cache", BasePrefixCache=BasePrefixCache, MatchResult=MatchResult)
    stand_in("sglang.srt.mem_cache.hicache_storage", get_hash_str=lambda *a, **k: "", hash_str_to_int64=lambda s: 0)
    stand_in("sglang.srt.mem_cache.utils", convert_to_bigram_key=lambda ids: ids)

    def unused(*args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError("a stand-in: only SGLang's paged and sliding-window allocators call this")

    class SWAKVPool:  # the sliding-window pool class, which the token allocator never sees
        pass

    stand_in("sglang.srt.mem_cache.memory_pool", SWAKVPool=SWAKVPool)
    stand_in("sglang.srt.utils", get_bool_env_var=unused, get_num_new_pages=unused, next_power_of_2=unused)
    for name in MODULES:
        full = f"sglang.srt.mem_cache.{name}"
        spec = importlib.util.spec_from_file_location(full, src / f"sglang/srt/mem_cache/{name}.py")
        assert spec is not None and spec.loader is not None
        mod = importlib.util.module_from_spec(spec)
        sys.modules[full] = mod
        spec.loader.exec_module(mod)
    return sys.modules["sglang.srt.mem_cache.radix_cache"], sys.modules["sglang.srt.mem_cache.allocator"]


def workloads(seed: int = 0) -> dict[str, list[tuple[list[int], int]]]:
    """name -> [(prompt tokens, output tokens)] (token ids below 50000)."""
    rng = random.Random(seed)
    rand = lambda n: [rng.randrange(1, 50000) for _ in range(n)]  # noqa: E731
    systems = [rand(1024) for _ in range(16)]
    shared = [(rng.choice(systems) + rand(64), 64) for _ in range(3000)]
    convs = [[] for _ in range(300)]
    turns: list[tuple[int, int]] = [(c, t) for c in range(300) for t in range(6)]
    # interleave conversations, keeping each one's turns in order
    order: list[int] = []
    pending = {c: 6 for c in range(300)}
    while pending:
        c = rng.choice(list(pending))
        order.append(c)
        pending[c] -= 1
        if not pending[c]:
            del pending[c]
    del turns
    chat = []
    for c in order:
        prompt = convs[c] + rand(48)
        chat.append((prompt, 96))
        convs[c] = prompt + rand(96)  # the reply joins the conversation
    long_random = [(rand(4096), 16) for _ in range(400)]
    return {"shared-prompt": shared, "chat": chat, "long-random": long_random}


def outputs_of(rows: list[tuple[list[int], int]], seed: int = 1) -> list[list[int]]:
    """The output tokens each request 'generates' (seeded; the same on both sides)."""
    rng = random.Random(seed)
    return [[rng.randrange(1, 50000) for _ in range(n)] for _, n in rows]


def run_pyserve(rows, outs, page_size: int) -> tuple[float, list[tuple[int, int, int, int]]]:  # type: ignore[no-untyped-def]
    from pyserve import _rs

    kv = _rs.KVCache(POOL_TOKENS, 4, 16384, page_size=page_size)
    keys = [np.asarray(p, dtype=np.int32) for p, _ in rows]
    fulls = [np.asarray(p + o, dtype=np.int32) for (p, _), o in zip(rows, outs)]
    trace = []
    start = time.perf_counter()
    for key, full in zip(keys, fulls):
        req_id, _, prefix_len = kv.add_req(key[:-1])
        need = -(-(len(full) - prefix_len) // page_size) * page_size  # conservative: whole pages
        short = need - kv.free_size()
        freed = kv.evict(short) if short > 0 else 0
        assert kv.prepare_extend([req_id], [len(full) - prefix_len]) is not None
        kv.cache_finished_req(req_id, full)
        trace.append((prefix_len, freed, kv.evictable_size(), kv.protected_size()))
    return time.perf_counter() - start, trace


def run_sglang(radix_mod, alloc_mod, rows, outs, page_size: int) -> tuple[float, list[tuple[int, int, int, int]]]:  # type: ignore[no-untyped-def]
    import torch

    # KV slots 1..POOL_TOKENS (0 is padding, as in pyserve); dtype is the KV's, unused without
    # a KV pool; need_sort as SGLang's model runner sets it outside disaggregation
    assert page_size == 1, "TokenToKVPoolAllocator is SGLang's page-size-1 allocator"
    pool = alloc_mod.TokenToKVPoolAllocator(POOL_TOKENS, torch.float16, "cpu", kvcache=None, need_sort=False)
    tree = radix_mod.RadixCache.create_simulated(mock_allocator=pool, page_size=page_size)
    RadixKey = radix_mod.RadixKey
    keys = [p for p, _ in rows]
    fulls = [p + o for (p, _), o in zip(rows, outs)]
    trace = []
    start = time.perf_counter()
    for key, full in zip(keys, fulls):
        m = tree.match_prefix(RadixKey(key[:-1]))
        prefix_len = len(m.device_indices)
        tree.inc_lock_ref(m.last_device_node)
        need = -(-(len(full) - prefix_len) // page_size) * page_size
        short = need - pool.available_size()
        freed = 0
        if short > 0:
            before = pool.available_size()
            tree.evict(short)
            freed = pool.available_size() - before
        new_slots = pool.alloc(len(full) - prefix_len)
        assert new_slots is not None, "SGLang's allocator ran out after the eviction"
        value = torch.cat([m.device_indices, new_slots])
        aligned = len(full) // page_size * page_size
        new_prefix = tree.insert(RadixKey(full[:aligned]), value[:aligned])
        pool.free(value[prefix_len:new_prefix])  # duplicates the tree already held
        pool.free(value[aligned:])  # the partial last page
        tree.dec_lock_ref(m.last_device_node)
        trace.append((prefix_len, freed, tree.evictable_size(), tree.protected_size()))
    return time.perf_counter() - start, trace


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=os.path.expanduser("~/.cache/pyserve-bench/sglang"))
    args = p.parse_args()
    args.page_size = 1
    radix_mod, alloc_mod = load_sglang_modules(fetch_wheel(Path(args.cache_dir)))
    print(
        f"pyserve's Rust radix cache vs SGLang's RadixCache + TokenToKVPoolAllocator ({SGLANG}), "
        f"pool {POOL_TOKENS} tokens"
    )
    header = (
        f"{'workload':>14} {'requests':>8} {'hit tokens':>10} {'evicted':>9} {'sglang s':>9} "
        f"{'pyserve s':>9} {'ratio':>7} {'equal':>6}"
    )
    print(header)
    print("-" * len(header))
    differ = []
    for name, rows in workloads().items():
        outs = outputs_of(rows)
        t_sgl, trace_sgl = run_sglang(radix_mod, alloc_mod, rows, outs, args.page_size)
        t_py, trace_py = run_pyserve(rows, outs, args.page_size)
        equal = trace_sgl == trace_py
        if not equal:
            differ.append(name)
            k = next((i for i, (a, b) in enumerate(zip(trace_sgl, trace_py)) if a != b), len(trace_py) - 1)
            print(f"  first difference at request {k}: sglang {trace_sgl[k]} pyserve {trace_py[k]}")
        hits, evicted = sum(t[0] for t in trace_py), sum(t[1] for t in trace_py)
        print(
            f"{name:>14} {len(rows):>8} {hits:>10} {evicted:>9} {t_sgl:>9.3f} {t_py:>9.3f} "
            f"{t_sgl / t_py:>6.1f}x {str(equal):>6}",
            flush=True,
        )
    if differ:
        print(f"RESULTS DIFFER on {', '.join(differ)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
