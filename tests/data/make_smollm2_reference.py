"""Regenerate smollm2_greedy_reference.json: HF transformers' greedy ids (64 new tokens, EOS
ignored) for the e2e prompts, on the SmolLM2 GGUF dequantized to float32 by transformers.

Run: PYTHONPATH=. python tests/data/make_smollm2_reference.py
"""

from __future__ import annotations

import json
from pathlib import Path

from transformers import AutoTokenizer

from tests.e2e.test_smollm2_server import PROMPTS
from tests.hf_reference import hf_greedy, load_hf_gguf, smollm2_gguf

MAX_NEW_TOKENS = 64


def main() -> None:
    gguf = smollm2_gguf()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = load_hf_gguf(str(gguf))
    cases = []
    for prompt in PROMPTS:
        ids = tok(prompt).input_ids
        cases.append({"prompt": prompt, "input_ids": ids, "output_ids": hf_greedy(model, ids, MAX_NEW_TOKENS)})
        print(prompt, flush=True)
    out = Path(__file__).with_name("smollm2_greedy_reference.json")
    out.write_text(
        json.dumps(
            {
                "model": gguf.name,
                "max_new_tokens": MAX_NEW_TOKENS,
                "reference": "transformers greedy generate, float32",
                "cases": cases,
            },
            indent=1,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
