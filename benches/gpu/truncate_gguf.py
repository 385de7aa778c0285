"""Write a smaller copy of a llama-architecture GGUF file that keeps only its first N
transformer blocks (benches/gpu/pack.sh uses it to make SmolLM2 fit the device machine's
64 MiB transfer limit).

Everything else is the original, byte for byte: every metadata key (the tokenizer's vocabulary,
merges and chat template included) except `<arch>.block_count`, which becomes N, and the raw,
still-quantized data of the token embedding, the final norm, the LM head (when untied) and of
blocks 0..N-1. The result is a real model with real weights, only shallower: greedy outputs are
not SmolLM2's, but the same run gives the same tokens on every backend, which is what the GPU
checks compare.

    python benches/gpu/truncate_gguf.py SRC.gguf DST.gguf --max-bytes 50000000

--max-bytes picks the largest N whose file stays under that size (at least 1 block); --layers
sets N directly. Prints N and the size written.
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import gguf

_BLOCK = re.compile(r"^blk\.(\d+)\.")


def _block_of(name: str) -> int | None:
    match = _BLOCK.match(name)
    return int(match.group(1)) if match else None


def plan_layers(reader: gguf.GGUFReader, max_bytes: int) -> int:
    """The most leading blocks whose tensors plus everything shared fit in max_bytes.

    Metadata size is estimated from the source file (header bytes before the first tensor);
    the alignment padding between tensors is counted once per tensor."""
    align = 32
    shared = 0
    per_block: dict[int, int] = {}
    for t in reader.tensors:
        size = int(t.n_bytes) + align
        block = _block_of(t.name)
        if block is None:
            shared += size
        else:
            per_block[block] = per_block.get(block, 0) + size
    header = min(int(t.data_offset) for t in reader.tensors)
    used = header + shared
    n = 0
    for block in sorted(per_block):
        if used + per_block[block] > max_bytes:
            break
        used += per_block[block]
        n += 1
    return max(n, 1)


def truncate(src: str, dst: str, num_layers: int) -> None:
    """Write `dst`: `src` with blocks >= num_layers dropped and block_count = num_layers.
    Raises ValueError when num_layers is not in 1..the source's block count."""
    reader = gguf.GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    count_key = f"{arch}.block_count"
    total = int(reader.fields[count_key].contents())
    if not 1 <= num_layers <= total:
        raise ValueError(f"num_layers must be in 1..{total}, got {num_layers}")
    tmp = dst + ".part"
    writer = gguf.GGUFWriter(tmp, arch)  # writes general.architecture itself
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the header fields the writer produces on its own
        vtype = field.types[0]
        sub_type = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        value = num_layers if key == count_key else field.contents()
        writer.add_key_value(key, value, vtype, sub_type=sub_type)
    for t in reader.tensors:
        block = _block_of(t.name)
        if block is not None and block >= num_layers:
            continue
        # t.data is the raw stored array (bytes per row for quantized types); raw_dtype keeps
        # the quantization type, so nothing is dequantized or re-quantized.
        writer.add_tensor(t.name, t.data, raw_dtype=t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("src")
    parser.add_argument("dst")
    group = parser.add_mutually_exclusive_group(required=True)
    group.add_argument("--layers", type=int)
    group.add_argument("--max-bytes", type=int)
    args = parser.parse_args()
    layers = args.layers
    if layers is None:
        layers = plan_layers(gguf.GGUFReader(args.src), args.max_bytes)
    truncate(args.src, args.dst, layers)
    print(f"{args.dst}: {layers} blocks, {os.path.getsize(args.dst) / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
