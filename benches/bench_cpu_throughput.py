"""CPU throughput: pyserve's Engine against HF transformers `generate` on SmolLM2-135M-Instruct
(the default GGUF, dequantized to float32), same prompts, same greedy outputs.

Workload: NUM_PROMPTS prompts of exactly INPUT_LEN token ids (seeded random ids from the
ordinary vocabulary), OUTPUT_LEN new tokens each, greedy, EOS ignored. Runs:
  1. pyserve Engine: all prompts submitted at once (continuous batching).
  2. HF generate, padded batch: all prompts in one `generate` call.
  3. HF generate, sequential: one prompt at a time.
Prints output tokens/s of each and the ratios pyserve / HF, plus how many pyserve outputs equal
HF's token for token (float32 both sides; a few may differ where two logits nearly tie).

Usage: PYTHONPATH=. python benches/bench_cpu_throughput.py [--num-prompts 64]
       [--input-len 128] [--output-len 128] [--seq-prompts N]
--seq-prompts N times the sequential baseline on the first N prompts only (its tokens/s is a
per-prompt rate, so a subset measures the same thing faster); default: all prompts.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def make_prompts(num: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    # ids >= 100 skip SmolLM2's special and byte tokens
    return torch.randint(100, vocab, (num, length), generator=gen).tolist()


def run_pyserve(path: str, prompts: list[list[int]], output_len: int) -> tuple[float, list[list[int]]]:
    from pyserve import Engine

    max_total = len(prompts) * (len(prompts[0]) + output_len) + 64
    with Engine(
        model_path=path,
        dtype="float32",
        quantization="none",  # the float32 path HF runs too (outputs compared token for token)
        max_total_tokens=max_total,
        max_running_requests=len(prompts),
        max_prefill_tokens=len(prompts) * len(prompts[0]),
        log_level="warning",
    ) as engine:
        params = {"temperature": 0, "max_new_tokens": output_len, "ignore_eos": True}
        engine.generate(input_ids=prompts[0][:16], sampling_params=dict(params, max_new_tokens=4))
        start = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=[dict(params) for _ in prompts])
        elapsed = time.perf_counter() - start
    return elapsed, [o["output_ids"] for o in outs]


def hf_generate(model, batch: list[list[int]], output_len: int) -> list[list[int]]:
    import transformers

    config = transformers.GenerationConfig(
        max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    ids = torch.tensor(batch)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
    return out[:, ids.shape[1] :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--seq-prompts", type=int, default=None)
    parser.add_argument("--skip-hf-seq", action="store_true")
    args = parser.parse_args()

    from pyserve.model_loader import default_model_path
    from tests.hf_reference import load_hf_gguf

    path = default_model_path()
    print(
        f"model {os.path.basename(path)} float32, torch {torch.__version__}, "
        f"{torch.get_num_threads()} threads; {args.num_prompts} prompts x {args.input_len} in, "
        f"{args.output_len} out, greedy, ignore_eos",
        flush=True,
    )
    hf = load_hf_gguf(path)
    hf.generation_config.eos_token_id = None
    prompts = make_prompts(args.num_prompts, args.input_len, hf.config.vocab_size)
    total_out = args.num_prompts * args.output_len

    t_ps, ps_out = run_pyserve(path, prompts, args.output_len)
    ps_tps = total_out / t_ps
    print(f"pyserve Engine          : {t_ps:8.1f} s  {ps_tps:8.1f} out tok/s", flush=True)

    hf_generate(hf, [prompts[0][:16]], 4)  # warm-up
    start = time.perf_counter()
    hf_batch_out = hf_generate(hf, prompts, args.output_len)
    t_b = time.perf_counter() - start
    b_tps = total_out / t_b
    print(f"HF generate, batch of {args.num_prompts}: {t_b:8.1f} s  {b_tps:8.1f} out tok/s", flush=True)

    s_tps = None
    if not args.skip_hf_seq:
        n_seq = args.seq_prompts or args.num_prompts
        start = time.perf_counter()
        for p in prompts[:n_seq]:
            hf_generate(hf, [p], args.output_len)
        t_s = time.perf_counter() - start
        s_tps = n_seq * args.output_len / t_s
        print(f"HF generate, sequential : {t_s:8.1f} s  {s_tps:8.1f} out tok/s ({n_seq} prompts)", flush=True)

    same = sum(a == b for a, b in zip(ps_out, hf_batch_out))
    print(f"pyserve outputs equal to HF batch outputs: {same}/{args.num_prompts}")
    print(f"ratio pyserve / HF padded batch: {ps_tps / b_tps:.2f}x (target >= 1.5x)")
    if s_tps is not None:
        print(f"ratio pyserve / HF sequential  : {ps_tps / s_tps:.2f}x (target >= 5x)")


if __name__ == "__main__":
    main()
