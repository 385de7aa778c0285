"""Write a random-weight mixture-of-experts GGUF at a real model's shapes, for benchmarks that
serve one file from pyserve and from llama.cpp's llama-server.

Shapes default to OLMoE-1B-7B's (allenai/OLMoE-1B-7B-0924: hidden 2048, 16 layers, 16 heads,
64 experts of intermediate size 1024, top 8, q/k norms across the heads); the tokenizer and
its metadata are copied from another GGUF (by default pyserve's default model, SmolLM2's BPE of
49152 tokens, so the vocabulary is that one's, not OLMoE's 50304) so that both servers
tokenize alike. Every matrix is `--qtype` blocks of seeded random codes with one small fp16
scale (Q4_0 / Q8_0: the scale is the block's first two bytes); the router and the norms are
float32 (the router N(0, 1/sqrt(hidden)), norms 1), as llama.cpp's converter writes them.
Tensors are written one at a time (the file is ~3.9 GB at Q4_0), so memory stays small.

Usage: python benches/moe_gguf.py OUT.gguf [--layers 16] [--hidden 2048] [--experts 64]
       [--top-k 8] [--inter 1024] [--heads 16] [--qtype Q4_0] [--tokenizer-gguf GGUF]
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np

from pyserve.model_loader.default_model import default_model_path

# bytes per block of 32 and where its fp16 scale sits, for the types this writer fills
BLOCKS = {"Q4_0": 18, "Q8_0": 34}


def copy_tokenizer(writer: gguf.GGUFWriter, source: str) -> int:
    """Copy the `tokenizer.*` keys of GGUF `source`; returns its vocabulary size."""
    reader = gguf.GGUFReader(source)
    vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        vtype = field.types[0]
        sub = field.types[1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), vtype, sub)
        if name == "tokenizer.ggml.tokens":
            vocab = len(field.data)
    return vocab


def random_blocks(rows: int, cols: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """[rows, cols / 32 * block bytes] uint8: random codes, each block's scale 1 / (4 sqrt(cols))
    in fp16 (so a row's dot product with unit activations stays near 1)."""
    block = BLOCKS[qtype]
    data = rng.integers(0, 256, size=(rows, cols // 32, block), dtype=np.uint8)
    scale = np.float16(0.25 / np.sqrt(cols) / (8 if qtype == "Q4_0" else 128))
    data[..., 0:2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
    return data.reshape(rows, -1)


def write(args: argparse.Namespace) -> None:
    rng = np.random.default_rng(0)
    qt = gguf.GGMLQuantizationType[args.qtype]
    h, inter, e, heads = args.hidden, args.inter, args.experts, args.heads
    writer = gguf.GGUFWriter(str(args.out), "olmoe")
    vocab = copy_tokenizer(writer, args.tokenizer_gguf)
    writer.add_name("random OLMoE-shaped mixture (pyserve benchmark)")
    writer.add_block_count(args.layers)
    writer.add_context_length(4096)
    writer.add_embedding_length(h)
    writer.add_feed_forward_length(inter)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(vocab)
    writer.add_expert_count(e)
    writer.add_expert_used_count(args.top_k)
    writer.add_expert_feed_forward_length(inter)
    writer.add_file_type(int(qt))

    # (name, numpy shape in weights (outermost first), type, maker of its array)
    tensors: list[tuple[str, list[int], gguf.GGMLQuantizationType, Callable[[], np.ndarray]]] = []

    def quant(name: str, *dims: int) -> None:
        def make() -> np.ndarray:
            return random_blocks(int(np.prod(dims[:-1])), dims[-1], args.qtype, rng).reshape(*dims[:-1], -1)

        tensors.append((name, list(dims), qt, make))

    def f32(name: str, dims: list[int], make: Callable[[], np.ndarray]) -> None:
        tensors.append((name, dims, gguf.GGMLQuantizationType.F32, make))

    quant("token_embd.weight", vocab, h)
    f32("output_norm.weight", [h], lambda: np.ones(h, dtype=np.float32))
    quant("output.weight", vocab, h)
    for layer in range(args.layers):
        b = f"blk.{layer}"
        f32(f"{b}.attn_norm.weight", [h], lambda: np.ones(h, dtype=np.float32))
        f32(f"{b}.ffn_norm.weight", [h], lambda: np.ones(h, dtype=np.float32))
        f32(f"{b}.attn_q_norm.weight", [h], lambda: np.ones(h, dtype=np.float32))
        f32(f"{b}.attn_k_norm.weight", [h], lambda: np.ones(h, dtype=np.float32))
        for proj in ("attn_q", "attn_k", "attn_v", "attn_output"):
            quant(f"{b}.{proj}.weight", h, h)
        f32(f"{b}.ffn_gate_inp.weight", [e, h], lambda: (rng.standard_normal((e, h)) / np.sqrt(h)).astype(np.float32))
        quant(f"{b}.ffn_gate_exps.weight", e, inter, h)
        quant(f"{b}.ffn_up_exps.weight", e, inter, h)
        quant(f"{b}.ffn_down_exps.weight", e, h, inter)

    for name, dims, dtype, _ in tensors:
        if dtype == qt:  # gguf-py takes a quantized tensor's shape in bytes per row
            shape = [*dims[:-1], dims[-1] // 32 * BLOCKS[args.qtype]]
            writer.add_tensor_info(name, shape, np.dtype(np.uint8), int(np.prod(shape)), raw_dtype=dtype)
        else:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), int(np.prod(dims)) * 4, raw_dtype=dtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for _, _, _, make in tensors:
        writer.write_tensor_data(make())
    writer.close()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--qtype", choices=sorted(BLOCKS), default="Q4_0")
    p.add_argument("--tokenizer-gguf", default=None, help="copy the tokenizer of this GGUF (default: pyserve's model)")
    args = p.parse_args()
    args.tokenizer_gguf = args.tokenizer_gguf or default_model_path()
    write(args)
    print(f"wrote {args.out} ({args.out.stat().st_size / 1e9:.2f} GB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
